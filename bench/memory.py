"""The memory plan against measured peak memory: one learner step per layout, each in its own process.

    python bench/memory.py                 # the 26M model and a deeper, narrower one; a few minutes on 2 cores

For each model and layout (fp32; gradient checkpointing; bf16 autocast over fp32 master weights;
all-bf16; bf16 with checkpointing) and micro-batch size, a fresh process loads the model, runs two
learner steps on a batch of 512-token sequences (200 prompt tokens, 312 trained) and reports its
peak resident memory (``ru_maxrss``); the estimate is ``agentjet_server.memory``'s plan for the
learner's device with the same layout, which counts the runtime, weights, gradients, optimizer
state and activations. Ratio = estimate / measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SHAPES = {
    "26M": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8},
    "deep": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 4},
}
LAYOUTS = {
    "fp32": {},
    "checkpointing": {"gradient_checkpointing": True},
    "bf16 autocast": {"learner_dtype": "bfloat16"},
    "all bf16": {"learner_dtype": "bfloat16", "optimizer_dtype": "bfloat16"},
    "bf16 + checkpointing": {"learner_dtype": "bfloat16", "gradient_checkpointing": True},
    "LoRA rank 8": {"lora_rank": 8},
    "LoRA rank 8 + checkpointing": {"lora_rank": 8, "gradient_checkpointing": True},
    # an adapter per agent (--adapters planner,executor): each step trains one, the engine gets it alone
    "2 adapters of rank 8": {"lora_rank": 8, "adapters": 2},
    # FSDP2 CPU offload in one process: on a CPU learner "host memory" is the same RAM, so this checks
    # the gathered copies and FSDP's own cost, not the split between device and host
    "CPU offload": {"cpu_offload": True},
}
PROMPT, LENGTH = 200, 512


def build(shape: str, target: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from agentjet_server.embedded import ensure_embedded_model

    source = ensure_embedded_model()
    base = AutoConfig.from_pretrained(source)
    settings = {**base.to_dict(), **SHAPES[shape]}
    settings.pop("layer_types", None)
    settings["num_key_value_heads"] = settings["num_attention_heads"] // 2
    settings["head_dim"] = settings["hidden_size"] // settings["num_attention_heads"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(type(base)(**settings)).save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def _without_huge_pages() -> None:
    """Keep transparent huge pages out of this process's resident memory.

    Where the host's THP setting is ``always``, every large allocation is backed by 2 MiB pages and
    the peak RSS grows by however much of those pages the allocator leaves untouched, which differs
    from host to host; the plan counts the bytes the learner touches. (Linux only; elsewhere a no-op.)
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_thp_disable = 41
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_thp_disable, 1, 0, 0, 0)


def child(model: str, layout: dict[str, object], tokens: int) -> None:
    """One measurement (run in a fresh process): peak RSS over two learner steps."""
    import resource

    _without_huge_pages()

    import torch
    from transformers import AutoModelForCausalLM

    from agentjet_server.engine.adapter import LoraSpec
    from agentjet_server.learner.batch import Batch, Sequence
    from agentjet_server.learner.trainer import Learner, LearnerConfig

    torch.set_num_threads(2)
    pure = layout.get("optimizer_dtype") == "bfloat16"
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if pure else torch.float32)
    config = LearnerConfig(
        compute_dtype=str(layout.get("learner_dtype", "float32")),  # type: ignore[arg-type]
        gradient_checkpointing=bool(layout.get("gradient_checkpointing", False)),
        micro_batch_tokens=tokens,
        lora=LoraSpec(rank=int(str(layout["lora_rank"])), alpha=16.0) if layout.get("lora_rank") else None,
        cpu_offload=bool(layout.get("cpu_offload", False)),
        adapters=tuple(f"agent{i}" for i in range(int(str(layout.get("adapters", 0))))),
    )
    learner = Learner(net, config, pad_id=0)
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for i in range(tokens // LENGTH):
        ids = torch.randint(10, 1000, (LENGTH,), generator=generator).tolist()
        trained = list(range(PROMPT, LENGTH))
        sequences.append(Sequence(ids, trained, [-1.0] * len(trained), [1.0 if i % 2 else -1.0] * len(trained)))
    batch = Batch(sequences, [0.0] * len(sequences), 1, 0, len(sequences))
    for step in range(2):
        if config.adapters:  # one adapter per step, as a batch of two agents' turns trains them
            learner.step(batch, config.adapters[step % len(config.adapters)])
            learner.adapter_weights(config.adapters[step % len(config.adapters)])  # what the engine gets
        else:
            learner.step(batch)
            learner.full_state_dict()  # the weights the engine gets after each step
    print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def estimate(model: Path, layout: dict[str, object], tokens: int) -> int:
    from agentjet_server.memory import RUNTIME_OVERHEAD, Layout, learner_items
    from agentjet_server.model_shape import ModelShape

    chosen = Layout(micro_batch_tokens=tokens, trained_share=(LENGTH - PROMPT) / LENGTH, **layout)  # type: ignore[arg-type]
    return RUNTIME_OVERHEAD["cpu"] + sum(i.bytes for i in learner_items(ModelShape.from_pretrained(model), chosen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,8192", help="micro-batch sizes (tokens) to measure")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="layouts to measure (comma-separated)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="model shapes to measure (comma-separated)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], json.loads(args.child[1]), int(args.child[2]))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            model = build(shape, Path(tmp) / shape)
            for tokens in (int(t) for t in args.tokens.split(",")):
                for name in args.layouts.split(","):
                    layout = LAYOUTS[name]
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", str(model), json.dumps(layout), str(tokens)],
                        capture_output=True,
                        text=True,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                        check=True,
                    )
                    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
                    planned = estimate(model, layout, tokens)
                    rows.append((shape, tokens, name, measured, planned))
                    print(
                        f"{shape:>5} {tokens:>5} tokens  {name:<22} measured {measured / 2**20:7.0f} MiB  "
                        f"estimate {planned / 2**20:7.0f} MiB  ratio {planned / measured:.2f}",
                        flush=True,
                    )
    worst = max(abs(p / m - 1) for *_, m, p in rows)
    print(f"\nlargest deviation of the estimate from the measured peak: {worst:.0%}")


if __name__ == "__main__":
    main()
