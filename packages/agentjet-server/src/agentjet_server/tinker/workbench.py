"""The Tinker API's workbench: its own frozen copy of the server's base model (loaded at the first Tinker
call, on the learner's device), with a LoRA adapter per training client (``create_model``) and per saved
sampler snapshot. A swarm run may train the served model's full weights; Tinker's LoRA clients need the base
as the SDK named it, frozen, so they get a copy of their own, and a swarm run and any number of Tinker clients
train side by side without touching each other's weights.

Every operation runs on the workbench's one thread, in the order it arrived (a training client's
``forward_backward`` calls and ``optim_step`` are serialized as the SDK submits them): the routes check a
request, hand it over and answer with a future (``tinker.futures``). Training clients interleave freely: a
``forward_backward`` activates its client's adapter alone (only its parameters take gradients, which stay on
them until its ``optim_step``), and each client has its own AdamW.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentjet_server.errors import ConflictError, InvalidRequestError, NotFoundError
from agentjet_server.tinker import losses
from agentjet_server.tinker.files import LORA_ALPHA, load_adapter_tensors
from agentjet_server.tinker.full import MAX_FROZEN, FullModels
from agentjet_server.tinker.futures import Futures
from agentjet_server.tinker.sampling import SampleJob, sample, split
from agentjet_server.tinker.store import Checkpoints, Kept, Remote, Sequences, Sessions
from agentjet_server.tinker.wire import Datum, ForwardBackward, SampleResult
from agentjet_server.tinker.worker import Worker

logger = logging.getLogger(__name__)

MAX_MODELS = 16  # training clients loaded at once
MAX_SNAPSHOTS = 16  # sampler snapshots loaded at once (the least recently used are unloaded, reloaded from disk)
MAX_RANK = 256
TOKENS_PER_PASS = 16_384  # a forward_backward's datums go through the model in passes of at most this many tokens


@dataclass
class TrainingModel:
    model_id: str
    session_id: str
    adapter: str  # its LoRA adapter's name, or with ``full`` its trainable copy's (``tinker.full``)
    rank: int
    targets: list[str]
    user_metadata: dict[str, Any] | None = None
    full: bool = False
    optimizer: torch.optim.Optimizer | None = None
    steps: int = 0
    last_request: datetime = field(default_factory=lambda: datetime.now(UTC))


@dataclass
class Sampler:
    sampler_id: str
    session_id: str
    adapter: str | None  # an adapter's or a full copy's name; None: the base model
    model_path: str | None


class Workbench:
    def __init__(
        self,
        model_path: Path,
        model_name: str,
        device: str,
        state_root: Path,
        tokenizer_id: str | None = None,
        remote: Remote | None = None,
        full_clients: int = 1,
    ) -> None:
        from transformers import AutoConfig

        self.model_path, self.model_name, self.device = Path(model_path), model_name, torch.device(device)
        self.config: Any = AutoConfig.from_pretrained(str(self.model_path))
        self.arch = str(self.config.model_type)
        # what the SDK's get_tokenizer loads (AutoTokenizer.from_pretrained): the model's directory, which a
        # client on the same disk loads as it is; elsewhere, register the tokenizer (docs/tinker.md)
        self.tokenizer_id = tokenizer_id or str(self.model_path)
        self.futures = Futures()
        self.sessions = Sessions()
        self.sequences = Sequences()
        self.checkpoints = Checkpoints(state_root, remote)
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.snapshots: dict[str, str] = {}  # checkpoint path -> loaded adapter, least recently used first
        self.full = FullModels(self.model_path, self.device, full_clients)
        self._base: Any = None
        self._peft: Any = None
        self._tokenizer: Any = None
        self.worker = Worker(self.futures, self.run_samples)

    # ----------------------------------------------------------------------------- the thread

    def submit(self, kind: str, work: Callable[[], Any] | SampleJob, request_id: str | None = None) -> str:
        """Run ``work`` on the workbench's thread; the future's id (``request_id`` if the caller made it)."""
        return self.worker.submit(request_id or self.futures.create(kind), work)

    def close(self) -> None:
        self.worker.close()

    # ----------------------------------------------------------------------------- the model

    @property
    def base(self) -> Any:
        """The frozen base (loaded on first use, on the workbench's thread)."""
        if self._base is None:
            from transformers import AutoModelForCausalLM

            logger.info("Tinker API: loading a frozen copy of %s for its training clients", self.model_path)
            model: Any = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=torch.float32)
            self._base = model.to(self.device).eval().requires_grad_(False)
        return self._base

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        return self._tokenizer

    def tokenizer_files(self) -> dict[str, str]:
        """The model directory's tokenizer files, by name (what ``AutoTokenizer.from_pretrained`` reads)."""
        names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]
        names += ["vocab.json", "merges.txt", "added_tokens.json"]
        return {n: (self.model_path / n).read_text() for n in names if (self.model_path / n).is_file()}

    @property
    def vocab(self) -> int:
        return int(self.config.vocab_size)

    @property
    def eos(self) -> set[int]:
        eos = self.config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def add_adapter(self, name: str, rank: int, targets: list[str], seed: int | None = None) -> None:
        from peft import LoraConfig

        config = LoraConfig(
            r=rank,
            lora_alpha=LORA_ALPHA,  # type: ignore[arg-type]  # peft annotates int; floats work
            lora_dropout=0.0,
            target_modules=targets,
            bias="none",
        )
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            if self._peft is None:
                from peft import get_peft_model

                self._peft = get_peft_model(self.base, config, adapter_name=name).eval()
            else:
                self._peft.add_adapter(name, config)
        self._peft.requires_grad_(False)  # a client's parameters take gradients only while it trains

    def remove_adapter(self, name: str) -> None:
        if self.full.holds(name):
            self.full.remove(name)
        elif self._peft is not None and name in self._peft.peft_config:
            self._peft.delete_adapter(name)

    def adapter_params(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        """What training client ``name`` trains: its adapter's parameters, or a full copy's every one."""
        if self.full.holds(name):
            return list(self.full.module(name).named_parameters())
        marker = (f".lora_A.{name}.", f".lora_B.{name}.")
        return [(k, p) for k, p in self._peft.named_parameters() if marker[0] in k or marker[1] in k]

    @contextlib.contextmanager
    def using(self, adapter: str | None, train: bool = False) -> Iterator[Any]:
        """The model with ``adapter`` applied (None: the base alone); with ``train``, only its parameters
        take gradients (a full copy: all of its own)."""
        if self.full.holds(adapter):
            yield self.full.module(str(adapter))
            return
        if adapter is None:
            if self._peft is None:
                yield self.base
            else:
                with self._peft.disable_adapter():
                    yield self._peft
            return
        self._peft.set_adapter(adapter)
        if train:
            for _, param in self.adapter_params(adapter):
                param.requires_grad_(True)
        try:
            yield self._peft
        finally:
            for _, param in self.adapter_params(adapter):
                param.requires_grad_(False)

    def model(self, model_id: str) -> TrainingModel:
        found = self.models.get(model_id)
        if found is None:
            raise NotFoundError(
                f"no training client {model_id!r} on this server (created by create_model or load_state; it may "
                "have been unloaded when its session ended: load it again from a saved state)"
            )
        return found

    def new_model_id(self, session_id: str, model_seq_id: Any) -> str:
        """The id the SDK derives too (``SESSION:train:N``, its N-th training client), never one in use."""
        if isinstance(model_seq_id, bool) or not isinstance(model_seq_id, int) or model_seq_id < 0:
            raise InvalidRequestError("model_seq_id must be the training client's number (an integer from 0)")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise ConflictError(f"training client {model_id} exists already")
        return model_id

    # ----------------------------------------------------------------------------- training

    def forward_backward(self, request: ForwardBackward) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        trained = self.model(request.model_id)
        trained.last_request = datetime.now(UTC)
        fn = losses.LOSSES[request.loss_fn]
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        with self.using(trained.adapter, train=not request.forward_only) as model:
            for part in _passes(request.data):
                part_loss, part_outputs = _pass(model, part, request, fn, self.device)
                if not request.forward_only and part_loss.requires_grad:
                    part_loss.backward()  # type: ignore[no-untyped-call]
                total += float(part_loss.detach())
                outputs.extend(part_outputs)
        return outputs, {"loss:sum": total}

    def optim_step(self, model_id: str, params: dict[str, float]) -> dict[str, Any]:
        trained = self.model(model_id)
        trained.last_request = datetime.now(UTC)
        named = self.adapter_params(trained.adapter)
        if trained.optimizer is None:
            trained.optimizer = torch.optim.AdamW([p for _, p in named], lr=params["learning_rate"])
        for group in trained.optimizer.param_groups:
            group.update(
                lr=params["learning_rate"],
                betas=(params["beta1"], params["beta2"]),
                eps=params["eps"],
                weight_decay=params["weight_decay"],
            )
        grads = [p.grad for _, p in named if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        if params["grad_clip_norm"] > 0 and grads:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], params["grad_clip_norm"])
        trained.optimizer.step()
        trained.optimizer.zero_grad(set_to_none=True)
        trained.steps += 1
        return {"metrics": {"grad_norm:mean": norm, "step:max": float(trained.steps)}}

    # ----------------------------------------------------------------------------- sampling

    def run_samples(self, jobs: list[SampleJob]) -> list[tuple[str, SampleResult]]:
        """Sample requests of one sampler, prompt and settings as one batch; each its own result."""
        sampler = self.samplers[jobs[0].sampler_id]
        adapter = self._sampler_adapter(sampler)
        ask = dataclasses.replace(jobs[0].ask, num_samples=sum(j.ask.num_samples for j in jobs))
        with self.using(adapter) as model:
            result = sample(model, ask, self.eos, self.tokenizer.decode)
        ids = [sequence_id for job in jobs for sequence_id in job.sequence_ids]
        for sequence_id, seq in zip(ids, result.sequences, strict=True):
            self.sequences.add(sequence_id, Kept(sampler.session_id, ask.prompt, seq.tokens, seq.logprobs))
        return [("sample", part) for part in split(result, [j.ask.num_samples for j in jobs])]

    def _sampler_adapter(self, sampler: Sampler) -> str | None:
        if sampler.model_path is None:
            return sampler.adapter
        loaded = self.snapshots.pop(sampler.model_path, None)
        if loaded is None:
            loaded = self.load_snapshot(sampler.model_path)
        self.snapshots[sampler.model_path] = loaded  # the most recently used, last
        for full, limit in ((False, MAX_SNAPSHOTS), (True, MAX_FROZEN)):
            kept = [path for path, name in self.snapshots.items() if self.full.holds(name) == full]
            for old_path in kept[: max(0, len(kept) - limit)]:
                self.remove_adapter(self.snapshots.pop(old_path))
        return loaded

    def load_snapshot(self, path: str) -> str:
        """A saved sampler checkpoint as an adapter of its own (frozen)."""
        directory = self.checkpoints.existing(path)
        meta = self.checkpoints.meta(path)
        if meta.get("full"):
            return self.full.load_frozen(directory)
        name = f"s{uuid.uuid4().hex[:12]}"
        self.add_adapter(name, int(meta["rank"]), list(meta["targets"]))
        load_adapter_tensors(self.adapter_params(name), name, directory)
        return name


def _passes(data: list[Datum]) -> Iterator[list[Datum]]:
    part: list[Datum] = []
    for datum in data:
        if part and (len(part) + 1) * max(len(datum.tokens), *(len(d.tokens) for d in part)) > TOKENS_PER_PASS:
            yield part
            part = []
        part.append(datum)
    if part:
        yield part


def _pass(
    model: Any, data: list[Datum], request: ForwardBackward, fn: Callable[..., torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, list[dict[str, np.ndarray]]]:
    """One pass of ``data`` through ``model``: the summed loss and each datum's target log-probs."""
    width = max(len(d.tokens) for d in data)
    ids = torch.zeros(len(data), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(data), width, dtype=torch.long, device=device)
    for row, datum in enumerate(data):
        ids[row, : len(datum.tokens)] = torch.tensor(datum.tokens, device=device)
        mask[row, : len(datum.tokens)] = 1
    with torch.set_grad_enabled(not request.forward_only):
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        loss = torch.zeros((), device=device)
        outputs = []
        for row, datum in enumerate(data):
            n = len(datum.tokens)
            logp_all = torch.log_softmax(logits[row, :n], dim=-1)
            x = {k: torch.as_tensor(v, device=device) for k, v in datum.inputs.items()}
            targets = x["target_tokens"].long()
            logp = logp_all.gather(1, targets.view(n, -1)).view(targets.shape)
            x = {k: (v.float() if k != "target_tokens" else v) for k, v in x.items()}
            loss = loss + fn(logp, x, request.config)
            outputs.append({"logprobs": logp.detach().cpu().numpy()})
    return loss, outputs
