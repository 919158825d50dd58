"""The capture core: every front door (SDK transports, loopback proxy) records through here.

A recorder holds one episode's turns. It is fed either a whole response or the events of a
streamed one, of any API the server speaks (``api_of``: chat completions, OpenAI's Responses,
Anthropic's Messages, text completions); each answer's ``agentjet`` extension becomes one ``Turn``
with the exact token ids, log-probabilities and policy versions. A Responses or Messages request is
recorded as the chat request it means (``dialects``), so its turns are matched to earlier calls and
merged into timelines exactly as chat turns are. Capture never breaks the agent's LLM call:
anything unexpected is logged and counted in ``failures``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any

from agentjet_client.dialects import (
    DialectError,
    messages_answer,
    messages_to_chat,
    responses_answer,
    responses_to_chat,
)
from agentjet_client.protocol import AgentJetExtension, Turn

logger = logging.getLogger(__name__)

CHAT_PATH_SUFFIX = "/chat/completions"
# the POST paths that sample (checked in this order: chat completions also end in /completions)
API_PATHS = (
    ("/chat/completions", "chat"),
    ("/responses", "responses"),
    ("/messages", "messages"),
    ("/completions", "completions"),
)


# what a turn copies of the server's extension, as it came: the tokens, their log-probs and versions, the
# signature over them, how (processed distribution) and by what (adapter) they were sampled, and under what
# token limit
SAMPLED = (
    "policy_version",
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
    "completion_versions",
    "finish_reason",
    "signature",
    "sampled_from",
    "adapter",
    "max_tokens",
)


class EpisodeRecorder:
    """Thread-safe list of one episode's turns, in the order their responses completed."""

    def __init__(self) -> None:
        self._turns: list[Turn] = []
        # each turn's answer (text, tool calls), to tell apart calls that share their messages
        # (n > 1 choices, a framework asking again) by which answer came back
        self._answers: list[Answer | None] = []
        self._tools: list[str] = []  # each turn's request's tools, as compared between calls
        self._lock = threading.Lock()
        self._rewards: dict[int, float] = {}  # turn index -> its own reward (``reward_turn``)
        self.failures = 0
        self.last_failure: str | None = None
        self.trace: Any = None  # the episode span's context: each captured call's span starts under it

    def answers(self) -> list[Answer | None]:
        """Each turn's answer as the agent got it (text and tool calls), in turn order."""
        with self._lock:
            return list(self._answers)

    @property
    def turns(self) -> list[Turn]:
        with self._lock:
            turns = list(self._turns)
            rewards = dict(self._rewards)
        return [t.model_copy(update={"reward": rewards[i]}) if i in rewards else t for i, t in enumerate(turns)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._turns)

    def entries(self, start: int = 0) -> list[dict[str, Any]]:
        """The captured calls from turn ``start`` on as JSON data, each turn with the answer it gave and
        the tools its request showed: what ``restore`` needs to go on matching later calls to them."""
        with self._lock:
            rows = list(zip(self._turns, self._answers, self._tools, strict=True))[start:]
        return [{"turn": t.model_dump(mode="json"), "answer": answer, "tools": tools} for t, answer, tools in rows]

    def restore(self, entries: list[dict[str, Any]]) -> None:
        """Append turns kept by ``entries`` (of another recorder, say before a restart)."""
        for entry in entries:
            with self._lock:
                self._turns.append(Turn.model_validate(entry["turn"]))
                self._answers.append(answer_from(entry.get("answer")))
                self._tools.append(str(entry.get("tools") or "[]"))

    def reward_turn(self, reward: float, agent: str | None = None) -> None:
        """Add ``reward`` to the newest captured call (of ``agent``, if given): a reward that arrives
        with that turn (PPO places it at the turn's last token), on top of the episode's."""
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"a turn reward must be a finite number, not {reward!r}")
        with self._lock:
            index = next(
                (i for i in range(len(self._turns) - 1, -1, -1) if agent is None or self._turns[i].agent == agent),
                None,
            )
            if index is None:
                who = f" of agent '{agent}'" if agent is not None else ""
                raise ValueError(f"no LLM call{who} has finished in this episode yet: reward a turn after its call")
            self._rewards[index] = self._rewards.get(index, 0.0) + float(reward)

    def fail(self, reason: str) -> None:
        with self._lock:
            self.failures += 1
            self.last_failure = reason
        logger.warning("capture failed (the agent's call is unaffected): %s", reason)

    def extension(self, agent: str, request: dict[str, Any]) -> dict[str, Any]:
        """The ``agentjet`` request extension: the agent making the call (the server signs its sample
        for that agent) and, when there is one, the earlier call it continues (``claim``)."""
        return {"agent": agent, **(self.claim(agent, request) or {})}

    def claim(self, agent: str, request: dict[str, Any]) -> dict[str, Any] | None:
        """The ``agentjet`` request extension naming the earlier call of ``agent`` that ``request``
        continues: the newest turn whose messages begin the request's, followed by an assistant
        message that is that turn's answer (text and tool calls; re-serialised JSON compares equal).
        None if no earlier call's answer came back (the agent edited its history: a new timeline), or
        if the request shows the model other tools than that call did (AgentScope asks for its last
        reply with ``tool_choice`` "none"): the tools are rendered before the messages, so the earlier
        prompt does not begin this one. The server checks the claim against the text; a wrong one
        costs nothing (it renders afresh)."""
        try:
            messages = [_canonical(m) for m in request.get("messages") or []]
            tools = _tools_key(request)
            with self._lock:
                candidates = []
                for turn, answer, listed in zip(self._turns, self._answers, self._tools, strict=True):
                    n = len(turn.request_messages)
                    if turn.agent != agent or n == 0 or len(messages) <= n or messages[n].get("role") != "assistant":
                        continue
                    if listed != tools:
                        continue
                    if [_canonical(m) for m in turn.request_messages] == messages[:n]:
                        candidates.append((turn, answer))
            if not candidates:
                return None
            # calls that share their messages (n > 1 choices, a retry): take the one whose answer came back
            answered = [t for t, a in candidates if a is not None and a == _sent_back(messages, t)]
            unknown = [t for t, a in candidates if a is None]
            if not (answered or unknown):
                return None  # the answer sent back is none of theirs: the agent edited its history
            turn = (answered or unknown)[-1]
            return {
                "prefix_token_ids": [*turn.prompt_token_ids, *turn.completion_token_ids],
                "prefix_prompt_tokens": len(turn.prompt_token_ids),
            }
        except Exception as exc:  # capture must never raise into the agent
            self.fail(f"could not match the request to an earlier call: {type(exc).__name__}: {exc}")
            return None

    def _add(
        self,
        agent: str,
        request: dict[str, Any],
        ext: AgentJetExtension,
        model: str | None,
        started: float,
        answer: Answer | None = None,
    ) -> None:
        asked = request.get("model")
        turn = Turn(
            agent=agent,
            model=model,
            requested_model=asked[:256] if isinstance(asked, str) and asked != model else None,
            request_messages=list(request.get("messages") or []),
            started_at=started,
            latency_s=max(0.0, time.time() - started),
            **{name: getattr(ext, name) for name in SAMPLED},
        )
        with self._lock:
            self._turns.append(turn)
            self._answers.append(answer)
            self._tools.append(_tools_key(request))

    def record_response(
        self, agent: str, request: dict[str, Any], response: Any, started: float, api: str = "chat"
    ) -> None:
        """Record a whole answer (parsed JSON body) of ``api`` to ``request`` (in chat form, ``chat_form``)."""
        try:
            if not isinstance(response, dict):
                self.fail("the response is not a JSON object")
                return
            if api in ("responses", "messages"):
                ext = response.get("agentjet")
                if ext is None:
                    self.fail("response has no 'agentjet' extension; is the base URL an AgentJet server?")
                    return
                text, calls = (responses_answer if api == "responses" else messages_answer)(response)
                answer = answer_of(text, calls)
                self._add(agent, request, AgentJetExtension.model_validate(ext), response.get("model"), started, answer)
                return
            choices = response.get("choices")
            if not choices:
                self.fail("response has no choices")
                return
            for choice in choices:
                ext = choice.get("agentjet")
                if ext is None:
                    self.fail("response choice has no 'agentjet' extension; is the base URL an AgentJet server?")
                    continue
                said: Answer | None = None  # text completions continue by their tokens alone
                if api != "completions":
                    message = choice.get("message") or {}
                    said = answer_of(message.get("content"), message.get("tool_calls"))
                self._add(agent, request, AgentJetExtension.model_validate(ext), response.get("model"), started, said)
        except Exception as exc:  # capture must never raise into the agent
            self.fail(f"could not record response: {type(exc).__name__}: {exc}")

    def record_chunks(
        self, agent: str, request: dict[str, Any], chunks: list[dict[str, Any]], started: float, api: str = "chat"
    ) -> None:
        """Record a streamed answer of ``api`` from its parsed SSE events."""
        if api == "responses":
            final = [
                c.get("response") for c in chunks if c.get("type") in ("response.completed", "response.incomplete")
            ]
            if final and isinstance(final[-1], dict):
                self.record_response(agent, request, final[-1], started, api)
            else:
                self.fail("stream ended without response.completed (interrupted, or not an AgentJet server)")
            return
        if api == "messages":
            self._record_message_events(agent, request, chunks, started)
            return
        try:
            done: dict[int, tuple[AgentJetExtension, Any, Answer | None]] = {}
            texts: dict[int, str] = {}
            calls: dict[int, dict[int, dict[str, str]]] = {}  # choice -> tool call index -> name, arguments
            for chunk in chunks:
                for choice in chunk.get("choices") or []:
                    index = int(choice.get("index") or 0)
                    delta = choice.get("delta") or {}
                    piece = delta.get("content")
                    if isinstance(piece, str):
                        texts[index] = texts.get(index, "") + piece
                    for call in delta.get("tool_calls") or []:
                        got = calls.setdefault(index, {}).setdefault(int(call.get("index") or 0), {})
                        function = call.get("function") or {}
                        got["name"] = got.get("name", "") + (function.get("name") or "")
                        got["arguments"] = got.get("arguments", "") + (function.get("arguments") or "")
                    ext = choice.get("agentjet")
                    if ext is not None:
                        made = [{"function": c} for _, c in sorted(calls.get(index, {}).items())]
                        answer = answer_of(texts.get(index), made) if api == "chat" else None
                        done[index] = (AgentJetExtension.model_validate(ext), chunk.get("model"), answer)
            for _, (ext_model, model, answer) in sorted(done.items()):  # choice order, as a whole answer has it
                self._add(agent, request, ext_model, model, started, answer)
            if not done:
                self.fail("stream ended without an 'agentjet' extension (interrupted, or not an AgentJet server)")
        except Exception as exc:  # capture must never raise into the agent
            self.fail(f"could not record stream: {type(exc).__name__}: {exc}")

    def _record_message_events(
        self, agent: str, request: dict[str, Any], events: list[dict[str, Any]], started: float
    ) -> None:
        """An Anthropic message stream, put back together as the whole message it streamed."""
        try:
            message: dict[str, Any] = {"content": []}
            blocks: dict[int, dict[str, Any]] = {}
            partial: dict[int, str] = {}
            for event in events:
                kind = event.get("type")
                if kind == "message_start":
                    message["model"] = (event.get("message") or {}).get("model")
                elif kind == "content_block_start":
                    blocks[int(event.get("index") or 0)] = dict(event.get("content_block") or {})
                elif kind == "content_block_delta":
                    index, delta = int(event.get("index") or 0), event.get("delta") or {}
                    block = blocks.setdefault(index, {"type": "text", "text": ""})
                    if delta.get("type") == "text_delta":
                        block["text"] = block.get("text", "") + str(delta.get("text") or "")
                    elif delta.get("type") == "input_json_delta":
                        partial[index] = partial.get(index, "") + str(delta.get("partial_json") or "")
                elif kind == "message_delta" and event.get("agentjet") is not None:
                    message["agentjet"] = event["agentjet"]
            for index, arguments in partial.items():
                blocks[index]["input"] = json.loads(arguments or "{}")
            message["content"] = [block for _, block in sorted(blocks.items())]
            if "agentjet" not in message:
                self.fail("stream ended without an 'agentjet' extension (interrupted, or not an AgentJet server)")
                return
            self.record_response(agent, request, message, started, "messages")
        except Exception as exc:  # capture must never raise into the agent
            self.fail(f"could not record stream: {type(exc).__name__}: {exc}")


class SSECollector:
    """Incrementally parses an SSE byte stream as the spec reads one (lines end in CRLF, LF or CR; an event's
    ``data:`` lines are joined by newlines and dispatched at a blank line), keeping each event's data that is
    a JSON object. An event the stream ends without a blank line after is kept too (``chunks``)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []  # the data lines of the event being read
        self._chunks: list[dict[str, Any]] = []
        self.broken = False

    @property
    def chunks(self) -> list[dict[str, Any]]:
        """The JSON objects of the events read so far (and of one the stream ended in)."""
        if self._buffer:  # a last line without its line end
            line, self._buffer = self._buffer.rstrip(b"\r"), b""
            self._line(line)
        if self._data:
            self._dispatch()
        return self._chunks

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while True:
            cut = min((i for i in (self._buffer.find(b"\r"), self._buffer.find(b"\n")) if i >= 0), default=-1)
            if cut < 0 or (self._buffer[cut : cut + 1] == b"\r" and cut == len(self._buffer) - 1):
                return  # no whole line yet (a CR at the end may be half of a CRLF)
            line = self._buffer[:cut]
            step = 2 if self._buffer[cut : cut + 2] == b"\r\n" else 1
            self._buffer = self._buffer[cut + step :]
            self._line(line)

    def _line(self, line: bytes) -> None:
        if not line:
            self._dispatch()
            return
        field, _, value = line.partition(b":")
        if field == b"data":
            self._data.append(value[1:] if value.startswith(b" ") else value)

    def _dispatch(self) -> None:
        payload, self._data = b"\n".join(self._data).strip(), []
        if payload == b"[DONE]" or not payload:
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.broken = True
            return
        if isinstance(obj, dict):
            self._chunks.append(obj)


Answer = tuple[str, tuple[tuple[str, str], ...]]


def answer_from(data: Any) -> Answer | None:
    """An ``Answer`` read back from JSON (``EpisodeRecorder.entries``)."""
    if data is None:
        return None
    return str(data[0]), tuple((str(name), str(arguments)) for name, arguments in data[1])


def answer_of(content: Any, tool_calls: Any) -> Answer:
    """An assistant answer as compared between what the server sent and what an agent sends back:
    its text (content blocks joined, whitespace-stripped) and its tool calls (name, arguments with
    the JSON normalised), so the forms frameworks re-serialise it in compare equal."""
    if isinstance(content, list):
        content = "".join(b.get("text") or "" for b in content if isinstance(b, dict) and b.get("type") == "text")
    text = content.strip() if isinstance(content, str) else ""
    calls = []
    for call in tool_calls or []:
        function = (call.get("function") if isinstance(call, dict) else None) or {}
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            arguments = json.dumps(parsed, sort_keys=True)
        except (TypeError, ValueError):
            arguments = str(arguments)
        calls.append((str(function.get("name")), arguments))
    return text, tuple(calls)


def _sent_back(messages: list[dict[str, Any]], turn: Turn) -> Answer:
    """The assistant message that follows ``turn``'s messages in ``messages``, as an ``Answer``."""
    message = messages[len(turn.request_messages)]
    return answer_of(message.get("content"), message.get("tool_calls"))


def _tools_key(request: dict[str, Any]) -> str:
    """The tools a request shows the model, as compared between calls: none for ``tool_choice``
    "none" (the server renders the prompt without them then), none and an empty list alike."""
    tools = [] if request.get("tool_choice") == "none" else request.get("tools") or []
    return json.dumps(tools, sort_keys=True, default=str)


def _canonical(message: Any) -> dict[str, Any]:
    """A message as compared between calls: keys with null values dropped."""
    if not isinstance(message, dict):
        return {"value": message}
    return {k: v for k, v in message.items() if v is not None}


def with_claim(body: bytes, claim: dict[str, Any] | None) -> bytes:
    """The request body with the ``agentjet`` extension added (unchanged without a claim)."""
    if claim is None:
        return body
    data = parse_request_body(body)
    if not data or "agentjet" in data:
        return body
    return json.dumps({**data, "agentjet": claim}).encode()


def is_chat_request(method: str, path: str) -> bool:
    return api_of(method, path) == "chat"


def api_of(method: str, path: str) -> str | None:
    """Which sampling API a request calls (``chat``, ``responses``, ``messages``, ``completions``), or None."""
    if method.upper() != "POST":
        return None
    path = path.rstrip("/")
    return next((api for suffix, api in API_PATHS if path.endswith(suffix)), None)


def chat_form(api: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat request a request of ``api`` means (what its turn records and is matched by); None
    when it cannot be read as one (the server refuses it too: nothing to record)."""
    try:
        if api == "responses":
            return responses_to_chat(body)
        if api == "messages":
            return messages_to_chat(body)
    except DialectError:
        return None
    if api == "completions":
        return {"model": body.get("model"), "messages": []}  # continued by tokens, not messages
    return body


def parse_request_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
