"""Distillation teachers. ``agentjet-server up --teacher DIR``: the teacher is loaded beside the learner, scores
the trained tokens of every step (recorded as ``teacher_kl``, the step's mode ``distill``, counted in
``/metrics``); settings that cannot work are refused with what to do. ``--teacher URL`` (``learner.teacher``):
another server scores each batch over ``/v1/completions`` (echo), as the same model would in process; an
outage of the teacher keeps the batch until it answers again."""

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
        # far enough that each step's sampled KL estimate (a few dozen tokens) is well above 0
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
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
        ({"teacher": ".", "teacher_model": "big"}, "--teacher-model names the model of a --teacher URL"),
        ({"teacher": "http://127.0.0.1:9", "distill_loss": "full"}, "--distill-loss full needs the teacher's whole"),
        ({"distill_loss": "full"}, "a local --teacher DIR"),
    ],
)
def test_teacher_settings_that_cannot_work_are_refused_with_what_to_do(settings, message):
    from pydantic import ValidationError

    from agentjet_server.settings import ServerSettings

    with pytest.raises(ValidationError, match=message):
        ServerSettings(**settings)


def teacher_logprobs(model_dir: Path, tokens: list[int]) -> list[float]:
    """Each token's log-prob after the first under the model in ``model_dir``, computed here."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def test_a_teacher_behind_a_url_scores_as_in_process_and_its_outage_keeps_the_batch(model_dir, tmp_path):
    from agentjet_server.engine.tokens import ChatTokenizer
    from agentjet_server.errors import ConfigError
    from agentjet_server.learner.batch import Sequence
    from agentjet_server.learner.teacher import RemoteTeacher, TeacherError, TeacherUnavailable

    teacher_dir = perturbed_copy(model_dir, tmp_path / "teacher")
    teacher = LiveServer(teacher_dir, name="teacher", serve_only=True)
    port = teacher.port
    encode = ChatTokenizer(model_dir).tokenizer.encode
    # the scores that come back are the teacher model's own, at the trained positions only
    remote = RemoteTeacher(teacher.url)
    assert remote.connect(encode) == "teacher"
    tokens = encode("Write eight as a digit. 8")
    sequence = Sequence.single(tokens, 3, [0.0] * (len(tokens) - 3), 1.0)
    remote.score([sequence])
    assert sequence.teacher_logprobs == pytest.approx(teacher_logprobs(teacher_dir, tokens)[2:], abs=1e-4)
    with pytest.raises(TeacherError, match="not 'other': fix --teacher-model"):
        RemoteTeacher(teacher.url, model="other").connect(encode)
    student = LiveServer(model_dir, batch_groups=2, group_size=4, teacher=teacher.url, distill_coef=0.5)
    try:
        run_digits_client(student.url, 16, 4)
        # the step count moves before the step's episodes are counted trained (after its weights are live)
        wait_for(lambda: student.runtime.store.trained == 16, "two distillation steps, their episodes trained")
        history = httpx2.get(student.url + "/v1/metrics/history").json()
        steps = [line for line in history["lines"] if line.get("kind") == "step"]
        assert {s["mode"] for s in steps} == {"distill"}
        assert all(s["teacher_kl"] > 0.01 for s in steps), [s["teacher_kl"] for s in steps]
        # the teacher goes away: the next batch waits in the buffer, the error says why, nothing is trained
        teacher.stop()
        trained_before = student.runtime.store.trained
        run_digits_client(student.url, 8, 4)
        wait_for(lambda: "TeacherUnavailable" in (student.runtime.loop.error or ""), "the teacher's outage reported")
        assert student.runtime.loop.trainer.steps == 2 and student.runtime.store.trained == trained_before
        with pytest.raises(TeacherUnavailable):
            RemoteTeacher(teacher.url, attempts=1).score([sequence])
        with pytest.raises(ConfigError, match=r"cannot be reached .* start it, or fix --teacher"):
            LiveServer(model_dir, teacher=teacher.url)
        # back on its port: the kept batch is trained, with the teacher's signal
        teacher = LiveServer(teacher_dir, port=port, name="teacher", serve_only=True)
        wait_for(lambda: student.runtime.store.trained == trained_before + 8, "the kept batch trained")
        assert student.runtime.loop.trainer.steps == 3 and student.runtime.loop.error is None
        # the kept batch's tries before the teacher came back counted nothing: each episode once
        assert sum(student.runtime.loop.tags.trained.values()) == trained_before + 8
    finally:
        student.stop()
        teacher.stop()


def wait_for(condition: object, what: str, limit: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + limit
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
