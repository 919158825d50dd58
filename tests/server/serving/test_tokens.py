"""The shared tokenizer (``engine.tokens.ChatTokenizer``): encoding and decoding straight through the Rust
tokenizer give exactly what the Hugging Face wrapper gives, and a rendered prompt is kept for when it is sent
again, bounded, and never kept for a template that writes today's date; on the embedded models' real
tokenizers."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from agentjet_server.engine import tokens
from agentjet_server.engine.tokens import ChatTokenizer, rust_tokenizer

TEXTS = [
    "",
    "Write seven as a digit.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "naïve café, 日本語のテキスト, emoji 🤖🎉, العربية",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>\n<|im_start|>assistant\n",
    '{"name": "add", "arguments": {"a": 1, "b": 2}}',
    "don't won't it's , . ! ? ;",
    "\u200b zero width \ufeff and a combining e\u0301",
]


@pytest.fixture(scope="module", params=["tiny", "tools"])
def chat(request: pytest.FixtureRequest, model_dir: Path, tools_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(model_dir if request.param == "tiny" else tools_model_dir)


def test_the_rust_tokenizer_encodes_and_decodes_as_the_wrapper_does(chat: ChatTokenizer) -> None:
    wrapper = chat.tokenizer
    assert chat._rust is not None, "the embedded tokenizers are fast and clean no spaces: the direct path applies"
    for text in TEXTS:
        assert chat.encode(text) == wrapper.encode(text, add_special_tokens=False), text
    rng = random.Random(0)
    vocab = len(wrapper)
    special = sorted(chat.stop_ids)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))] + rng.sample(special, k=1)
        rng.shuffle(ids)
        assert chat.decode(ids) == wrapper.decode(ids, skip_special_tokens=True), ids
        assert chat.decode_all(ids) == wrapper.decode(ids, skip_special_tokens=False), ids


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_wrapper(chat: ChatTokenizer) -> None:
    wrapper = chat.tokenizer
    assert rust_tokenizer(wrapper) is chat._rust
    wrapper.clean_up_tokenization_spaces = True
    try:
        assert rust_tokenizer(wrapper) is None  # the wrapper's clean-up would be skipped: not used
    finally:
        wrapper.clean_up_tokenization_spaces = False
    assert rust_tokenizer(object()) is None


def test_a_prompt_sent_again_is_not_rendered_again(chat: ChatTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
    first = chat.render(messages)
    assert first == chat.encode(chat.render_text(messages))
    first.append(-1)  # a caller's changes to its ids do not reach the kept copy
    rendered: list[str] = []
    real = chat.render_text
    monkeypatch.setattr(chat, "render_text", lambda *a, **k: rendered.append("x") or real(*a, **k))
    again = chat.render(messages)
    assert again == first[:-1] and rendered == []
    # anything that changes the prompt is a different entry: another message, tools, an assistant prefix
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat.render(messages, tools) != again
    assert chat.render(messages, assistant_prefix="<tool_call>") == again + chat.encode("<tool_call>")
    assert chat.render([*messages[:1], {"role": "user", "content": "Name a number."}]) != again
    assert len(rendered) == 3


def test_kept_prompts_are_bounded(chat: ChatTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "RENDERED_ENTRIES", 5)
    for i in range(12):
        chat.render([{"role": "user", "content": f"question {i}"}])
    assert len(chat._rendered) == 5
    assert chat._rendered_tokens == sum(len(ids) for ids in chat._rendered.values())
    monkeypatch.setattr(tokens, "RENDERED_ENTRIES", 1000)
    monkeypatch.setattr(tokens, "RENDERED_TOKENS", 200)
    for i in range(12):
        chat.render([{"role": "user", "content": f"another question {i} " * 3}])
    assert 0 < chat._rendered_tokens <= 200
    long = [{"role": "user", "content": "word " * 100}]  # over an eighth of the budget: rendered, not kept
    assert chat.render(long) == chat.encode(chat.render_text(long))
    assert all(len(ids) <= 200 // 8 for ids in chat._rendered.values())


def test_a_template_that_writes_the_date_renders_every_time(model_dir: Path) -> None:
    template = ChatTokenizer(model_dir).tokenizer.chat_template
    dated = ChatTokenizer(model_dir, chat_template="{{ strftime_now('%d %b %Y') }}\n" + template)
    messages = [{"role": "user", "content": "What day is it?"}]
    assert dated.render(messages) == dated.render(messages)
    assert len(dated._rendered) == 0
    assert dated.render_text(messages).startswith(time.strftime("%d %b %Y"))
