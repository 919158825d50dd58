"""scripts/docs_check.py: it finds a command, a flag or a module map that drifted from the code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checker():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("docs_check", ROOT / "scripts" / "docs_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_check"] = module
    spec.loader.exec_module(module)
    return module


def test_commands_and_flags_that_do_not_exist_are_found_with_their_line():
    check = checker()
    trees = check.command_trees()
    every = {flag for tree in trees.values() for flag in check.all_options(tree)} | check.script_flags()
    page = ROOT / "docs" / "page.md"
    text = (
        "Start it:\n\n    agentjet-server up --batch-groups 4 \\\n      --metrics\n\n"
        "then `agentjet-client run --code-dir x --episods 10` and `agentjet-client trian --code-dir x`;\n"
        "the old `--lam` flag, `--no-metrics` and `--max-staleness` (ours), `--nproc_per_node` (torchrun's).\n"
        "`agentjet-server admin config` and `agentjet-client research run study.toml`.\n"
    )
    found = [*check.command_problems(page, text, trees), *check.loose_flag_problems(page, text, every)]
    assert found == [
        "docs/page.md:3: `agentjet-server up --metrics`: agentjet-server up has no option --metrics "
        "(agentjet-server up --help lists its options)",
        "docs/page.md:6: `agentjet-client run --episods`: agentjet-client run has no option --episods "
        "(agentjet-client run --help lists its options)",
        "docs/page.md:6: `agentjet-client trian`: agentjet-client has no command 'trian' (agentjet-client --help)",
        "docs/page.md:7: `--lam` is no option of agentjet-server or agentjet-client (renamed, or a tool's of its "
        "own: then name the tool beside it)",
    ], found


def test_the_module_map_is_the_codes():
    check = checker()
    assert not list(check.module_problems())  # the map in docs/architecture.md is current
    text = check.module_map()
    assert "| `runtime.py` |" in text and "| `research/auto.py` |" in text and "| `api/` |" in text
