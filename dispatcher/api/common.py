"""What the API's front ends share: the model routes' call (:class:`ModelCall`, which
builds the gate request from the HTTP request) and counting (:func:`model_route`), the
admission predicates of a route only one path serves (:func:`normalized_only`,
:func:`tunnel_only`), the request-outcome metric, the headers that describe the attempt which
answered, a committed answer's events as a stream sends them (:data:`SSE_HEADERS`,
:func:`relay_rest`, :data:`SHUTDOWN_SEND_TIMEOUT`), and the OpenAI error shape
(:func:`openai_error`), which the OpenAI routes and the edge's own routes answer in."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, Final

import attrs
import trio

from .. import wire
from ..admission import (
    DEFAULT_SHARE,
    AdmissionError,
    Candidate,
    Predicate,
)
from ..errors import (
    LimitStoreUnavailable,
    RateLimited,
    RunError,
    ShuttingDown,
    error_status_and_body,
)
from ..gate.attempts import (
    Answer,
    GateRequest,
    PrepareAttempt,
    RequestResult,
    TunnelCall,
)
from ..gate.pool import DispatchRequest, DispatchResult
from ..http import (
    HTTPStream,
    PeerGone,
    Request,
    Responder,
)
from ..observe.traffic import RequestRecord
from ..paths.runs import RunSpec
from ..tenants import Ticket
from .front import RenderedError, Route, RouteContext
from .seam import EdgeServices

JSON_HEADERS = ((b"content-type", b"application/json"),)

SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)
"""The headers of every event stream a front end answers with (``x-accel-buffering: no``
keeps a proxy such as nginx from holding the events back)."""

SHUTDOWN_SEND_TIMEOUT: Final = 1.0
"""How long a stream cut short by the edge's shutdown may take to send the client its last
event (the error that says so), shielded from the cancellation."""

REASONING_EFFORT: Final = "reasoning_effort"
"""The chat body's field in which a translating front end (Responses' ``reasoning.effort``,
Messages' ``thinking`` / ``output_config.effort``) passes the effort the client asked for. Only
candidates announcing the ``reasoning`` capability get it (:func:`effort_where_announced`): an
engine that does not reason ignores it at best, and OpenAI's own non-reasoning models refuse
it."""

REASONING: Final = "reasoning"
"""The capability of a model that takes a reasoning effort (``capabilities`` in a node's
model table)."""


async def effort_where_announced(  # noqa: ASYNC124 (a PrepareAttempt is async; this one needs no I/O)
    _number: int, candidate: Candidate, spec: RunSpec
) -> RunSpec:
    """A translating front end's :data:`~dispatcher.gate.attempts.PrepareAttempt`: the
    attempt's body without :data:`REASONING_EFFORT` unless ``candidate`` announces
    :data:`REASONING`."""
    if REASONING_EFFORT not in spec.body or REASONING in candidate.capabilities:
        return spec
    body = dict(spec.body)
    del body[REASONING_EFFORT]
    return attrs.evolve(spec, body=body)


def fit_effort(body: dict[str, Any]) -> PrepareAttempt | None:
    """What a translating front end gives its gate request as ``prepare``: with an effort in
    ``body``, :func:`effort_where_announced`; else nothing to do per attempt."""
    return effort_where_announced if REASONING_EFFORT in body else None


def openai_error(exc: BaseException) -> RenderedError:
    """Any error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``
    (see :func:`dispatcher.errors.error_status_and_body`)."""
    status, body, retry_after = error_status_and_body(exc)
    return RenderedError(status, body, retry_after=retry_after)


class CutResponse(PeerGone):
    """Raised after a streamed body broke off: the server then closes the connection without
    ending the body (and without logging a handler failure), so the client can tell the body
    is incomplete."""


@attrs.define
class RequestOutcome:
    """Filled in by a route as it learns more: the model label and how the request ended.
    Once the route hands the request to the gate it sets ``gate``: the outcome of the row of
    the last dispatched attempt then decides the metric, so metric and ledger agree."""

    model: str = "unknown"
    outcome: str = "bad_request"
    gate: RequestResult | None = None

    def final(self) -> str:
        row = self.gate.outcome if self.gate is not None else None
        if row is None:
            return self.outcome
        if row == "aborted" and self.outcome in ("client_gone", "shutting_down"):
            # The last dispatched attempt failed before the client saw anything, and the
            # request then ended by the client leaving (while a recovery waited): that is how
            # the client's request ended.
            return self.outcome
        return _METRIC_OUTCOME[row]


_METRIC_OUTCOME: dict[str, str] = {
    "completed": "completed",
    "cancelled": "client_gone",
    "failed": "failed",
    "aborted": "failed",  # every attempt failed before the answer started: a 502
}


class CountedRequest:
    """Count the request under ``dispatcher_requests_total`` once, however it ends: what the
    route set, or what the exception leaving it says (and tell ``record`` that outcome).
    A small class rather than a generator: a held stream keeps no suspended frame for it."""

    __slots__ = ("_edge", "_record", "_result")

    def __init__(self, edge: EdgeServices, record: RequestRecord | None = None) -> None:
        self._edge, self._record, self._result = edge, record, RequestOutcome()

    def __enter__(self) -> RequestOutcome:
        self._edge.metrics.inflight_requests += 1
        return self._result

    def __exit__(self, _type: object, exc: BaseException | None, _tb: object) -> None:
        result, metrics = self._result, self._edge.metrics
        if exc is not None:
            result.outcome = _outcome_of(exc, result.outcome)
        metrics.inflight_requests -= 1
        outcome = result.final()
        metrics.count_request(result.model, outcome)
        if self._record is not None:
            self._record.outcome = outcome


def _outcome_of(exc: BaseException, outcome: str) -> str:
    """The outcome a request ends with when ``exc`` leaves its route (``outcome``, what the
    route had set, for any other exception)."""
    if isinstance(exc, ShuttingDown):
        return "shutting_down"
    if isinstance(exc, trio.Cancelled):
        return "client_gone"
    if isinstance(exc, CutResponse):
        return "failed"
    if isinstance(exc, PeerGone):
        return "client_gone"
    if isinstance(exc, AdmissionError | RateLimited | LimitStoreUnavailable):
        return "rejected"
    if isinstance(exc, RunError):
        return "failed"
    return outcome


def dispatch_headers(result: DispatchResult, attempts: int) -> tuple[tuple[bytes, bytes], ...]:
    """``x-dispatcher-*``: the attempt that answered; ``-model`` is the model group that
    served (a fallback's, when the one asked for failed). ``-node`` and ``-provider`` reach
    the client only with ``expose_node_ids`` (the work routes' responder drops them
    otherwise, see ``api.app``)."""
    return (
        (b"x-dispatcher-attempts", str(attempts).encode()),
        (b"x-dispatcher-model", result.model_group.encode()),
        (b"x-dispatcher-node", result.node_id.encode()),
        (b"x-dispatcher-provider", result.provider_id.encode()),
        (b"x-dispatcher-queue-ms", f"{result.queue_wait * 1000:.1f}".encode()),
    )


def normalized_only(refusal: str) -> Predicate:
    """The admission predicate of a route only normalized candidates serve (a tunnel relays
    the client's bytes to a provider, and none speaks the route's API): a tunnel candidate is
    refused with ``refusal``, so no attempt is spent on it."""

    def predicate(candidate: Candidate) -> str | None:
        if candidate.path == "normalized":
            return None
        return refusal

    return predicate


def tunnel_only(route: str) -> Predicate:
    """The admission predicate of a route only tunnels serve."""

    def predicate(candidate: Candidate) -> str | None:
        if candidate.path == "tunnel":
            return None
        return f"serves this model normalized, not through a tunnel, which {route} needs"

    return predicate


@functools.cache
def serving(route: wire.RouteName) -> Predicate:
    """The admission predicate of a route: a candidate whose provider does not serve it
    (``routes`` in its node's ``hello``) is refused, so no attempt is spent on it."""

    def predicate(candidate: Candidate) -> str | None:
        if route in candidate.routes:
            return None
        if candidate.path == "tunnel":
            served = ", ".join(sorted(candidate.routes))
            return f"its tunnel provider declares the routes {served}, not {route!r}"
        return f"its {candidate.adapter!r} adapter does not serve {route!r}"

    return predicate


def both(first: Predicate, second: Predicate) -> Predicate:
    """A predicate refusing what either refuses (the first's reason first)."""

    def predicate(candidate: Candidate) -> str | None:
        reason = first(candidate)
        return reason if reason is not None else second(candidate)

    return predicate


@attrs.define(eq=False)
class Pending:
    """What a stream's renderer appended to :attr:`out` since the last :meth:`send`."""

    stream: HTTPStream
    out: list[bytes] = attrs.field(factory=list)

    async def send(self, ended: bool = False) -> None:
        """Send what is pending, if anything (``ended`` is :func:`relay_rest`'s: whether
        the answer ended, which changes nothing here)."""
        if self.out:
            await self.stream.send(b"".join(self.out))
            self.out.clear()


async def relay_rest(
    answer: Answer,
    render: Callable[[wire.RunEvent], bool],
    send: Callable[[bool], Awaitable[None]],
) -> bool:
    """A committed answer after its head, as a stream sends it: the next event to arrive and
    the events ready behind it go to ``render`` (True for the one that ends the answer: none
    after it is rendered), then ``send(ended)`` sends what they rendered; again, until an event
    ended the answer (True) or the events ran out without one (False)."""
    while True:
        try:
            event = await answer.__anext__()
        except StopAsyncIteration:
            return False
        ended = render(event) or any(render(ready) for ready in answer.ready_events())
        await send(ended)
        if ended:
            return True


@attrs.define
class ModelCall:
    """One request to a route that runs a model, counted from its start (see
    :func:`model_route`): the edge, the HTTP request, its context, and what the request
    metric will count. :meth:`gate_request` adds the tenant's ``x-ratelimit-*`` headers to
    ``ctx.headers``, which every answer of the route carries (as OpenAI's answers do)."""

    edge: EdgeServices
    request: Request
    ctx: RouteContext
    counted: RequestOutcome
    tenancy: Tenancy

    async def gate_request(
        self,
        body: dict[str, Any],
        *,
        stream: bool,
        predicate: Predicate | None = None,
        prepare: PrepareAttempt | None = None,
        raw_body: Callable[[str], bytes] | None = None,
        run_route: wire.RouteName = "chat",
        tunnel_body: dict[str, Any] | None = None,
        affinity_key: str | None = None,
        affinity: Callable[[], str | None] | None = None,
    ) -> GateRequest:
        """The gate's view of the request (``body`` already parsed and validated), which a
        tunnel attempt relays as the client sent it (``tunnel_body`` instead, when the route
        translated the client's body to ``body``: the Messages and Responses APIs, relayed
        natively; or, with ``raw_body``, as the bytes it gives for the served model name:
        ``TunnelCall.raw_body``) and a normalized attempt runs as ``run_route`` (what ``body``
        is: a chat body, or an embeddings body); the counted request learns its model label and
        then follows the gate's result. ``affinity`` makes the request's affinity key, called
        only when affinity may route it (:meth:`EdgeServices.affinity_wanted`);
        ``affinity_key`` is one made already.

        The one check of the client's tenant, before the gate (so a recovery attempt is
        never a second request): a model it may not use is a 404, a limit it is over a 429;
        else its ticket is held until the route is left (:func:`model_route`)."""
        request, ctx = self.request, self.ctx
        self.counted.model = self.edge.metric_model_label(body["model"])
        if ctx.record is not None:
            ctx.record.asking(body["model"], self.counted.model)
        tenancy = self.tenancy
        if tenancy.gated:
            raise RuntimeError("gate_request is called once per client request")
        tenancy.gated = True
        ticket = None
        if tenancy.held is not None:
            tenancy.ticket = ticket = await tenancy.held.enter_async_context(
                self.edge.tenants.admitted(ctx.request_id, ctx.tenant, body["model"], body)
            )
        if (
            affinity_key is None
            and affinity is not None
            and self.edge.affinity_wanted(body["model"])
        ):
            affinity_key = affinity()  # made only where affinity may route the request
        session = request.header(b"x-session-id")
        gated = GateRequest(
            request_id=ctx.request_id,
            client_request_id=ctx.client_request_id,
            dispatch=DispatchRequest(
                model=body["model"],
                body=body,
                route=request.path,
                run_route=run_route,
                session_id=session.decode("latin-1") if session else None,
                affinity_key=affinity_key,
                predicate=predicate,
                # fair queueing between tenants: the tenant as admitted (a reload since the
                # request was authenticated does not change it)
                share=DEFAULT_SHARE if ticket is None else ticket.tenant.share,
            ),
            stream=stream,
            attribution=ctx.attribution,
            prepare=prepare,
            # a fallback model the key may not use is not tried for it
            may_use=None if ticket is None else ticket.tenant.allows,
            tunnel_call=TunnelCall(
                method=request.method,
                path=request.path,
                query=request.query,
                headers=tuple(request.headers),
                body=body if tunnel_body is None else tunnel_body,
                raw_body=raw_body,
            ),
        )
        self.counted.gate = gated.result
        if ctx.record is not None:
            ctx.record.dispatching(gated, self.counted.model)
        if ticket is not None:
            self.ctx = attrs.evolve(ctx, headers=(*ctx.headers, *ticket.headers))
            assert tenancy.held is not None  # a ticket is only entered there
            tenancy.held.callback(_answered, ticket, gated.result)  # before the release
        return gated


ServeModel = Callable[[ModelCall, Responder], Awaitable[str]]
"""What a model route does with its call: answer it, and return the outcome the request
metric counts when no attempt was dispatched (otherwise the gate's row outcome counts)."""


def _answered(ticket: Ticket, result: RequestResult) -> None:
    """The request is over: did an attempt commit (a billable usage row is then on its way,
    maybe after the request, as a cancelled stream's)? ``aborted`` is an attempt that failed
    before the commit; None, no attempt was dispatched."""
    ticket.answered = result.outcome not in (None, "aborted")


@attrs.define(eq=False)
class Tenancy:
    """A model request's tenant admission: its ticket (None until
    :meth:`ModelCall.gate_request`, and when client auth is off), held on ``held``, which
    :func:`model_route`'s block leaves however the route ends (None without a tenant to
    admit: nothing to hold)."""

    held: AsyncExitStack | None
    ticket: Ticket | None = None
    gated: bool = False
    """:meth:`ModelCall.gate_request` was called (it is called once)."""


def model_route(serve: ServeModel) -> Route:
    """The route that answers with ``serve``, its request counted under
    ``dispatcher_requests_total`` however it ends (:class:`CountedRequest`), its tenant's
    ticket held until it ends (:class:`Tenancy`)."""

    @functools.wraps(serve)
    async def route(
        edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
    ) -> None:
        with CountedRequest(edge, ctx.record) as counted:
            if ctx.tenant is None:  # client auth off (or an admin's call): nothing to hold
                call = ModelCall(edge, request, ctx, counted, Tenancy(None))
                counted.outcome = await serve(call, responder)
                return
            async with AsyncExitStack() as held:
                call = ModelCall(edge, request, ctx, counted, Tenancy(held))
                counted.outcome = await serve(call, responder)

    return route
