"""The Tinker API's operations over the workbench: each checks its request where the route runs (a bad
request is a 4xx within a second, never a failed future found later) and hands the work to the workbench's
thread; the routes (``api/tinker.py``) only parse and render."""

from __future__ import annotations

import uuid
from typing import Any

from agentjet_server.errors import ConflictError, InvalidRequestError, NotFoundError
from agentjet_server.tinker import losses
from agentjet_server.tinker.checks import adam_params, check_datum, resolve_provenance
from agentjet_server.tinker.files import lora_targets
from agentjet_server.tinker.sampling import SampleJob
from agentjet_server.tinker.saving import Saving
from agentjet_server.tinker.store import parse_path
from agentjet_server.tinker.wire import ForwardBackward, SampleAsk
from agentjet_server.tinker.workbench import MAX_MODELS, MAX_RANK, Sampler, TrainingModel, Workbench


class Service:
    def __init__(self, bench: Workbench, vocab: int, max_context: int) -> None:
        self.bench, self.vocab, self.max_context = bench, vocab, max_context
        self.saving = Saving(self)

    # ----------------------------------------------------------------------------- sessions

    def create_session(self) -> str:
        self.sweep()
        session_id = f"session-{uuid.uuid4().hex[:16]}"
        self.bench.sessions.create(session_id)
        return session_id

    def heartbeat(self, session_id: str) -> None:
        if not self.bench.sessions.beat(session_id):
            self.bench.sessions.create(session_id)  # a restarted server takes its clients' sessions back
        self.sweep()

    def sweep(self) -> None:
        """Sessions whose heartbeats stopped: their sequences are dropped, their training clients unloaded."""
        for session_id in self.bench.sessions.lapsed():
            self.bench.sequences.drop_session(session_id)
            for model_id in [m.model_id for m in self.bench.models.values() if m.session_id == session_id]:
                self.unload(model_id)

    def session(self, session_id: Any) -> str:
        if not isinstance(session_id, str) or not self.bench.sessions.known(session_id):
            raise NotFoundError(f"no session {session_id!r} on this server: create one (ServiceClient does)")
        return session_id

    # ----------------------------------------------------------------------------- training clients

    def create_model(self, body: dict[str, Any]) -> str:
        session_id = self.session(body.get("session_id"))
        base = body.get("base_model")
        if base != self.bench.model_name:
            raise NotFoundError(
                f"base_model {base!r}: this server trains {self.bench.model_name!r} (see get_server_capabilities)"
            )
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise InvalidRequestError(
                f"optimizer {optimizer!r}: this server's training clients use adamw", param="optimizer_config"
            )
        lora = body.get("lora_config")
        if lora is None:
            return self._create_full(session_id, body)
        if not isinstance(lora, dict):
            raise InvalidRequestError("lora_config must be an object (rank, seed, train_mlp, ...)", param="lora_config")
        rank = lora.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
            raise InvalidRequestError(f"lora_config.rank must be an integer from 1 to {MAX_RANK}", param="lora_config")
        self.room()
        model_id = self.bench.new_model_id(session_id, body.get("model_seq_id"))
        flags = (
            bool(lora.get("train_mlp", True)),
            bool(lora.get("train_attn", True)),
            bool(lora.get("train_unembed", True)),
        )

        def work() -> dict[str, Any]:
            targets = lora_targets(self.bench.base, *flags)
            adapter = f"c{uuid.uuid4().hex[:12]}"
            self.bench.add_adapter(adapter, rank, targets, lora.get("seed"))
            self.bench.models[model_id] = TrainingModel(
                model_id, session_id, adapter, rank, targets, body.get("user_metadata")
            )
            return {"model_id": model_id, "type": "create_model"}

        return self.bench.submit("CreateModel", work)

    def _create_full(self, session_id: str, body: dict[str, Any]) -> str:
        """A full-model training client: a trainable copy of its own (``tinker.full``), if there is room."""
        self.room()
        model_id = self.bench.new_model_id(session_id, body.get("model_seq_id"))
        self.bench.full.reserve()

        def work() -> dict[str, Any]:
            name = self.bench.full.create()
            self.bench.models[model_id] = TrainingModel(
                model_id, session_id, name, 0, [], body.get("user_metadata"), full=True
            )
            return {"model_id": model_id, "type": "create_model"}

        return self.bench.submit("CreateModel", work)

    def room(self) -> None:
        if len(self.bench.models) >= MAX_MODELS:
            raise ConflictError(
                f"{MAX_MODELS} training clients are loaded on this server; unload one (POST /api/v1/unload_model "
                "with its model_id, or end its session) before creating another"
            )

    def unload(self, model_id: str) -> str:
        trained = self.bench.model(model_id)

        def work() -> dict[str, Any]:
            self.bench.models.pop(model_id, None)
            self.bench.remove_adapter(trained.adapter)
            for sampler_id in [s.sampler_id for s in self.bench.samplers.values() if s.adapter == trained.adapter]:
                del self.bench.samplers[sampler_id]
            return {"model_id": model_id, "type": "unload_model"}

        return self.bench.submit("UnloadModel", work)

    def info(self, model_id: Any) -> dict[str, Any]:
        trained = self.bench.model(str(model_id))
        return {
            "type": "get_info",
            "model_id": trained.model_id,
            "model_data": {
                "arch": self.bench.arch,
                "model_name": self.bench.model_name,
                "tokenizer_id": self.bench.tokenizer_id,
            },
            "is_lora": not trained.full,
            "lora_rank": None if trained.full else trained.rank,
            "model_name": self.bench.model_name,
        }

    # ----------------------------------------------------------------------------- forward and backward

    def forward_backward(self, request: ForwardBackward) -> str:
        self.bench.model(request.model_id)
        losses.check(request.loss_fn, request.config)
        if not request.data:
            raise InvalidRequestError("forward_backward needs at least one datum", param="data")
        for index, datum in enumerate(request.data):
            check_datum(datum, index, request.loss_fn, self.vocab, self.max_context)
            if request.loss_fn == "stable_reinforce" and not request.forward_only:
                resolve_provenance(self.bench.sequences, datum, index)
        kind = "Forward" if request.forward_only else "ForwardBackward"
        return self.bench.submit(kind, lambda: ("forward_backward", *self.bench.forward_backward(request)))

    def optim_step(self, body: dict[str, Any]) -> str:
        model_id = str(body.get("model_id"))
        self.bench.model(model_id)
        params = adam_params(body)
        return self.bench.submit("OptimStep", lambda: self.bench.optim_step(model_id, params))

    # ----------------------------------------------------------------------------- sampling

    def new_sampler(self, session_id: str, adapter: str | None, path: str | None) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        self.bench.samplers[sampler_id] = Sampler(sampler_id, session_id, adapter, path)
        return sampler_id

    def create_sampler(self, body: dict[str, Any]) -> str:
        session_id = self.session(body.get("session_id"))
        path, base = body.get("model_path"), body.get("base_model")
        if path is not None:
            parse_path(str(path))
            self.bench.checkpoints.existing(str(path))
            return self.new_sampler(session_id, None, str(path))
        if base != self.bench.model_name:
            raise NotFoundError(f"base_model {base!r}: this server samples {self.bench.model_name!r}")
        return self.new_sampler(session_id, None, None)

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        sampler = self.bench.samplers.get(sampler_id)
        if sampler is None:
            raise NotFoundError(f"no sampling session {sampler_id!r} on this server")
        return {"sampler_id": sampler_id, "base_model": self.bench.model_name, "model_path": sampler.model_path}

    def sample(self, body: dict[str, Any], ask: SampleAsk) -> tuple[str, list[str]]:
        sampler_id = body.get("sampling_session_id")
        if sampler_id is None:
            raise InvalidRequestError(
                "asample needs a sampling_session_id (create_sampling_session; the SDK's SamplingClient does it)",
                param="sampling_session_id",
            )
        sampler = self.bench.samplers.get(str(sampler_id))
        if sampler is None:
            raise NotFoundError(f"no sampling session {sampler_id!r} on this server")
        if len(ask.prompt) + ask.max_tokens > self.max_context:
            raise InvalidRequestError(
                f"the prompt's {len(ask.prompt)} tokens and max_tokens {ask.max_tokens} exceed the model's context "
                f"of {self.max_context}"
            )
        if min(ask.prompt) < 0 or max(ask.prompt) >= self.vocab:
            raise InvalidRequestError(
                f"the prompt holds a token id outside this model's vocabulary (0..{self.vocab - 1})"
            )
        request_id = self.bench.futures.create("Sample")
        sequence_ids = [f"{request_id}-{i}" for i in range(ask.num_samples)]
        self.bench.submit("Sample", SampleJob(sampler.sampler_id, ask, sequence_ids), request_id)
        return request_id, sequence_ids
