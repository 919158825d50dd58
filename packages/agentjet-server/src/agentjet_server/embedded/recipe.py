"""How an embedded model is built from its spec: no downloads, under half a minute (``tools``: about
7 minutes on 2 idle cores).

1. a byte-level BPE tokenizer (Qwen2's pre-tokenizer, ChatML special tokens, tool-call tags)
   trained on a small generated corpus, with the ChatML chat template that supports tools;
2. a ``Qwen2ForCausalLM`` from a fresh config (``tiny`` 0.66M parameters, ``small`` 1.7M,
   ``tools`` 0.69M);
3. a short supervised warm-up on *formats*: demo prompts with random digits as targets (the
   model learns to answer with one digit and stop, not which digit: that is left to RL), and
   requests with tools answered by a well-formed ``<tool_call>``. The ``small`` model also gets
   a weak prior for ``Repeat the digit 7.``: it first learns to copy the digit (every answer
   right), then a third of its answers there are right (it ends near 0.3).

``tools`` (``recipe="copy"``) is warmed up to call the tools a request lists: it first learns to
copy (random token runs that repeat, until an induction head forms), then its tool requests list
tools with random names and parameters, answered by calls that copy them.

The server ships the three models this recipe built (``embedded/models/``), so every machine serves
and trains the same bits; ``agentjet-server build-model NAME`` runs the recipe again. Float sums
differ between CPUs, so a rebuild elsewhere is a slightly different model that learns the same things
(``tests/server/test_embedded.py, run with --slow``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agentjet_server.embedded.specs import EMBEDDED_SPEC, EmbeddedSpec, demo_tasks, spec_hash
from agentjet_server.serving.chat_format import CHATML_TOOLS_TEMPLATE, TOOL_CALL_CLOSE, TOOL_CALL_OPEN

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXTRA_TOKENS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE]
# Qwen2's pre-tokenizer split, so that AutoTokenizer (which installs it for qwen2 models)
# tokenizes exactly as the tokenizer was trained.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have not are "
    "but what all were when we there can which their said if do will each about how up out "
    "them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get through back much "
    "before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take "
    "why help put different away again off went old number great tell men say small every "
    "found still between name should home big give air line set own under read last never us "
    "left end along while might next sound below saw something thought both few those always "
    "show large often together asked house world going want school important until form food "
    "keep children feet land side without boy once animal life enough took sometimes four head "
    "above kind began almost live page got earth need far hand high year mother light country "
    "father let night picture being study second soon story since white ever paper hard near "
    "sentence better best across during today however sure knew it's try told young sun thing "
    "whole hear example heard several change answer room sea against top turned learn point "
    "city play toward five himself usually money seen didn't car morning i'm body upon family "
    "later turn move face door cut done group true leave plus minus times equals question agent "
    "tool call function arguments weather search result user assistant system reward task"
).split()


def _corpus(rng: random.Random) -> list[str]:
    lines: list[str] = []
    for _ in range(3000):
        n = rng.randint(3, 14)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        lines.append(sentence.capitalize() + rng.choice([".", "?", "!", ","]))
    for kind in ("add", "max", "copy", "words", "next"):
        for prompt, answer in demo_tasks(kind):
            lines.extend([prompt, answer] * 4)
    for _ in range(400):
        name = rng.choice(["get_weather", "search", "add", "lookup", "calculator"])
        args = {rng.choice(["city", "query", "x", "y", "text"]): rng.choice(_WORDS)}
        lines.append(json.dumps({"name": name, "arguments": args}))
        lines.append(json.dumps({"type": "function", "function": {"name": name, "parameters": {}}}))
    for role in ("system", "user", "assistant", "tool"):
        lines.extend([f"<|im_start|>{role}\n"] * 200)
    lines.extend(["\n", "\n\n", "  ", "0123456789"])
    return lines


def build_tokenizer(vocab_size: int, seed: int) -> Any:
    """Train the byte-level BPE and wrap it for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(EXTRA_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=EMBEDDED_SPEC.max_position_embeddings,
    )
    tokenizer.add_tokens(EXTRA_TOKENS)
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


WARMUP_TOOLS = [("get_weather", "city"), ("add", "x"), ("lookup", "key"), ("square", "n")]


def _tool_example(rng: random.Random) -> tuple[list[dict[str, str]], list[dict[str, object]], str]:
    """A request with tools, and the call the model should answer it with."""
    chosen = rng.sample(WARMUP_TOOLS, k=rng.randint(1, 2))
    tools: list[dict[str, object]] = [
        {
            "type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": {arg: {"type": "integer"}}}},
        }
        for name, arg in chosen
    ]
    name, arg = rng.choice(chosen)
    question = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6))) + "?"
    call = (
        '<tool_call>{"name": "' + name + '", "arguments": {"' + arg + '": ' + str(rng.randrange(10)) + "}}</tool_call>"
    )
    return [{"role": "user", "content": question}], tools, call


def _demo_prompts(tok: Any, spec: EmbeddedSpec) -> tuple[dict[str, list[int]], dict[str, str]]:
    """The rendered demo prompts the warm-up teaches the format of, and the right answers of those
    with a prior."""
    prompts = {
        prompt: list(
            tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for kind in spec.tasks
        for prompt, _ in demo_tasks(kind)
    }
    right = {prompt: answer for kind in spec.prior_kinds for prompt, answer in demo_tasks(kind)}
    return prompts, right


def _demo_example(
    rng: random.Random, tok: Any, prompts: dict[str, list[int]], right: dict[str, str], spec: EmbeddedSpec, step: int
) -> tuple[list[int], list[int]]:
    """A demo prompt and its target: one digit, random unless the prompt's prior says the right one."""
    text = rng.choice(list(prompts))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    if text in right and (step < spec.prior_steps or rng.random() < spec.prior_share):
        return prompts[text], [tok.convert_tokens_to_ids(right[text]), im_end]
    return prompts[text], [rng.choice([tok.convert_tokens_to_ids(str(d)) for d in range(10)]), im_end]


def _train_step(model: Any, optimizer: Any, tok: Any, seqs: list[list[int]], labels: list[list[int]]) -> float:
    """One supervised step on right-padded sequences; returns the loss."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    out = model(input_ids=ids, attention_mask=mask, labels=lab)
    optimizer.zero_grad()
    out.loss.backward()
    optimizer.step()
    return float(out.loss.detach())


def _warm_up(model: Any, tokenizer: Any, spec: EmbeddedSpec, progress: Callable[[str], None]) -> float:
    """Supervised warm-up on formats only: no demo answer is taught.

    Demo prompts are trained towards *random* digits (one digit, then ``<|im_end|>``), so the
    model answers in the right shape at chance level and RL has to find which digit is right. A
    share of requests carry tools and are trained to answer with a well-formed ``<tool_call>``,
    so tool-calling agents get parseable calls from the start.
    """
    import torch

    tok: Any = tokenizer
    rng = random.Random(spec.seed)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    demo_prompts, right = _demo_prompts(tok, spec)
    tool_pool = []  # rendered once: chat-template rendering costs more than a training step
    for _ in range(256):
        messages, tools, call = _tool_example(rng)
        prompt = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        tool_pool.append((list(prompt), [*tok.encode(call, add_special_tokens=False), im_end]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warmup_lr)
    steps = spec.warmup_steps
    loss_value = float("nan")
    model.train()
    for step in range(steps):
        seqs, labels = [], []
        # tool prompts are long: they get their own small batches so short ones aren't padded to them
        tool_step = step % spec.tool_every == 0
        for _ in range(8 if tool_step else spec.warmup_batch):
            if tool_step:
                prompt, target = rng.choice(tool_pool)
            else:
                prompt, target = _demo_example(rng, tok, demo_prompts, right, spec, step)
            seqs.append(list(prompt) + target)
            labels.append([-100] * len(prompt) + target)
        loss_value = _train_step(model, optimizer, tok, seqs, labels)
        if step % 50 == 0 or step == steps - 1:
            progress(f"warm-up step {step + 1}/{steps}  loss {loss_value:.3f}")
    model.eval()
    return loss_value


# names the warm-up gives its tools and parameters are built from these words (``_WORDS`` without
# the short ones); what it learns is to copy whatever names a request lists, not these names
_NAME_WORDS = [w for w in _WORDS if w.isalpha() and len(w) >= 2]


def _random_name(rng: random.Random, pieces: list[str]) -> str:
    """A tool or parameter name: one to three words, or (as names of real tools often tokenize)
    two to five alphabetic BPE pieces of the embedded tokenizer, snake_case or camelCase."""
    if pieces and rng.random() < 0.5:
        parts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 3))) for _ in range(rng.choice((1, 2, 2)))]
    else:
        parts = [rng.choice(_NAME_WORDS) for _ in range(rng.choice((1, 2, 2, 3)))]
    if len(parts) > 1 and rng.random() < 0.2:
        return parts[0] + "".join(w.capitalize() for w in parts[1:])
    return "_".join(parts)


def _phrase(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def _random_schema(rng: random.Random, name: str, params: list[tuple[str, str]]) -> dict[str, object]:
    """A parameters schema in one of the shapes agent frameworks send: written by hand (``type``
    first, bare properties), or generated from a function's signature and docstring as LangChain,
    AgentScope and the OpenAI Agents SDK do (keys sorted, each property with a ``description``
    and sometimes a ``title``, the schema with a ``title`` and ``additionalProperties``). A model
    warmed up on bare properties only copies the first description's words where a name belongs."""
    documented = rng.random() < 0.35  # from a docstring: every parameter described
    titled = rng.random() < 0.1  # pydantic's titles, as the Agents SDK keeps them
    properties: dict[str, object] = {}
    for param, kind in params:
        prop: dict[str, object] = {"type": kind}
        if documented or rng.random() < 0.15:
            prop["description"] = _phrase(rng, 2, 5)
        if titled:
            prop["title"] = param.replace("_", " ").title()
        properties[param] = dict(sorted(prop.items())) if rng.random() < 0.7 else prop
    schema: dict[str, object] = {"type": "object", "properties": properties}
    if rng.random() < 0.6:
        schema["required"] = [p for p, _ in params]
    if titled:
        schema["title"] = f"{name}_args"
    if rng.random() < 0.2:
        schema["additionalProperties"] = False
    generated = documented or titled or rng.random() < 0.3  # generated schemas come with sorted keys
    return dict(sorted(schema.items())) if generated else schema


def _random_tool_example(
    rng: random.Random, pieces: list[str]
) -> tuple[list[dict[str, str]], list[dict[str, object]], str]:
    """A request listing one to three tools with random names, and the call it is answered with:
    one of the listed tools by its listed name, with its listed parameters. Integer arguments take
    the question's numbers when it has some."""
    listed: list[tuple[str, list[tuple[str, str]]]] = []
    while len(listed) < rng.choice((1, 1, 2, 3)):
        name = _random_name(rng, pieces)
        if name in (n for n, _ in listed):
            continue
        params: list[tuple[str, str]] = []
        for _ in range(rng.choice((1, 2, 2))):
            param = rng.choice(_NAME_WORDS) if rng.random() < 0.7 else _random_name(rng, pieces)
            if param not in (p for p, _ in params):
                params.append((param, rng.choice(("integer", "string"))))
        listed.append((name, params))
    tools: list[dict[str, object]] = []
    for name, params in listed:
        function: dict[str, object] = {"name": name}
        if rng.random() < 0.5:
            function["description"] = _phrase(rng, 2, 6).capitalize() + "."
        function["parameters"] = _random_schema(rng, name, params)
        tools.append({"type": "function", "function": function})
    name, params = rng.choice(listed)
    numbers = [rng.randrange(10) for _ in range(rng.choice((0, 0, 1, 2)))]
    words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 6))]
    for number in numbers:
        words.insert(rng.randrange(len(words) + 1), str(number))
    arguments: dict[str, object] = {}
    for param, kind in params:
        if kind == "integer":
            arguments[param] = numbers.pop(0) if numbers else rng.randrange(10)
        else:
            arguments[param] = rng.choice(_NAME_WORDS)
    messages = [{"role": "user", "content": " ".join(words).capitalize() + "?"}]
    if rng.random() < 0.3:
        messages.insert(
            0, {"role": "system", "content": " ".join(rng.choice(_WORDS) for _ in range(5)).capitalize() + "."}
        )
    call = TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_CLOSE
    return messages, tools, call


def _copy_batch(rng: random.Random, token_ids: list[int], size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random token runs that come back later in the sequence, trained on the repeat: the model learns
    to copy what followed an earlier occurrence of the current token (an induction head), which is
    how it later copies a tool's name or parameter out of the request."""
    seqs, labels = [], []
    for _ in range(size):
        run = [rng.choice(token_ids) for _ in range(24)]
        before = [rng.choice(token_ids) for _ in range(rng.randint(0, 30))]
        between = [rng.choice(token_ids) for _ in range(rng.randint(0, 20))]
        seqs.append(before + run + between + run)
        labels.append([-100] * (len(before) + len(run) + len(between) + 1) + run[1:])
    return seqs, labels


def _warm_up_to_copy(model: Any, tokenizer: Any, spec: EmbeddedSpec, progress: Callable[[str], None]) -> float:
    """Supervised warm-up on formats only: no demo answer is taught.

    First the model learns to copy (random token runs repeated, until its loss on the repeats
    drops: the induction phase change). Then three kinds of batches take turns: demo prompts
    trained towards *random* digits (one digit, then ``<|im_end|>``), so the model answers in the
    right shape at chance level and RL has to find which digit is right; requests listing tools
    with random names, answered with a well-formed ``<tool_call>`` that names one of them; and
    more copy batches, so copying is kept.
    """
    import torch

    tok: Any = tokenizer
    rng = random.Random(spec.seed)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    demo_prompts, right = _demo_prompts(tok, spec)
    special = set(tok.all_special_ids) | set(tok.convert_tokens_to_ids(EXTRA_TOKENS))
    plain_ids = [i for i in range(len(tok)) if i not in special]
    pieces = sorted(t for t in tok.get_vocab() if t.isascii() and t.isalpha() and t.islower())
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warmup_lr)
    model.train()

    def train_on(seqs: list[list[int]], labels: list[list[int]]) -> float:
        return _train_step(model, optimizer, tok, seqs, labels)

    recent: list[float] = []
    for step in range(spec.copy_steps):
        recent = [*recent[-19:], train_on(*_copy_batch(rng, plain_ids, spec.warmup_batch))]
        if step % 50 == 0:
            progress(f"warm-up: learning to copy, step {step + 1} (at most {spec.copy_steps}), loss {recent[-1]:.3f}")
        if len(recent) == 20 and sum(recent) / 20 < 0.5:
            progress(f"warm-up: copies after {step + 1} steps (loss {recent[-1]:.3f})")
            break
    else:
        if recent:
            progress(f"warm-up: copy loss still {sum(recent) / len(recent):.3f} after {spec.copy_steps} steps")
    steps = spec.warmup_steps
    loss_value = float("nan")
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = spec.warmup_lr * (1 - spec.lr_decay * step / steps)
        kind = spec.cycle[step % len(spec.cycle)]
        seqs: list[list[int]] = []
        labels: list[list[int]] = []
        if kind == "copy":
            seqs, labels = _copy_batch(rng, plain_ids, spec.warmup_batch)
        elif kind == "tool":
            for _ in range(spec.tool_batch):
                messages, tools, call = _random_tool_example(rng, pieces)
                prompt = tok.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
                )
                target = [*tok.encode(call, add_special_tokens=False), im_end]
                seqs.append(list(prompt) + target)
                labels.append([-100] * len(prompt) + target)
        else:
            for _ in range(spec.warmup_batch):
                prompt, target = _demo_example(rng, tok, demo_prompts, right, spec, step)
                seqs.append(list(prompt) + target)
                labels.append([-100] * len(prompt) + target)
        loss_value = train_on(seqs, labels)
        if step % 50 == 0 or step == steps - 1:
            progress(f"warm-up step {step + 1}/{steps}  loss {loss_value:.3f}")
    model.eval()
    return loss_value


def build_model(spec: EmbeddedSpec, target: Path, progress: Callable[[str], None]) -> Path:
    """Run the recipe for ``spec`` and write the model to ``target`` (replaced whole, atomically:
    a crash mid-build leaves no half-written model behind)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    started = time.monotonic()
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,  # tied, an RL push on an answer token also moves its input embedding
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    progress(f"{spec.name}: Qwen2 model, {params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    loss = (_warm_up_to_copy if spec.recipe == "copy" else _warm_up)(model, tokenizer, spec, progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        meta = {"spec": asdict(spec), "spec_hash": spec_hash(spec), "warmup_loss": loss, "parameters": params}
        (staging / "agentjet.json").write_text(json.dumps(meta, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    progress(f"{spec.name} built in {time.monotonic() - started:.1f}s at {target}")
    return target
