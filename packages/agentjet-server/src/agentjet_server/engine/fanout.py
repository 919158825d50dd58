"""Weights for several engine processes at once, copied once into shared memory that the updates reuse.

Each update is written into a set of shared-memory tensors, in the engines' dtype (they would convert
it anyway; bf16 halves what is copied), which every replica then reads. The tensors are allocated by
the first two updates and reused: moving fresh tensors into shared memory cost 1.7 s for a
147M-parameter model here, most of it faulting in new pages, against a plain copy into pages already
mapped (``bench/fanout.py``). Two sets, written in turn, so the newest weights stay whole while the
next update writes; a restarting replica that read a set while it was rewritten sees the newest
weights change and loads again.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SharedWeights:
    """Two sets of shared-memory tensors, written in turn by the updates (``share``); one update at a time."""

    def __init__(self, dtype: str | None) -> None:
        """``dtype``: the engines' (``create_engine``'s name for it); floating-point tensors are converted
        to it. ``auto`` or None: each tensor keeps its own."""
        self._dtype = _DTYPES.get(str(dtype))
        self._sets: list[dict[str, torch.Tensor]] = [{}, {}]

    def share(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` copied into the set not written last time; the tensors of that set."""
        spare = self._sets[0]
        self._sets.reverse()
        out = {}
        for name, tensor in state_dict.items():
            source = tensor.detach()
            dtype = self._dtype if self._dtype is not None and source.is_floating_point() else source.dtype
            buffer = spare.get(name)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != dtype:
                buffer = torch.empty(source.shape, dtype=dtype).share_memory_()  # type: ignore[no-untyped-call]
                spare[name] = buffer
            buffer.copy_(source)
            out[name] = buffer
        return out
