"""The edge's error tree: one root, each class carrying the HTTP status and OpenAI error fields
it maps to; :func:`error_status_and_body` is the one place they become a response body (by
``isinstance``, nothing duck-typed). Front ends render the same tree in their own shape.

::

    DispatcherError           .status .error_type .code .param .retry_after .retryable .headers
    ├── BadRequest            400 invalid_request_error
    ├── PayloadTooLarge       413 invalid_request_error
    ├── Unauthorized          401 authentication_error
    ├── Forbidden             403 permission_error (a tenant's key naming another's usage)
    ├── NotFound              404 invalid_request_error
    ├── NoConfigFile          409 no_config_file: a reload with no file to read
    ├── UpstreamRejected      4xx the upstream's own status: the client's mistake, not retried
    ├── ShuttingDown          503 the edge is draining: nothing new is admitted
    ├── StoreUnavailable      503 store_unavailable: a shared store (the usage ledger's
    │                             PostgreSQL) cannot be reached now (.retry_after)
    ├── LimitStoreUnavailable 503 limit_store_unavailable: the shared limit store (Redis) does
    │                             not answer and ``on_store_error = "refuse"``
    ├── RateLimited           429 requests rate_limit_exceeded: a tenant over its RPM or
    │   │                         concurrency (.headers: x-ratelimit-*)
    │   ├── TokenRateLimited  429 tokens rate_limit_exceeded: over its TPM
    │   └── QuotaExceeded     429 insufficient_quota: a tenant's budget is spent
    ├── TunnelUnavailable     501 a tunnel candidate and no tunnel transport installed
    ├── MethodNotAllowed      405 (dispatcher.api.app, with the Allow header)
    ├── AdmissionError        the request got no slot (dispatcher.admission)
    │   ├── UnknownModel          404 model_not_found
    │   ├── ModelUnavailable      503 model_unavailable (.retry_after): none serves it now,
    │   │                             one did within the linger, or the client's key names it
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

from typing import Any

import orjson


class DispatcherError(Exception):
    """The root. A subclass states what it maps to in its class line::

        class QueueFull(AdmissionError, status=429, error_type="invalid_request_error",
                        code="queue_full"): ...

    (each keyword optional: unnamed ones are inherited). A raise site may give its own
    ``code``, ``param``, ``retry_after`` and ``status``."""

    status: int = 500
    error_type: str = "server_error"
    default_code: str = "internal_error"
    retryable: bool = False
    r"""Whether another candidate may succeed where this failed (the :class:`RunError`\ s)."""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Response headers the error's answer carries (the rate limits' ``x-ratelimit-*``)."""

    def __init_subclass__(
        cls,
        *,
        status: int | None = None,
        error_type: str | None = None,
        code: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init_subclass__()
        if status is not None:
            cls.status = status
        if error_type is not None:
            cls.error_type = error_type
        if code is not None:
            cls.default_code = code
        if retryable is not None:
            cls.retryable = retryable

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
            self.status = status


_CLIENT = "invalid_request_error"


class BadRequest(DispatcherError, status=400, error_type=_CLIENT, code="invalid_request"):
    """The request is malformed or invalid (its JSON, a field, a header)."""


class PayloadTooLarge(DispatcherError, status=413, error_type=_CLIENT, code="payload_too_large"):
    """The request body is over the size limit."""


class Unauthorized(
    DispatcherError, status=401, error_type="authentication_error", code="invalid_api_key"
):
    """No API key, or a wrong one (the response says ``WWW-Authenticate: Bearer``)."""


class Forbidden(DispatcherError, status=403, error_type="permission_error", code="forbidden"):
    """The key is valid and may not do this."""


class NotFound(DispatcherError, status=404, error_type=_CLIENT, code="not_found"):
    """No such route or object."""


class NoConfigFile(DispatcherError, status=409, error_type=_CLIENT, code="no_config_file"):
    """``POST /admin/reload`` on an edge that was not started from a config file."""


class UpstreamRejected(DispatcherError, status=400, error_type=_CLIENT, code="invalid_request"):
    """The upstream refused the request as the client's mistake (a 4xx such as a bad
    parameter or a context-length overflow): relayed with the upstream's status and its own
    error code, never retried, never counted against the node."""


class TunnelUnavailable(DispatcherError, status=501, code="tunnel_unavailable"):
    """Admission chose a tunnel candidate and this edge has no tunnel transport installed."""


DRAIN_RETRY_AFTER = 1.0
"""``Retry-After`` (seconds) of the 503 a draining edge answers: soon, and elsewhere."""


class ShuttingDown(DispatcherError, status=503, code="shutting_down"):
    """The dispatcher is draining or shut down: it admits nothing new (503, retry after
    :data:`DRAIN_RETRY_AFTER` unless the raise site says otherwise)."""

    def __init__(
        self, message: str, *, code: str | None = None, retry_after: float = DRAIN_RETRY_AFTER
    ) -> None:
        super().__init__(message, code=code, retry_after=retry_after)


STORE_RETRY_AFTER = 5.0
"""Seconds a client is told to wait when a shared store cannot be reached."""


class StoreUnavailable(DispatcherError, status=503, code="store_unavailable"):
    """A shared store cannot be reached now (the usage ledger's PostgreSQL, for
    ``GET /v1/usage``): 503 with ``Retry-After``. What was recorded is kept (the ledger's
    outbox); only the read failed."""

    def __init__(self, message: str, *, retry_after: float = STORE_RETRY_AFTER) -> None:
        super().__init__(message, retry_after=retry_after)


LIMIT_STORE_RETRY_AFTER = 2.0
"""``Retry-After`` (seconds) of the 503 refusing a request the limit store cannot check: the
edge probes the store about twice a second and serves again once it answers."""


class LimitStoreUnavailable(DispatcherError, status=503, code="limit_store_unavailable"):
    """The shared limit store (``[store] redis_url``) does not answer, or not within
    ``timeout_s``, and ``on_store_error = "refuse"``: a request whose key has limits cannot be
    checked against them, so it is refused (503, retry after
    :data:`LIMIT_STORE_RETRY_AFTER`; ``dispatcher.store.limits_guard``). The message names the
    limit store, never its address."""

    def __init__(self, message: str, *, retry_after: float = LIMIT_STORE_RETRY_AFTER) -> None:
        super().__init__(message, retry_after=retry_after)


class RateLimited(DispatcherError, status=429, error_type="requests", code="rate_limit_exceeded"):
    """A tenant is over a rate limit (requests per minute, or requests in flight), checked
    once per client request before admission: 429 with ``Retry-After`` and OpenAI's
    ``x-ratelimit-*`` headers (``dispatcher.tenants``)."""

    def __init__(
        self, message: str, *, retry_after: float, headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.headers = headers


class TokenRateLimited(RateLimited, error_type="tokens"):
    """A tenant is over its tokens per minute."""


class QuotaExceeded(RateLimited, error_type="insufficient_quota", code="insufficient_quota"):
    """A tenant's budget (tokens or USD, per UTC day or month) is spent: 429
    ``insufficient_quota``, ``Retry-After`` the start of the next period."""


class RunError(DispatcherError, status=502, code="upstream_error", retryable=True):
    """A dispatched attempt could not produce an answer."""


class StaleGeneration(RunError, status=503, code="stale_generation"):
    """The node reconnected between selection and send."""


class NodeUnavailable(RunError, code="node_unavailable"):
    """The node's connection broke before the request went out."""


class TunnelFailed(RunError, code="tunnel_failed"):
    """The tunnel ended with an error: the node's (unreachable provider, broken body, ...) or
    a synthesized one (the node was lost). ``retryable`` says whether another candidate may
    succeed."""

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
