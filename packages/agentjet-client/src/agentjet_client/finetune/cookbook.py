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
