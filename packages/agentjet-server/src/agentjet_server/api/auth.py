"""Bearer keys: with keys set, every route but ``/healthz`` and the dashboard page needs one. Client keys
infer, push trajectories and read status and metrics; admin keys can also steer (``/v1/admin/...``).
Anthropic's SDK sends its key as ``x-api-key``, which is read too."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.requests import Request

from agentjet_server.api.context import api_of
from agentjet_server.errors import AuthenticationError, PermissionDeniedError


def _key_in(token: str, keys: Sequence[str]) -> bool:
    return any(hmac.compare_digest(token.encode(), k.encode()) for k in keys)


def authorize(request: Request, admin: bool = False) -> None:
    """Any key when keys are set; ``admin`` routes an admin key."""
    settings = api_of(request).settings
    if not settings.auth_enabled:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        scheme, token = "bearer", request.headers.get("x-api-key", "")
    if not token:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    token = token.strip()
    if _key_in(token, settings.admin_keys):
        return
    if not _key_in(token, settings.api_keys):
        raise AuthenticationError("the API key is not valid for this server", code="invalid_api_key")
    if admin and not settings.admin_keys:
        raise PermissionDeniedError(
            f"{request.url.path} needs an admin key, and this server has none (it was started with client keys "
            "only). Restart it with an admin key (AGENTJET_ADMIN_KEYS=... or --admin-key-file FILE, and --resume "
            "to continue the run) and send that key",
            code="no_admin_keys",
        )
    if admin:
        raise PermissionDeniedError(
            f"{request.url.path} needs an admin key; this is a client key (client keys can infer, push "
            "trajectories and read status and metrics). Use a key from AGENTJET_ADMIN_KEYS or --admin-key-file",
            code="admin_key_required",
        )
