"""Fixtures of the server's tests: the real OpenAI and Anthropic SDKs pointed at the shared live servers."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.conftest import LiveServer


@pytest.fixture(scope="module")
def sdk(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused") as client:
        yield client


@pytest.fixture(scope="module")
def chatty_sdk(chatty_server: LiveServer) -> Iterator[openai.OpenAI]:
    """The SDK against the server of a model that rambles until ``max_tokens`` (streams, stop strings)."""
    with openai.OpenAI(base_url=chatty_server.url + "/v1", api_key="unused") as client:
        yield client


@pytest.fixture(scope="module")
def claude(live_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live_server.url, api_key="unused") as client:
        yield client
