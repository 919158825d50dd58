"""LoRA against full fine-tuning on the same model and batch, side by side in one run.

    python bench/lora.py              # the 26M model (hidden 512, 8 layers); about a minute on 2 cores

For full fine-tuning and for LoRA adapters of a few ranks (all linear layers, alpha = 2 x rank),
each in a fresh process: trainable parameters, the AdamW state's bytes after a step, the median
time of a learner step (5 steps after a warm-up step, on 8 sequences of 512 tokens, 312 trained),
the time to merge the adapter into the weights the engine gets, and the process's peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from memory import LENGTH, PROMPT, build  # noqa: E402  (bench/ is not a package)

RANKS = (8, 32)


def child(model: str, rank: int) -> None:
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.adapter import LoraSpec
    from agentjet_server.learner.batch import Batch, Sequence
    from agentjet_server.learner.trainer import Learner, LearnerConfig

    torch.set_num_threads(2)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(model)
    total = sum(p.numel() for p in net.parameters())
    lora = LoraSpec(rank=rank, alpha=2.0 * rank) if rank else None
    learner = Learner(net, LearnerConfig(lr=1e-4, lora=lora), pad_id=0)
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for i in range(8):
        ids = torch.randint(10, 1000, (LENGTH,), generator=generator).tolist()
        trained = list(range(PROMPT, LENGTH))
        sequences.append(Sequence(ids, trained, [-1.0] * len(trained), [1.0 if i % 2 else -1.0] * len(trained)))
    batch = Batch(sequences, [0.0] * len(sequences), 1, 0, len(sequences))
    learner.step(batch)  # warm-up; creates the AdamW state
    times = []
    for _ in range(5):
        started = time.perf_counter()
        learner.step(batch)
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    learner.full_state_dict()
    export = time.perf_counter() - started
    state = learner.optimizer.state.values()
    optimizer = sum(t.numel() * t.element_size() for s in state for t in s.values() if torch.is_tensor(t))
    result = {
        "total": total,
        "trainable": learner.trainable_parameters,
        "optimizer_bytes": optimizer,
        "step_s": statistics.median(times),
        "export_s": export,
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build("26M", Path(tmp) / "26M")
        for rank in [0, *(int(r) for r in args.ranks.split(","))]:
            print(f"measuring {'full fine-tuning' if not rank else f'LoRA rank {rank}'} ...", flush=True)
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(model), str(rank)],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                check=True,
            )
            rows[rank] = json.loads(out.stdout.strip().splitlines()[-1])
    full = rows[0]
    print(f"\nmodel: 26M ({full['total'] / 1e6:.1f}M parameters), fp32, CPU, 2 threads; 8 x {LENGTH}-token sequences")
    head = "trainable parameters | AdamW state (MiB) | step (s) | merge for the engine (ms) | peak RSS (MiB)"
    print(f"\n| | {head} | step / full |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for rank, r in rows.items():
        name = "full fine-tuning" if not rank else f"LoRA rank {rank} (all linear layers)"
        share = r["trainable"] / r["total"]
        print(
            f"| {name} | {r['trainable']:,} ({share:.2%}) | {r['optimizer_bytes'] / 2**20:.1f} | {r['step_s']:.3f} | "
            f"{r['export_s'] * 1000:.0f} | {r['peak'] / 2**20:.0f} | {r['step_s'] / full['step_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
