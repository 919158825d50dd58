"""What every engine shares about tokens: the chat template, detokenisation, and stops.

``ChatTokenizer`` loads a model directory's tokenizer (it must carry a chat template) and
knows which token ids end a turn. Every engine renders and decodes through one (``Engine.chat``),
so a prompt renders to the same ids whichever engine serves it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentjet_server.errors import InvalidRequestError, ModelLoadError

_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")

# rendered prompts kept, so that a prompt sent again (a GRPO group's episodes all send their task's) is
# neither rendered nor tokenised again; bounded by entries and by the tokens held
RENDERED_ENTRIES = 1024
RENDERED_TOKENS = 1 << 20

Messages = Sequence[Mapping[str, Any]]  # a conversation: OpenAI-shaped message dicts
ToolSpecs = Sequence[Mapping[str, Any]]  # tool definitions as the chat template takes them


def load_tokenizer(path: Path, chat_template: str | None = None) -> Any:
    """The model directory's tokenizer; it must carry a chat template, or be given one."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load a tokenizer from {path}: {exc}. Pass --model a local Hugging Face "
            "model directory (config.json, weights, tokenizer files)"
        ) from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(
            f"the tokenizer in {path} has no chat template; use an instruct/chat model or add "
            "'chat_template' to its tokenizer_config.json, or pass --chat-template FILE"
        )
    return tokenizer


def check_model_dir(path: Path) -> None:
    if not (path / "config.json").exists():
        raise ModelLoadError(
            f"{path} is not a model directory (no config.json); pass --model a local Hugging "
            "Face causal-LM directory, or leave --model out for the embedded default"
        )


def rust_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers`` tokenizer behind a fast Hugging Face one, when encoding and decoding through it
    gives what the Hugging Face wrapper gives (no clean-up of spaces after decoding), else None. Called
    directly it costs a prompt about half, a token's text a third."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class ChatTokenizer:
    def __init__(self, path: Path, chat_template: str | None = None) -> None:
        self.tokenizer = load_tokenizer(path, chat_template)
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.stop_ids = frozenset(self._stop_ids(path))
        self._rust = rust_tokenizer(self.tokenizer)
        # a template that writes today's date renders differently tomorrow: its prompts are not kept
        self._keep_rendered = "strftime_now" not in str(self.tokenizer.chat_template)
        self._rendered: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._rendered_tokens = 0
        self._rendered_lock = threading.Lock()  # prompts are rendered on the event loop and in worker threads

    def _stop_ids(self, path: Path) -> set[int]:
        tok = self.tokenizer
        ids: set[int] = set()
        for token in _END_OF_TURN:
            tid = tok.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != tok.unk_token_id and tid >= 0:
                ids.add(tid)
        if (path / "generation_config.json").exists():
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
            ids.update(t for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int))
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
        return ids

    def render(self, messages: Messages, tools: ToolSpecs | None = None, assistant_prefix: str = "") -> list[int]:
        if not self._keep_rendered:
            return self.encode(self.render_text(messages, tools) + assistant_prefix)
        try:
            key = json.dumps([messages, tools, assistant_prefix], ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError):  # not JSON (a caller's own objects): rendered every time
            return self.encode(self.render_text(messages, tools) + assistant_prefix)
        with self._rendered_lock:
            kept = self._rendered.get(key)
            if kept is not None:
                self._rendered.move_to_end(key)
                return list(kept)
        ids = self.encode(self.render_text(messages, tools) + assistant_prefix)
        self._keep(key, tuple(ids))
        return ids

    def _keep(self, key: str, ids: tuple[int, ...]) -> None:
        if len(ids) > RENDERED_TOKENS // 8:
            return  # one prompt would push out most of the others
        with self._rendered_lock:
            if key in self._rendered:
                return
            self._rendered[key] = ids
            self._rendered_tokens += len(ids)
            while len(self._rendered) > RENDERED_ENTRIES or self._rendered_tokens > RENDERED_TOKENS:
                _, dropped = self._rendered.popitem(last=False)
                self._rendered_tokens -= len(dropped)

    def render_text(
        self, messages: Messages, tools: ToolSpecs | None = None, add_generation_prompt: bool = True
    ) -> str:
        """The chat template's text for ``messages`` (special tokens as text)."""
        try:
            text: str = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises many kinds; all mean the messages don't fit the template
            raise InvalidRequestError(
                f"the model's chat template could not render these messages: {str(exc)[:300]}; check the roles, "
                "their order and the tool definitions",
                param="messages",
                code="chat_template_error",
            ) from exc
        return text

    def encode(self, text: str) -> list[int]:
        if self._rust is not None:
            rust_ids: list[int] = self._rust.encode(text, add_special_tokens=False).ids
            return rust_ids
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode_all(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` with special tokens kept (``decode`` drops them)."""
        if self._rust is not None:
            rust_text: str = self._rust.decode(list(token_ids), skip_special_tokens=False)
            return rust_text
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._rust is not None:
            rust_text: str = self._rust.decode(list(token_ids), skip_special_tokens=True)
            return rust_text
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return text

    def hits_stop_string(self, output_ids: Sequence[int], stops: Sequence[str]) -> bool:
        """Whether the completion so far contains one of ``stops``.

        A stop string of n characters spans at most 4n byte-level tokens: only that tail is decoded.
        """
        if not stops:
            return False
        window = 4 * max(len(x) for x in stops) + 4
        tail = self.decode(output_ids[-window:])
        return any(x in tail for x in stops)
