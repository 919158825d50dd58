"""The tinker-cookbook's own loops (pinned 0.6.1), unchanged, against a real server with the embedded model:
only ``base_url``, the model name and the tokenizer and renderer that ``agentjet_client.finetune.cookbook``
registers differ from a run on the hosted service. ``supervised.train`` over a local JSONL of chats with the
cookbook's conversation-file builder, and ``rl.train`` with an RL dataset of ours (examples/tinker_cookbook)
with ``stable_reinforce``, whose provenance the server checks against the sequences it sampled."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import tinker_cookbook
from tinker_cookbook import renderers
from tinker_cookbook.tokenizer_utils import get_tokenizer

from agentjet_client.finetune.cookbook import register
from tests.conftest import LiveServer

assert tinker_cookbook.__version__ == "0.6.1", tinker_cookbook.__version__
ROOT = Path(__file__).resolve().parents[2]
# the SDK's own connection pools are never closed (tests/server/api/test_tinker.py says more)
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning", "ignore::ResourceWarning"),
]


def example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "cookbook_digits", ROOT / "examples" / "tinker_cookbook" / "digits.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # chz's dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(model_dir, monkeypatch_module, tmp_path_factory):  # type: ignore[no-untyped-def]
    monkeypatch_module.setenv("AGENTJET_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch_module.setenv("TINKER_API_KEY", "tml-local")
    live = LiveServer(model_dir)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def rows(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_registered_tokenizer_and_renderer_are_the_models_own(server):
    names = register(server.url)
    assert names.model == "agentjet-tiny" and names.tokenizer_dir.is_dir()  # fetched from the server, no hub
    tokenizer = get_tokenizer(names.model)
    renderer = renderers.get_renderer(names.renderer, tokenizer)
    chat = [{"role": "user", "content": "Write seven as a digit."}, {"role": "assistant", "content": "7"}]
    template = tokenizer.apply_chat_template(chat, tokenize=False)
    supervised = renderer.build_supervised_example(chat)[0].to_ints()
    assert tokenizer.decode(supervised) == template.rstrip("\n")  # the template's closing newline is not trained
    prompt = renderer.build_generation_prompt(chat[:1]).to_ints()
    assert prompt == tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True)["input_ids"]


def test_supervised_train_runs_unchanged_and_lowers_the_held_out_loss(server, tmp_path):
    from tinker_cookbook.supervised import train

    asyncio.run(train.main(example().sft_config(server.url, tmp_path, 1e-2)))
    measured = rows(tmp_path / "log" / "metrics.jsonl")
    held_out = [r["test/nll"] for r in measured if "test/nll" in r]
    assert len(held_out) >= 2 and held_out[-1] < 0.8 * held_out[0], held_out
    assert measured[-1]["step"] == 11  # 3 epochs of the 32 chats not held out, in batches of 8


def test_rl_train_learns_the_digits_with_stable_reinforce(server, tmp_path):
    from tinker_cookbook.rl import train

    config = example().rl_config(server.url, tmp_path, seed=0, batches=24, digits=(3, 8), lr=2e-3)
    asyncio.run(train.main(config))
    correct = [r["env/all/correct"] for r in rows(tmp_path / "metrics.jsonl") if "env/all/correct" in r]
    assert len(correct) == 24
    first, last = correct[: max(1, len(correct) // 10)], correct[-max(1, len(correct) // 5) :]
    assert sum(last) / len(last) >= sum(first) / len(first) + 0.2, correct
