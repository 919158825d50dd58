"""Fixtures of the state tests: the trajectories of 2K steps, the same for every test of a module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentjet_client.protocol import Trajectory
from tests.server.state.runs import K, make_trajectories


@pytest.fixture(scope="module")
def trajectories(model_dir: Path) -> list[Trajectory]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return make_trajectories(vocab, 2 * K)
