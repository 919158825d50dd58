"""The LoRA adapters the vLLM engine serves, one per policy version (``--lora-rank`` with ``--engine vllm``).

The learner's thread writes each new adapter in peft's format to a directory of its own and offers it
(``AdapterBook.offer``); the engine thread registers the newest with vLLM between two steps
(``register``), so new requests run on it, while requests in flight finish on the adapter they started
with. Adapters that no request runs on any more, and that are not the newest, are removed from vLLM
and from disk (``drop_unused``).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentjet_server.engine.adapter import LoraSpec, write_adapter
from agentjet_server.engine.handoff import WeightSlot, WeightUpdate
from agentjet_server.errors import ConfigError

MAX_LIVE_ADAPTERS = 8  # adapter versions vLLM keeps loaded at once (requests in flight keep theirs)


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for slot in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ConfigError(f"--lora-rank {rank}: vLLM serves adapters of rank 512 at most")


def lora_engine_args(spec: LoraSpec) -> dict[str, Any]:
    """vLLM's engine arguments for serving adapters of ``spec``: it sizes its LoRA buffers by these; a
    request keeps the adapter it started on, so a few versions can be live at once."""
    return {
        "enable_lora": True,
        "max_lora_rank": lora_rank_slot(spec.rank),
        "max_loras": MAX_LIVE_ADAPTERS,
        "max_cpu_loras": MAX_LIVE_ADAPTERS,
    }


@dataclass
class _Adapter:
    """A LoRA adapter registered with vLLM, for one policy version."""

    version: int
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
        self._by_version: dict[int, _Adapter] = {}  # the newest serves new requests

    def offer(
        self, adapter: Mapping[str, torch.Tensor], version: int, wake: Callable[[], None], closed: threading.Event
    ) -> None:
        """Write ``adapter`` for ``version`` and wait until the engine thread has registered it."""
        write_adapter(self._directory / f"v{version}", dict(adapter), self.spec, self._base)
        self._slot.offer({}, version, wake, closed)

    def take(self) -> WeightUpdate | None:
        """For the engine thread: the newest adapter offered, if any (its ``version`` says which)."""
        return self._slot.take()

    def register(self, engine: Any, version: int) -> None:
        """Load the adapter written for ``version`` into vLLM (``engine``: its ``LLMEngine``)."""
        from vllm.lora.request import LoRARequest

        path = self._directory / f"v{version}"
        request = LoRARequest(f"agentjet-v{version}", version + 1, str(path))
        engine.add_lora(request)
        self._by_version[version] = _Adapter(version, request, path)

    def lora_request(self, version: int) -> Any | None:
        """vLLM's handle on the adapter of ``version`` (None before the first one is registered)."""
        adapter = self._by_version.get(version)
        return adapter.request if adapter is not None else None

    def drop_unused(self, engine: Any, newest: int, in_use: Collection[int]) -> None:
        """Remove the adapters that are not ``newest`` and whose version is not ``in_use`` by a request."""
        for version, adapter in list(self._by_version.items()):
            if version != newest and version not in in_use:
                engine.remove_lora(adapter.request.lora_int_id)
                shutil.rmtree(adapter.path, ignore_errors=True)
                del self._by_version[version]

    def close(self) -> None:
        """Delete the adapters' files."""
        shutil.rmtree(self._directory, ignore_errors=True)
