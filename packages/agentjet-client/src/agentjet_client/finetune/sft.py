"""``agentjet-client sft DATA --server URL``: supervised fine-tuning of the model a server serves.

DATA is chat JSONL, one chat per line in the OpenAI messages format (``{"messages": [...], "tools": [...]}``,
tool calls included). A part is held out (``--eval-fraction``); the rest is sent in batches to the server's
``POST /v1/train/sft``, where each batch is one update of the learner with the negative log-likelihood of
the assistant tokens (the chat template's assistant mask), between two policy updates. After every epoch
the held-out loss is measured (``"evaluate": true``: nothing is updated). At the end the server writes a
checkpoint: reinforcement learning goes on from these weights on the same server, and after a restart from
the checkpoint (``agentjet-server up --resume``).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx2
import typer
from rich.console import Console

from agentjet_client.errors import InputError

console = Console(soft_wrap=True)  # a line stays one line in a pipe or a log (grep-able)


def read_records(path: Path, what: str, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, each with the ``keys`` it has of ``keys`` (the first required);
    exits with the line that is wrong."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path}:{number} is not JSON ({exc}); one {what} per line") from exc
        if not isinstance(record, dict) or keys[0] not in record:
            raise InputError(f'{path}:{number}: each line is a {what}, an object with "{keys[0]}"')
        records.append({k: record[k] for k in keys if k in record})
    if not records:
        raise InputError(f"{path} holds no {what}")
    return records


def read_chats(path: Path) -> list[dict[str, Any]]:
    """The chats of a JSONL file (``{"messages": [...], "tools": [...]}``); exits with the line that is wrong."""
    chats = read_records(path, "chat", ("messages", "tools"))
    for chat in chats:
        if not isinstance(chat["messages"], list):
            raise InputError(f'{path}: "messages" must be a list of messages')
    return chats


class Trainer:
    """The server's ``/v1/train/{mode}`` and checkpoint endpoints (``mode``: "sft" or "dpo")."""

    def __init__(
        self,
        server: str,
        admin_key: str | None,
        adapter: str | None,
        lr: float | None = None,
        mode: str = "sft",
        **settings: Any,
    ) -> None:
        headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx2.Client(base_url=server.rstrip("/"), headers=headers, timeout=3600)
        self.adapter, self.lr, self.mode, self.settings = adapter, lr, mode, settings

    def post(self, items: list[dict[str, Any]], evaluate: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"adapter": self.adapter, "evaluate": evaluate, **self.settings}
        body["examples" if self.mode == "sft" else "pairs"] = items
        if self.lr is not None:
            body["lr"] = self.lr
        deadline = time.monotonic() + 600
        while True:
            try:
                reply = self.http.post(f"/v1/train/{self.mode}", json=body)
            except httpx2.HTTPError as exc:
                raise InputError(f"the server did not answer ({exc}); is it running at {self.http.base_url}?") from exc
            if reply.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(2.0)  # starting, or its state dir refuses writes for now: it says so, and recovers
        if reply.status_code != 200:
            try:
                message = reply.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = reply.text[:500]
            raise InputError(f"the server refused the batch ({reply.status_code}): {message}")
        answer: dict[str, Any] = reply.json()
        return answer

    def held_out_loss(self, chats: list[dict[str, Any]], batch_size: int) -> float:
        total, tokens = 0.0, 0
        for start in range(0, len(chats), batch_size):
            answer = self.post(chats[start : start + batch_size], evaluate=True)
            total += answer["loss"] * answer["tokens"]
            tokens += answer["tokens"]
        return total / max(tokens, 1)

    def checkpoint(self) -> str:
        reply = self.http.post("/v1/admin/checkpoint")
        if reply.status_code != 200:
            raise InputError(f"the checkpoint failed ({reply.status_code}): {reply.text[:500]}")
        return str(reply.json()["path"])


# the options ``sft`` and ``dpo`` share
Server = Annotated[str, typer.Option(help="the server whose model it trains")]
AdminKey = Annotated[str | None, typer.Option(help="the server's admin key", envvar="AGENTJET_ADMIN_KEY")]
Adapter = Annotated[str | None, typer.Option(help="the adapter to train (--adapters)")]
Epochs = Annotated[int, typer.Option(min=1, help="passes over the training part")]
EvalFraction = Annotated[float, typer.Option(min=0.0, max=0.9, help="share held out (without --eval-data)")]
Rate = Annotated[float | None, typer.Option(help="the updates' learning rate [default: the server's]")]
Seed = Annotated[int, typer.Option(help="seed of the split and the order")]
NoCheckpoint = Annotated[bool, typer.Option("--no-checkpoint", help="no checkpoint at the end")]


def held_out_split(
    records: list[dict[str, Any]], held_out: list[dict[str, Any]] | None, fraction: float, rng: random.Random
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training part, held-out part): ``held_out`` if given, else a shuffled ``fraction`` of ``records``."""
    order = list(range(len(records)))
    rng.shuffle(order)
    held = 0 if held_out is not None else round(len(records) * fraction)
    kept = held_out if held_out is not None else [records[i] for i in order[:held]]
    return [records[i] for i in order[held:]], kept


def sft_command(
    data: Annotated[Path, typer.Argument(help="chat JSONL, one chat per line")],
    server: Server = "http://127.0.0.1:8000",
    admin_key: AdminKey = None,
    adapter: Adapter = None,
    epochs: Epochs = 3,
    batch_size: Annotated[int, typer.Option(min=1, max=512, help="chats per update")] = 16,
    eval_fraction: EvalFraction = 0.1,
    eval_data: Annotated[Path | None, typer.Option(help="chat JSONL held out instead")] = None,
    lr: Rate = None,
    seed: Seed = 0,
    no_checkpoint: NoCheckpoint = False,
) -> None:
    """Supervised fine-tuning of the server's model (or one adapter) on chat JSONL, with a held-out loss.

    Example:
    agentjet-client sft chats.jsonl --server http://127.0.0.1:8000 --epochs 3
    """
    rng = random.Random(seed)
    given = read_chats(eval_data) if eval_data is not None else None
    train, held_out = held_out_split(read_chats(data), given, eval_fraction, rng)
    trainer = Trainer(server, admin_key, adapter, lr)
    batches = (len(train) + batch_size - 1) // batch_size
    console.print(
        f"sft: {len(train)} chats to train on ({batches} updates per epoch), {len(held_out)} held out, "
        f"{epochs} epoch(s) -> {server}" + (f" (adapter {adapter})" if adapter else "")
    )
    if held_out:
        console.print(f"held-out loss before: {trainer.held_out_loss(held_out, batch_size):.4f} per token")

    def epoch_line(epoch: int, answers: list[dict[str, Any]]) -> str:
        tokens = [(answer["loss"], answer["tokens"]) for answer in answers]
        mean = sum(loss * n for loss, n in tokens) / max(sum(n for _, n in tokens), 1)
        line = f"epoch {epoch}/{epochs}: train loss {mean:.4f}"
        if held_out:
            line += f"  held-out loss {trainer.held_out_loss(held_out, batch_size):.4f}"
        return line

    run_epochs(trainer, train, rng, epochs, batch_size, "chats", lambda answer: "", epoch_line)
    if not no_checkpoint:
        save(trainer)


def run_epochs(
    trainer: Trainer,
    train: list[dict[str, Any]],
    rng: random.Random,
    epochs: int,
    batch_size: int,
    unit: str,
    figures: Callable[[dict[str, Any]], str],
    epoch_line: Callable[[int, list[dict[str, Any]]], str | None],
) -> None:
    """``epochs`` passes over ``train`` (shuffled each time) in updates of ``batch_size`` records, a line per
    update (``figures`` of the server's answer besides its loss) and one per epoch (``epoch_line``)."""
    batches = (len(train) + batch_size - 1) // batch_size
    started = time.monotonic()
    for epoch in range(1, epochs + 1):
        rng.shuffle(train)
        answers = []
        for b, start in enumerate(range(0, len(train), batch_size), 1):
            answer = trainer.post(train[start : start + batch_size], evaluate=False)
            answers.append(answer)
            done = (epoch - 1) * len(train) + min(start + batch_size, len(train))
            console.print(
                f"epoch {epoch}/{epochs}  update {b}/{batches}  loss {answer['loss']:.4f}  {figures(answer)}"
                f"policy v{answer['policy_version']}  {done / (time.monotonic() - started):.1f} {unit}/s"
            )
        line = epoch_line(epoch, answers)
        if line:
            console.print(line)


def save(trainer: Trainer) -> None:
    """The server's checkpoint at the end of a fine-tuning run, and where it goes on from."""
    path = trainer.checkpoint()
    console.print(
        f"checkpoint {path}: reinforcement learning continues from these weights on this server, "
        "and from this checkpoint after a restart (agentjet-server up --resume)"
    )
