"""The size contracts of ``scripts/architecture.py`` (run in the lint session) catch what they name: a function
over 80 lines, a file over 600, a class over 250 counted with the module functions that take it, a module
function whose first parameter has no annotation; and the real tree holds them, with at most five named
exceptions, each with its reason."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import architecture  # noqa: E402


def body(lines: int, indent: str = "    ") -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))


def test_each_size_contract_catches_its_breach(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "class Small:\n    pass\n\n\n"
        f"def helper(small: Small) -> None:\n{body(249)}\n\n"  # its 250 lines count toward Small's 2
        f"def long() -> None:\n{body(81)}\n\n"
        "def loose(thing) -> None:\n    pass\n"
    )
    found = architecture._module_sizes("pkg.mod", source, in_api=False)
    assert any(line.startswith("pkg.mod.Small: 252 lines with the module functions that take it") for line in found)
    assert any(line.startswith("pkg.mod.long: 82 lines, over 80") for line in found)
    assert any(line.startswith("pkg.mod.helper: 250 lines, over 80") for line in found)
    assert "pkg.mod.loose: its first parameter has no annotation; annotate it" in found
    big = tmp_path / "big.py"
    big.write_text(body(601, indent=""))
    assert architecture._module_sizes("pkg.big", big, in_api=False) == [
        "pkg.big: 601 lines, over 600 for a file; split it by job"
    ]
    within = tmp_path / "ok.py"
    within.write_text(f"class Small:\n    pass\n\n\ndef helper(small: Small) -> None:\n{body(70)}")
    assert architecture._module_sizes("pkg.ok", within, in_api=False) == []


def test_the_tree_holds_the_size_contracts_with_at_most_five_named_exceptions():
    assert architecture.sizes() == []
    assert len(architecture.SIZE_EXCEPTIONS) <= 5
    assert all(len(reason) > 40 for reason in architecture.SIZE_EXCEPTIONS.values())
