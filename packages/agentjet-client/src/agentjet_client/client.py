"""``SwarmClient``: the client's connections to the AgentJet servers its agents' models live on.

    client = SwarmClient("http://127.0.0.1:8000")
    with client.episode(task_id="t1") as episode:
        llm = episode.openai()
        ...                                   # the agent's own code
        result = client.submit([episode.to_trajectory(reward=1.0)])

Every agent's calls go to the server given first, except the agents named in ``agents``:

    client = SwarmClient("http://127.0.0.1:8001", agents={"executor": "http://127.0.0.1:8002"})

``episode.openai(agent="executor")`` (and the other model handles, and the capture proxy's
``/episodes/<id>/executor/v1``) then sample from the second server, whatever model name the
agent's code asks for. ``split`` cuts a finished episode into one trajectory per server, with only
the turns that server's model sampled; ``submit`` pushes each part to its own server.

Its own HTTP calls (submit, status) go through ``transport`` (an httpx2 transport; tests hand
in an in-process one) and are retried with exponential backoff and jitter on connection
errors, 5xx and 429. A 4xx is the request's fault and is raised at once.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import httpx2
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from agentjet_client.capture.episode import Episode, EpisodeContext
from agentjet_client.capture.proxy import CaptureProxy
from agentjet_client.errors import RejectedRequest, ServerBusy, ServerError, ServerStarting, ServerUnreachable
from agentjet_client.protocol import (
    STARTING,
    ClientReport,
    ErrorResponse,
    ServerStatus,
    Trajectory,
    TrajectoryBatch,
    TrajectoryBatchResult,
    check_agent_name,
)

MAX_SUBMIT_BATCH = 256


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, ServerUnreachable):
        return True
    return isinstance(exc, ServerError) and not isinstance(exc, RejectedRequest)


def _seconds(header: str | None) -> float | None:
    """A ``Retry-After`` header's seconds (None when absent or given as a date)."""
    try:
        return max(0.0, float(header)) if header else None
    except ValueError:
        return None


def normalise_server_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"server URL '{url}' must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
    return url[:-3] if url.endswith("/v1") else url


_OUTCOME_ORDER = {"accepted": 0, "duplicate": 1, "rejected": 2}


class SwarmClient:
    """A connection to one or more swarm servers: which server each agent's calls go to, their status,
    new episodes (``episode``) and trajectory pushes, through one capture proxy on loopback."""

    def __init__(
        self,
        server_url: str,
        api_key: str | None = None,
        *,
        agents: Mapping[str, str] | None = None,
        client_id: str | None = None,
        transport: httpx2.BaseTransport | None = None,
        async_transport_factory: Callable[[], httpx2.AsyncBaseTransport] | None = None,
        timeout: float = 30.0,
        attempts: int = 6,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.server_url = normalise_server_url(server_url)
        # agent name -> the server its model lives on (agents not named here use ``server_url``)
        self.agent_servers = {check_agent_name(name): normalise_server_url(url) for name, url in (agents or {}).items()}
        self.api_key = api_key
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:8]}"
        self._transport = transport
        self._async_transport_factory = async_transport_factory
        self._http = httpx2.Client(transport=transport, timeout=timeout)
        self._attempts = attempts
        self._sleep = sleep
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._proxy: CaptureProxy | None = None
        self._shared_sync: httpx2.BaseTransport | None = None
        self._shared_async: dict[int, httpx2.AsyncBaseTransport] = {}

    @property
    def api_base(self) -> str:
        return f"{self.server_url}/v1"

    @property
    def servers(self) -> list[str]:
        """Every server this client's agents use, the default first."""
        return list(dict.fromkeys([self.server_url, *self.agent_servers.values()]))

    def server_for(self, agent: str) -> str:
        return self.agent_servers.get(agent, self.server_url)

    def api_base_for(self, agent: str) -> str:
        return f"{self.server_for(agent)}/v1"

    def split(self, trajectory: Trajectory) -> dict[str, Trajectory]:
        """One trajectory per server: the turns its own model sampled, the episode's reward and the
        per-agent rewards. A server none of whose agents made a call in the episode still gets its
        part, marked failed (nothing to train there): its GRPO group then completes with the
        episode's siblings instead of waiting for the group timeout."""
        if len(self.servers) == 1:
            return {self.server_url: trajectory}
        parts = {}
        for server in self.servers:
            turns = [t for t in trajectory.turns if self.server_for(t.agent) == server]
            update: dict[str, Any] = {"turns": turns}
            if not turns and trajectory.status == "complete":
                update.update(status="failed", error="the episode made no call to this server's agents")
            parts[server] = trajectory.model_copy(update=update)
        return parts

    # ------------------------------------------------------------------ episodes and capture

    def episode(
        self,
        task_id: str,
        *,
        task_tag: str | None = None,
        episode_id: str | None = None,
        purpose: Literal["train", "eval"] = "train",
    ) -> Episode:
        """A new episode of task ``task_id`` (its GRPO group key); ``purpose="eval"`` makes it an
        evaluation episode, recorded by the server and never trained."""
        ep = Episode(self.context, task_id, task_tag=task_tag, episode_id=episode_id, purpose=purpose)
        with self._lock:
            self._episodes[ep.id] = ep
        return ep

    @property
    def context(self) -> EpisodeContext:
        """What this client's episodes need from it."""
        return EpisodeContext(
            client_id=self.client_id,
            api_key=self.api_key,
            api_base_for=self.api_base_for,
            proxy_url=self.proxy_url,
            sync_transport=self.shared_sync_transport,
            async_transport=self.shared_async_transport,
            forget=self.forget_episode,
        )

    def forget_episode(self, episode_id: str) -> None:
        with self._lock:
            self._episodes.pop(episode_id, None)

    def _lookup(self, episode_id: str) -> Any:
        with self._lock:
            ep = self._episodes.get(episode_id)
        return ep.recorder if ep is not None else None

    def proxy_url(self, episode_id: str, agent: str) -> str:
        with self._lock:
            if self._proxy is None:
                transport = self._async_transport_factory() if self._async_transport_factory else None
                proxy = CaptureProxy(self.server_for, self._lookup, api_key=self.api_key, transport=transport)
                proxy.start()
                self._proxy = proxy
        return self._proxy.url_for(episode_id, agent)

    def shared_sync_transport(self) -> httpx2.BaseTransport:
        """One connection pool for every episode's sync SDK client."""
        with self._lock:
            if self._shared_sync is None:
                self._shared_sync = self._transport or httpx2.HTTPTransport(limits=httpx2.Limits(max_connections=256))
            return self._shared_sync

    def shared_async_transport(self) -> httpx2.AsyncBaseTransport:
        """One connection pool per event loop for every episode's async SDK client (aiohttp's, under httpx2:
        ``capture.aio``)."""
        import asyncio

        from agentjet_client.capture.aio import AiohttpTransport

        key = id(asyncio.get_running_loop())
        with self._lock:
            if key not in self._shared_async:
                self._shared_async[key] = (
                    self._async_transport_factory() if self._async_transport_factory else AiohttpTransport(256)
                )
            return self._shared_async[key]

    async def aclose_pool(self) -> None:
        """Close the running event loop's shared connection pool (call before the loop ends)."""
        import asyncio

        with self._lock:
            transport = self._shared_async.pop(id(asyncio.get_running_loop()), None)
        if transport is not None:
            await transport.aclose()

    # ------------------------------------------------------------------ server calls

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _request(
        self, method: str, path: str, json_body: Any = None, server: str | None = None, retry: bool = True
    ) -> Any:
        url = server or self.server_url

        def once() -> Any:
            try:
                response = self._http.request(method, f"{url}{path}", json=json_body, headers=self._headers())
            except httpx2.HTTPError as exc:
                raise ServerUnreachable(
                    f"cannot reach the AgentJet server at {url} ({type(exc).__name__}: {exc}); "
                    "is `agentjet-server up` running there?"
                ) from exc
            if response.status_code >= 400:
                message = ErrorResponse.message_of(response.text)
                if response.status_code == 429:
                    raise ServerBusy(429, message, _seconds(response.headers.get("retry-after")))
                cls = (
                    RejectedRequest
                    if 400 <= response.status_code < 500
                    else ServerStarting
                    if response.status_code == 503 and ErrorResponse.type_of(response.text) == STARTING
                    else ServerError
                )
                raise cls(response.status_code, message)
            return response.json()

        if not retry:
            return once()
        retrying = Retrying(
            stop=stop_after_attempt(self._attempts),
            wait=wait_random_exponential(multiplier=0.2, max=10.0),
            retry=retry_if_exception(_retryable),
            sleep=self._sleep,
            reraise=True,
        )
        return retrying(once)

    def submit(self, trajectories: Iterable[Trajectory], report: ClientReport | None = None) -> TrajectoryBatchResult:
        """Push trajectories (idempotent by id: a resend is answered ``duplicate``); ``report``
        tells the server about this client run (its dashboard and ``/v1/admin/clients``). With
        agents on several servers each trajectory is split (``split``) and each part pushed to its
        server; a trajectory's result is then the worst of its parts' (rejected, duplicate,
        accepted), and the policy version is the default server's."""
        items = list(trajectories)
        if not items:
            raise ValueError("submit() needs at least one trajectory")
        if len(self.servers) == 1:
            return self.submit_to(self.server_url, items, report)
        answers = {
            server: self.submit_to(server, [self.split(t)[server] for t in items], report) for server in self.servers
        }
        results = [
            max(parts, key=lambda r: _OUTCOME_ORDER.get(r.status, 3))
            for parts in zip(*(a.results for a in answers.values()), strict=True)
        ]
        return TrajectoryBatchResult(results=results, policy_version=answers[self.server_url].policy_version)

    def submit_to(
        self, server: str, trajectories: list[Trajectory], report: ClientReport | None = None, retry: bool = True
    ) -> TrajectoryBatchResult:
        """Push trajectories, as they are, to one of this client's servers (``retry=False``: one attempt,
        its error raised as it comes: a caller with a backoff of its own, such as a ``Sender``)."""
        if not trajectories:
            raise ValueError("submit() needs at least one trajectory")
        results = []
        version = 0
        for start in range(0, len(trajectories), MAX_SUBMIT_BATCH):
            batch = TrajectoryBatch(trajectories=trajectories[start : start + MAX_SUBMIT_BATCH], client=report)
            data = self._request("POST", "/v1/trajectories", batch.model_dump(mode="json"), server, retry)
            answer = TrajectoryBatchResult.model_validate(data)
            results.extend(answer.results)
            version = answer.policy_version
        return TrajectoryBatchResult(results=results, policy_version=version)

    def status(self, server: str | None = None, retry: bool = True) -> ServerStatus:
        """The status of the default server (or of ``server``, one of ``servers``); ``retry=False``: one
        call, its error raised as it comes."""
        return ServerStatus.model_validate(self._request("GET", "/v1/status", server=server, retry=retry))

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.stop()
            self._proxy = None
        if self._shared_sync is not None and self._shared_sync is not self._transport:
            self._shared_sync.close()
        self._shared_async.clear()  # their loops are gone; sockets close with them
        self._http.close()

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
