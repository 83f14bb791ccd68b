"""The per-request record: one :class:`RequestRecord` per HTTP request, from the handler's
first line to its last, and what its end produces -- the access-log line, the request
metrics, the recent-failures ring.

Ownership is lexical: the HTTP handler (``api.app``) enters :meth:`Traffic.open`, and leaving
that block, however it is left, ends the record exactly once. While it is open the record is
in :attr:`Traffic.in_flight` (what ``GET /admin/status`` lists); the route and the gate fill
it in as they learn more:

* the handler: the route (the route table's path, so a bounded value), the key id, the HTTP
  status the answer started with, the error it answered;
* a model route (``api.common``): the gate request it built -- its model, stream flag, and the
  gate's :class:`~dispatcher.gate.attempts.RequestResult` (attempts, the latest attempt with
  its node,
  queue wait and first output, the admission wait under way) -- and the outcome it counted.

Nothing is counted twice: the tokens are what the attempt's usage row says (read with the
accounting's own :func:`~dispatcher.gate.accounting.counts_so_far` /
:func:`~dispatcher.gate.accounting.tunnel_counts`, live while the request runs), the time to first
output is the attempt's ``output_at``, the outcome is the one ``dispatcher_requests_total``
counts.

The access log is the logger ``dispatcher.access``: one record per request, at INFO (at DEBUG
for a successful probe, scrape or status poll: :data:`QUIET_ROUTES`), its message
``METHOD PATH STATUS`` and its fields (:meth:`RequestSummary.fields`) under
:data:`dispatcher.observe.logs.FIELDS`, which both log formats render escaped.
"""

from __future__ import annotations

import collections
import logging
import operator
import time
from collections.abc import Mapping
from typing import Final, Literal

import attrs
import trio

from .. import wire
from ..gate.accounting import Counts, counts_so_far, tunnel_counts
from ..gate.attempts import GateRequest, RunAttempt, TunnelAttempt
from ..shared.excgroups import holds
from .logs import FIELDS
from .metrics import UNKNOWN_MODEL, Metrics

__all__ = [
    "QUIET_ROUTES",
    "RECENT_FAILURES",
    "Refusals",
    "RequestRecord",
    "RequestState",
    "RequestSummary",
    "Traffic",
]

access_log = logging.getLogger("dispatcher.access")
log = logging.getLogger("dispatcher.traffic")

RECENT_FAILURES: Final = 50
"""How many failed requests :attr:`Traffic.failures` keeps (the newest first)."""
REFUSAL_WINDOW: Final = 300.0
"""Seconds of 429 / 503 answers the status page counts per queue."""
MAX_REFUSALS: Final = 1000
"""Refusals remembered per model label (the window's count saturates there)."""
MAX_TEXT: Final = 300
"""Characters kept of a client's or node's text (a model name, a path, an error message)."""

QUIET_ROUTES: Final = frozenset({"/healthz", "/readyz", "/metrics", "/admin/status"})
"""Routes polled by machines: their access line is DEBUG unless the request failed."""

FAILED_OUTCOMES: Final = frozenset({"failed", "rejected", "shutting_down"})
"""Outcomes :attr:`Traffic.failures` keeps (and any answer of status 500 or above)."""

RequestState = Literal["received", "queued", "running", "answering"]
"""Where an in-flight request is: its body being read and checked, waiting for admission,
admitted and waiting for its first output, answering."""


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= MAX_TEXT:
        return text
    return text[: MAX_TEXT - 3] + "..."


def _s(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _outcome_of_status(status: int | None) -> str:
    """The outcome of a request on a route that counts none itself (not a model route)."""
    if status is None:
        return "client_gone"
    if status >= 500:
        return "failed"
    if status >= 400:
        return "bad_request"
    return "completed"


@attrs.frozen(kw_only=True)
class RequestSummary:
    """One request as the access log writes it and ``GET /admin/status`` lists it (in flight
    and among the recent failures): the same fields, in this order, always all of them (None
    when unknown). Durations in seconds, ``started_at`` in unix seconds."""

    request_id: str
    client_request_id: str | None
    method: str
    path: str
    """As sent, clipped to :data:`MAX_TEXT` characters."""
    route: str | None
    model: str | None
    """As the client asked for it (clipped)."""
    key_id: str | None
    stream: bool | None
    state: RequestState
    """Where the request is (or was when it ended)."""
    node: str | None
    provider: str | None
    status: int | None
    outcome: str | None
    error_code: str | None
    error: str | None
    """The cause, as the client was told it (a node's or provider's message included)."""
    attempts: int
    """Attempts admitted (the one under way included)."""
    queue_wait_s: float | None
    """The admitted attempt's wait, or how long the request has been waiting now."""
    ttft_s: float | None
    duration_s: float
    """Until now while in flight."""
    input_tokens: int | None
    output_tokens: int | None
    tokens_source: str | None
    dropped_tools: str | None
    """The built-in tools a front end dropped from the request (``web_search,file_search``),
    as its ``x-dispatcher-dropped-tools`` header says."""
    started_at: float

    def fields(self) -> dict[str, object]:
        """The fields by name, in order (what ``attrs.asdict`` gives: every value is a
        scalar), read without ``asdict``'s per-field machinery (one per request)."""
        return dict(zip(_SUMMARY_FIELDS, _summary_values(self), strict=True))


_SUMMARY_FIELDS: Final = tuple(field.name for field in attrs.fields(RequestSummary))
_summary_values = operator.attrgetter(*_SUMMARY_FIELDS)


@attrs.define(eq=False)
class RequestRecord:
    """One HTTP request, from the handler's start to its end (see the module docstring).
    Times are ``trio.current_time()`` unless named ``_wall``."""

    request_id: str
    """The edge's id (``x-dispatcher-request-id``, the usage ledger's key)."""
    client_request_id: str | None
    """The client's own ``x-request-id`` when it is one to keep."""
    method: str
    """The request's method, as h11 parsed it."""
    path: str
    """As the request line has it (its query left out)."""
    started_at: float
    """When the handler began."""
    started_wall: float
    """Unix time of ``started_at``."""
    route: str | None = None
    """The route table's path (``/v1/responses/{id}`` for a pattern); None: no route."""
    key_id: str | None = None
    """The id of the client's API key (``app.key_id``), once authorized."""
    work: bool = False
    """The route runs a model (what the status page lists in flight)."""
    gated: GateRequest | None = None
    """The gate request a model route built (model, stream, the gate's result)."""
    model_label: str | None = None
    """The bounded ``model`` label of the request's metrics."""
    asked_model: str | None = None
    """The model the client asked for, known before the gate request is (a request the
    tenant check refuses has one and no gate request)."""
    status: int | None = None
    """The status the answer started with (None: no answer started)."""
    outcome: str | None = None
    """A model route's counted outcome (``dispatcher_requests_total``); at the end, every
    request's (from the status for the other routes)."""
    error_code: str | None = None
    """The ``code`` of the error the client was answered."""
    error: str | None = None
    """Its message (clipped)."""
    left: bool = False
    """The client left before the end (see :meth:`client_gone`)."""
    dropped_tools: str | None = None
    """The built-in tools the front end dropped (:attr:`RequestSummary.dropped_tools`)."""

    # -- filled in by the API ----------------------------------------------------------

    def routed(self, route: str, *, work: bool) -> None:
        self.route, self.work = route, work

    def asking(self, model: str, model_label: str) -> None:
        """A model route read the model the client asks for (before its tenant check)."""
        self.asked_model, self.model_label = model, model_label

    def dispatching(self, gated: GateRequest, model_label: str) -> None:
        """A model route built its gate request (the gate fills ``gated.result``)."""
        self.gated, self.model_label = gated, model_label

    def answered(self, status: int) -> None:
        if self.status is None:
            self.status = status

    def client_gone(self) -> None:
        """The request was cancelled or the client's connection reset: ``client_gone``
        unless the route counted an outcome or an answer was already given."""
        self.left = True
        if self.outcome is None and self.status is None:
            self.outcome = "client_gone"

    def failed(self, code: str | None, message: str) -> None:
        """The request's error (the first one named stands)."""
        if self.error is None:
            self.error_code, self.error = code, _clip(message)

    # -- read --------------------------------------------------------------------------

    @property
    def model(self) -> str | None:
        """The model as the client asked for it (clipped)."""
        if self.gated is not None:
            return _clip(str(self.gated.dispatch.model))
        return None if self.asked_model is None else _clip(self.asked_model)

    @property
    def attempt(self) -> RunAttempt | TunnelAttempt | None:
        return None if self.gated is None else self.gated.result.attempt

    def state(self) -> RequestState:
        gated = self.gated
        if gated is None:
            return "received"
        attempt = gated.result.attempt
        if gated.result.waiting_since is not None or attempt is None:
            return "queued"
        return "answering" if attempt.committed else "running"

    def queue_wait(self, now: float) -> float | None:
        if self.gated is None:
            return None
        waiting = self.gated.result.waiting_since
        if waiting is not None:
            return now - waiting
        attempt = self.attempt
        return None if attempt is None else attempt.result.queue_wait

    def ttft(self) -> float | None:
        """From the request's start to the answering attempt's first output."""
        attempt = self.attempt
        if attempt is None or not attempt.committed or attempt.output_at is None:
            return None
        return max(0.0, attempt.output_at - self.started_at)

    def counts(self) -> Counts | None:
        """The latest attempt's tokens, as its usage row says them (so far, while it runs)."""
        gated, attempt = self.gated, self.attempt
        if gated is None or attempt is None:
            return None
        if isinstance(attempt, RunAttempt):
            return counts_so_far(gated, attempt.run)
        return tunnel_counts(gated, attempt.tunnel)

    def _cause(self) -> tuple[str | None, str | None]:
        """The error, or what ended a committed answer badly (a node's failure, a stall)."""
        if self.error is not None or self.outcome != "failed":
            return self.error_code, self.error
        attempt = self.attempt
        if isinstance(attempt, RunAttempt):
            if attempt.stalled:
                return "stall_timeout", "no output from the model within the stall timeout"
            terminal = attempt.run.terminal
            if isinstance(terminal, wire.RunFailed):
                return terminal.code, _clip(f"the model run failed: {terminal.message}")
            if isinstance(terminal, wire.RunCancelled):
                return "cancelled", "the node cancelled the run"
        if isinstance(attempt, TunnelAttempt) and attempt.failed:
            return "tunnel_failed", "the tunnelled answer broke off"
        return None, None

    def summary(self, now: float) -> RequestSummary:
        return self._summary(now, self.counts(), self.ttft())

    def _summary(self, now: float, counts: Counts | None, ttft: float | None) -> RequestSummary:
        """:meth:`summary`, with the :meth:`counts` and :meth:`ttft` the caller read."""
        gated, attempt = self.gated, self.attempt
        code, error = self._cause()
        result = None if attempt is None else attempt.result
        return RequestSummary(
            request_id=self.request_id,
            client_request_id=self.client_request_id,
            method=self.method,
            path=_clip(self.path) or "",
            route=self.route,
            model=self.model,
            key_id=self.key_id,
            stream=None if gated is None else gated.stream,
            state=self.state(),
            node=None if result is None else result.node_id,
            provider=None if result is None else result.provider_id,
            status=self.status,
            outcome=self.outcome,
            error_code=code,
            error=error,
            attempts=0 if gated is None else gated.result.attempts,
            queue_wait_s=_s(self.queue_wait(now)),
            ttft_s=_s(ttft),
            duration_s=round(now - self.started_at, 4),
            input_tokens=None if counts is None else counts.prompt_tokens,
            output_tokens=None if counts is None else counts.completion_tokens,
            tokens_source=None if counts is None else counts.usage_source,
            dropped_tools=self.dropped_tools,
            started_at=round(self.started_wall, 3),
        )

    @property
    def is_failure(self) -> bool:
        return self.outcome in FAILED_OUTCOMES or (self.status is not None and self.status >= 500)


@attrs.frozen(kw_only=True)
class Refusals:
    """A queue's recent 429 and 503 answers (within :data:`REFUSAL_WINDOW`)."""

    too_many_requests: int
    unavailable: int
    last_at: float | None
    """Unix time of the latest one."""


class InFlight:
    """The block of :meth:`Traffic.open` (its record's clock starts as it is made): enters
    the request's record, and leaving it, however, ends the record once -- a cancellation or
    a ``left_on`` exception is the client gone, any other exception that nothing recorded an
    internal error. A small class rather than a generator: a held stream keeps one of these,
    not a suspended frame."""

    __slots__ = ("_left_on", "_record", "_traffic")

    def __init__(
        self,
        traffic: Traffic,
        request_id: str,
        client_request_id: str | None,
        method: str,
        path: str,
        left_on: type[BaseException] | tuple[type[BaseException], ...] = (),
    ) -> None:
        self._traffic = traffic
        self._left_on = left_on
        self._record = RequestRecord(
            request_id=request_id,
            client_request_id=client_request_id,
            method=method,
            path=path,
            started_at=trio.current_time(),
            started_wall=time.time(),
        )

    def __enter__(self) -> RequestRecord:
        record = self._record
        self._traffic.in_flight[record.request_id] = record
        return record

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        record, traffic = self._record, self._traffic
        try:
            if exc is not None and (isinstance(exc, self._left_on) or holds(exc, trio.Cancelled)):
                record.client_gone()
            elif exc is not None and not record.left:
                record.failed("internal_error", f"{type(exc).__name__}: {exc}")
                if record.outcome is None:
                    record.outcome = "failed"
        finally:
            del traffic.in_flight[record.request_id]
            traffic._end(record)


class Traffic:
    """The requests in flight and what ended ones leave behind (see the module docstring).
    ``metrics``: where a model route's ended request is observed."""

    def __init__(self, metrics: Metrics | None = None, *, recent_failures: int = RECENT_FAILURES):
        self.metrics = metrics
        self.in_flight: dict[str, RequestRecord] = {}
        """Open records by request id, oldest first."""
        self.failures: collections.deque[RequestSummary] = collections.deque(maxlen=recent_failures)
        """The latest failed requests, newest first."""
        self._refusals: dict[str, collections.deque[tuple[float, float, int]]] = {}
        """model label -> (trio time, unix time, status) of its recent 429 / 503 answers."""

    def open(
        self,
        request_id: str,
        client_request_id: str | None,
        method: str,
        path: str,
        *,
        left_on: type[BaseException] | tuple[type[BaseException], ...] = (),
    ) -> InFlight:
        """The record of one request, in flight while the block is open; leaving ends it
        once (the access line, the metrics, the failure ring). Leaving by a cancellation, or
        by an exception of a ``left_on`` type (the server's "the client is gone"), is the
        client leaving."""
        return InFlight(self, request_id, client_request_id, method, path, left_on)

    def _end(self, record: RequestRecord) -> None:
        """Everything an ended request leaves, once; never raises (a request's exit path
        must not break on its bookkeeping)."""
        try:
            now, wall = trio.current_time(), time.time()
            counted = record.outcome is not None
            if record.outcome is None:
                record.outcome = _outcome_of_status(record.status)
            quiet = record.route in QUIET_ROUTES and record.outcome == "completed"
            level = logging.DEBUG if quiet else logging.INFO
            failure = record.is_failure
            counts, ttft = record.counts(), record.ttft()  # read once, for both
            if failure or access_log.isEnabledFor(level):
                summary = record._summary(now, counts, ttft)
                access_log.log(
                    level,
                    "%s %s %s",
                    summary.method,
                    summary.path,
                    summary.status if summary.status is not None else "-",
                    extra={FIELDS: summary.fields()},
                )
                if failure:
                    self.failures.appendleft(summary)
            # a queue's refusals: admission's, inside the gate (not a tenant's limit, before it)
            if record.status in (429, 503) and record.gated is not None and record.model_label:
                self._refused(record.model_label, now, wall, record.status)
            if counted and self.metrics is not None and record.route is not None:
                self.metrics.observe_request(
                    record.model_label or UNKNOWN_MODEL,
                    record.route,
                    record.outcome or "failed",
                    now - record.started_at,
                    ttft=ttft,
                    tokens=None
                    if counts is None
                    else (counts.prompt_tokens, counts.completion_tokens),
                    attempts=0 if record.gated is None else record.gated.result.attempts,
                    cached=0 if counts is None else counts.cached_tokens,
                )
        except Exception:
            log.exception("could not account for request %s", record.request_id)

    def _refused(self, model: str, now: float, wall: float, status: int) -> None:
        seen = self._refusals.get(model)
        if seen is None:
            seen = self._refusals[model] = collections.deque(maxlen=MAX_REFUSALS)
        seen.append((now, wall, status))

    def refusals(self, now: float) -> Mapping[str, Refusals]:
        """Per model label, its 429 / 503 answers within :data:`REFUSAL_WINDOW` (those
        older are forgotten here, and a label with none left)."""
        since = now - REFUSAL_WINDOW
        result: dict[str, Refusals] = {}
        for model in list(self._refusals):
            seen = self._refusals[model]
            while seen and seen[0][0] < since:
                seen.popleft()
            if not seen:
                del self._refusals[model]
                continue
            result[model] = Refusals(
                too_many_requests=sum(1 for _, _, status in seen if status == 429),
                unavailable=sum(1 for _, _, status in seen if status == 503),
                last_at=round(seen[-1][1], 3),
            )
        return result

    def waiting(self, now: float) -> Mapping[str, tuple[int, float]]:
        """Per model label, the requests waiting for admission now and the oldest wait."""
        result: dict[str, tuple[int, float]] = {}
        for record in self.in_flight.values():
            gated = record.gated
            if gated is None or gated.result.waiting_since is None:
                continue
            label = record.model_label or UNKNOWN_MODEL
            count, oldest = result.get(label, (0, 0.0))
            result[label] = (count + 1, max(oldest, now - gated.result.waiting_since))
        return result
