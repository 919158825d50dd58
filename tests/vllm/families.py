"""Tiny models of real model families, for the parser tests: each family's special tokens, a chat
template in that family's format (written here, not copied), its architecture, and weights trained
for a few seconds until, for each test prompt, the greedy answer is exactly the family's way of
thinking and calling tools. Both servers then sample the same answer, and what is compared is how
each one reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER, TIME]
ASK_TOOL = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_TWO = [{"role": "user", "content": "Weather and time in Oslo?"}]
ASK_PLAIN = [{"role": "user", "content": "Say hello."}]


@dataclass
class Family:
    name: str
    architecture: str  # the transformers config class
    special: list[str]  # special tokens (the first ones are eos / pad)
    added: list[str]  # added tokens that are not special
    eos: list[str]  # end-of-turn tokens, all in generation_config.json
    template: str
    tool_parser: str | None
    reasoning_parser: str | None
    # (messages, tools, completion text as the model must sample it, ending with its stop token)
    cases: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]] = field(default_factory=list)


# Qwen3: ChatML turns, tool schemas in the system turn, <tool_call> JSON, <think> reasoning that the
# template keeps only for the assistant turns after the last user message
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- if tools -%}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nFunctions you may call, one JSON signature per line:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\n\nTo call one, answer with:\n<tool_call>\n"
    '{"name": <name>, "arguments": <JSON object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' -%}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "<|im_start|>assistant\n"
    "{%- set r = m.reasoning_content or m.reasoning -%}"
    "{% if r and loop.index0 > ns.last_user %}<think>\n{{ r.strip() }}\n</think>\n\n{% endif %}"
    "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    "{% if not loop.first or m.content %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}}"
    "\n</tool_call>"
    "{%- endfor -%}"
    "<|im_end|>\n"
    "{%- elif m.role == 'tool' -%}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)

# Llama 3.1: header-delimited turns, tool schemas in the first user turn, a bare JSON call
LLAMA31_TEMPLATE = (
    "<|begin_of_text|>"
    "{%- set ns = namespace(tools_done=false) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' and tools and not ns.tools_done -%}"
    "{%- set ns.tools_done = true -%}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "Answer with a JSON call of one of these functions, as "
    '{"name": function name, "parameters": arguments}, or in words.\n\n'
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    "{{ m.content }}<|eot_id|>"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for c in m.tool_calls -%}"
    '{"name": "{{ c.function.name }}", "parameters": '
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}}"
    "{%- endfor -%}"
    "<|eot_id|>"
    "{%- elif m.role == 'tool' -%}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else -%}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif -%}"
)

# Mistral (v11 tool format): [INST] turns, tools before the last user turn, [TOOL_CALLS]name[ARGS]{...}
MISTRAL_TEMPLATE = (
    "<s>"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}"
    "{%- if tools and loop.index0 == ns.last_user -%}"
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif -%}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' -%}"
    "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] -%}"
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}"
    "{%- endfor -%}"
    "</s>"
    "{%- elif m.role == 'tool' -%}"
    "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- endif -%}"
    "{%- endfor -%}"
)

FAMILIES = {
    "qwen3": Family(
        name="qwen3",
        architecture="Qwen3",
        special=["<|im_end|>", "<|endoftext|>", "<|im_start|>"],
        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        eos=["<|im_end|>", "<|endoftext|>"],
        template=QWEN3_TEMPLATE,
        tool_parser="hermes",
        reasoning_parser="qwen3",
        cases=[
            (
                ASK_TOOL,
                TOOLS,
                "<think>\nThe user wants the weather, so I call get_weather.\n</think>\n\n"
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            ),
            (
                ASK_TWO,
                TOOLS,
                "<think>\nTwo things: weather and time.\n</think>\n\nLet me look both up.\n"
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
            ),
            (ASK_PLAIN, None, "<think>\nA greeting.\n</think>\n\nHello there!<|im_end|>"),
        ],
    ),
    "llama31": Family(
        name="llama31",
        architecture="Llama",
        special=[
            "<|eot_id|>",
            "<|end_of_text|>",
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        added=[],
        eos=["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"],
        template=LLAMA31_TEMPLATE,
        tool_parser="llama3_json",
        reasoning_parser=None,
        cases=[
            (ASK_TOOL, TOOLS, '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'),
            (ASK_PLAIN, None, "Hello there!<|eot_id|>"),
        ],
    ),
    "mistral": Family(
        name="mistral",
        architecture="Mistral",
        special=[
            "</s>",
            "<pad>",
            "<s>",
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        added=[],
        eos=["</s>"],
        template=MISTRAL_TEMPLATE,
        tool_parser="mistral",
        reasoning_parser=None,
        cases=[
            (ASK_TOOL, TOOLS, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>'),
            (
                ASK_TWO,
                TOOLS,
                '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"city": "Oslo"}</s>',
            ),
            (ASK_PLAIN, None, "Hello there!</s>"),
        ],
    ),
}


def _tokenizer(family: Family, corpus: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=family.special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token=family.special[0],
        pad_token=family.special[1],
        unk_token=None,
        additional_special_tokens=family.special[2:],
        model_max_length=1024,
    )
    if family.added:
        tokenizer.add_tokens(family.added)
    tokenizer.chat_template = family.template
    return tokenizer


def build(family: Family, target: Path, steps: int = 2000, seed: int = 0) -> Path:
    """Build ``family``'s tiny model into ``target`` (skipped when it is there already)."""
    if (target / "config.json").exists():
        return target
    import torch
    import transformers

    torch.manual_seed(seed)
    prompts: list[str] = []
    scratch = _tokenizer(family, ["x"])
    for messages, tools, _ in family.cases:
        prompts.append(scratch.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))
    corpus = [p + c for p, (_, _, c) in zip(prompts, family.cases, strict=True)] * 20
    corpus += [json.dumps(t) for t in TOOLS] * 10
    tokenizer = _tokenizer(family, corpus)
    pairs = []
    for prompt, (_, _, completion) in zip(prompts, family.cases, strict=True):
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(completion, add_special_tokens=False)
        assert tokenizer.decode(p + c, skip_special_tokens=False) == prompt + completion
        pairs.append((p, c))
    config_cls = getattr(transformers, f"{family.architecture}Config")
    model_cls = getattr(transformers, f"{family.architecture}ForCausalLM")
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in family.eos]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # the smallest head vLLM's CPU attention takes
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=eos_ids[0],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = model_cls(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def learned() -> bool:  # the greedy answer to every prompt is its case's completion, by a margin
        model.eval()
        with torch.no_grad():
            for p, c in pairs:
                logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
                top2 = logits.topk(2).values
                if logits.argmax(-1).tolist() != c or not bool(((top2[:, 0] - top2[:, 1]) > 2).all()):
                    return False
        model.train()
        return True

    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = sum(  # every case each step: the cases that share a prompt prefix pull apart steadily
            model(input_ids=torch.tensor([p + c]), labels=torch.tensor([[-100] * len(p) + c])).loss for p, c in pairs
        )
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 and learned():
            break
    else:
        raise AssertionError(f"the {family.name} model did not learn its answers in {steps} steps")
    model.generation_config.eos_token_id = eos_ids
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
