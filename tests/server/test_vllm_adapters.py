"""The vLLM engine's LoRA bookkeeping (``engine/vllm_adapters.py``) as far as it runs without vLLM: the
rank slots vLLM accepts, and an adapter offered by the learner's thread, written in peft's format, taken
by the engine thread. Registering with vLLM is in ``tests/vllm/test_vllm_lora.py``."""

import json
import threading

import pytest
import torch

from agentjet_server.engine.adapter import LoraSpec
from agentjet_server.engine.vllm_adapters import MAX_LIVE_ADAPTERS, AdapterBook, lora_engine_args, lora_rank_slot
from agentjet_server.errors import ConfigError


def test_a_rank_takes_the_smallest_slot_vllm_accepts_and_over_512_is_refused():
    assert [lora_rank_slot(r) for r in (1, 8, 9, 64, 300, 512)] == [8, 8, 16, 64, 320, 512]
    with pytest.raises(ConfigError, match="512 at most"):
        lora_rank_slot(513)
    args = lora_engine_args(LoraSpec(rank=24, alpha=48.0))
    assert args["enable_lora"] and args["max_lora_rank"] == 32 and args["max_loras"] == MAX_LIVE_ADAPTERS


def test_an_offered_adapter_is_written_in_peft_format_and_taken_by_the_engine_thread(model_dir):
    book = AdapterBook(LoraSpec(rank=8, alpha=16.0), model_dir)
    adapter = {
        "model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.randn(8, 16),
        "model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.zeros(16, 8),
    }
    closed = threading.Event()
    taken: list[int] = []

    def engine_thread() -> None:
        while not taken:
            update = book.take()
            if update is not None:
                taken.append(update.version)
                update.applied.set()

    thread = threading.Thread(target=engine_thread)
    thread.start()
    book.offer(adapter, 3, wake=lambda: None, closed=closed)  # returns once the engine thread took it
    thread.join()
    assert taken == [3] and book.lora_request(3) is None  # taken, not yet registered with vLLM
    written = book._directory / "v3"
    config = json.loads((written / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["target_modules"] == ["q_proj"]
    assert (written / "adapter_model.safetensors").exists()
    book.close()
    assert not written.exists()
