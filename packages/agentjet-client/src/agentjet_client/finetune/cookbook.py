"""Point the tinker-cookbook at an AgentJet server: the server's tokenizer, fetched once over its Tinker API
(no model hub), and a renderer for the embedded models' ChatML chat template, both registered with the
cookbook under the names its configurations take.

    from agentjet_client.finetune.cookbook import register

    names = register("http://127.0.0.1:8000")      # key: TINKER_API_KEY, else tml-local
    config = tinker_cookbook.supervised.train.Config(
        base_url=names.base_url, model_name=names.model, renderer_name=names.renderer, ...
    )

The cookbook (``pip install tinker-cookbook``) is the user's; nothing here imports it until ``register`` runs.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

RENDERER = "agentjet/chatml"  # ChatML without reasoning blocks, as the embedded models' template writes it


@dataclass(frozen=True)
class Registered:
    base_url: str
    model: str  # the name the server trains and samples under; the cookbook's tokenizer is registered as it
    renderer: str
    tokenizer_dir: Path


def cache_root() -> Path:
    return Path(os.environ.get("AGENTJET_CACHE", Path.home() / ".cache" / "agentjet")) / "tokenizers"


def fetch_tokenizer(base_url: str, api_key: str) -> tuple[str, Path]:
    """The server's model name and a local directory holding its tokenizer files (fetched once per content)."""
    answer = httpx2.get(base_url.rstrip("/") + "/api/v1/tokenizer", headers={"X-API-Key": api_key}, timeout=60)
    if answer.status_code != 200:
        raise RuntimeError(
            f"{base_url} did not give its tokenizer ({answer.status_code}: {answer.text[:200]}); is it an "
            "agentjet-server with the tinker extra, and is the key tml-<one of its keys>?"
        )
    body = answer.json()
    files: dict[str, str] = body["files"]
    digest = hashlib.sha256("".join(f"{k}\0{v}" for k, v in sorted(files.items())).encode()).hexdigest()[:12]
    directory = cache_root() / f"{body['model_name']}-{digest}"
    if not (directory / "tokenizer_config.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text)
    return str(body["model_name"]), directory


def chatml_renderer(tokenizer: Any, image_processor: Any = None) -> Any:
    """The cookbook's renderer for the embedded models: their template is ChatML without reasoning blocks,
    token for token what the cookbook's Qwen3 instruct renderer writes (tested against the template)."""
    from tinker_cookbook.renderers.qwen3 import Qwen3InstructRenderer

    return Qwen3InstructRenderer(tokenizer)


def register(base_url: str, api_key: str | None = None) -> Registered:
    """Register the server's tokenizer (under its model name) and ``RENDERER`` with the tinker-cookbook."""
    try:
        from tinker_cookbook import renderers, tokenizer_utils
    except ImportError as exc:
        raise ImportError("register() sets up the tinker-cookbook: pip install tinker-cookbook") from exc
    from transformers import AutoTokenizer

    key = api_key or os.environ.get("TINKER_API_KEY") or "tml-local"
    model, directory = fetch_tokenizer(base_url, key)

    def load() -> Any:  # a Hugging Face tokenizer, as the cookbook's own loader returns
        return AutoTokenizer.from_pretrained(str(directory))

    tokenizer_utils.register_tokenizer(model, load)
    renderers.register_renderer(RENDERER, chatml_renderer)
    return Registered(base_url.rstrip("/"), model, RENDERER, directory)


def create_full_training_client(
    service_client: Any, base_model: str, user_metadata: dict[str, str] | None = None
) -> Any:
    """A ``TrainingClient`` that trains every weight of ``base_model`` (a copy of its own on the server; see
    docs/tinker.md for the memory it takes and the limit the server sets). The SDK (0.38) asks only for LoRA
    clients; this sends its own ``create_model`` request without a LoRA config, as that method does with one.
    A client made from a full checkpoint (``create_training_client_from_state``) is a full-model one too."""
    from tinker import types
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    holder = service_client.holder
    session_id, model_seq_id = holder.get_session_id(), holder.get_training_client_id()

    async def create() -> Any:
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            request = types.CreateModelRequest(
                session_id=session_id,
                model_seq_id=model_seq_id,
                base_model=base_model,
                lora_config=None,
                user_metadata=user_metadata,
                optimizer_config=types.AdamOptimizerConfig(),
            )
            future = await client.models.create(request=request)
        created = await _APIFuture(
            types.CreateModelResponse, holder, future, request_start_time=time.time(), request_type="CreateModel"
        ).result_async()
        info = await fetch_training_info(holder, created.model_id)
        return TrainingClient(holder, model_seq_id=model_seq_id, model_id=created.model_id, info=info)

    return holder.run_coroutine_threadsafe(create()).result()
