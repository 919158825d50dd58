"""``agentjet-server up --teacher DIR``: the teacher is loaded beside the learner, scores the trained tokens of
every step (recorded as ``teacher_kl``, the step's mode ``distill``, counted in ``/metrics``); settings that
cannot work are refused with what to do."""

from __future__ import annotations

import re
from pathlib import Path

import httpx2
import pytest
import torch

from tests.conftest import LiveServer, run_digits_client


def perturbed_copy(model_dir: Path, out: Path) -> Path:
    """The model with its output head moved: the same tokenizer, other answers."""
    import shutil

    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, out)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.add_(0.2 * torch.randn_like(model.lm_head.weight))
    model.save_pretrained(out)
    return out


def test_a_teacher_scores_every_step_and_its_kl_is_recorded(model_dir, tmp_path):
    teacher = perturbed_copy(model_dir, tmp_path / "teacher")
    server = LiveServer(model_dir, batch_groups=2, group_size=4, teacher=teacher, distill_coef=0.5)
    try:
        assert server.runtime.loop.trainer.teacher is not None
        run_digits_client(server.url, 32, 4)
        lines = httpx2.get(server.url + "/v1/metrics/history").json()
        metrics = httpx2.get(server.url + "/metrics").text
    finally:
        server.stop()
    steps = [line for line in (lines["lines"] if isinstance(lines, dict) else lines) if line.get("kind") == "step"]
    assert steps and {s["mode"] for s in steps} == {"distill"}
    assert all(s["teacher_kl"] > 0.01 for s in steps), [s["teacher_kl"] for s in steps]  # a teacher that differs
    assert re.search(r'agentjet_learner_steps_by_mode_total\{mode="distill"\} [1-9]', metrics)
    assert re.search(r"agentjet_learner_teacher_kl [0-9.e+-]+", metrics)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"teacher": "/no/such/model"}, "--teacher /no/such/model does not exist"),
        ({"teacher": ".", "algorithm": "ppo"}, "with --algorithm ppo it is not supported yet"),
    ],
)
def test_teacher_settings_that_cannot_work_are_refused_with_what_to_do(settings, message):
    from pydantic import ValidationError

    from agentjet_server.settings import ServerSettings

    with pytest.raises(ValidationError, match=message):
        ServerSettings(**settings)
