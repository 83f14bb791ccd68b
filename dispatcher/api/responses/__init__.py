"""The OpenAI Responses front end: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}`` (see ``docs/responses.md``).

A Responses request is translated into the typed
:class:`~dispatcher.gate.attempts.GateRequest` with an
OpenAI chat body (``instructions`` and the ``input`` items as ``messages``, function ``tools``,
``tool_choice``, ``max_output_tokens`` as ``max_tokens`` ...), so it takes the same gate,
recovery, cancellation and usage rows as chat completions; the ledger's row records the route
``/v1/responses``. Admission (:data:`RESPONSES_PREDICATE`, ``serving("responses")``) offers
every normalized candidate (translated) and the tunnel candidates whose provider declares the
route ``responses``: those are relayed natively (:func:`~dispatcher.api.tunnel_relay.relay`,
the Responses dialect), the client's body as sent but for ``model``. A native answer is the
upstream's: the edge does not store it (``store`` goes to the upstream as sent). A request
with ``previous_response_id`` names a response this edge stored, whose conversation only the
edge has: it is served translated (:data:`CHAINED_PREDICATE` refuses tunnel candidates).

Nothing is written before the gate yields the committed answer: for a stream, the preamble
(``response.created``, ``response.in_progress``) goes out with the first content, so a failure
before it is still an HTTP status (and recovered by the gate). After it, a failure is a
``response.failed`` event with an error ``code`` and the stream ends there -- never a
``response.completed``.

Stored responses (``store``, true unless the client says false) live in the edge's
:class:`~dispatcher.store.responses.ResponseStore` (SQLite beside the usage ledger, bounded by
count, bytes and age), reached through the seam (``EdgeServices.response_store``);
``previous_response_id`` prepends the stored conversation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import attrs
import orjson
import trio

from ... import wire
from ...errors import BadRequest, NotFound, StoreUnavailable
from ...gate.attempts import Answer, TunnelAnswer
from ...http import PeerGone, Request, Responder
from ...store.seam import ResponseStore, StoredResponse
from ...wire import JSONObject
from ..affinity import affinity_key
from ..common import (
    JSON_HEADERS,
    SHUTDOWN_SEND_TIMEOUT,
    SSE_HEADERS,
    ModelCall,
    both,
    dispatch_headers,
    fit_effort,
    model_route,
    normalized_only,
    openai_error,
    relay_rest,
    serving,
)
from ..front import (
    FrontEnd,
    Route,
    RouteContext,
    RouteSpec,
)
from ..seam import EdgeServices
from ..tunnel_relay import relay
from ._answer import (
    Events,
    Turn,
    error_code,
    final_event,
)
from ._request import (
    ParsedResponsesRequest,
    chat_body,
    parse_responses_request,
)

__all__ = [
    "CHAINED_PREDICATE",
    "FRONT_END",
    "RESPONSES_PATH",
    "RESPONSES_PREDICATE",
    "RESPONSE_ID_ROUTE",
    "ParsedResponsesRequest",
    "ResponseStore",
    "StoredResponse",
    "chat_body",
    "error_code",
    "make_front_end",
    "parse_responses_request",
]

RESPONSES_PATH: Final = "/v1/responses"
RESPONSE_ID_ROUTE: Final = "/v1/responses/{id}"
"""The route of one stored response: a pattern route (``api.app`` matches the last path
segment as ``{id}``)."""

RESPONSES_PREDICATE: Final = serving("responses")
"""The admission predicate of ``/v1/responses``: normalized candidates (translated) and tunnel
candidates whose provider declares ``responses`` (relayed natively); no attempt is spent on
another tunnel."""
CHAINED_PREDICATE: Final = both(
    RESPONSES_PREDICATE,
    normalized_only(
        "serves this model through a tunnel, and previous_response_id names a response "
        "stored by this edge, which an upstream does not have"
    ),
)
"""The admission predicate of a request with ``previous_response_id``: the conversation is in
the edge's store, so only a translated answer can continue it."""

# --------------------------------------------------------------------------- routes


StoreOf = Callable[[EdgeServices], ResponseStore]
"""Where a route finds the store: the edge's (``EdgeServices.response_store``), or one an
embedder or a test gave :func:`make_front_end`."""


log = logging.getLogger("dispatcher.api.responses")


@attrs.define
class _Unstored:
    """Answers that went out unstored (the store's database down): a WARNING for the first,
    then at most one every :attr:`every` seconds with the count since -- not one a request."""

    every: float = 60.0
    _last: float | None = None
    _since: int = 0

    def warn(self, response_id: object, exc: StoreUnavailable) -> None:
        self._since += 1
        now = trio.current_time()
        if self._last is not None and now - self._last < self.every:
            return
        log.warning(
            "response %s answered but not stored (%d unstored since the last warning; a "
            "previous_response_id naming them will not be found): %s",
            response_id,
            self._since,
            exc,
        )
        self._last, self._since = now, 0


_not_stored = _Unstored()


def _edge_store(edge: EdgeServices) -> ResponseStore:
    return edge.response_store


async def _history(
    store: ResponseStore, previous: str | None, owner: str | None
) -> list[JSONObject]:
    if previous is None:
        return []
    stored = await store.get(previous, owner)
    if stored is None:
        raise BadRequest(
            f"previous response {previous!r} was not found: it was not stored (store: false), "
            "was deleted, or is past the store's bounds",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return list(stored.conversation)


def _create_route(store_of: StoreOf) -> Route:
    @model_route
    async def create_response(call: ModelCall, responder: Responder) -> str:
        request = parse_responses_request(await call.request.body())
        if request.tools.dropped:
            _drop_built_in_tools(call, request)
        previous = request.body.get("previous_response_id")
        owner = call.ctx.attribution
        store = store_of(call.edge)
        history = await _history(store, previous, owner)
        chat = chat_body(request, history)
        gated = await call.gate_request(
            chat,
            stream=request.stream,
            predicate=RESPONSES_PREDICATE if previous is None else CHAINED_PREDICATE,
            prepare=fit_effort(chat),
            tunnel_body=request.body,
            affinity=functools.partial(affinity_key, call.request.headers, request.body, chat),
        )
        turn = Turn(request, previous)

        async def keep() -> None:
            # Before the answer's last byte: a client that chains on it at once finds it.
            if request.store and turn.fields["status"] in ("completed", "incomplete"):
                try:
                    await store.put(turn.response(), turn.conversation(history), owner)
                except StoreUnavailable as exc:
                    # The answer is the client's all the same: it goes out, unstored.
                    _not_stored.warn(turn.fields["id"], exc)

        async with call.edge.gate.open(gated) as answer:
            if isinstance(answer, TunnelAnswer):  # a provider speaking the Responses API
                own = [h for h in call.ctx.headers if h[0] != DROPPED_TOOLS_HEADER]
                return await relay(call.edge, answer, chat, responder, own)
            headers = (*call.ctx.headers, *dispatch_headers(answer.result, answer.attempts))
            try:
                reply = _Reply(turn, answer, responder, headers, keep)
                if request.stream:
                    await _stream(call.edge, reply)
                else:
                    await _complete(reply)
            except PeerGone:
                answer.client_gone()  # a reset is a client leaving, like a cancellation
                raise
            return "completed" if isinstance(answer.terminal, wire.RunCompleted) else "failed"

    return create_response


DROPPED_TOOLS_HEADER: Final = b"x-dispatcher-dropped-tools"
"""The answer's header naming the built-in tools dropped from the request."""


def _drop_built_in_tools(call: ModelCall, request: ParsedResponsesRequest) -> None:
    """The request offers built-in tools no backend runs: refused where the edge is set so,
    else dropped, which its answers' header and its access line say."""
    dropped = request.tools.dropped
    if call.ctx.settings.refuse_built_in_tools:
        tools = request.body["tools"]
        index = next(i for i, tool in enumerate(tools) if tool["type"] == dropped[0])
        raise BadRequest(
            f"'tools[{index}].type': built-in tools ({', '.join(dropped)}) are refused by this "
            "edge: no model behind it can run them; offer function tools instead",
            param=f"tools[{index}].type",
            code="unsupported_value",
        )
    names = ",".join(dropped)
    headers = (*call.ctx.headers, (DROPPED_TOOLS_HEADER, names.encode()))
    call.ctx = attrs.evolve(call.ctx, headers=headers)
    if call.ctx.record is not None:
        call.ctx.record.dropped_tools = names


@attrs.frozen
class _Reply:
    """What delivering one committed answer takes: the response being built, the gate's
    answer, where it goes (with the attempt's headers), and how to store it once complete."""

    turn: Turn
    answer: Answer
    responder: Responder
    headers: Sequence[tuple[bytes, bytes]]
    keep: Callable[[], Awaitable[None]]


async def _complete(reply: _Reply) -> None:
    """A non-streamed answer: the gate committed it complete."""
    for event in reply.answer.head:
        if reply.turn.feed(event):
            break
    await reply.keep()
    body = reply.turn.response()
    await reply.responder.respond(200, (*JSON_HEADERS, *reply.headers), orjson.dumps(body))


async def _stream(edge: EdgeServices, reply: _Reply) -> None:
    """A streamed answer: the gate committed at its first content; the preamble goes out with
    it. From here a failure is ``response.failed``."""
    events = Events()
    started = reply.turn.response()
    preamble: list[JSONObject] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    stream = await reply.responder.start_stream(200, (*SSE_HEADERS, *reply.headers))

    async def send(ended: bool) -> None:
        # the events of the batch that ended the answer go out with the final one, below
        if not ended and (chunk := reply.turn.output.take_events()):
            await stream.send(events.encode(chunk))

    ended = False
    with edge.stream_scope() as scope:
        for event in reply.answer.head:
            if ended := reply.turn.feed(event):
                break
        await stream.send(events.encode([*preamble, *reply.turn.output.take_events()]))
        if not ended:
            ended = await relay_rest(reply.answer, reply.turn.feed, send)
        if not ended:  # the run's events ended without a terminal one
            reply.turn.fail("server_error", "the model run ended without finishing")
        await reply.keep()
        await stream.send(
            events.encode([*reply.turn.output.take_events(), final_event(reply.turn)])
        )
    if scope.cancelled_caught:
        reply.turn.fail("server_error", "the dispatcher is shutting down")
        with trio.move_on_after(SHUTDOWN_SEND_TIMEOUT, shield=True):
            await stream.send(
                events.encode([*reply.turn.output.take_events(), final_event(reply.turn)])
            )


def _response_id(request: Request) -> str:
    response_id = request.path.rpartition("/")[2]
    if not response_id:
        raise NotFound("no response id in the path", code="unknown_url")
    return response_id


def _not_found(response_id: str) -> NotFound:
    return NotFound(
        f"response {response_id!r} was not found: it was not stored (store: false), was "
        "deleted, or is past the store's bounds",
        code="response_not_found",
    )


def _stored_route(store_of: StoreOf) -> Route:
    async def stored_response(
        edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
    ) -> None:
        store = store_of(edge)
        response_id = _response_id(request)
        if request.query:
            raise BadRequest(
                f"query parameters are not supported on {RESPONSES_PATH}/{{id}}",
                code="unsupported_parameter",
            )
        headers = (*JSON_HEADERS, *ctx.headers)
        if request.method == "DELETE":
            if not await store.delete(response_id, ctx.attribution):
                raise _not_found(response_id)
            body: JSONObject = {"id": response_id, "object": "response.deleted", "deleted": True}
            await responder.respond(200, headers, orjson.dumps(body))
            return
        stored = await store.get(response_id, ctx.attribution)
        if stored is None:
            raise _not_found(response_id)
        await responder.respond(200, headers, orjson.dumps(stored.response))

    return stored_response


def make_front_end(store: ResponseStore | None = None) -> FrontEnd:
    """The Responses front end over ``store``; None (what :data:`FRONT_END` is): the edge's
    own, ``EdgeServices.response_store``, which ``open_dispatcher`` opens beside the ledger."""
    store_of: StoreOf = _edge_store if store is None else (lambda _: store)
    return FrontEnd(
        "responses",
        {
            RESPONSES_PATH: RouteSpec(("POST",), _create_route(store_of), "client", work=True),
            RESPONSE_ID_ROUTE: RouteSpec(("GET", "DELETE"), _stored_route(store_of), "client"),
        },
        openai_error,
    )


FRONT_END: Final = make_front_end()
"""The front end ``api.app.FRONT_ENDS`` registers, over the edge's store."""
