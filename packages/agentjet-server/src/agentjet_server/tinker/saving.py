"""The Tinker API's checkpoints: ``save_state`` / ``save_weights_for_sampler`` (a named checkpoint, or an
ephemeral one behind ``save_weights_and_get_sampling_client``), ``load_state`` onto a training client or as a
new one (``create_training_client_from_state[_with_optimizer]``), and the RestClient's training-run and
checkpoint listings."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, Protocol

import torch

from agentjet_server.engine.adapter import LoraSpec, write_adapter
from agentjet_server.errors import ConflictError, InvalidRequestError, NotFoundError
from agentjet_server.tinker.files import LORA_ALPHA, load_adapter_tensors
from agentjet_server.tinker.store import check_name, parse_path, tinker_path
from agentjet_server.tinker.workbench import TrainingModel, Workbench


class Clients(Protocol):
    """What saving needs of the service: its workbench, sessions, room for a client, new samplers."""

    bench: Workbench

    def session(self, session_id: Any) -> str: ...

    def room(self) -> None: ...

    def new_sampler(self, session_id: str, adapter: str | None, path: str | None) -> str: ...


class Saving:
    def __init__(self, service: Clients) -> None:
        self.service, self.bench = service, service.bench

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
                    "sampling_session_id": self.service.new_sampler(trained.session_id, trained.adapter, None),
                }
            path = save(trained, self.bench, kind, name, optimizer=not sampler, meta=meta)
            if not sampler:
                return {"path": path, "type": "save_weights"}
            answer: dict[str, Any] = {"type": "save_weights_for_sampler", "path": None if ephemeral else path}
            if ephemeral:
                answer["sampling_session_id"] = self.service.new_sampler(trained.session_id, None, path)
            return answer

        return self.bench.submit("SaveWeightsForSampler" if sampler else "SaveWeights", work)

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
        full = bool(meta.get("full"))
        if existing is None:
            session_id = self.service.session(body.get("session_id"))
            self.service.room()
            new_id = self.bench.new_model_id(session_id, body.get("model_seq_id"))
            if full:
                self.bench.full.reserve()
        elif existing.full != full or existing.rank != meta["rank"] or existing.targets != meta["targets"]:
            raise ConflictError(f"{path} holds {_holds(meta)}; this training client trains {_holds(existing)}")

        def work() -> dict[str, Any]:
            trained = existing
            directory = self.bench.checkpoints.existing(path)
            if trained is None:
                rank, targets = int(meta["rank"]), list(meta["targets"])
                if full:
                    name = self.bench.full.create(directory)
                else:
                    name = f"c{uuid.uuid4().hex[:12]}"
                    self.bench.add_adapter(name, rank, targets)
                    load_adapter_tensors(self.bench.adapter_params(name), name, directory)
                trained = TrainingModel(new_id, session_id, name, rank, targets, body.get("user_metadata"), full=full)
                self.bench.models[new_id] = trained
            elif full:
                self.bench.full.replace(trained.adapter, directory)
            else:
                load_adapter_tensors(self.bench.adapter_params(trained.adapter), trained.adapter, directory)
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
            "is_lora": not (trained.full if trained is not None else meta.get("full", False)),
            "corrupted": False,
            "lora_rank": (trained.rank if trained is not None else meta.get("rank")) or None,
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


def save(trained: TrainingModel, bench: Workbench, kind: str, name: str, optimizer: bool, meta: dict[str, Any]) -> str:
    """Write ``trained``'s adapter (with ``optimizer``, its optimizer state) as checkpoint ``name``; its path."""
    path = tinker_path(trained.model_id, kind, check_name(name))
    directory = bench.checkpoints.directory(path)
    directory.mkdir(parents=True, exist_ok=True)
    if trained.full:  # a Hugging Face model directory
        bench.full.save(trained.adapter, directory)
    else:  # peft's adapter format
        params = bench.adapter_params(trained.adapter)
        tensors = {k.removeprefix("base_model.model."): p.detach().cpu() for k, p in params}
        spec = LoraSpec(rank=trained.rank, alpha=LORA_ALPHA, targets=",".join(trained.targets))
        write_adapter(directory, tensors, spec, bench.model_name, name=trained.adapter)
    if optimizer:
        state = trained.optimizer.state_dict() if trained.optimizer is not None else None
        torch.save({"optimizer": state, "steps": trained.steps}, directory / "optimizer.pt")
    recorded = {
        "model_id": trained.model_id,
        "base_model": bench.model_name,
        "rank": trained.rank,
        "full": trained.full,
    }
    recorded.update(targets=trained.targets, steps=trained.steps, **meta)
    bench.checkpoints.write_meta(directory, recorded)
    return path


def _holds(what: TrainingModel | dict[str, Any]) -> str:
    full, rank = (what.full, what.rank) if isinstance(what, TrainingModel) else (what.get("full"), what["rank"])
    return "the full model's weights" if full else f"a rank-{rank} adapter"
