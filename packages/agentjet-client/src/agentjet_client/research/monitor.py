"""Following a trial's server through its public API: ``/v1/status`` (policy version, episode
counts, learner errors), ``/metrics`` (the cumulative reward of accepted training episodes, read
as windows) and ``/v1/metrics/history`` (every learner step and evaluation episode, by sequence
number, so nothing between two polls is missed).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import httpx2

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text format: ``(name, labels) -> value`` for every sample line."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        out[(name, frozenset(_LABEL.findall(labels or "")))] = number
    return out


def reward_totals(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], purpose: str) -> tuple[float, int]:
    """Sum and count of the rewards of accepted ``purpose`` episodes, over every task tag."""
    total, count = 0.0, 0.0
    for (name, labels), value in samples.items():
        if dict(labels).get("purpose") != purpose:
            continue
        if name == "agentjet_episode_reward_sum":
            total += value
        elif name == "agentjet_episode_reward_count":
            count += value
    return total, int(count)


@dataclass
class Observation:
    """One poll of a trial's server."""

    status: dict[str, Any]
    train_sum: float
    train_count: int
    lines: list[dict[str, Any]] = field(default_factory=list)  # history lines after the cursor
    last_seq: int = 0

    @property
    def policy_version(self) -> int:
        return int(self.status.get("policy_version", 0))

    @property
    def train_episodes(self) -> int:
        """Training episodes accepted over the whole run (the server's counts survive --resume)."""
        return int(self.status.get("trajectories", {}).get("accepted", 0))  # evaluation episodes are counted apart

    @property
    def step(self) -> int:
        return int(self.status.get("learner", {}).get("step", 0))


class Probe:
    """Reads one trial's server."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url
        self._http = httpx2.Client(base_url=url, headers=headers, timeout=timeout)

    def healthy(self) -> bool:
        try:
            return self._http.get("/healthz", timeout=2.0).status_code == 200
        except httpx2.HTTPError:
            return False

    def observe(self, since: int) -> Observation:
        """Status, reward totals and the history after line ``since``; raises httpx2.HTTPError."""
        status = self._json("/v1/status")
        response = self._http.get("/metrics")
        response.raise_for_status()
        total, count = reward_totals(parse_metrics(response.text), "train")
        history = self._json(f"/v1/metrics/history?since={since}&kind=step,eval&limit=20000")
        lines = history.get("lines", [])
        return Observation(status, total, count, lines, int(history.get("last_seq", since)))

    def history(self, since: int, kind: str) -> tuple[list[dict[str, Any]], int]:
        body = self._json(f"/v1/metrics/history?since={since}&kind={kind}&limit=20000")
        return body.get("lines", []), int(body.get("last_seq", since))

    def stop(self) -> str:
        """The admin API's stop: the server writes a checkpoint and exits."""
        response = self._http.post("/v1/admin/stop", timeout=300.0)
        response.raise_for_status()
        return str(response.json().get("message", ""))

    def checkpoint(self) -> str:
        """The admin API's checkpoint (after the step in progress): its directory."""
        return str(self._admin("POST", "/v1/admin/checkpoint")["path"])

    def adopt(self, checkpoint: str) -> dict[str, Any]:
        """The admin API's adopt: the server takes that checkpoint's weights and optimizer state."""
        return self._admin("POST", "/v1/admin/adopt", {"checkpoint": checkpoint})  # type: ignore[no-any-return]

    def config(self) -> dict[str, Any]:
        """The server's effective settings (the admin API's config)."""
        return self._admin("GET", "/v1/admin/config")["config"]  # type: ignore[no-any-return]

    def change(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Live settings changed through the admin API (from the next learner step)."""
        return self._admin("PATCH", "/v1/admin/config", settings)  # type: ignore[no-any-return]

    def _admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """An admin call; a refusal raises ValueError with the server's message."""
        response = self._http.request(method, path, json=body, timeout=300.0)
        if 400 <= response.status_code < 500:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            raise ValueError(f"{method} {path}: {response.status_code} {message}")
        response.raise_for_status()
        return response.json()

    def _json(self, path: str) -> Any:
        response = self._http.get(path)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._http.close()


@dataclass(frozen=True)
class EvalEpisode:
    """An evaluation episode from the history: its round, the policy version it started at, its reward."""

    round: str
    version: int
    reward: float


def eval_episodes(lines: list[dict[str, Any]]) -> list[EvalEpisode]:
    """The history's evaluation episodes, each with its round: the runner names an evaluation
    group ``eval:<task>@<client id>:<round>``, so the episodes of one round stay together even
    when the policy changed during it."""
    out = []
    for line in lines:
        reward = line.get("reward")
        if line.get("kind") != "eval" or not isinstance(reward, int | float) or not math.isfinite(reward):
            continue
        task, version = str(line.get("task_id", "")), int(line.get("policy_version", 0))
        key = task.rsplit("@", 1)[1] if task.startswith("eval:") and "@" in task else f"v{version}"
        out.append(EvalEpisode(key, version, float(reward)))
    return out
