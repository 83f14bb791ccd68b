"""The edge's error tree: one root, each class carrying the HTTP status and OpenAI error fields
it maps to; :func:`error_status_and_body` is the one place they become a response body (by
``isinstance``, nothing duck-typed). Front ends render the same tree in their own shape.

::

    DispatcherError                    .status .error_type .code .param .retry_after
    ├── BadRequest            400 invalid_request_error
    ├── PayloadTooLarge       413 invalid_request_error
    ├── Unauthorized          401 authentication_error
    ├── NotFound              404 invalid_request_error
    ├── UpstreamRejected      4xx the upstream's own status: the client's mistake, not retried
    ├── ShuttingDown          503 the edge is draining: nothing new is admitted
    ├── AdmissionError        the request got no slot (dispatcher.admission)
    │   ├── UnknownModel          404 model_not_found
    │   ├── NoCapableCandidate    400 no_capable_candidate (.reasons, .only_excluded)
    │   ├── QueueFull             429 queue_full (.retry_after)
    │   └── QueueTimeout          503 queue_timeout (.retry_after)
    └── RunError              a dispatched attempt could not produce an answer (502)
        ├── StaleGeneration   503 the node reconnected between selection and send
        ├── NodeUnavailable   502 the node connection broke before the request went out
        ├── TunnelFailed      502 a tunnel ended with an error (.retryable)
        └── AllAttemptsFailed 502 every attempt failed before anything was streamed

``AdmissionError`` and its subclasses live in ``dispatcher.admission`` (beside the core that
decides them); the rest here.
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


class UpstreamRejected(DispatcherError):
    """The upstream refused the request as the client's mistake (a 4xx such as a bad
    parameter or a context-length overflow): relayed with the upstream's status and its own
    error code, never retried, never counted against the node."""

    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


DRAIN_RETRY_AFTER = 1.0
"""``Retry-After`` (seconds) of the 503 a draining edge answers: soon, and elsewhere."""


class ShuttingDown(DispatcherError):
    """The dispatcher is draining or shut down: it admits nothing new (503, retry after
    :data:`DRAIN_RETRY_AFTER` unless the raise site says otherwise)."""

    status = 503
    default_code = "shutting_down"

    def __init__(
        self, message: str, *, code: str | None = None, retry_after: float = DRAIN_RETRY_AFTER
    ) -> None:
        super().__init__(message, code=code, retry_after=retry_after)


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


class TunnelFailed(RunError):
    """The tunnel ended with an error: the node's (unreachable provider, broken body, ...) or
    a synthesized one (the node was lost). ``retryable`` says whether another candidate may
    succeed."""

    default_code = "tunnel_failed"

    def __init__(self, message: str, *, code: str = "tunnel_failed", retryable: bool) -> None:
        super().__init__(message, code=code)
        self.retryable = retryable


class AllAttemptsFailed(RunError):
    """Every attempt failed before anything was streamed (502, with the last cause)."""


def openai_error_object(
    message: str, *, error_type: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_status_and_body(exc: BaseException) -> tuple[int, bytes, float | None]:
    """Status, OpenAI error body and Retry-After for any error that reaches the API."""
    if isinstance(exc, DispatcherError) and 400 <= exc.status <= 599:
        error_type = exc.error_type
        if exc.status < 500 and error_type == "server_error":
            error_type = "invalid_request_error"  # a status given at the raise site
        body = openai_error_object(
            exc.message,
            error_type=error_type,
            code=exc.code,
            param=exc.param,
        )
        return exc.status, orjson.dumps(body), exc.retry_after
    body = openai_error_object(
        "internal error in the dispatcher", error_type="server_error", code="internal_error"
    )
    return 500, orjson.dumps(body), None
