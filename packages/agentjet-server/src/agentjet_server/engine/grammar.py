"""Structured outputs in the transformers engine: ``response_format`` ``json_object`` and ``json_schema``
compiled by xgrammar (the constrained-decoding library vLLM uses for the same requests, so both engines
mask alike; its grammars are compiled once per schema and matched token by token in C++). xgrammar is
the ``structured`` extra (``pip install 'agentjet-server[structured]'``); without it such a request is
a 400 that says so.

A request's ``Grammar`` is one xgrammar matcher: before each token, the tokens the grammar does not allow
are masked out of the row's logits (``mask``); after it, the sampled token advances the matcher
(``accept``). The end-of-turn tokens are allowed only where the grammar may end, so a finished answer
parses. The masked distribution is a processed one: its log-probabilities are the behaviour policy's.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from agentjet_client.errors import extra_hint
from agentjet_server.engine.tokens import ChatTokenizer
from agentjet_server.errors import InvalidRequestError

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"


class Grammar:
    """One request's matcher: masks a row's logits, then takes the token sampled from them."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, scores: torch.Tensor) -> None:
        """Set what the grammar does not allow next to -inf, in place (``scores``: one row, on the CPU)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(scores.unsqueeze(0), self._bitmask.to(scores.device))

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise InvalidRequestError(f"token {token} does not continue the response_format grammar")


class Grammars:
    """The engine's grammar compiler (built on first use: importing xgrammar takes seconds) and its
    compiled grammars by schema."""

    def __init__(self, chat: ChatTokenizer, vocab_size: int) -> None:
        self._chat, self._vocab = chat, vocab_size
        self._compiler: Any = None
        self._compiled: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def matcher(self, spec: tuple[str, str]) -> Grammar:
        """A fresh matcher for ``spec`` (``(JSON_OBJECT, "")`` or ``(JSON_SCHEMA, schema JSON)``)."""
        try:
            import xgrammar as xgr
        except ImportError as exc:
            feature = "response_format json_object and json_schema on this server"
            hint = extra_hint(feature, "structured", exc, package="agentjet-server")
            raise InvalidRequestError(f"{hint}; then restart the server", param="response_format") from None

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._chat.tokenizer, vocab_size=self._vocab, stop_token_ids=sorted(self._chat.stop_ids)
                )
                self._compiler = xgr.GrammarCompiler(info)
            compiled = self._compiled.get(spec)
            if compiled is None:
                compiled = self._compile(spec)
                if len(self._compiled) >= 256:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[spec] = compiled
        return Grammar(xgr.GrammarMatcher(compiled), self._vocab)

    def _compile(self, spec: tuple[str, str]) -> Any:
        try:
            # compact JSON, as vLLM with ``disable_any_whitespace`` compiles it: no whitespace the model may pad with
            return self._compiler.compile_json_schema(json_schema(spec), any_whitespace=False, separators=(",", ":"))
        except Exception as exc:  # xgrammar's own message says what it cannot take
            raise InvalidRequestError(
                f"response_format.json_schema.schema cannot be compiled to a grammar: {exc}", param="response_format"
            ) from None


def json_schema(spec: tuple[str, str]) -> str:
    """The JSON schema ``spec`` constrains to: json_object's is any JSON object, as OpenAI's json_object mode
    (xgrammar's builtin JSON grammar takes arrays too). Both engines compile this, so they mask alike."""
    kind, schema = spec
    return '{"type": "object"}' if kind == JSON_OBJECT else schema


def grammar_of(response_format: dict[str, Any] | None) -> tuple[str, str] | None:
    """The grammar a request's ``response_format`` asks for (None: free text); 400s name what is wrong."""
    if not response_format or response_format.get("type") in (None, "text"):
        return None
    kind = response_format.get("type")
    if kind == JSON_OBJECT:
        return (JSON_OBJECT, "")
    if kind != JSON_SCHEMA:
        raise InvalidRequestError(
            f"response_format type {kind!r} is not one of text, json_object, json_schema", param="response_format"
        )
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(schema, dict):
        raise InvalidRequestError(
            "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
            param="response_format",
        )
    if spec.get("strict") and "additionalProperties" not in schema and schema.get("type") == "object":
        schema = {**schema, "additionalProperties": False}  # strict: exactly the properties named
    return (JSON_SCHEMA, json.dumps(schema, sort_keys=True))
