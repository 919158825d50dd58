"""A Tinker training client's adapter on disk: peft's format (``adapter_model.safetensors`` and
``adapter_config.json``, loadable with ``PeftModel.from_pretrained`` or by vLLM), its optimizer state beside it
for ``save_state``, and ``meta.json`` with what it was created with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentjet_server.errors import ConflictError, InvalidRequestError

LORA_ALPHA = 32.0  # Tinker's LoRA scaling is alpha / rank with alpha 32, whatever the rank


def lora_targets(base: Any, mlp: bool, attn: bool, unembed: bool) -> list[str]:
    """The layers a client's LoRA wraps on ``base``: attention and MLP projections and the output head, as its
    LoRA config asks (not a head whose weights are the input embeddings')."""
    head = base.get_output_embeddings()  # once other clients' adapters wrap it: their LoRA layer around it
    head_path = next((path for path, module in base.named_modules() if module is head), None)
    names: set[str] = set()
    for path, module in base.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".lora_" in path:  # other clients' LoRA layers are not
            continue
        path = path.removesuffix(".base_layer")  # a layer another client's adapter already wraps
        if path == head_path:
            if unembed and not base.config.tie_word_embeddings:
                names.add(path.rsplit(".", 1)[-1])
        elif (attn and "attn" in path) or (mlp and "mlp" in path):
            names.add(path.rsplit(".", 1)[-1])
    if not names:
        raise InvalidRequestError("the LoRA config leaves no layer of this model to train", param="lora_config")
    return sorted(names)


def load_adapter_tensors(own_params: list[tuple[str, torch.nn.Parameter]], name: str, directory: Path) -> None:
    """A saved adapter's tensors into adapter ``name``'s parameters (``own_params``), in place."""
    from safetensors.torch import load_file

    saved = load_file(str(directory / "adapter_model.safetensors"))
    own = dict(own_params)
    loaded = 0
    for key, tensor in saved.items():
        inner = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            inner = inner.replace(f".{part}.weight", f".{part}.{name}.weight")
        target = own.get("base_model.model." + inner)
        if target is None or target.shape != tensor.shape:
            raise ConflictError(f"the checkpoint in {directory.name} does not fit this model ({key})")
        with torch.no_grad():
            target.copy_(tensor.to(target.device))
        loaded += 1
    if loaded != len(own):
        raise ConflictError(f"the checkpoint in {directory.name} holds {loaded} of the adapter's {len(own)} tensors")
