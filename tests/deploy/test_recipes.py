"""The recipes under ``deploy/``: Kubernetes manifests validated against the bundled OpenAPI schemas
(kubernetes-validate, strict: an unknown field fails), Compose files against the Compose specification
(check-jsonschema's vendored schema), Slurm scripts as bash; every AGENTJET_* variable and every flag a recipe
uses exists in the CLIs, so the recipes cannot drift from them; the Ray recipe runs clients against a server."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx2
import kubernetes_validate
import pytest
import yaml
from typer.main import get_command

from agentjet_client.cli import ENV_PREFIX as CLIENT_PREFIX
from agentjet_client.cli import command as client_command
from agentjet_server.cli import app as server_app
from agentjet_server.cli import envvar_of
from tests.chaos.test_server_kill import AGENT
from tests.conftest import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = "1.33"
BIN = Path(sys.executable).parent


def manifests() -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    return [
        (f"{path.name}:{doc['kind']}", doc)
        for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


@pytest.mark.parametrize(("name", "doc"), manifests(), ids=[name for name, _ in manifests()])
def test_each_kubernetes_manifest_is_valid(name, doc):
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_kubernetes_validator_catches_a_wrong_field():
    statefulset = next(doc for _, doc in manifests() if doc["kind"] == "StatefulSet")
    wrong = copy.deepcopy(statefulset)
    wrong["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}  # the field is livenessProbe
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES, strict=True)


def test_the_server_statefulset_is_scraped_probed_and_keyed_from_secrets():
    statefulset = next(doc for _, doc in manifests() if doc["kind"] == "StatefulSet")
    pod = statefulset["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    container = pod["spec"]["containers"][0]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert not [e for e in container["env"] if "KEY" in e["name"] and "value" in e and "FILE" not in e["name"]]
    assert statefulset["spec"]["volumeClaimTemplates"]  # the state dir follows the pod
    # the shutdown upload fits in the grace period
    assert pod["spec"]["terminationGracePeriodSeconds"] > 600


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    command = [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml"])
def test_each_compose_file_is_valid(name):
    out = check_compose(DEPLOY / "compose" / name)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_compose_validator_catches_a_wrong_field(tmp_path):
    text = (DEPLOY / "compose" / "compose.yaml").read_text().replace("stop_grace_period: 11m", "stop_grace: 11m")
    (tmp_path / "compose.yaml").write_text(text)
    assert check_compose(tmp_path / "compose.yaml").returncode != 0


@pytest.mark.parametrize("script", sorted(p.name for p in (DEPLOY / "slurm").glob("*.sbatch")))
def test_each_slurm_script_is_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(DEPLOY / "slurm" / script)]).returncode == 0


def recipe_files() -> list[Path]:
    return [p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in (".yaml", ".sbatch", ".sh", ".py", "")]


def test_every_variable_and_flag_a_recipe_uses_exists():
    up = get_command(server_app).commands["up"]  # type: ignore[attr-defined]
    server_vars = {envvar_of(p.opts[0]) for p in up.params if p.param_type_name == "option"}
    server_flags = {opt for p in up.params for opt in [*p.opts, *p.secondary_opts]}
    run = client_command().commands["run"]
    client_vars = {p.envvar for p in run.params if p.param_type_name == "option"}
    used_server = used_client = 0
    for path in recipe_files():
        text = path.read_text()
        for name in set(re.findall(r"AGENTJET_SERVER_[A-Z0-9_]+", text)):
            assert name in server_vars, f"{path.relative_to(ROOT)}: {name} is no option of agentjet-server up"
            used_server += 1
        for name in set(re.findall(r"AGENTJET_CLIENT_[A-Z0-9_]+", text)):
            assert name in client_vars, f"{path.relative_to(ROOT)}: {name} is no option of agentjet-client run"
            assert name.startswith(CLIENT_PREFIX)
            used_client += 1
        for flags in re.findall(r"agentjet_server up ((?:--[a-z-]+ ?)+)", text):
            for flag in flags.split():
                assert flag in server_flags, f"{path.relative_to(ROOT)}: up has no {flag}"
    assert used_server >= 10 and used_client >= 8


def test_the_ray_recipe_runs_clients_against_a_server(tmp_path):
    """Two clients as Ray tasks on a local Ray, configured by the environment alone."""
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "agent.py").write_text(AGENT)
    server = ServerProcess(["--group-size", "4", "--batch-groups", "1"], tmp_path / "server.log")
    try:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AGENTJET_")},
            "SERVER": server.url,
            "CODE_DIR": str(tmp_path / "agent"),
            "CLIENTS": "2",
            "EPISODES": "8",
            "GROUP_SIZE": "4",
            "RAY_ADDRESS": "local",
            "HOME": str(tmp_path),  # the clients' spools
        }
        out = subprocess.run(
            [sys.executable, str(DEPLOY / "ray" / "clients.py")], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "2 clients finished; exit statuses [0]" in out.stdout
        counts = httpx2.get(server.url + "/v1/status").json()["trajectories"]
        assert counts["accepted"] == 16
    finally:
        server.stop()
