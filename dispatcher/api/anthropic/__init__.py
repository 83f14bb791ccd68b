"""The Anthropic Messages front end: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``, errors in Anthropic's shape (:func:`anthropic_error`).

A Messages request is validated strictly and translated to an OpenAI chat body
(:mod:`._request`), then served like a chat completion: one typed
:class:`~dispatcher.gate.attempts.GateRequest` on route ``/v1/messages`` (the usage rows
say so), the
same gate, recovery before the commit, cancellation and usage rows. The committed answer is
rendered back as a ``message`` or its SSE events (:mod:`._answer`).

Admission (:data:`MESSAGES_PREDICATE`, ``serving("messages")``) offers every normalized
candidate (translated, as above) and the tunnel candidates whose provider declares the route
``messages`` (an Anthropic-API provider): those are relayed natively, the client's body as sent
(``model`` replaced by the served name), ``anthropic-version`` and ``anthropic-beta`` passed on,
the answer's bytes as the provider sent them but for the model's name
(:func:`~dispatcher.api.tunnel_relay.relay`, Anthropic's dialect: the commit at the first
content event, usage from ``message_start`` and ``message_delta``, an ``event: error`` after
the commit). A tunnel provider that does not declare ``messages`` is never chosen.

``docs/messages.md`` lists the subset supported and what is answered 400.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final

import attrs
import orjson
import trio

from ... import wire
from ...admission import ModelUnavailable, QueueTimeout
from ...errors import (
    DispatcherError,
    LimitStoreUnavailable,
    NotFound,
    RunError,
    ShuttingDown,
)
from ...gate.attempts import Answer, TunnelAnswer
from ...http import PeerGone, Request, Responder
from ...shared.excgroups import leaves
from ..affinity import affinity_key
from ..common import (
    JSON_HEADERS,
    SHUTDOWN_SEND_TIMEOUT,
    SSE_HEADERS,
    ModelCall,
    Pending,
    dispatch_headers,
    fit_effort,
    model_route,
    relay_rest,
    serving,
)
from ..front import (
    FrontEnd,
    RenderedError,
    RouteContext,
    RouteSpec,
)
from ..seam import EdgeServices
from ..tunnel_relay import relay
from ._answer import (
    PING,
    EventWriter,
    error_event,
    message_body,
)
from ._request import (
    MessagesRequest,
    count_input_tokens,
    parse_count_tokens_request,
    parse_messages_request,
    to_chat_body,
)

__all__ = [
    "FRONT_END",
    "MESSAGES_PATH",
    "MESSAGES_PREDICATE",
    "anthropic_error",
    "count_tokens",
    "messages",
]

PING_INTERVAL: Final = 10.0
"""Seconds a Messages stream may stay silent before it sends a ``ping`` event."""

MESSAGES_PATH: Final = "/v1/messages"
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"

# --------------------------------------------------------------------------- errors

ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
"""Anthropic's error type for each status it documents."""

OVERLOADED: Final = (QueueTimeout, ModelUnavailable, ShuttingDown, LimitStoreUnavailable, RunError)
"""The errors of an edge that cannot answer now, retryable later: 529 ``overloaded_error``
(a queue wait that timed out, a model whose node may come back, a draining edge, a limit
store that does not answer, every attempt failed -- ``RunError`` covers
``AllAttemptsFailed`` -- or a node lost at send). A
full queue is 429 ``rate_limit_error``, as Anthropic's docs answer a client over its
rate."""


def anthropic_error(exc: BaseException) -> RenderedError:
    """Any error in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``:
    the status the error tree says (529 for :data:`OVERLOADED`, 500 for any other server
    error), the type by status (:data:`ERROR_TYPES`; another 4xx is
    ``invalid_request_error``), ``Retry-After`` kept."""
    if isinstance(exc, DispatcherError) and 400 <= exc.status <= 599:
        if isinstance(exc, OVERLOADED):
            status = 529
        elif exc.status >= 500:
            status = 500
        else:
            status = exc.status
        error_type = ERROR_TYPES.get(status, "invalid_request_error")
        message, retry_after = exc.message, exc.retry_after
    else:
        status, error_type, message, retry_after = 500, "api_error", "internal error", None
    body = {"type": "error", "error": {"type": error_type, "message": message}}
    return RenderedError(status, orjson.dumps(body), retry_after=retry_after)


# --------------------------------------------------------------------------- routes


MESSAGES_PREDICATE: Final = serving("messages")
"""The admission predicate of ``/v1/messages``: normalized candidates (translated) and tunnel
candidates whose provider declares ``messages`` (relayed natively); no attempt is spent on
another tunnel."""


@model_route
async def messages(call: ModelCall, responder: Responder) -> str:
    """``POST /v1/messages``."""
    parsed = parse_messages_request(await call.request.body())
    chat = to_chat_body(parsed.body)
    gated = await call.gate_request(
        chat,
        stream=parsed.stream,
        predicate=MESSAGES_PREDICATE,
        prepare=fit_effort(chat),
        tunnel_body=parsed.body,
        affinity=functools.partial(affinity_key, call.request.headers, parsed.body, chat),
    )
    estimate = count_input_tokens(parsed.body)
    async with call.edge.gate.open(gated) as answer:
        request_id = (b"request-id", call.ctx.request_id.encode())
        if isinstance(answer, TunnelAnswer):  # a provider speaking the Messages API
            return await relay(call.edge, answer, chat, responder, (*call.ctx.headers, request_id))
        message_id = "msg_" + answer.run.run_id
        headers = (
            *call.ctx.headers,
            *dispatch_headers(answer.result, answer.attempts),
            request_id,
        )
        try:
            if parsed.stream:
                await _stream(call.edge, parsed, answer, responder, headers, message_id, estimate)
            else:
                body = message_body(
                    message_id=message_id,
                    model=parsed.model,
                    head=answer.head,
                    input_estimate=estimate,
                )
                await responder.respond(200, (*JSON_HEADERS, *headers), orjson.dumps(body))
        except PeerGone:
            answer.client_gone()  # a reset is a client leaving, like a cancellation
            raise
        return "completed" if isinstance(answer.terminal, wire.RunCompleted) else "failed"


async def _stream(
    edge: EdgeServices,
    parsed: MessagesRequest,
    answer: Answer,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
    message_id: str,
    estimate: int,
) -> None:
    """The committed answer as Messages SSE events, a ``ping`` after each
    :data:`PING_INTERVAL` seconds of silence; after the commit a failure is an ``error``
    event, and the stream ends without ``message_stop``."""
    writer = EventWriter(message_id=message_id, model=parsed.model, input_estimate=estimate)
    stream = await responder.start_stream(200, (*SSE_HEADERS, *headers))
    pending = Pending(stream)

    def render(item: wire.RunEvent) -> bool:
        return writer.render(item, pending.out)

    with edge.stream_scope() as scope:
        pending.out.append(writer.start(answer.head))
        ended = False
        for item in answer.head:
            ended = ended or render(item)
        keepalive = _Keepalive(pending, PING_INTERVAL)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keepalive.ping)
                await keepalive.send()
                if not ended:
                    ended = await relay_rest(answer, render, keepalive.send)
                if ended:
                    # sent: a client leaving from here (while the pinger stops) changes
                    # nothing of what it saw
                    answer.delivered()
                async with keepalive.lock:  # never cut a ping in the middle
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # the pinger raises nothing: what the relay raised, as it raised it
            raise _alone(group) from None
    if scope.cancelled_caught:
        with trio.move_on_after(SHUTDOWN_SEND_TIMEOUT, shield=True):
            await stream.send(error_event("overloaded_error", "the dispatcher is shutting down"))


@attrs.define(eq=False)
class _Keepalive:
    """A Messages stream's sends (what the renderer appended to :attr:`pending`), and a
    ``ping`` event after ``interval`` seconds without one (:meth:`ping`, a task beside the
    relay), as Anthropic's streams keep a long silence (a model thinking, a tool call's input
    being written) from looking dead to clients and proxies. One send at a time."""

    pending: Pending
    interval: float
    lock: trio.Lock = attrs.Factory(trio.Lock)
    last: float = attrs.Factory(trio.current_time)
    """When the stream last sent something."""

    async def send(self, ended: bool = False) -> None:
        async with self.lock:
            if self.pending.out:
                await self.pending.send()
                self.last = trio.current_time()

    async def ping(self) -> None:
        try:
            while True:
                await trio.sleep_until(self.last + self.interval)
                async with self.lock:
                    if trio.current_time() >= self.last + self.interval:
                        await self.pending.stream.send(PING)
                        self.last = trio.current_time()
        except PeerGone:
            return  # the relay finds the client gone at its next send


def _alone(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """What a nursery wrapped, as the relay alone would have raised it: its one exception
    beside the cancellations (an outer scope cancelled the pinger too), or a cancellation
    (what a lease's block counts as the client leaving); else the group."""
    found = leaves(group)
    others = [leaf for leaf in found if not isinstance(leaf, trio.Cancelled)]
    if len(others) == 1:
        return others[0]
    return found[0] if not others else group


async def count_tokens(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    """``POST /v1/messages/count_tokens``: the input's estimate by the edge's one token
    estimator (no model runs; an unknown model is a 404 as for ``/v1/messages``)."""
    body = parse_count_tokens_request(await request.body())
    model = body["model"]
    if edge.metric_model_label(model) == "unknown" and model not in edge.registry.models():
        raise NotFound(f"model {model!r} is not served here", code="model_not_found")
    payload = orjson.dumps({"input_tokens": count_input_tokens(body)})
    await responder.respond(200, (*JSON_HEADERS, *ctx.headers), payload)


_POST: Final = ("POST",)

FRONT_END: Final = FrontEnd(
    "anthropic",
    {
        MESSAGES_PATH: RouteSpec(_POST, messages, "client", work=True),
        COUNT_TOKENS_PATH: RouteSpec(_POST, count_tokens, "client"),
    },
    anthropic_error,
)
"""Registered with one line in ``api/app.py``'s ``FRONT_ENDS``."""
