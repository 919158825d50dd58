"""The LLM behind ``research auto``: any OpenAI-compatible endpoint (a hosted model, ``vllm serve``,
a local gateway) or an Anthropic-compatible one, asked for JSON answers, with every token counted.

The key comes from the environment: ``AGENTJET_RESEARCH_API_KEY``, else ``OPENAI_API_KEY`` (OpenAI
style) or ``ANTHROPIC_API_KEY`` (Anthropic style). A local server that wants no key gets a
placeholder.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from agentjet_client.errors import StudyError

Style = Literal["openai", "anthropic"]
ANSWER_TOKENS = 16000  # the longest answer asked for: a plan with its code files


@dataclass
class Usage:
    """Tokens the researcher used, as its endpoint counted them."""

    prompt: int = 0
    completion: int = 0
    calls: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    def as_dict(self) -> dict[str, int]:
        return {"prompt": self.prompt, "completion": self.completion, "calls": self.calls}


@dataclass
class Researcher:
    """Asks the model; ``usage`` grows with every answer."""

    url: str
    model: str
    style: Style = "openai"
    timeout: float = 600.0
    usage: Usage = field(default_factory=Usage)
    _client: Any = None

    def client(self) -> Any:
        if self._client is not None:
            return self._client
        key = os.environ.get("AGENTJET_RESEARCH_API_KEY")
        if self.style == "anthropic":
            try:
                import anthropic
            except ImportError as exc:
                raise StudyError("--llm-api anthropic needs the anthropic package: pip install anthropic") from exc
            key = key or os.environ.get("ANTHROPIC_API_KEY") or "none"
            self._client = anthropic.Anthropic(base_url=self.url or None, api_key=key, timeout=self.timeout)
        else:
            import openai

            key = key or os.environ.get("OPENAI_API_KEY") or "none"
            self._client = openai.OpenAI(base_url=self.url or None, api_key=key, timeout=self.timeout)
        return self._client

    def ask(self, system: str, messages: list[dict[str, str]], max_tokens: int = ANSWER_TOKENS) -> str:
        """The model's answer to ``messages`` (user/assistant turns) under ``system``; its tokens
        are added to ``usage``. StudyError when the endpoint fails (with what to check)."""
        try:
            if self.style == "anthropic":
                reply = self.client().messages.create(
                    model=self.model, system=system, messages=messages, max_tokens=max_tokens
                )
                text = "".join(getattr(block, "text", "") for block in reply.content)
                prompt, completion = reply.usage.input_tokens, reply.usage.output_tokens
            else:
                reply = self.client().chat.completions.create(
                    model=self.model,
                    messages=[{"role": "system", "content": system}, *messages],
                    max_completion_tokens=max_tokens,
                    temperature=0,
                )
                text = reply.choices[0].message.content or ""
                usage = reply.usage
                prompt = usage.prompt_tokens if usage else 0
                completion = usage.completion_tokens if usage else 0
        except StudyError:
            raise
        except Exception as exc:  # the SDKs' connection, status and timeout errors
            raise StudyError(
                f"the researcher model ({self.style} API at {self.url or 'its default URL'}, model {self.model}) "
                f"failed: {type(exc).__name__}: {str(exc)[:600]}; check --llm-url, --llm-model and the key "
                "(AGENTJET_RESEARCH_API_KEY)"
            ) from exc
        self.usage.prompt += int(prompt or 0)
        self.usage.completion += int(completion or 0)
        self.usage.calls += 1
        return text


def json_answer(text: str) -> dict[str, Any]:
    """The JSON object in a model's answer: the whole answer, a fenced ```json block, or the
    outermost braces. ValueError (what was wrong, for the model to fix) otherwise."""
    candidates = [text.strip()] if text.strip()[:1] in ("{", "[") else []
    candidates += re.findall(r"```(?:json)?\s*\n(.*?)```", text, flags=re.DOTALL)
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    error = "no JSON object in the answer"
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError as exc:
            error = f"the JSON does not parse: {exc}"
            continue
        if isinstance(value, dict):
            return value
        error = "the answer is JSON but not an object"
    raise ValueError(error)
