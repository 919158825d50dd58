"""What bounds the Tinker API's full-model training clients (``tinker.full``): the server's limit, and the
memory the learner's device has free, each refusal saying which and what to do."""

from __future__ import annotations

import pytest
import torch

from agentjet_server.errors import ConflictError
from agentjet_server.tinker import full as full_module
from agentjet_server.tinker.full import TRAINED_BYTES, FullModels


def test_a_full_client_is_refused_past_the_limit_or_the_free_memory(model_dir, monkeypatch):
    models = FullModels(model_dir, torch.device("cpu"), limit=1)
    assert models.parameters > 100_000  # counted from the config on the meta device
    models.reserve()  # the machine has room for one copy of the tiny model
    with pytest.raises(ConflictError, match=r"1 full-model training client\(s\) are loaded.*--tinker-full-clients 1"):
        models.reserve()  # the one reserved, not created yet, counts
    name = models.create()
    assert models.pending == 0 and all(p.requires_grad for p in models.module(name).parameters())
    models.remove(name)

    free = models.parameters * TRAINED_BYTES  # enough for the state, not for the headroom beside it
    monkeypatch.setattr(full_module, "device_available", lambda device: free)
    with pytest.raises(ConflictError, match=r"needs about .* GiB on cpu .* is free: ask for a LoRA client"):
        models.reserve()
    assert models.pending == 0

    off = FullModels(model_dir, torch.device("cpu"), limit=0)
    with pytest.raises(ConflictError, match="--tinker-full-clients 0"):
        off.reserve()


def test_the_free_memory_is_read_from_the_machine():
    available = full_module.device_available("cpu")
    assert 0 < available <= full_module.os.sysconf("SC_PAGE_SIZE") * full_module.os.sysconf("SC_PHYS_PAGES")
