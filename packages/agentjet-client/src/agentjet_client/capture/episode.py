"""An episode: one run of an agent on one task, and everything its LLM calls sampled.

Give the agent a captured model handle and it trains unchanged:

* ``episode.openai(agent=...)`` / ``episode.async_openai(agent=...)`` — OpenAI SDK clients (chat
  completions, the Responses API, text completions);
* ``episode.anthropic(agent=...)`` / ``episode.async_anthropic(agent=...)`` — Anthropic SDK clients
  (the Messages API);
* ``episode.base_url`` / ``episode.url_for(agent)`` — the loopback capture proxy, for any
  program in any language that speaks the OpenAI API over HTTP;
* ``episode.api_key`` — a key to send with those requests.

``episode.to_trajectory(reward)`` turns the captured turns into what the server trains on.

``EpisodeHandle`` is the contract of the agent's ``episode`` argument: ``Episode`` (in the runner's
process) and ``isolation.ProxyEpisode`` (in a worker process) both fulfil it. An ``Episode`` gets
what it needs from its client as one ``EpisodeContext``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

import httpx2

from agentjet_client import tracing
from agentjet_client.capture.recorder import EpisodeRecorder
from agentjet_client.capture.transport import AsyncCaptureTransport, CaptureTransport
from agentjet_client.protocol import Trajectory, TrajectoryStatus, check_agent_name

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI


# the OpenAI SDK's retries back off 0.5, 1, 2, 4, 8, 8 s: six ride out a server restart (--resume
# takes a few seconds) instead of failing every episode that was waiting on the model
LLM_RETRIES = 6

_SDKClient = TypeVar("_SDKClient")  # openai.OpenAI or openai.AsyncOpenAI


@runtime_checkable
class EpisodeHandle(Protocol):
    """What an agent can do with its ``episode``: model handles whose calls are captured as
    ``agent``'s turns (and go to that agent's server), the capture proxy's base URLs for any other
    program, and a reward for the newest turn."""

    id: str
    task_id: str

    @property
    def api_key(self) -> str: ...

    @property
    def base_url(self) -> str: ...

    def url_for(self, agent: str) -> str: ...

    def openai(self, agent: str = "default", *, train: bool = True, **kwargs: Any) -> Any: ...

    def async_openai(self, agent: str = "default", *, train: bool = True, **kwargs: Any) -> Any: ...

    def langchain(self, agent: str = "default", **kwargs: Any) -> Any: ...

    def agentscope(self, agent: str = "default", **kwargs: Any) -> Any: ...

    def anthropic(self, agent: str = "default", **kwargs: Any) -> Any: ...

    def async_anthropic(self, agent: str = "default", **kwargs: Any) -> Any: ...

    def reward_turn(self, reward: float, agent: str | None = None) -> None: ...


@dataclass(frozen=True)
class EpisodeContext:
    """What an episode needs from the client it belongs to (``SwarmClient.context``)."""

    client_id: str
    api_key: str | None
    api_base_for: Callable[[str], str]  # agent -> the ``/v1`` base URL of its server
    proxy_url: Callable[[str, str], str]  # (episode id, agent) -> the capture proxy's base URL
    sync_transport: Callable[[], httpx2.BaseTransport]  # the shared connection pool
    async_transport: Callable[[], httpx2.AsyncBaseTransport]  # the running event loop's pool
    forget: Callable[[str], None]  # the episode closed: the proxy no longer records into it


class Episode:
    """One episode as the agent sees it: its task id, the models it may call (``openai()``,
    ``langchain()``, ``agentscope()``, or ``base_url`` and ``api_key`` for any HTTP client), each call
    captured into the episode's timeline; ``to_trajectory`` turns it into what is pushed."""

    def __init__(
        self,
        context: EpisodeContext,
        task_id: str,
        *,
        task_tag: str | None = None,
        episode_id: str | None = None,
        purpose: Literal["train", "eval"] = "train",
    ) -> None:
        self.context = context
        self.purpose: Literal["train", "eval"] = purpose
        self.id = episode_id or uuid.uuid4().hex
        self.task_id = task_id
        self.task_tag = task_tag
        self.recorder = EpisodeRecorder()
        attributes = {"agentjet.episode_id": self.id, "agentjet.task_id": task_id, "agentjet.purpose": purpose}
        self._span, self.recorder.trace = tracing.start_episode(self.id, attributes)  # a trace per episode
        self._closers: list[Any] = []
        self._async_clients: list[Any] = []

    @property
    def api_key(self) -> str:
        return self.context.api_key or "agentjet-no-key"

    @property
    def base_url(self) -> str:
        """The capture proxy's base URL for the default agent."""
        return self.url_for("default")

    def url_for(self, agent: str) -> str:
        """The capture proxy's base URL for ``agent``: its calls go to the agent's server."""
        return self.context.proxy_url(self.id, check_agent_name(agent))

    def _sync_http(self, agent: str, record: bool = True) -> httpx2.Client:
        """An HTTP client that records sampling calls as ``agent`` (or, without ``record``, nothing); closed
        with the episode."""
        transport = CaptureTransport(self.recorder, agent, self.context.sync_transport())
        transport.record = record
        http = httpx2.Client(transport=transport, timeout=httpx2.Timeout(600.0, connect=10.0))
        self._closers.append(http)
        return http

    def _async_http(self, agent: str, record: bool = True) -> httpx2.AsyncClient:
        transport = AsyncCaptureTransport(self.recorder, agent, self.context.async_transport)
        transport.record = record
        http = httpx2.AsyncClient(transport=transport, timeout=httpx2.Timeout(600.0, connect=10.0))
        self._async_clients.append(http)
        return http

    def _openai_sdk(
        self, sdk_client: Callable[..., _SDKClient], agent: str, http: Any, kwargs: dict[str, Any]
    ) -> _SDKClient:
        """An OpenAI SDK client (sync or async) for ``agent``'s API base with the episode's key, its
        calls going through ``http`` (which records them); ``kwargs`` go to the SDK."""
        kwargs.setdefault("max_retries", LLM_RETRIES)
        return sdk_client(base_url=self.context.api_base_for(agent), api_key=self.api_key, http_client=http, **kwargs)

    def openai(self, agent: str = "default", *, train: bool = True, **kwargs: Any) -> OpenAI:
        """An ``openai.OpenAI`` client whose chat completions are recorded as ``agent``; with
        ``train=False`` nothing is recorded (a call to a helper model, say a critic, that is no part of what
        the episode trains)."""
        import openai

        return self._openai_sdk(openai.OpenAI, agent, self._sync_http(agent, train), kwargs)

    def langchain(self, agent: str = "default", **kwargs: Any) -> Any:
        """A LangChain chat model (``ChatOpenAI``) recorded as ``agent``; ``kwargs`` go to ``ChatOpenAI``.
        Needs ``pip install 'agentjet-client[langchain]'``."""
        from agentjet_client.capture.adapters.langchain import chat_model

        # our own HTTP clients, closed with the episode (LangChain's defaults are cached per base URL
        # and never closed: one leaked connection pool per episode)
        kwargs.setdefault("http_client", self._sync_http(agent))
        kwargs.setdefault("http_async_client", self._async_http(agent))
        return chat_model(self.context.api_base_for(agent), self.api_key, LLM_RETRIES, **kwargs)

    def agentscope(self, agent: str = "default", **kwargs: Any) -> Any:
        """An AgentScope 2.x ``OpenAIChatModel`` recorded as ``agent`` (``max_tokens``, ``temperature``,
        ``top_p`` become its parameters; other ``kwargs`` go to the model). Needs
        ``pip install 'agentjet-client[agentscope]'``."""
        from agentjet_client.capture.adapters.agentscope import chat_model

        client_kwargs = {"http_client": self._async_http(agent), **kwargs.pop("client_kwargs", {})}
        return chat_model(
            self.context.api_base_for(agent), self.api_key, LLM_RETRIES, client_kwargs=client_kwargs, **kwargs
        )

    def async_openai(self, agent: str = "default", *, train: bool = True, **kwargs: Any) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client whose chat completions are recorded as ``agent`` (with
        ``train=False``: not recorded)."""
        import openai

        return self._openai_sdk(openai.AsyncOpenAI, agent, self._async_http(agent, train), kwargs)

    def anthropic(self, agent: str = "default", **kwargs: Any) -> Any:
        """An ``anthropic.Anthropic`` client whose messages are recorded as ``agent``. Needs
        ``pip install 'agentjet-client[anthropic]'``."""
        from agentjet_client.capture.adapters.anthropic import client

        kwargs.setdefault("http_client", self._sync_http(agent))
        return client(self.context.api_base_for(agent), self.api_key, LLM_RETRIES, asynchronous=False, **kwargs)

    def async_anthropic(self, agent: str = "default", **kwargs: Any) -> Any:
        """An ``anthropic.AsyncAnthropic`` client whose messages are recorded as ``agent``."""
        from agentjet_client.capture.adapters.anthropic import client

        kwargs.setdefault("http_client", self._async_http(agent))
        return client(self.context.api_base_for(agent), self.api_key, LLM_RETRIES, asynchronous=True, **kwargs)

    def reward_turn(self, reward: float, agent: str | None = None) -> None:
        """Give the newest finished LLM call (of ``agent``, if given) its own reward, e.g. for a tool
        call that worked. The episode's reward (what the agent returns) still counts; with
        ``--algorithm ppo`` each turn's reward arrives at its last sampled token (GRPO ignores them)."""
        self.recorder.reward_turn(reward, agent)

    def to_trajectory(
        self,
        reward: float,
        *,
        status: TrajectoryStatus = "complete",
        error: str | None = None,
        code_version: str | None = None,
        agent_rewards: dict[str, float] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Trajectory:
        turns = self.recorder.turns
        if status == "complete" and not turns:
            status, error = "failed", error or "the episode made no captured LLM call"
        meta = dict(metadata or {})
        if self.recorder.failures:
            meta["capture_failures"] = self.recorder.failures
        return Trajectory(
            id=self.id,
            task_id=self.task_id,
            task_tag=self.task_tag,
            client_id=self.context.client_id,
            code_version=code_version,
            status=status,
            turns=turns,
            reward=reward,
            agent_rewards=agent_rewards,
            error=error[:4000] if error else None,
            metadata=meta,
            purpose=self.purpose,
            traceparent=tracing.traceparent(self.recorder.trace),
        )

    @property
    def trace_ids(self) -> tuple[str | None, str | None]:
        """``(trace_id, span_id)`` of the episode's span, in hex (Nones when not traced)."""
        return tracing.ids(self.recorder.trace)

    def _end_span(self) -> None:
        if self._span is not None:
            self._span.end()
            self._span = None

    def close(self) -> None:
        self.context.forget(self.id)
        for http in self._closers:
            http.close()
        self._closers.clear()
        self._end_span()

    async def aclose(self) -> None:
        for http in self._async_clients:
            await http.aclose()
        self._async_clients.clear()
        self.close()

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Episode:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
