"""Weight fan-out to engine replicas: an in-process engine's update against two replica processes,
with the shared-memory sets the updates reuse and with a fresh shared-memory copy per update (how
fan-out worked before; ``FreshCopies`` here does it that way). Same model, same weights, one run.

    python bench/fanout.py                 # the 146.8M model of bench/gpu.py, on CPU, bf16 engines
    python bench/fanout.py --hidden 256 --layers 4   # a quicker look

Each update gets new tensors, as the learner hands them over after a step. The first two updates
of the reusing set allocate its shared memory; the rows give every update and the median of the
last three.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from agentjet_server.engine.base import EngineOptions
from agentjet_server.engine.fanout import SharedWeights
from agentjet_server.engine.replicas import ReplicaSet

sys.path.insert(0, str(Path(__file__).parent))


class FreshCopies(SharedWeights):
    """The baseline: every update moved into new shared memory, in the learner's dtype."""

    def share(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
        for tensor in out.values():
            tensor.share_memory_()  # type: ignore[no-untyped-call]
        return out


def main() -> None:
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.hf import TransformersEngine
    from gpu import build  # type: ignore[import-not-found]

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--updates", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m"
        params = build(model, args.hidden, args.layers, 1024)
        print(f"model: {params / 1e6:.1f}M parameters; {args.updates} updates each", flush=True)
        weights = AutoModelForCausalLM.from_pretrained(model).state_dict()

        def measure(engine: object) -> list[float]:
            took = []
            for version in range(1, args.updates + 1):
                fresh = {name: tensor.clone() for name, tensor in weights.items()}
                started = time.perf_counter()
                engine.update_weights(fresh, version)  # type: ignore[attr-defined]
                took.append(time.perf_counter() - started)
            return took

        rows: dict[str, list[float]] = {}
        engine = TransformersEngine(model, EngineOptions(dtype=torch.bfloat16))
        rows["in-process engine"] = measure(engine)
        engine.close()
        for label, fresh in (("2 replicas, fresh shared memory", True), ("2 replicas, reused sets", False)):
            print(f"starting {label} ...", flush=True)
            replicas = ReplicaSet(
                "transformers",
                model,
                replicas=2,
                devices=["cpu"],
                threads=1,
                model_name="bench",
                max_batch=8,
                dtype="bfloat16",
            )
            if fresh:
                replicas._fanout = FreshCopies(None)  # in place of the reused sets
            rows[label] = measure(replicas)
            replicas.close()
        print(f"\n{'':34} {'each update (ms)':>40} {'median of last 3':>18}")
        for label, took in rows.items():
            each = " ".join(f"{t * 1000:6.0f}" for t in took)
            print(f"{label:34} {each:>40} {statistics.median(took[-3:]) * 1000:>15.0f} ms")
        fresh, reused = (statistics.median(rows[k][-3:]) for k in list(rows)[1:])
        print(f"\nreused sets against fresh shared memory: {fresh / reused:.1f}x faster")


if __name__ == "__main__":
    main()
