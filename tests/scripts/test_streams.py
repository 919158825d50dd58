"""``scripts/dev.py test`` runs the suite as three streams at once: BESIDE (after the vLLM suite), THIRD, and
the main stream with the rest. Every path they name exists, no path is in two streams, and together they
hold every test file exactly once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dev():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("dev", ROOT / "scripts" / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_streams_name_existing_paths_and_share_none():
    dev = _dev()
    named = [*dev.BESIDE, *dev.THIRD]
    assert len(named) == len(set(named))
    for path in named:
        assert (ROOT / path).exists(), f"scripts/dev.py names {path}, which is not there: fix BESIDE or THIRD"
    files = sorted(p.relative_to(ROOT) for p in (ROOT / "tests").rglob("test_*.py"))

    def streams_of(file: Path) -> list[str]:
        found = [
            name
            for name, paths in (("beside", dev.BESIDE), ("third", dev.THIRD))
            for p in paths
            if file.is_relative_to(p)
        ]
        return found or ["main"]

    for file in files:
        assert len(streams_of(file)) == 1, (file, streams_of(file))
    counted = {name: sum(streams_of(f) == [name] for f in files) for name in ("main", "beside", "third")}
    assert all(counted.values()), counted  # each stream has work
