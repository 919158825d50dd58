"""A team of two models on one server (an adapter per agent) against the same team on two servers.

    python bench/adapters.py [--runs 3] [--episodes 1600] [--json FILE]

``examples/planner_executor`` (digits 3 and 8) trained from the embedded tiny model with LoRA rank 8 on
every linear layer and the output head (lr 1.5e-3, groups of 8, batches of 2 groups), the same seeds:

  two servers  ``up --lora-rank 8`` per agent: each server holds the base and one adapter, and trains it
               on its own agent's turns (``run --server URL --server executor=URL2``);
  one server   ``up --lora-rank 8 --adapters planner,executor``: one base, both adapters
               (``run --server URL``).

Reported per run: each agent's mean reward over the first 10% and the last 20% of its turns (the client's
summary), the wall time, and the servers' peak resident memory (VmHWM, summed over the servers: what the
team takes on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMMON = ["--lora-rank", "8", "--lora-targets", "all-linear,lm_head", "--lr", "1.5e-3", "--batch-groups", "2"]
COMMON += ["--group-size", "8", "--checkpoint-every", "100000", "--log-level", "warning"]
ENV = {**os.environ, "AGENTJET_DIGITS": "3,8"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(BIN / "agentjet-server"), "up", "--port", str(port), *args], stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited at start; see {log}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                return proc, url
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"a server did not start; see {log}") from None
            time.sleep(0.3)


def peak_kib(proc: subprocess.Popen[bytes]) -> int:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def run_layout(layout: str, run: int, episodes: int, folder: Path) -> dict[str, Any]:
    seed = ["--seed", str(run)]
    servers: list[subprocess.Popen[bytes]] = []
    try:
        if layout == "one server":
            proc, url = start(
                [*COMMON, *seed, "--adapters", "planner,executor", "--state-dir", str(folder / "s")],
                folder / "server.log",
            )
            servers.append(proc)
            routes = ["--server", url]
        else:
            planner, url = start([*COMMON, *seed, "--state-dir", str(folder / "p")], folder / "planner.log")
            servers.append(planner)
            executor, url2 = start([*COMMON, *seed, "--state-dir", str(folder / "e")], folder / "executor.log")
            servers.append(executor)
            routes = ["--server", url, "--server", f"executor={url2}"]
        command = [str(BIN / "agentjet-client"), "run", "--code-dir", str(ROOT / "examples" / "planner_executor")]
        command += [*routes, "--episodes", str(episodes), "--group-size", "8", "--seed", str(run)]
        command += ["--spool-dir", str(folder / "spool")]
        started = time.monotonic()
        out = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=1800)
        seconds = time.monotonic() - started
        if out.returncode:
            raise SystemExit(f"the client failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        memory = sum(peak_kib(p) for p in servers) / 1024
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(timeout=60)
    found = re.findall(r"agent (\w+): (\d+) turns, mean reward first 10% ([\d.]+)  last 20% ([\d.]+)", out.stdout)
    agents = {name: (float(first), float(last)) for name, _, first, last in found}
    return {"layout": layout, "run": run, "seconds": seconds, "peak_mib": memory, "agents": agents}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=1600)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="agentjet-bench-adapters-") as tmp:
        for run in range(args.runs):
            for layout in ("two servers", "one server"):
                folder = Path(tmp) / f"run{run}-{layout.replace(' ', '-')}"
                folder.mkdir()
                print(f"run {run}: {layout} ...", flush=True)
                result = run_layout(layout, run, args.episodes, folder)
                results.append(result)
                shown = "  ".join(f"{n} {a:.3f} -> {b:.3f}" for n, (a, b) in sorted(result["agents"].items()))
                print(f"  {result['seconds']:.0f}s, servers' peak {result['peak_mib']:.0f} MiB; {shown}", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
    print("\n| run | layout | planner first -> last | executor first -> last | wall | servers' peak RSS |")
    print("|---:|---|---|---|---:|---:|")
    for r in results:
        p, e = r["agents"].get("planner", (0, 0)), r["agents"].get("executor", (0, 0))
        print(
            f"| {r['run']} | {r['layout']} | {p[0]:.2f} -> {p[1]:.2f} | {e[0]:.2f} -> {e[1]:.2f} | "
            f"{r['seconds']:.0f} s | {r['peak_mib']:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
