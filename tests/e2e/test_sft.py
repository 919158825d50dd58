"""End to end: ``agentjet-client sft`` trains a running ``agentjet-server up`` on chat JSONL (64 chats), with a
held-out loss; the server's greedy answers then match the data on the trained prompts, and after a restart
reinforcement learning on the demo continues from the checkpoint the command had written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from tests.conftest import ServerProcess, run_digits_client

pytestmark = pytest.mark.e2e
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PHRASES = ["Write {w} as a digit.", "Write {w} as a digit, please.", "What digit is {w}?", "{W} as a digit:"]
PHRASES += ["Give the digit for {w}.", "Spell {w} as a digit."]


def pair(prompt: str, answer: str) -> dict:  # type: ignore[type-arg]
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def chats() -> list[dict]:  # type: ignore[type-arg]
    """64 chats: every word in six phrasings, and four of two turns with a system message."""
    one = [pair(p.format(w=w, W=w.capitalize()), str(d)) for d, w in enumerate(WORDS) for p in PHRASES]
    two = [
        {
            "messages": [
                {"role": "system", "content": "Answer with one digit."},
                {"role": "user", "content": f"Write {WORDS[d]} as a digit."},
                {"role": "assistant", "content": str(d)},
                {"role": "user", "content": f"And {WORDS[(d + 1) % 10]}?"},
                {"role": "assistant", "content": str((d + 1) % 10)},
            ]
        }
        for d in (2, 5, 7, 9)
    ]
    return one + two


def test_sft_on_chat_jsonl_then_rl_continues_from_its_checkpoint(tmp_path):
    data, held_out = tmp_path / "chats.jsonl", tmp_path / "held-out.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats()))
    unseen = [  # phrasings the training never saw
        pair(f"Convert {w} to a digit.", str(d)) for d, w in enumerate(WORDS)
    ]
    held_out.write_text("".join(json.dumps(c) + "\n" for c in unseen))
    state = tmp_path / "state"
    # the small embedded model: the tiny one learns these 64 chats by heart (100 epochs) without the unseen phrasings
    args = ["--model-size", "small", "--state-dir", str(state), "--batch-groups", "2", "--group-size", "8"]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        command = [str(Path(sys.executable).parent / "agentjet-client"), "sft", str(data), "--server", server.url]
        command += ["--eval-data", str(held_out), "--lr", "1e-3", "--epochs", "40", "--batch-size", "16"]
        sft = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert sft.returncode == 0, sft.stdout[-3000:] + sft.stderr[-3000:]
        answers = {}
        for chat in chats()[:60]:  # the single-turn chats: each prompt and its digit
            ask = {"messages": chat["messages"][:1], "max_tokens": 3, "temperature": 0.0}
            reply = httpx2.post(server.url + "/v1/chat/completions", json=ask).json()
            prompt, digit = (m["content"] for m in chat["messages"])
            answers[prompt] = (reply["choices"][0]["message"]["content"], digit)
    finally:
        server.stop()
    out = " ".join(sft.stdout.split())
    before = float(re.search(r"held-out loss before: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    train, after = (float(x) for x in re.findall(r"epoch 40/40: train loss ([\d.]+) held-out loss ([\d.]+)", out)[0])
    assert after < before, out[-2000:]  # the unseen phrasings too
    wrong = {prompt: pair for prompt, pair in answers.items() if pair[0].strip() != pair[1]}
    assert not wrong, wrong
    checkpoint = re.search(r"checkpoint (\S+):", out).group(1)  # type: ignore[union-attr]
    assert Path(checkpoint).parent == state / "checkpoints"
    print(f"sft: held-out loss {before:.3f} -> {after:.3f}, train loss {train:.3f}; greedy answers 60/60 right")

    again = ServerProcess([*args, "--resume"], tmp_path / "again.log")
    try:
        resumed = again.status()["policy_version"]
        assert resumed == 160  # forty epochs of four updates, each a policy version
        rl = run_digits_client(again.url, 160, 8, digits="0,1,2,3,4,5,6,7,8,9")
        status = again.wait_trained()
    finally:
        again.stop()
    first = float(re.search(r"mean reward first 10% ([\d.]+)", " ".join(rl.split())).group(1))  # type: ignore[union-attr]
    # reinforcement learning starts where the supervised steps left the model (chance: 0.1)
    assert first >= 0.5, rl[-2000:]
    print(f"RL resumed at policy v{resumed}: mean reward of its first 10% of episodes {first:.3f}")
    # every episode reached the learner; a group the model already solves every time carries no signal and
    # steps nothing, so the version moves only for groups that still differ
    assert status["trajectories"]["trained"] == 160 and status["learner"]["last_error"] is None
    assert status["policy_version"] >= resumed


def preference_pairs(phrases: list[str], offset: int) -> list[dict]:  # type: ignore[type-arg]
    """For each word in each phrasing: its digit chosen over a wrong one."""
    return [
        {
            "prompt": [{"role": "user", "content": p.format(w=w, W=w.capitalize())}],
            "chosen": str(d),
            "rejected": str((d + offset + i) % 10 or 1) if (d + offset + i) % 10 != d else str((d + 5) % 10),
        }
        for i, p in enumerate(phrases)
        for d, w in enumerate(WORDS)
    ]


def test_dpo_on_64_pairs_raises_the_held_out_margin(tmp_path):
    train = preference_pairs(PHRASES, 1) + preference_pairs(PHRASES[:1], 4)[:4]
    assert len(train) == 64 and all(p["chosen"] != p["rejected"] for p in train)
    data, held_out = tmp_path / "pairs.jsonl", tmp_path / "held-out.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in train))
    unseen = preference_pairs(["Convert {w} to a digit."], 3)  # a phrasing the training never saw
    held_out.write_text("".join(json.dumps(p) + "\n" for p in unseen))
    server = ServerProcess(["--state-dir", str(tmp_path / "state")], tmp_path / "server.log")
    try:
        command = [str(Path(sys.executable).parent / "agentjet-client"), "dpo", str(data), "--server", server.url]
        command += [
            "--eval-data",
            str(held_out),
            "--lr",
            "1e-3",
            "--epochs",
            "6",
            "--batch-size",
            "16",
            "--beta",
            "0.5",
        ]
        dpo = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert dpo.returncode == 0, dpo.stdout[-3000:] + dpo.stderr[-3000:]
        history = httpx2.get(server.url + "/v1/metrics/history").json()
    finally:
        server.stop()
    out = " ".join(dpo.stdout.split())
    figure = r"reward margin ([-+\d.]+) accuracy ([\d.]+) log-prob margin ([-+\d.]+)"
    before = [float(x) for x in re.search("held-out before: " + figure, out).groups()]  # type: ignore[union-attr]
    after = [float(x) for x in re.findall("epoch 6/6: held-out " + figure, out)[0]]
    assert before[0] == pytest.approx(0, abs=1e-3)  # the reference is the model before the first update
    assert after[0] > 0.05 and after[2] > before[2] and after[1] >= before[1], out[-2000:]
    lines = history["lines"] if isinstance(history, dict) else history
    steps = [line for line in lines if line.get("kind") == "step"]
    assert len(steps) == 24 and {s["mode"] for s in steps} == {"dpo"}
    print(
        f"dpo: held-out reward margin {before[0]:+.3f} -> {after[0]:+.3f}, accuracy {before[1]:.2f} -> {after[1]:.2f}"
    )
