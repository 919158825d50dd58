"""The tool examples trained on each embedded model, side by side on the same episodes.

    python bench/tool_models.py   # tool_use and openai_agents, 1,280 episodes each: ~6 min on 2 cores (+ first builds)
    python bench/tool_models.py --examples tool_use --episodes 320

For each example and each model (``tiny``: warm-up tools ``get_weather``, ``add(x)``, ``lookup``,
``square``; ``tools``: warm-up on tools with random names, it copies the names a request lists) a
fresh ``agentjet-server up --model-size SIZE --lr LR`` and one ``agentjet-client run`` over the same
tasks and seed. Rewards are read from the server's log in the order it accepted them: mean of the
first 10% and of the last 20% of episodes, and the share of episodes whose first answer calls ``add`` with
exactly its parameters ``a`` and ``b``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import httpx2  # noqa: E402

from _server import wait_until_up  # noqa: E402

# each model at the rate measured for it on the digits task (docs/guide.md, "The embedded models")
RATES = {"tiny": "1e-3", "tools": "5e-4"}


def first_call_is_listed(tokenizer: Any, trajectory: dict[str, Any]) -> bool:
    """Whether the episode's first answer calls ``add`` (the one tool both examples list) with
    exactly its parameters ``a`` and ``b``."""
    turns = trajectory["turns"]
    if not turns:
        return False
    text = tokenizer.decode(turns[0]["completion_token_ids"])
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.S):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") == "add" and set(call.get("arguments") or {}) == {"a", "b"}:
            return True
    return False


def one_run(example: str, size: str, episodes: int, port: int) -> dict[str, object]:
    from transformers import PreTrainedTokenizerFast

    from agentjet_server.embedded import ensure_embedded_model
    from agentjet_server.ingest.wal import Accepted, read_records

    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="agentjet-bench-") as tmp:
        state = Path(tmp) / "state"
        server_cmd = [str(bin_dir / "agentjet-server"), "up", "--port", str(port), "--model-size", size]
        server_cmd += ["--lr", RATES[size], "--group-size", "8", "--state-dir", str(state), "--log-level", "warning"]
        log = open(Path(tmp) / "server.log", "w")
        server = subprocess.Popen(server_cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        try:
            wait_until_up(url)
            client_cmd = [str(bin_dir / "agentjet-client"), "run", "--code-dir", str(ROOT / "examples" / example)]
            client_cmd += ["--server", url, "--episodes", str(episodes), "--group-size", "8", "--seed", "0"]
            subprocess.run(client_cmd, check=True, stdout=subprocess.DEVNULL)
            seconds = time.monotonic() - started
            while (counts := httpx2.get(url + "/v1/status").json()["trajectories"])["trained"] < counts["accepted"]:
                time.sleep(0.5)  # the learner takes the last batches
            # read before the shutdown checkpoint compacts the log
            accepted = [r.trajectory for r in read_records(state / "log") if isinstance(r, Accepted)]
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ensure_embedded_model(size=size))
    rewards = [float(t["reward"]) for t in accepted]
    head, tail = rewards[: max(1, len(rewards) // 10)], rewards[-max(1, len(rewards) // 5) :]
    return {
        "episodes": len(rewards),
        "first": sum(head) / len(head),
        "last": sum(tail) / len(tail),
        "listed": sum(first_call_is_listed(tokenizer, t) for t in accepted) / max(1, len(accepted)),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default="tool_use,openai_agents", help="examples/ directories (comma-separated)")
    parser.add_argument("--episodes", type=int, default=1280)
    parser.add_argument("--port", type=int, default=8771)
    args = parser.parse_args()
    from agentjet_server.embedded import ensure_embedded_model

    for size in RATES:
        ensure_embedded_model(size=size, progress=lambda m: print(f"  {m}", flush=True))
    print(f"{'example':<14} {'model':<6} {'lr':>5} {'first 10%':>9} {'last 20%':>8} {'listed call':>11} {'time':>6}")
    for example in args.examples.split(","):
        for size in RATES:
            row = one_run(example, size, args.episodes, args.port)
            print(
                f"{example:<14} {size:<6} {RATES[size]:>5} {row['first']:9.3f} {row['last']:8.3f} "
                f"{row['listed']:11.0%} {row['seconds']:5.0f}s",
                flush=True,
            )


if __name__ == "__main__":
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    main()
