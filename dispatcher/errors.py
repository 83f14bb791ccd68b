"""The edge's error tree. Each error carries the HTTP status and OpenAI error fields it maps to;
:func:`openai_error_body` is the one place they become a response body.

::

    DispatcherError
    ├── BadRequest            400 invalid_request_error
    ├── PayloadTooLarge       413 invalid_request_error
    ├── Unauthorized          401 authentication_error
    ├── ModelNotFound         404 invalid_request_error / model_not_found
    ├── UpstreamRejected      4xx the upstream's own status: the client's mistake, not retried
    ├── ShuttingDown          503 the edge is draining: nothing new is admitted
    └── RunError              a dispatched run could not produce an answer
        ├── StaleGeneration   503 the node reconnected between selection and send
        ├── NodeUnavailable   502 the node connection broke before the run request went out
        └── RunFailedError    502 the node reported run.failed before anything was streamed

``admission.AdmissionError`` (unknown model 404, no capable candidate 400, queue full 429,
queue timeout 503) is the admission layer's own tree with the same ``status`` / ``code`` /
``retry_after`` fields, mapped by the same function.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson


class DispatcherError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str] = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.retry_after = retry_after
        if status is not None:
            self.status = status  # type: ignore[misc]


class BadRequest(DispatcherError):
    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class PayloadTooLarge(DispatcherError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class Unauthorized(DispatcherError):
    status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class NotFound(DispatcherError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class UpstreamRejected(DispatcherError):
    """The upstream refused the request as the client's mistake (a 4xx such as a bad
    parameter or a context-length overflow): relayed with the upstream's status and its own
    error code, never retried, never counted against the node."""

    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class ShuttingDown(DispatcherError):
    """The dispatcher is draining or shut down: it admits nothing new (503, retry)."""

    status = 503
    default_code = "shutting_down"


class RunError(DispatcherError):
    status = 502
    error_type = "server_error"
    default_code = "upstream_error"
    retryable: bool = True


class StaleGeneration(RunError):
    status = 503
    default_code = "stale_generation"


class NodeUnavailable(RunError):
    default_code = "node_unavailable"


class RunFailedError(RunError):
    def __init__(self, message: str, *, code: str, retryable: bool) -> None:
        super().__init__(message, code=code)
        self.retryable = retryable


def openai_error_object(
    message: str, *, error_type: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_status_and_body(exc: BaseException) -> tuple[int, bytes, float | None]:
    """Status, OpenAI error body and Retry-After for any error that reaches the API."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 400 <= status <= 599:
        message = getattr(exc, "message", None) or str(exc)
        error_type = getattr(exc, "error_type", None) or (
            "invalid_request_error" if status < 500 else "server_error"
        )
        code = getattr(exc, "code", None)
        retry_after = getattr(exc, "retry_after", None)
        body = openai_error_object(
            message,
            error_type=error_type,
            code=code if isinstance(code, str) else None,
            param=getattr(exc, "param", None),
        )
        return status, orjson.dumps(body), retry_after
    body = openai_error_object(
        "internal error in the dispatcher", error_type="server_error", code="internal_error"
    )
    return 500, orjson.dumps(body), None
