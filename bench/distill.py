"""On-policy distillation from the small embedded model into the tiny one, then RL on the demo from each start.

    .venv/bin/python bench/distill.py [--runs 3] [--distill-episodes 96000] [--rl-episodes 26000] [--json FILE]
        [--distill-loss full|sampled] [--phrasings six|demo]      (--rl-episodes 0: the distillation alone)

1. The teacher: the embedded small model (``--model-size small``) fine-tuned in this process on 64 chats of
   the demo's words in six phrasings (the SFT of ``tests/e2e/test_sft.py``), until its greedy answers are
   right.
2. Per run (seed): ``agentjet-server up --teacher TEACHER --distill-loss full`` on the embedded tiny model,
   fed by a digits agent asking the words in the six phrasings of the teacher's data (``--phrasings demo``:
   the demo's alone), whose reward is always 0: the step's only signal is the teacher's, at each token the
   student sampled (``full``: the exact KL over the vocabulary there; ``sampled``: the advantage
   ``log pi_teacher - log pi_student`` of the sampled token). The exact KL(student || teacher) of the
   answer's first token, and the greedy answers, are measured before and after, on the demo's prompts and
   on ten prompts of a phrasing neither the teacher nor the distillation saw (held out).
3. RL on the demo (groups of 16, 10 groups a step, the server's defaults, seed = run) from the distilled
   student and from the tiny model's warm-up alone: episodes until the mean reward over three consecutive
   steps (160 episodes each) reaches 0.8, as ``bench/peers.py`` measures it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.test_sft import PHRASES

from _server import served
from agentjet_client import RunConfig, Runner, SwarmClient, swarm_agent
from peers import GROUP, WORDS, ours

HELD_OUT = "Convert {w} to a digit."


def embedded(size: str) -> Path:
    from agentjet_server.embedded import ensure_embedded_model

    return Path(ensure_embedded_model(size=size))


def make_teacher(folder: Path) -> Path:
    """The small model after supervised fine-tuning on the demo's words (greedy right on every prompt)."""
    import torch
    from tests.e2e.test_sft import chats
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.tokens import ChatTokenizer
    from agentjet_server.learner.supervised import examples_batch
    from agentjet_server.learner.trainer import Learner, LearnerConfig

    small = embedded("small")
    chat = ChatTokenizer(small)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(small)
    learner = Learner(model, LearnerConfig(lr=1e-3), pad_id=chat.pad_id)
    data = chats()
    for epoch in range(40):
        for start in range(0, len(data), 16):
            learner.step(examples_batch(chat, data[start : start + 16]))
        if epoch % 10 == 9:
            print(f"  teacher: epoch {epoch + 1}/40", flush=True)
    shutil.copytree(small, folder)
    model.save_pretrained(folder)
    right = sum(answer(model, chat, f"Write {w} as a digit.") == str(d) for d, w in enumerate(WORDS))
    print(f"  teacher: greedy answers right on {right}/10 demo prompts", flush=True)
    return folder


def answer(model: Any, chat: Any, prompt: str) -> str:
    import torch

    ids = chat.encode(chat.render_text([{"role": "user", "content": prompt}], None, add_generation_prompt=True))
    with torch.no_grad():
        return str(chat.decode_all([int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())]))


def first_token_accuracy(model_dir: Path) -> dict[str, int]:
    """How many of the ten words the model answers right, greedy, on the demo's phrasing and the held-out one."""
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.tokens import ChatTokenizer

    chat, model = ChatTokenizer(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    right = {}
    for key, phrasing in (("right_demo", "Write {w} as a digit."), ("right_held_out", HELD_OUT)):
        right[key] = sum(answer(model, chat, phrasing.format(w=w)) == str(d) for d, w in enumerate(WORDS))
    return right


def first_token_kl(student: Path, teacher: Path, phrasing: str) -> float:
    """The exact KL(student || teacher) of the answer's first token, averaged over the ten words."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.tokens import ChatTokenizer

    chat = ChatTokenizer(student)
    s_model, t_model = (AutoModelForCausalLM.from_pretrained(p) for p in (student, teacher))
    total = 0.0
    for w in WORDS:
        messages = [{"role": "user", "content": phrasing.format(w=w)}]
        ids = torch.tensor([chat.encode(chat.render_text(messages, None, add_generation_prompt=True))])
        with torch.no_grad():
            s = torch.log_softmax(s_model(input_ids=ids).logits[0, -1].float(), -1)
            t = torch.log_softmax(t_model(input_ids=ids).logits[0, -1].float(), -1)
        total += float((s.exp() * (s - t)).sum())
    return total / len(WORDS)


def distill(
    student: Path, teacher: Path, episodes: int, seed: int, out: Path, loss: str, phrasings: list[str]
) -> dict[str, Any]:
    """Distils ``teacher`` into ``student`` on the words in ``phrasings``, with no reward; the weights go to
    ``out``."""
    tasks = [
        {"id": f"digit-{d}-{i}", "prompt": p.format(w=w, W=w.capitalize())}
        for i, p in enumerate(phrasings)
        for d, w in enumerate(WORDS)
    ]

    @swarm_agent(tasks=tasks)
    async def unrewarded(task: dict[str, Any], episode: Any) -> float:
        await episode.async_openai().chat.completions.create(
            model="agentjet-tiny",
            messages=[{"role": "user", "content": task["prompt"]}],
            max_tokens=4,
            temperature=1.0,
        )
        return 0.0

    started = time.monotonic()
    args = ("--teacher", str(teacher), "--distill-coef", "1.0", "--distill-loss", loss, "--seed", str(seed))
    with served(student, *args) as url, SwarmClient(url) as client:
        config = RunConfig(episodes=episodes, group_size=GROUP, concurrency=32, seed=seed)
        asyncio.run(Runner(client, unrewarded, config, spool=None).run())
        history = httpx2.get(url + "/v1/metrics/history", timeout=60).json()
        path = httpx2.post(url + "/v1/admin/checkpoint", timeout=600).json()["path"]
        shutil.copytree(Path(path) / "model", out)
    lines = history["lines"] if isinstance(history, dict) else history
    kls = [line["teacher_kl"] for line in lines if line.get("kind") == "step" and line.get("teacher_kl") is not None]
    accuracy = first_token_accuracy(out)
    return {"seconds": time.monotonic() - started, "steps": len(kls), "sampled_kl": (kls[0], kls[-1]), **accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--distill-episodes", type=int, default=96000)
    parser.add_argument("--rl-episodes", type=int, default=26000)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--phrasings",
        choices=("demo", "six"),
        default="six",
        help="what the distillation asks: the demo's prompts (RL's own), or the words in the teacher's six phrasings",
    )
    parser.add_argument(
        "--distill-loss",
        choices=("sampled", "full"),
        default="full",
        help="the server's --distill-loss: the sampled tokens' advantage, or the exact KL over the vocabulary",
    )
    args = parser.parse_args()
    tiny = embedded("tiny")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="agentjet-bench-distill-") as tmp:
        print("teacher: the small model, fine-tuned on the demo's words ...", flush=True)
        teacher = make_teacher(Path(tmp) / "teacher")
        before = {
            "demo": first_token_kl(tiny, teacher, "Write {w} as a digit."),
            "held out": first_token_kl(tiny, teacher, HELD_OUT),
        }
        print(f"KL(student || teacher) before: demo prompts {before['demo']:.3f}, held out {before['held out']:.3f}")
        for run in range(args.runs):
            student = Path(tmp) / f"student-{run}"
            print(f"run {run}: distilling ({args.distill_episodes} episodes, no reward) ...", flush=True)
            phrasings = PHRASES if args.phrasings == "six" else [PHRASES[0]]
            report = distill(tiny, teacher, args.distill_episodes, run, student, args.distill_loss, phrasings)
            after = {
                "demo": first_token_kl(student, teacher, "Write {w} as a digit."),
                "held out": first_token_kl(student, teacher, HELD_OUT),
            }
            print(
                f"  {report['seconds']:.0f} s, {report['steps']} steps; KL after: demo prompts {after['demo']:.3f}, "
                f"held out {after['held out']:.3f}; sampled KL {report['sampled_kl'][0]:.3f} -> "
                f"{report['sampled_kl'][1]:.3f}; greedy right: demo {report['right_demo']}/10, held out "
                f"{report['right_held_out']}/10",
                flush=True,
            )
            row: dict[str, Any] = {"run": run, "distill": report, "kl_before": before, "kl_after": after}
            for start, model in (("warm-up", tiny), ("distilled", student)) if args.rl_episodes else ():
                print(f"  RL from the {start} model ...", flush=True)
                figures = ours(model, args.rl_episodes, 0.0, run).figures()
                row[start] = figures
                reached = figures["episodes_to_0.8"] if figures["episodes_to_0.8"] is not None else "-"
                print(f"    episodes to 0.8: {reached}; last 20% {figures['last_20%']:.3f}", flush=True)
            results.append(row)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    if not args.rl_episodes:
        return
    print(
        "\n| run | KL demo before -> after | KL held out before -> after | RL episodes to 0.8: warm-up | distilled "
        "| distilled, with the distillation's episodes |"
    )
    print("|---:|---|---|---:|---:|---:|")
    for r in results:
        cells = [r[k]["episodes_to_0.8"] for k in ("warm-up", "distilled")]
        shown = [f"{c:,}" if c is not None else "-" for c in cells]
        total = f"{cells[1] + args.distill_episodes:,}" if cells[1] is not None else "-"
        print(
            f"| {r['run']} | {r['kl_before']['demo']:.3f} -> {r['kl_after']['demo']:.3f} | "
            f"{r['kl_before']['held out']:.3f} -> {r['kl_after']['held out']:.3f} | {shown[0]} | {shown[1]} | {total} |"
        )


if __name__ == "__main__":
    main()
