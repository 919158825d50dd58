"""The LoRA adapters the vLLM engine serves, one per policy version (``--lora-rank`` with ``--engine vllm``),
and with an adapter per agent (``--adapters``) one per (adapter, version of that adapter).

The learner's thread writes each new adapter in peft's format to a directory of its own and offers it
(``AdapterBook.offer``); the engine thread registers the newest with vLLM between two steps
(``register``), so new requests run on it, while requests in flight finish on the adapter they started
with. Adapters that no request runs on any more, and that are not their name's newest, are removed from
vLLM and from disk (``drop_unused``). The one adapter of plain LoRA has the name ``""``; before a name's
first adapter is registered its requests run on the base model, which is what a fresh adapter (its B
matrices zero) computes.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.adapter import ADAPTER, LoraSpec, write_adapter
from agentjet_server.engine.handoff import WeightSlot, WeightUpdate
from agentjet_server.errors import ConfigError

MAX_LIVE_ADAPTERS = 8  # adapter versions vLLM keeps loaded at once (requests in flight keep theirs)


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for slot in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ConfigError(f"--lora-rank {rank}: vLLM serves adapters of rank 512 at most")


def lora_engine_args(spec: LoraSpec, adapters: int = 1) -> dict[str, Any]:
    """vLLM's engine arguments for serving adapters of ``spec``: it sizes its LoRA buffers by these; a
    request keeps the adapter it started on, so a few versions of each of ``adapters`` can be live at once."""
    live = MAX_LIVE_ADAPTERS * max(adapters, 1)
    return {"enable_lora": True, "max_lora_rank": lora_rank_slot(spec.rank), "max_loras": live, "max_cpu_loras": live}


Key = tuple[str, int]  # (adapter name, "" for plain LoRA; its version)


@dataclass
class _Adapter:
    """A LoRA adapter registered with vLLM, for one version of one name."""

    key: Key
    request: Any  # vllm.lora.request.LoRARequest
    path: Path


class AdapterBook:
    """The adapters of one vLLM engine: written and offered by the learner's thread, registered and
    dropped by the engine thread."""

    def __init__(self, spec: LoraSpec, base_model: Path) -> None:
        self.spec = spec
        self._base = str(base_model)
        self._directory = Path(tempfile.mkdtemp(prefix="agentjet-lora-"))
        self._slot = WeightSlot()
        self._registered: dict[Key, _Adapter] = {}
        self.newest: dict[str, int] = {}  # each name's newest version: it serves new requests
        self._ids = itertools.count(1)  # vLLM's LoRA ids: one per registration, never reused

    def offer(
        self,
        adapter: Mapping[str, torch.Tensor],
        version: int,
        wake: Callable[[], None],
        closed: threading.Event,
        name: str = "",
    ) -> None:
        """Write ``adapter`` (of ``name``; peft's parameter names, with the name in them unless it is plain
        LoRA's) for ``version`` and wait until the engine thread has registered it."""
        write_adapter(self._folder((name, version)), dict(adapter), self.spec, self._base, name or ADAPTER)
        self._slot.offer({}, version, wake, closed, adapter=name or None)

    def take(self) -> WeightUpdate | None:
        """For the engine thread: an adapter offered, if any (its ``version`` and ``adapter`` say which)."""
        return self._slot.take()

    def register(self, engine: Any, version: int, name: str = "") -> None:
        """Load the adapter written for ``version`` of ``name`` into vLLM (``engine``: its ``LLMEngine``)."""
        from vllm.lora.request import LoRARequest

        key = (name, version)
        path = self._folder(key)
        request = LoRARequest(
            f"agentjet-{name}-v{version}" if name else f"agentjet-v{version}", next(self._ids), str(path)
        )
        engine.add_lora(request)
        self._registered[key] = _Adapter(key, request, path)
        self.newest[name] = version

    def lora_request(self, version: int, name: str = "") -> Any | None:
        """vLLM's handle on the adapter of ``version`` of ``name`` (None before the first one is registered)."""
        adapter = self._registered.get((name, version))
        return adapter.request if adapter is not None else None

    def drop_unused(self, engine: Any, in_use: Collection[Key]) -> None:
        """Remove the adapters that are not their name's newest and that no request runs on (``in_use``)."""
        for key, adapter in list(self._registered.items()):
            if key[1] != self.newest.get(key[0]) and key not in in_use:
                engine.remove_lora(adapter.request.lora_int_id)
                shutil.rmtree(adapter.path, ignore_errors=True)
                del self._registered[key]

    def close(self) -> None:
        """Delete the adapters' files."""
        shutil.rmtree(self._directory, ignore_errors=True)

    def _folder(self, key: Key) -> Path:
        name, version = key
        return self._directory / (f"{name}-v{version}" if name else f"v{version}")
