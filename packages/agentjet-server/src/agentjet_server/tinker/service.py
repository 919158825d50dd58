"""The Tinker API's operations over the workbench: each checks its request where the route runs (a bad
request is a 4xx within a second, never a failed future found later) and hands the work to the workbench's
thread; the routes (``api/tinker.py``) only parse and render."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from agentjet_server.errors import ConflictError, InvalidRequestError, NotFoundError
from agentjet_server.tinker import losses
from agentjet_server.tinker.store import parse_path, tinker_path
from agentjet_server.tinker.wire import Datum, ForwardBackward, SampleAsk
from agentjet_server.tinker.workbench import MAX_MODELS, MAX_RANK, Sampler, TrainingModel, Workbench

ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


class Service:
    def __init__(self, bench: Workbench, vocab: int, max_context: int) -> None:
        self.bench, self.vocab, self.max_context = bench, vocab, max_context

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
        lora = body.get("lora_config")
        if not isinstance(lora, dict):
            raise ConflictError(
                "a full-model training client is not offered by the Tinker API here: its base must stay frozen for the "
                "other clients' adapters; train the full model through the swarm (agentjet-client run), or ask for a "
                "LoRA client (lora_config)"
            )
        rank = lora.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
            raise InvalidRequestError(f"lora_config.rank must be an integer from 1 to {MAX_RANK}", param="lora_config")
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise InvalidRequestError(
                f"optimizer {optimizer!r}: this server's training clients use adamw", param="optimizer_config"
            )
        self._room()
        model_id = self.bench.new_model_id()
        flags = (
            bool(lora.get("train_mlp", True)),
            bool(lora.get("train_attn", True)),
            bool(lora.get("train_unembed", True)),
        )

        def work() -> dict[str, Any]:
            targets = self.bench.targets(*flags)
            self.bench.add_adapter(model_id, rank, targets, lora.get("seed"))
            self.bench.models[model_id] = TrainingModel(
                model_id, session_id, model_id, rank, targets, body.get("user_metadata")
            )
            return {"model_id": model_id, "type": "create_model"}

        return self.bench.submit("CreateModel", work)

    def _room(self) -> None:
        if len(self.bench.models) >= MAX_MODELS:
            raise ConflictError(
                f"{MAX_MODELS} training clients are loaded on this server; unload one (TrainingClient.unload, or end "
                "its session) before creating another"
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
            "is_lora": True,
            "lora_rank": trained.rank,
            "model_name": self.bench.model_name,
        }

    # ----------------------------------------------------------------------------- forward and backward

    def forward_backward(self, request: ForwardBackward) -> str:
        self.bench.model(request.model_id)
        losses.check(request.loss_fn, request.config)
        if not request.data:
            raise InvalidRequestError("forward_backward needs at least one datum", param="data")
        for index, datum in enumerate(request.data):
            self._check_datum(datum, index, request.loss_fn)
            if request.loss_fn == "stable_reinforce" and not request.forward_only:
                self._provenance(datum, index)
        kind = "Forward" if request.forward_only else "ForwardBackward"
        return self.bench.submit(kind, lambda: ("forward_backward", *self.bench.forward_backward(request)))

    def _check_datum(self, datum: Datum, index: int, loss_fn: str) -> None:
        n = len(datum.tokens)
        if not n or n > self.max_context:
            raise InvalidRequestError(f"datum {index} has {n} tokens; this model takes 1 to {self.max_context}")
        if min(datum.tokens) < 0 or max(datum.tokens) >= self.vocab:
            raise InvalidRequestError(
                f"datum {index}: a token id outside this model's vocabulary (0..{self.vocab - 1})"
            )
        allowed = set(losses.REQUIRED[loss_fn]) | losses.OPTIONAL_INPUTS
        for name in losses.REQUIRED[loss_fn]:
            if name not in datum.inputs:
                raise InvalidRequestError(
                    f"datum {index}: {loss_fn} needs loss_fn_inputs[{name!r}]", param="loss_fn_inputs"
                )
        for name, array in datum.inputs.items():
            if name not in allowed:
                raise InvalidRequestError(
                    f"datum {index}: loss_fn_inputs[{name!r}] is not an input of {loss_fn} "
                    f"(its inputs: {', '.join(sorted(allowed))})",
                    param="loss_fn_inputs",
                )
            if array.ndim == 0 or array.shape[0] != n:
                raise InvalidRequestError(
                    f"datum {index}: loss_fn_inputs[{name!r}] has shape {list(array.shape)}, but the datum has {n} "
                    "input tokens (targets, weights and the rest give one value per input position)",
                    param="loss_fn_inputs",
                )
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                raise InvalidRequestError(f"datum {index}: loss_fn_inputs[{name!r}] holds a value that is not finite")
        targets = datum.inputs["target_tokens"]
        if targets.ndim > 2 or (targets.size and (targets.min() < 0 or targets.max() >= self.vocab)):
            raise InvalidRequestError(
                f"datum {index}: target_tokens must be ids of this model's vocabulary (0..{self.vocab - 1})"
            )
        for name in ("weights", "advantages", "logprobs"):
            if name in datum.inputs and datum.inputs[name].shape != targets.shape:
                raise InvalidRequestError(
                    f"datum {index}: loss_fn_inputs[{name!r}] has shape {list(datum.inputs[name].shape)}, "
                    f"target_tokens {list(targets.shape)}: they must match",
                    param="loss_fn_inputs",
                )

    def _provenance(self, datum: Datum, index: int) -> None:
        """stable_reinforce: each target token is where its provenance says it came from, and its sampler
        log-probability is the one the server kept (the client's own copy is not trusted)."""
        if not datum.target_spans:
            raise InvalidRequestError(
                f"datum {index}: stable_reinforce needs provenance on every datum (Datum.with_provenance; the cookbook "
                "adds it when its sampling clients record stability info)",
                param="loss_fn_input_spans",
            )
        targets = datum.inputs["target_tokens"].reshape(-1).tolist()
        mu = datum.inputs["logprobs"].astype(np.float32).reshape(-1).copy()
        position = 0
        for span in datum.target_spans:
            kept = self.bench.sequences.get(span.sequence_id)
            source = kept.tokens if span.sampled else kept.prompt
            end = span.offset + span.length
            if end > len(source) or targets[position : position + span.length] != source[span.offset : end]:
                raise InvalidRequestError(
                    f"datum {index}: target tokens {position}..{position + span.length - 1} are not the "
                    f"{'sampled' if span.sampled else 'prompt'} tokens {span.offset}..{end - 1} of sequence "
                    f"{span.sequence_id} as this server sampled it",
                    param="loss_fn_input_spans",
                )
            if span.sampled:
                mu[position : position + span.length] = kept.logprobs[span.offset : end]
            position += span.length
        if position != len(targets):
            raise InvalidRequestError(f"datum {index}: the provenance spans cover {position} of {len(targets)} targets")
        datum.inputs["logprobs"] = mu

    def optim_step(self, body: dict[str, Any]) -> str:
        model_id = str(body.get("model_id"))
        self.bench.model(model_id)
        given = body.get("adam_params") or body.get("optim_params") or {}
        if not isinstance(given, dict) or given.get("type", "adam") not in ("adam", "adamw"):
            raise InvalidRequestError(
                "optim_step takes adam_params (this server's clients use AdamW)", param="adam_params"
            )
        params = {**ADAM_DEFAULTS}
        for key, value in given.items():
            if key == "type":
                continue
            if (
                key not in params
                or isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise InvalidRequestError(
                    f"adam_params {key!r}: the keys are {', '.join(ADAM_DEFAULTS)}, numbers", param=key
                )
            params[key] = float(value)
        if not params["learning_rate"] >= 0 or not 0 <= params["beta1"] < 1 or not 0 <= params["beta2"] < 1:
            raise InvalidRequestError("adam_params: learning_rate >= 0 and betas in [0, 1)", param="adam_params")
        return self.bench.submit("OptimStep", lambda: self.bench.optim_step(model_id, params))

    # ----------------------------------------------------------------------------- checkpoints

    def save_weights(self, body: dict[str, Any], sampler: bool) -> str:
        trained = self.bench.model(str(body.get("model_id")))
        name, kind = body.get("path"), "sampler_weights" if sampler else "weights"
        ephemeral = name is None
        if ephemeral and not sampler:
            raise InvalidRequestError("save_state needs a name (path)", param="path")
        name = name or f"ephemeral-{uuid.uuid4().hex[:12]}"
        if (
            not body.get("overwrite")
            and (self.bench.checkpoints.directory(tinker_path(trained.model_id, kind, name)) / "meta.json").exists()
        ):
            raise ConflictError(
                f"a checkpoint {name!r} of {trained.model_id} exists; choose another name or overwrite it"
            )
        inflight = body.get("kind") == "inflight"
        meta = {"user_metadata": body.get("user_metadata")}

        def work() -> dict[str, Any]:
            if inflight:  # a sampler that follows the training client's own adapter as it trains
                return {
                    "type": "save_weights_for_sampler",
                    "sampling_session_id": self._sampler(trained.session_id, trained.adapter, None),
                }
            path = self.bench.save(trained, kind, name, optimizer=not sampler, meta=meta)
            if not sampler:
                return {"path": path, "type": "save_weights"}
            answer: dict[str, Any] = {"type": "save_weights_for_sampler", "path": None if ephemeral else path}
            if ephemeral:
                answer["sampling_session_id"] = self._sampler(trained.session_id, None, path)
            return answer

        return self.bench.submit("SaveWeightsForSampler" if sampler else "SaveWeights", work)

    def _sampler(self, session_id: str, adapter: str | None, path: str | None) -> str:
        sampler_id = f"sampler-{uuid.uuid4().hex[:16]}"
        self.bench.samplers[sampler_id] = Sampler(sampler_id, session_id, adapter, path)
        return sampler_id

    def load_weights(self, body: dict[str, Any]) -> str:
        path = str(body.get("path"))
        parse_path(path)
        meta = self.bench.checkpoints.meta(path)
        with_optimizer = bool(body.get("optimizer"))
        if with_optimizer and not (self.bench.checkpoints.existing(path) / "optimizer.pt").exists():
            raise InvalidRequestError(f"{path} holds no optimizer state (a sampler checkpoint): load it without one")
        existing = self.bench.models.get(str(body.get("model_id"))) if body.get("model_id") else None
        if body.get("model_id") and existing is None:
            self.bench.model(str(body.get("model_id")))
        if existing is None:
            session_id = self.session(body.get("session_id"))
            self._room()
        elif existing.rank != meta["rank"] or existing.targets != meta["targets"]:
            raise ConflictError(
                f"{path} is a rank-{meta['rank']} adapter; this training client's is rank {existing.rank}"
            )

        def work() -> dict[str, Any]:
            trained = existing
            if trained is None:
                model_id = self.bench.new_model_id()
                self.bench.add_adapter(model_id, int(meta["rank"]), list(meta["targets"]))
                trained = TrainingModel(
                    model_id, session_id, model_id, int(meta["rank"]), list(meta["targets"]), body.get("user_metadata")
                )
                self.bench.models[model_id] = trained
            directory = self.bench.checkpoints.existing(path)
            self.bench.load_adapter_tensors(trained.adapter, directory)
            trained.optimizer = None
            if with_optimizer:
                saved = torch.load(directory / "optimizer.pt", weights_only=True)
                if saved["optimizer"] is not None:
                    named = self.bench.adapter_params(trained.adapter)
                    trained.optimizer = torch.optim.AdamW([p for _, p in named])
                    trained.optimizer.load_state_dict(saved["optimizer"])
                trained.steps = int(saved["steps"])
            return {"type": "load_weights", "path": path, "model_id": trained.model_id}

        return self.bench.submit("LoadWeights", work)

    # ----------------------------------------------------------------------------- sampling

    def create_sampler(self, body: dict[str, Any]) -> str:
        session_id = self.session(body.get("session_id"))
        path, base = body.get("model_path"), body.get("base_model")
        if path is not None:
            parse_path(str(path))
            self.bench.checkpoints.existing(str(path))
            return self._sampler(session_id, None, str(path))
        if base != self.bench.model_name:
            raise NotFoundError(f"base_model {base!r}: this server samples {self.bench.model_name!r}")
        return self._sampler(session_id, None, None)

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        sampler = self.bench.samplers.get(sampler_id)
        if sampler is None:
            raise NotFoundError(f"no sampling session {sampler_id!r} on this server")
        return {"sampler_id": sampler_id, "base_model": self.bench.model_name, "model_path": sampler.model_path}

    def sample(self, body: dict[str, Any], ask: SampleAsk) -> tuple[str, list[str]]:
        sampler_id = body.get("sampling_session_id")
        if sampler_id is None:  # the older form: the model path or base model on the request itself
            sampler_id = self.create_sampler({**body, "session_id": next(iter(self.bench.sessions.last), None)})
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
        self.bench.submit(
            "Sample", lambda: ("sample", self.bench.run_sample(sampler.sampler_id, ask, sequence_ids)), request_id
        )
        return request_id, sequence_ids

    # ----------------------------------------------------------------------------- listings

    def training_run(self, model_id: str) -> dict[str, Any]:
        trained = self.bench.models.get(model_id)
        listing = self.bench.checkpoints.listing(model_id)
        if trained is None and not listing:
            raise NotFoundError(f"no training run {model_id!r} on this server")
        last = {c["checkpoint_type"]: c for c in listing}
        meta = self.bench.checkpoints.meta(listing[-1]["tinker_path"]) if listing else {}
        when = trained.last_request if trained is not None else datetime.fromisoformat(meta["time"])
        return {
            "training_run_id": model_id,
            "base_model": self.bench.model_name,
            "model_owner": "agentjet",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": trained.rank if trained is not None else meta.get("rank"),
            "last_request_time": when.astimezone(UTC).isoformat(),
            "last_checkpoint": last.get("training"),
            "last_sampler_checkpoint": last.get("sampler"),
            "user_metadata": trained.user_metadata if trained is not None else None,
        }

    def training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        ids = sorted(set(self.bench.models) | set(self.bench.checkpoints.models()))
        page = ids[offset : offset + limit]
        return {
            "training_runs": [self.training_run(i) for i in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)},
        }
