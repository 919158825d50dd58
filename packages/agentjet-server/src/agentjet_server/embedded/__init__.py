"""The embedded models: small Qwen2-architecture models that ship inside the server package.

``agentjet-server up`` with no ``--model`` serves one of them, so the whole loop can be watched on a
laptop CPU with nothing to download and nothing to build:

- ``tiny`` (``agentjet-tiny``, 0.66M parameters, the default): answers the demo prompts of
  ``examples/digits`` (``Write seven as a digit.``) with one digit at chance, and requests with tools
  with a well-formed ``<tool_call>`` of its warm-up tools;
- ``small`` (``agentjet-small``, 1.7M): the same, plus ``Repeat the digit 3.`` with a weak prior
  (right about a third of the time), the executor's prompt in ``examples/planner_executor``;
- ``tools`` (``agentjet-tools``, 0.69M): calls the tools a request lists, by their names, names it
  never saw in its warm-up included.

Each ships prebuilt under ``models/`` (weights, tokenizer, ``agentjet.json`` with the spec it was
built from), so every machine serves and trains the bit-identical model. The recipe lives in
``recipe.py``; when a spec changes (its hash no longer matches the shipped copy), the model is built
once into the cache (``AGENTJET_CACHE_DIR``, else ``~/.cache/agentjet``) and
``agentjet-server build-model NAME --out`` refreshes the shipped copy.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from agentjet_server.embedded.specs import (
    EMBEDDED_SPEC,
    EMBEDDED_SPECS,
    NUMBER_WORDS,
    EmbeddedSpec,
    demo_tasks,
    spec_hash,
)

__all__ = [
    "EMBEDDED_SPEC",
    "EMBEDDED_SPECS",
    "NUMBER_WORDS",
    "SHIPPED_DIR",
    "EmbeddedSpec",
    "default_cache_dir",
    "demo_tasks",
    "ensure_embedded_model",
    "shipped_model",
    "spec_hash",
]

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parent / "models"


def default_cache_dir() -> Path:
    base = os.environ.get("AGENTJET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agentjet"
    )
    return Path(base)


def _built_from(path: Path) -> str | None:
    """The spec hash a model directory was built from, or None when it is not a complete model."""
    try:
        meta = json.loads((path / "agentjet.json").read_text())
    except (OSError, ValueError):
        return None
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        return None
    built = meta.get("spec_hash") if isinstance(meta, dict) else None
    return built if isinstance(built, str) else None


def _spec(size: str) -> EmbeddedSpec:
    if size not in EMBEDDED_SPECS:
        raise ValueError(f"no embedded model of size '{size}'; choose one of {', '.join(EMBEDDED_SPECS)}")
    return EMBEDDED_SPECS[size]


def shipped_model(size: str = "tiny") -> Path | None:
    """The shipped model of ``size`` when it was built from today's spec, else None."""
    spec = _spec(size)
    path = SHIPPED_DIR / spec.name
    return path if _built_from(path) == spec_hash(spec) else None


def ensure_embedded_model(
    cache_dir: Path | None = None, progress: Callable[[str], None] | None = None, size: str = "tiny"
) -> Path:
    """The directory of the embedded model of ``size`` (a key of ``EMBEDDED_SPECS``): the shipped copy,
    or, where the spec changed since it was built, a build cached under ``cache_dir``."""
    spec = _spec(size)
    shipped = shipped_model(size)
    if shipped is not None:
        return shipped
    target = (cache_dir or default_cache_dir()) / f"{spec.name}-{spec_hash(spec)}"
    if _built_from(target) == spec_hash(spec):
        return target
    say = progress or (lambda msg: logger.info("%s", msg))
    say(f"building the embedded model {spec.name} (its spec changed since the shipped copy; cached afterwards)")
    from agentjet_server.embedded.recipe import build_model

    return build_model(spec, target, say)
