"""The commands a trial's processes run, and the port its server listens on.

* its server: ``agentjet-server up`` (the study's ``server_command``) with the trial's job file
  (``server.toml``), its state dir, ``--fresh`` or ``--resume``, and its share of the machine: a
  device of the study's ``devices`` in turn, or, with trials in parallel on CPU, its share of the
  cores (``OMP_NUM_THREADS``);
* its client: ``agentjet-client run`` for the episodes it has left, or ``agentjet-client eval`` for
  the final evaluation, with the study's ``[client]`` settings and environment;
* its port: a free one below the kernel's ephemeral range, kept across restarts (its client and
  its spool know that URL).
"""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

from agentjet_client.research.study import Study
from agentjet_client.research.trial import TrialDir, TrialRecord


def server_command(
    base: list[str], study: Study, record: TrialRecord, files: TrialDir, resume: bool, parallel: int
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a trial's server: ``base`` (how to run ``agentjet-server``)
    ``up`` on the trial's job file and state dir, fresh or resumed from its checkpoint, with
    ``parallel`` trials sharing the machine."""
    command = [*base, "up", "--config", str(files.server_config), "--port", str(record.port)]
    command += ["--state-dir", str(files.state), "--resume" if resume else "--fresh", "--log-level", "warning"]
    env = dict(os.environ)
    if study.study.devices:
        command += ["--device", study.study.devices[record.index % len(study.study.devices)]]
    elif parallel > 1:
        env["OMP_NUM_THREADS"] = str(study.study.cores_per_trial)  # torch's threads: the trial's share of the cores
    return command, env


def client_command(
    study: Study, study_path: Path, record: TrialRecord, files: TrialDir, evaluation: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a trial's client: ``agentjet-client run`` for its remaining
    episodes, or ``agentjet-client eval`` for the final evaluation."""
    client = study.client_settings(record.settings, study_path.parent)
    url = f"http://127.0.0.1:{record.port}"
    command = [sys.executable, "-m", "agentjet_client"]
    if evaluation:
        command += ["eval", "--code-dir", str(client.code_dir), "--server", url]
        command += ["--episodes", str(study.trial.eval_episodes or client.eval_episodes)]
        command += ["--spool-dir", str(files.path / "eval-spool")]
    else:
        group = client.group_size or int(study.server_settings(record.settings).get("group_size", 16))
        remaining = max(1, record.target_episodes - record.episodes)
        command += ["run", "--code-dir", str(client.code_dir), "--server", url, "--episodes", str(remaining)]
        command += ["--group-size", str(group), "--spool-dir", str(files.spool)]
        command += ["--eval-every", str(client.eval_every), "--eval-episodes", str(client.eval_episodes)]
        if client.seed is not None:
            command += ["--seed", str(client.seed)]
        command += client.args
    command += ["--concurrency", str(client.concurrency), "--timeout", str(client.timeout)]
    env = {**os.environ, **client.env}
    return command, env


def free_port() -> int:
    """A free port below the kernel's ephemeral range: one from that range could be handed to an
    outgoing connection (a client's, a trial's neighbour's) before the trial's server binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        if _port_free(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
