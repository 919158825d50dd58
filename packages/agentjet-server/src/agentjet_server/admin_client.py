"""A small HTTP client for a running server's status and admin API: what ``agentjet-server status``
and ``agentjet-server admin ...`` use (no torch, no engine: they only talk to a server).
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx2

from agentjet_client.protocol import ErrorResponse
from agentjet_server.errors import AgentJetServerError

# the key a caller sends: its role's variable first; a server takes an admin key wherever a client key
# does, and a client key sent to an admin route gets a 403 that says so
ADMIN_KEY_ENV = "AGENTJET_ADMIN_KEY"
API_KEY_ENV = "AGENTJET_API_KEY"
CALLER_KEY_ENVS = [ADMIN_KEY_ENV, API_KEY_ENV]


class AdminRequestError(AgentJetServerError):
    """The server could not be reached, or answered with an error (the message is its own)."""


class AdminClient:
    def __init__(self, server: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.server = server.rstrip("/").removesuffix("/v1")
        key = api_key or next(filter(None, map(os.environ.get, CALLER_KEY_ENVS)), None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx2.Client(base_url=self.server, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        try:
            response = self._http.request(method, path, json=body, timeout=timeout or self._http.timeout)
        except httpx2.HTTPError as exc:
            raise AdminRequestError(
                f"cannot reach the server at {self.server} ({type(exc).__name__}: {exc}); is it running? Check --server"
            ) from exc
        if response.status_code >= 400:
            message = ErrorResponse.message_of(response.text)
            hint = ""
            if response.status_code == 401:
                hint = f" (pass --api-key, or set {ADMIN_KEY_ENV} or {API_KEY_ENV})"
            raise AdminRequestError(f"{method} {path}: {response.status_code}: {message}{hint}")
        return response.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def as_toml(config: dict[str, Any]) -> str:
    """Settings as ``key = value`` lines (TOML: usable as a job file for ``up --config``)."""
    return "\n".join(f"{key} = {_toml(value)}" for key, value in config.items() if value is not None)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)
