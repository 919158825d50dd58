"""The server's exceptions, rooted in one class.

AgentJetServerError
├── ConfigError              bad settings (CLI / create_app), raised before serving starts
│   └── ModelLoadError       the model directory can't be loaded
├── StateError               the state dir (trajectory log, checkpoints) can't be used as asked;
│                            answered 503 (nothing acknowledged, retry later)
├── EngineError              inference failed (answered as 500 "engine_error")
└── RequestError             the caller's fault; answered as 4xx in OpenAI's error shape
    ├── InvalidRequestError      400
    ├── AuthenticationError      401
    ├── PermissionDeniedError    403
    ├── NotFoundError            404
    ├── RequestTimeoutError      408
    ├── PayloadTooLargeError     413
    └── RateLimitError           429 (with a Retry-After hint)
"""

from __future__ import annotations


class AgentJetServerError(Exception):
    """Base of everything the server raises on purpose."""


class ConfigError(AgentJetServerError):
    """A setting is wrong; the message says which and how to fix it."""


class ModelLoadError(ConfigError):
    """The model or tokenizer could not be loaded."""


class StateError(AgentJetServerError):
    """The state directory holds something the server can't use as asked (or can't write)."""


class EngineError(AgentJetServerError):
    """Inference failed."""

    status_code = 500
    error_type = "engine_error"


class RequestError(AgentJetServerError):
    """A request the server will not serve, answered with ``status_code``."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(RequestError):
    status_code = 400


class AuthenticationError(RequestError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(RequestError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(RequestError):
    status_code = 404
    error_type = "not_found_error"


class ConflictError(RequestError):
    """The request is fine, and this server is not the one for it (say, a push to a --serve-only server)."""

    status_code = 409
    error_type = "conflict_error"


class RequestTimeoutError(RequestError):
    status_code = 408


class PayloadTooLargeError(RequestError):
    status_code = 413


class RateLimitError(RequestError):
    """The server can't take more now; ``retry_after`` seconds is when trying again makes sense."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after = retry_after
