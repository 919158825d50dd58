"""Runs inside vLLM's worker (``worker_extension_cls``): load new weights in place.

vLLM mixes this class into its worker, so ``self`` is the worker and ``self.model_runner`` its
model runner. The engine calls it with ``collective_rpc("agentjet_load_weights", ...)``
between two engine steps. This module imports nothing from vLLM at import time, so the name
resolves in any process vLLM starts.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class WeightLoader:
    def agentjet_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named full tensors; returns how many were given.

        ``reload_weights`` (vLLM's in-place reload) runs each layer's loader and its
        post-processing, which repacks kernel-format weights (oneDNN on CPU, quantised layouts on
        GPU). An output head tied to the input embedding has no tensor of its own in the list,
        so its packed copy is rebuilt from the freshly loaded embedding afterwards.
        """
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        model: Any = runner.get_model()
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            reload(weights_iterator=iter(weights))
        else:  # vLLM before in-place reload: load, then convert to kernel format (the RLHF examples' path)
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            model.load_weights(weights=iter(weights))
            process_weights_after_loading(model, runner.model_config, next(model.parameters()).device)
        config = getattr(model, "config", None)
        head: Any = getattr(model, "lm_head", None)
        method: Any = getattr(head, "quant_method", None)
        if getattr(config, "tie_word_embeddings", False) and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
        return len(weights)
