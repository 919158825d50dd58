"""What decides each embedded model: its spec (sizes, warm-up recipe, seed) and the demo tasks whose
answer format the warm-up teaches. The hash of a spec names the model's build; a change to a spec, or to
the chat template, is a new model (``agentjet-server build-model NAME`` rebuilds it)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from agentjet_server.serving.chat_format import CHATML_TOOLS_TEMPLATE


@dataclass(frozen=True)
class EmbeddedSpec:
    """Everything that decides the embedded model; its hash names the cache directory."""

    name: str = "agentjet-tiny"
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096  # the context: real frameworks' system prompts must fit
    warmup_steps: int = 300
    warmup_batch: int = 32
    warmup_lr: float = 3e-3
    tool_every: int = 3  # every n-th warm-up step is a batch of tool-call examples
    # "formats": the steps above; "copy": ``_warm_up_to_copy`` (the ``tools`` size), with these:
    recipe: str = "formats"
    copy_steps: int = 0  # at most this many steps learning to copy (it ends at the phase change)
    tool_batch: int = 16
    # after the copy phase, batches take turns in this order: tool requests, demo prompts, copy runs
    cycle: tuple[str, ...] = ("tool", "demo", "tool", "copy")
    lr_decay: float = 0.9  # over those steps the rate falls linearly by this share: the last ones settle
    seed: int = 1234
    tasks: tuple[str, ...] = ("words",)  # demo prompt kinds whose answer *format* the warm-up teaches
    # a weak prior: for these kinds, this share of warm-up answers is the right one (the rest random),
    # as an instruction-tuned model follows an instruction some of the time before RL
    prior_kinds: tuple[str, ...] = ()
    prior_share: float = 0.0
    # the first steps answer those kinds right every time: reading the prompt (copying a digit out
    # of it) is learnt from a strong signal, then the answers relax to ``prior_share``
    prior_steps: int = 0
    format_version: int = 6


EMBEDDED_SPEC = EmbeddedSpec()
# the sizes ``agentjet-server up --model-size`` offers: ``small`` (about 3x the parameters) also
# knows the format of ``Repeat the digit 3.``, the executor's prompt in examples/planner_executor
EMBEDDED_SPECS = {
    "tiny": EMBEDDED_SPEC,
    "small": EmbeddedSpec(
        name="agentjet-small",
        hidden_size=192,
        intermediate_size=576,
        num_hidden_layers=3,
        tasks=("words", "copy"),
        # it follows "Repeat the digit 7." about a third of the time: without such a prior the executor
        # of examples/planner_executor settles on one constant digit (prompt-independent) under RL.
        # Copying a digit out of the prompt is learnt in the first 150 steps, where every answer is
        # right, and only at this lower rate: at 3e-3 the model stays with the digits' marginal.
        prior_kinds=("copy",),
        prior_share=1 / 3,
        prior_steps=150,
        warmup_lr=1e-3,
    ),
    # calls the tools a request lists, names it never saw included (tests/server/test_embedded.py)
    "tools": EmbeddedSpec(
        name="agentjet-tools",
        # a key/value head per query head: with two shared ones (grouped-query attention) it copied
        # tool names out of the request less often (probability of the name 0.60 against 0.85)
        num_key_value_heads=4,
        recipe="copy",
        copy_steps=2000,
        warmup_steps=1500,
        warmup_lr=1e-3,  # at 3e-3 these models never learn to copy anything out of the prompt
        format_version=7,  # 7: parameters schemas shaped as agent frameworks generate them
        tool_batch=24,
    ),
}

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def demo_tasks(kind: str) -> list[tuple[str, str]]:
    """``(user message, answer)`` of every demo task (kept in step with ``examples/``)."""
    if kind == "add":
        return [(f"What is {a} + {b}?", str(a + b)) for a in range(10) for b in range(10) if a + b <= 9]
    if kind == "max":
        return [(f"Which is larger, {a} or {b}?", str(max(a, b))) for a in range(10) for b in range(10) if a != b]
    if kind == "words":
        return [(f"Write {w} as a digit.", str(i)) for i, w in enumerate(NUMBER_WORDS)]
    if kind == "next":
        return [(f"What comes after {a}?", str(a + 1)) for a in range(9)]
    if kind == "copy":
        return [(f"Repeat the digit {a}.", str(a)) for a in range(10)]
    raise ValueError(kind)


def spec_hash(spec: EmbeddedSpec) -> str:
    """Twelve hex digits over every field of ``spec`` and the chat template."""
    payload = json.dumps({**asdict(spec), "template": CHATML_TOOLS_TEMPLATE}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]
