"""Full-model Tinker training clients, each a trainable copy of the model of its own: a ``create_model``
without ``lora_config`` (``agentjet_client.finetune.cookbook.create_full_training_client``; the SDK itself
asks only for LoRA clients), or ``load_state`` of a checkpoint one saved.

Each copy is loaded from the model's directory and has its own AdamW:
neither the frozen base under the LoRA clients nor the weights a swarm run trains are ever moved by one, so
the two never train the same weights and the one condition on offering it is memory. A client holds fp32
weights, their gradients and AdamW's two moments (``TRAINED_BYTES`` a parameter); ``--tinker-full-clients``
(default 1) caps how many are loaded at once, and one past the cap, or one the learner's device has not the
free memory for, is refused with that reason. A sampler of a saved full checkpoint is a frozen copy
(``FROZEN_BYTES`` a parameter); at most ``MAX_FROZEN`` are held, the least recently used unloaded (and loaded
again from disk when asked). A full checkpoint is a Hugging Face model directory (``save_pretrained``), which
``AutoModelForCausalLM.from_pretrained`` and vLLM load as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from agentjet_server.errors import ConflictError

logger = logging.getLogger(__name__)

TRAINED_BYTES = 16  # fp32 weights, gradients, AdamW's two moments
FROZEN_BYTES = 4
HEADROOM = 1.25  # activations and the allocator's slack beside the state
MAX_FROZEN = 2


class FullModels:
    """The full-model copies of one workbench, by name: trainable (``f…``) and frozen sampler snapshots (``g…``)."""

    def __init__(self, model_path: Path, device: torch.device, limit: int) -> None:
        self.model_path, self.device, self.limit = model_path, device, limit
        self.trainable: dict[str, Any] = {}
        self.frozen: dict[str, Any] = {}
        self.pending = 0  # creations accepted by a route, not yet done on the workbench's thread
        self._parameters: int | None = None

    def holds(self, name: str | None) -> bool:
        return name is not None and (name in self.trainable or name in self.frozen)

    def module(self, name: str) -> Any:
        return self.trainable[name] if name in self.trainable else self.frozen[name]

    @property
    def parameters(self) -> int:
        if self._parameters is None:
            from agentjet_server.model_shape import ModelShape

            self._parameters = ModelShape.from_pretrained(self.model_path).parameters
        return self._parameters

    def reserve(self) -> None:
        """(a route) Room for one more trainable copy, held until ``create``/``load`` (or ``release``); else
        a 409 that says what is short and what to do."""
        if self.limit == 0:
            raise ConflictError(
                "full-model training clients are off on this server (--tinker-full-clients 0): ask for a LoRA "
                "client (lora_config), or start the server with --tinker-full-clients 1"
            )
        held = len(self.trainable) + self.pending
        if held >= self.limit:
            raise ConflictError(
                f"{held} full-model training client(s) are loaded on this server, its limit "
                f"(--tinker-full-clients {self.limit}): unload one (POST /api/v1/unload_model with its model_id, or "
                "end its session), ask for a LoRA client (lora_config), or start the server with a higher limit"
            )
        need = int(self.parameters * TRAINED_BYTES * HEADROOM)
        free = device_available(str(self.device))
        if need > free:
            raise ConflictError(
                f"a full-model training client of this {self.parameters / 1e6:.0f}M-parameter model needs about "
                f"{_gib(need)} on {self.device} (fp32 weights, gradients and AdamW's moments) and "
                f"{_gib(free)} is free: ask for a LoRA client (lora_config), or free memory there"
            )
        self.pending += 1

    def release(self) -> None:
        self.pending = max(0, self.pending - 1)

    def create(self, directory: Path | None = None) -> str:
        """(the workbench's thread) A trainable copy of the base (or of a saved full checkpoint); its name."""
        try:
            name = f"f{uuid.uuid4().hex[:12]}"
            self.trainable[name] = self._load(directory or self.model_path).requires_grad_(True)
            return name
        finally:
            self.release()

    def replace(self, name: str, directory: Path) -> None:
        """(the workbench's thread) A trainable copy's weights from a saved full checkpoint."""
        self.trainable[name] = self._load(directory).requires_grad_(True)

    def load_frozen(self, directory: Path) -> str:
        name = f"g{uuid.uuid4().hex[:12]}"
        self.frozen[name] = self._load(directory).requires_grad_(False)
        return name

    def remove(self, name: str) -> None:
        self.trainable.pop(name, None)
        self.frozen.pop(name, None)

    def save(self, name: str, directory: Path) -> None:
        self.trainable[name].save_pretrained(str(directory), safe_serialization=True)

    def _load(self, directory: Path) -> Any:
        from transformers import AutoModelForCausalLM

        logger.info("Tinker API: loading a full-model copy from %s", directory)
        model: Any = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        return model.to(self.device).eval()


def device_available(device: str) -> int:
    """Memory ``device`` has free now (CPU: what the kernel counts as available, page cache included)."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
