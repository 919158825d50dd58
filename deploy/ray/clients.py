"""Swarm clients on a Ray cluster: one ``agentjet-client run`` process per Ray task, each configured by the
environment, rescheduled by Ray when its node goes (spot instances). Ray schedules; AgentJet adds nothing.

    SERVER=http://10.0.0.5:8000 CODE_DIR=/shared/agent CLIENTS=32 python deploy/ray/clients.py
    # or on a cluster: ray job submit --working-dir . -- python deploy/ray/clients.py

Each client's spool is on the node's disk: a task that dies loses only trajectories the server never
acknowledged (their episodes are simply played again), never one it acknowledged.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ray

OPTIONS = ("EPISODES", "CONCURRENCY", "TIMEOUT", "GROUP_SIZE", "LOG_FORMAT")


@ray.remote(num_cpus=1, max_retries=-1, retry_exceptions=False)
def client(index: int, environment: dict[str, str]) -> int:
    """One ``agentjet-client run`` on whichever node Ray chose; its exit status."""
    env = {**os.environ, **environment}
    env["AGENTJET_CLIENT_SEED"] = str(index)
    env.setdefault("AGENTJET_CLIENT_SPOOL_DIR", os.path.join(os.path.expanduser("~"), ".agentjet", "spool", str(index)))
    command = [os.path.join(os.path.dirname(sys.executable), "agentjet-client"), "run"]
    return subprocess.run(command, env=env).returncode


def main() -> None:
    missing = [name for name in ("SERVER", "CODE_DIR") if not os.environ.get(name)]
    if missing:
        sys.exit(f"set {' and '.join(missing)}: the server's URL and the agent's directory (on every node)")
    environment = {
        "AGENTJET_CLIENT_SERVER": os.environ["SERVER"],
        "AGENTJET_CLIENT_CODE_DIR": os.environ["CODE_DIR"],
    }
    if os.environ.get("KEY_FILE"):
        environment["AGENTJET_CLIENT_API_KEY_FILE"] = os.environ["KEY_FILE"]
    for name in OPTIONS:
        if os.environ.get(name):
            environment[f"AGENTJET_CLIENT_{name}"] = os.environ[name]
    ray.init(address=os.environ.get("RAY_ADDRESS"))  # a cluster's, else a local one
    count = int(os.environ.get("CLIENTS", "4"))
    codes = ray.get([client.remote(i, environment) for i in range(count)])
    print(f"{count} clients finished; exit statuses {sorted(set(codes))}")
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
