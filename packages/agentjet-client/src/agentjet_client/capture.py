"""The capture core: every front door (SDK transports, loopback proxy) records through here.

A recorder holds one episode's turns. It is fed either a whole chat completion response or the
chunks of a streamed one; each choice's ``agentjet`` extension becomes one ``Turn`` with the
exact token ids, log-probabilities and policy versions. Capture never breaks the agent's LLM
call: anything unexpected is logged and counted in ``failures``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from agentjet_client.protocol import AgentJetExtension, Turn

logger = logging.getLogger(__name__)

CHAT_PATH_SUFFIX = "/chat/completions"


class EpisodeRecorder:
    """Thread-safe list of one episode's turns, in the order their responses completed."""

    def __init__(self) -> None:
        self._turns: list[Turn] = []
        self._lock = threading.Lock()
        self.failures = 0
        self.last_failure: str | None = None

    @property
    def turns(self) -> list[Turn]:
        with self._lock:
            return list(self._turns)

    def fail(self, reason: str) -> None:
        with self._lock:
            self.failures += 1
            self.last_failure = reason
        logger.warning("capture failed (the agent's call is unaffected): %s", reason)

    def _add(
        self, agent: str, request: dict[str, Any], ext: AgentJetExtension, model: str | None, started: float
    ) -> None:
        turn = Turn(
            agent=agent,
            model=model,
            policy_version=ext.policy_version,
            request_messages=list(request.get("messages") or []),
            prompt_token_ids=ext.prompt_token_ids,
            completion_token_ids=ext.completion_token_ids,
            completion_logprobs=ext.completion_logprobs,
            completion_versions=ext.completion_versions,
            finish_reason=ext.finish_reason,
            started_at=started,
            latency_s=max(0.0, time.time() - started),
        )
        with self._lock:
            self._turns.append(turn)

    def record_response(self, agent: str, request: dict[str, Any], response: Any, started: float) -> None:
        """Record a non-streamed chat completion (parsed JSON body)."""
        try:
            choices = response.get("choices") if isinstance(response, dict) else None
            if not choices:
                self.fail("response has no choices")
                return
            for choice in choices:
                ext = choice.get("agentjet")
                if ext is None:
                    self.fail("response choice has no 'agentjet' extension; is the base URL an AgentJet server?")
                    continue
                self._add(agent, request, AgentJetExtension.model_validate(ext), response.get("model"), started)
        except Exception as exc:  # capture must never raise into the agent
            self.fail(f"could not record response: {type(exc).__name__}: {exc}")

    def record_chunks(self, agent: str, request: dict[str, Any], chunks: list[dict[str, Any]], started: float) -> None:
        """Record a streamed chat completion from its parsed SSE chunks."""
        try:
            found = 0
            for chunk in chunks:
                for choice in chunk.get("choices") or []:
                    ext = choice.get("agentjet")
                    if ext is not None:
                        self._add(agent, request, AgentJetExtension.model_validate(ext), chunk.get("model"), started)
                        found += 1
            if not found:
                self.fail("stream ended without an 'agentjet' extension (interrupted, or not an AgentJet server)")
        except Exception as exc:  # capture must never raise into the agent
            self.fail(f"could not record stream: {type(exc).__name__}: {exc}")


class SSECollector:
    """Incrementally parses an SSE byte stream, keeping each ``data:`` JSON object."""

    def __init__(self) -> None:
        self._buffer = b""
        self.chunks: list[dict[str, Any]] = []
        self.broken = False

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            self._line(line.rstrip(b"\r"))

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.broken = True
            return
        if isinstance(obj, dict):
            self.chunks.append(obj)


def is_chat_request(method: str, path: str) -> bool:
    return method.upper() == "POST" and path.rstrip("/").endswith(CHAT_PATH_SUFFIX)


def parse_request_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
