"""``agentjet-client dpo DATA --server URL``: preference training (DPO) of the model a server serves.

DATA is JSONL, one pair per line: ``{"prompt": [...], "chosen": ..., "rejected": ..., "tools": [...]}`` in
the OpenAI messages format (an answer is a string, an assistant message or a list of messages; without a
``prompt``, ``chosen`` and ``rejected`` are whole conversations whose common beginning is the prompt). A
part is held out (``--eval-fraction``).

Before the first update every pair is scored under the server's current weights: those are the reference
log-probs DPO measures the policy against (``ref_chosen_logps``, ``ref_rejected_logps``; a line that has
them keeps its own). The training part is then sent in batches to ``POST /v1/train/dpo``, each one update
of the learner between two policy updates. After every epoch the held-out pairs are scored: the implicit
reward margin ``beta * ((log pi - log ref)(chosen) - (log pi - log ref)(rejected))`` (0 before training),
the share of pairs it orders right, and the plain log-prob margin. At the end the server writes a
checkpoint that reinforcement learning continues from.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Annotated, Any

import typer

from agentjet_client.errors import InputError
from agentjet_client.finetune.sft import (
    Adapter,
    AdminKey,
    Epochs,
    EvalFraction,
    NoCheckpoint,
    Rate,
    Seed,
    Server,
    Trainer,
    console,
    held_out_split,
    read_records,
    run_epochs,
    save,
)

KEYS = ("chosen", "rejected", "prompt", "tools", "ref_chosen_logps", "ref_rejected_logps")


def read_pairs(path: Path) -> list[dict[str, Any]]:
    """The pairs of a JSONL file; exits with the line that is wrong."""
    pairs = read_records(path, "pair", KEYS)
    for number, pair in enumerate(pairs, 1):
        if "rejected" not in pair:
            raise InputError(f'{path}: pair {number} has "chosen" but no "rejected"')
    return pairs


def score(trainer: Trainer, pairs: list[dict[str, Any]], batch_size: int, beta: float) -> dict[str, float]:
    """Scores ``pairs`` (nothing is updated): fills in the reference log-probs of those without them (their
    scores now), and returns the DPO figures, means over the pairs."""
    sums = {"loss": 0.0, "reward_margin": 0.0, "accuracy": 0.0, "logp_margin": 0.0}
    for start in range(0, len(pairs), batch_size):
        part = pairs[start : start + batch_size]
        answer = trainer.post(part, evaluate=True)
        for pair, chosen, rejected in zip(part, answer["chosen_logps"], answer["rejected_logps"], strict=True):
            pair.setdefault("ref_chosen_logps", chosen)
            pair.setdefault("ref_rejected_logps", rejected)
            z = beta * ((chosen - pair["ref_chosen_logps"]) - (rejected - pair["ref_rejected_logps"]))
            sums["loss"] += math.log1p(math.exp(-z)) if z > -30 else -z
            sums["reward_margin"] += z
            sums["accuracy"] += z > 0
            sums["logp_margin"] += chosen - rejected
    return {key: value / len(pairs) for key, value in sums.items()}


def figures(found: dict[str, float]) -> str:
    return (
        f"reward margin {found['reward_margin']:+.4f}  accuracy {found['accuracy']:.2f}  "
        f"log-prob margin {found['logp_margin']:+.3f}"
    )


def dpo_command(
    data: Annotated[Path, typer.Argument(help="JSONL of preference pairs, one per line")],
    server: Server = "http://127.0.0.1:8000",
    admin_key: AdminKey = None,
    adapter: Adapter = None,
    beta: Annotated[float, typer.Option(min=0.0, help="how far from the reference it may go")] = 0.1,
    epochs: Epochs = 3,
    batch_size: Annotated[int, typer.Option(min=1, max=256, help="pairs per update")] = 16,
    eval_fraction: EvalFraction = 0.1,
    eval_data: Annotated[Path | None, typer.Option(help="pairs JSONL held out instead")] = None,
    lr: Rate = None,
    seed: Seed = 0,
    no_checkpoint: NoCheckpoint = False,
) -> None:
    """Preference training (DPO) of the server's model (or one adapter) on pairs, with held-out margins.

    Example:
    agentjet-client dpo pairs.jsonl --server http://127.0.0.1:8000 --beta 0.1
    """
    if beta <= 0:
        raise InputError("--beta must be above 0 (0.1 is usual)")
    rng = random.Random(seed)
    given = read_pairs(eval_data) if eval_data is not None else None
    train, held_out = held_out_split(read_pairs(data), given, eval_fraction, rng)
    trainer = Trainer(server, admin_key, adapter, lr, mode="dpo", beta=beta)
    batches = (len(train) + batch_size - 1) // batch_size
    console.print(
        f"dpo: {len(train)} pairs to train on ({batches} updates per epoch), {len(held_out)} held out, "
        f"{epochs} epoch(s), beta {beta} -> {server}" + (f" (adapter {adapter})" if adapter else "")
    )
    score(trainer, train, batch_size, beta)
    console.print(f"reference log-probs: {len(train)} training pairs scored under the server's current weights")
    if held_out:
        console.print(f"held-out before: {figures(score(trainer, held_out, batch_size, beta))}")

    def margins(answer: dict[str, Any]) -> str:
        return f"margin {answer['reward_margin']:+.4f}  accuracy {answer['accuracy']:.2f}  "

    def epoch_line(epoch: int, answers: list[dict[str, Any]]) -> str | None:
        return (
            f"epoch {epoch}/{epochs}: held-out {figures(score(trainer, held_out, batch_size, beta))}"
            if held_out
            else None
        )

    run_epochs(trainer, train, rng, epochs, batch_size, "pairs", margins, epoch_line)
    if not no_checkpoint:
        save(trainer)
