"""What ``agentjet-client gateway`` reads from its command line: the redaction hook, the label table, the judge."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentjet_client.judges import Judge


def load_hook(spec: str) -> Callable[[str], str]:
    """``module:function`` (importable from the working directory) or ``path/to/file.py:function``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"--redact {spec}: give MODULE:FUNCTION or FILE.py:FUNCTION")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"--redact {spec}: no file {path}")
        loaded = importlib.util.spec_from_file_location(f"agentjet_redact_{path.stem}", path)
        assert loaded is not None and loaded.loader is not None
        module: Any = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ValueError(f"--redact {spec}: cannot import {where} ({exc})") from exc
    hook = getattr(module, name, None)
    if not callable(hook):
        raise ValueError(f"--redact {spec}: {where} has no function {name}")
    return hook  # type: ignore[no-any-return]


def parse_labels(values: list[str]) -> dict[str, float]:
    from agentjet_client.gateway.service import DEFAULT_LABELS

    labels = dict(DEFAULT_LABELS)
    for value in values:
        name, sep, number = value.partition("=")
        try:
            labels[name.strip()] = float(number)
        except ValueError:
            raise ValueError(f"--label {value}: give NAME=REWARD, say thumbs_up=1") from None
        if not sep or not name.strip():
            raise ValueError(f"--label {value}: give NAME=REWARD, say thumbs_up=1")
    return labels


def make_judge(url: str | None, model: str | None, criteria: str) -> Judge | None:
    """The judge of ``--judge-url``/``--judge-model``/``--judge-criteria`` (``@FILE`` reads the criteria), or
    None without a URL. Its API key comes from ``AGENTJET_JUDGE_API_KEY``."""
    if url is None:
        if model is not None:
            raise ValueError("--judge-model names the judge's model: give its endpoint with --judge-url too")
        return None
    if not model:
        raise ValueError(f"--judge-url {url}: name the judge's model with --judge-model")
    if criteria.startswith("@"):
        path = Path(criteria[1:]).expanduser()
        if not path.is_file():
            raise ValueError(f"--judge-criteria {criteria}: no file {path}")
        criteria = path.read_text()
    if not criteria.strip():
        raise ValueError("--judge-criteria is empty: say what the judge rewards")
    from agentjet_client.judges import Judge

    return Judge(url, model, criteria)
