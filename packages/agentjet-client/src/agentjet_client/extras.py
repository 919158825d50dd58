"""What to tell a user whose optional extra does not import, for both packages.

An extra can fail in two ways, and the fix differs: its packages are not installed (install the extra), or
they are installed at a version that no longer has what we import (mcp 2 dropped ``FastMCP``: install a
version the extra's range allows). ``extra_hint`` tells them apart from the package's own metadata and
always carries the real ``ImportError``, so neither case reads as "install the command you just ran".
"""

from __future__ import annotations

import re
from importlib import metadata

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def extra_requirements(package: str, extra: str) -> list[str]:
    """The requirements ``package`` declares for ``extra`` (``["mcp<2,>=1.20"]``), markers dropped."""
    try:
        declared = metadata.requires(package) or []
    except metadata.PackageNotFoundError:
        return []
    wanted = re.compile(r"""extra\s*==\s*["']""" + re.escape(extra) + r"""["']""")
    return [line.split(";")[0].strip() for line in declared if ";" in line and wanted.search(line.split(";", 1)[1])]


def _installed(requirement: str) -> str | None:
    found = _NAME.match(requirement)
    if found is None:
        return None
    name = found.group(0).split("[")[0]
    try:
        return f"{name} {metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return None


def extra_hint(feature: str, extra: str, exc: ImportError, package: str = "agentjet-client") -> str:
    """One message for ``feature`` whose import of ``package[extra]`` raised ``exc``: what failed (the real
    error), what is installed against what the extra asks for, and the command that fixes it."""
    requirements = extra_requirements(package, extra)
    installed = [found for found in map(_installed, requirements) if found]
    error = f"{type(exc).__name__}: {exc}"
    install = f"pip install '{package}[{extra}]'"
    if requirements and len(installed) == len(requirements):
        # everything is there, yet the import failed: a version outside the range, or a broken install
        return (
            f"{feature} could not import what the {extra} extra brings ({error}); installed: {', '.join(installed)}, "
            f"while {package}[{extra}] asks for {', '.join(requirements)}: {install} puts a version it supports "
            "in place"
        )
    wants = f" ({', '.join(requirements)})" if requirements else ""
    return f"{feature} needs the {extra} extra{wants}: {install} ({error})"
