"""The OpenAI front end: ``POST /v1/chat/completions``, ``POST /v1/embeddings`` (normalized
providers whose adapter embeds, and tunnels: :func:`embeddings`), ``GET /v1/models`` (served
groups and their configured aliases), ``GET /v1/models/{id}``, the tunnel-only
``POST /v1/completions`` (:func:`tunnel_route`) and images, audio, moderations and rerank
(:mod:`._media`); a tunnel's answer relayed by :mod:`dispatcher.api.tunnel_relay`; errors in
OpenAI's shape
(:func:`~dispatcher.api.common.openai_error`).

A body is validated against its route's schema (:mod:`._request`) before anything is
dispatched; the committed answer is rendered back (:mod:`._answer`).

Streaming follows OpenAI's ``chat.completion.chunk`` SSE shape. Nothing is sent to the client
until the run's first content (or its end): until then a failure is still an HTTP status. After
that, a failure becomes an SSE error event and the stream ends without ``[DONE]`` -- never a
silent clean end.
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Sequence
from typing import Any

import orjson
import trio

from ... import wire
from ...errors import BadRequest, NotFound, RunError
from ...gate.attempts import Answer, GateRequest, TunnelAnswer
from ...http import (
    HTTPStream,
    PeerGone,
    Request,
    Responder,
)
from ...tenants import Tenant
from ..affinity import affinity_key
from ..common import (
    JSON_HEADERS,
    SHUTDOWN_SEND_TIMEOUT,
    SSE_HEADERS,
    ModelCall,
    Pending,
    both,
    dispatch_headers,
    model_route,
    openai_error,
    relay_rest,
    serving,
    tunnel_only,
)
from ..front import FrontEnd, RouteContext, RouteSpec
from ..seam import EdgeServices
from ..tunnel_relay import relay
from ._answer import ChunkWriter, collect, completion_body, render_event, sse_error
from ._embeddings import render_embeddings
from ._media import MEDIA_ROUTES, media_route
from ._request import ChatRequest, parse_chat_request, parse_tunnel_body


@model_route
async def chat_completions(call: ModelCall, responder: Responder) -> str:
    chat = parse_chat_request(await call.request.body())
    gated = await call.gate_request(
        chat.body,
        stream=chat.stream,
        predicate=serving("chat"),
        affinity=functools.partial(affinity_key, call.request.headers, chat.body),
    )
    return await _chat(call.edge, chat, gated, responder, call.ctx)


async def _chat(
    edge: EdgeServices,
    chat: ChatRequest,
    gated: GateRequest,
    responder: Responder,
    ctx: RouteContext,
) -> str:
    """Serve one parsed chat request through the gate; return its outcome for the metrics
    (when no attempt was dispatched; otherwise the gate's row outcome counts)."""
    async with edge.gate.open(gated) as answer:
        answer_headers = (*ctx.headers, *dispatch_headers(answer.result, answer.attempts))
        if isinstance(answer, TunnelAnswer):
            return await relay(edge, answer, chat.body, responder, answer_headers)
        try:
            if chat.stream:
                await _stream(edge, chat, answer, responder, answer_headers)
            else:
                await _complete(chat, answer, responder, answer_headers)
        except PeerGone:
            answer.client_gone()  # a reset is a client leaving, like a cancellation
            raise
        return "completed" if isinstance(answer.terminal, wire.RunCompleted) else "failed"


async def _complete(
    chat: ChatRequest, answer: Answer, responder: Responder, headers: Sequence[tuple[bytes, bytes]]
) -> None:
    """A non-streamed answer: the gate committed it complete (its head ends with
    ``run.completed``)."""
    body = completion_body(chat, answer.run.run_id, answer.head)
    await responder.respond(200, (*JSON_HEADERS, *headers), orjson.dumps(body))


async def _stream(
    edge: EdgeServices,
    chat: ChatRequest,
    answer: Answer,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
) -> None:
    """A streamed answer: the gate committed at its first content; from here a failure is an
    SSE error event and the stream ends without ``[DONE]``."""
    writer = ChunkWriter(chat, answer.run)
    usage: wire.Usage | None = None
    stream = await responder.start_stream(200, (*SSE_HEADERS, *headers))
    pending = Pending(stream)

    def render(event: wire.RunEvent) -> bool:
        nonlocal usage
        usage, ended = render_event(writer, event, usage, pending.out)
        return ended

    with edge.stream_scope() as scope:
        pending.out.append(writer.choice({"role": "assistant", "content": ""}))
        ended = False
        for event in answer.head:
            ended = render(event)
        await pending.send()
        if not ended:
            await relay_rest(answer, render, pending.send)
        if isinstance(answer.terminal, wire.RunCompleted):
            tail = [writer.usage(usage)] if chat.include_usage else []
            tail.append(b"data: [DONE]\n\n")
            await stream.send(b"".join(tail))
    if scope.cancelled_caught:
        with trio.move_on_after(SHUTDOWN_SEND_TIMEOUT, shield=True):
            await stream.send(sse_error("the dispatcher is shutting down", "shutting_down"))


@model_route
async def tunnel_route(call: ModelCall, responder: Responder) -> str:
    """``POST /v1/completions``: relayed through a tunnel."""
    route = call.request.path
    body = parse_tunnel_body(await call.request.body(), route=route)
    stream = body.get("stream") is True
    gated = await call.gate_request(
        body,
        stream=stream,
        predicate=both(serving("completions"), tunnel_only(route)),
        affinity=functools.partial(affinity_key, call.request.headers, body),
    )
    async with call.edge.gate.open(gated) as answer:
        assert isinstance(answer, TunnelAnswer), "the predicate admits tunnels only"
        return await relay(call.edge, answer, body, responder, call.ctx.headers)


@model_route
async def embeddings(call: ModelCall, responder: Responder) -> str:
    """``POST /v1/embeddings``: on a candidate that serves ``embeddings`` -- relayed through a
    tunnel, or run normalized (``run.request.route`` ``embeddings``) and answered as one JSON
    body when the run completed (:func:`._embeddings.embeddings_body`)."""
    body = parse_tunnel_body(await call.request.body(), route="/v1/embeddings")
    gated = await call.gate_request(
        body,
        stream=body.get("stream") is True,
        predicate=serving("embeddings"),
        run_route="embeddings",
    )
    async with call.edge.gate.open(gated) as answer:
        if isinstance(answer, TunnelAnswer):
            return await relay(call.edge, answer, body, responder, call.ctx.headers)
        headers = (*call.ctx.headers, *dispatch_headers(answer.result, answer.attempts))
        # An embeddings run has no content before its end: the gate committed it complete.
        events = list(answer.head)
        async for event in answer:
            events.append(event)
        terminal = answer.terminal
        if not isinstance(terminal, wire.RunCompleted):
            message = terminal.message if isinstance(terminal, wire.RunFailed) else "no answer"
            raise RunError(f"the embeddings run ended without its answer: {message}")
        rendered = await render_embeddings(body, events, answer.run.usage)
        try:
            await responder.respond(200, (*JSON_HEADERS, *headers), rendered)
        except PeerGone:
            answer.client_gone()  # a reset is a client leaving, like a cancellation
            raise
        return "completed"


def served_models(edge: EdgeServices, tenant: Tenant | None = None) -> list[str]:
    """The model names a client may ask for now, sorted: every served model group and every
    configured alias of a served group (those ``tenant``'s key may use)."""
    served = edge.registry.models()
    names = set(served)
    names.update(alias for alias, group in edge.model_aliases().items() if group in served)
    return sorted(name for name in names if tenant is None or tenant.allows(name))


def _model_object(edge: EdgeServices, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(edge.started_at),
        "owned_by": "trio-dispatcher",
    }


async def list_models(
    edge: EdgeServices,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
    tenant: Tenant | None = None,
) -> None:
    data = [_model_object(edge, name) for name in served_models(edge, tenant)]
    body = orjson.dumps({"object": "list", "data": data})
    await responder.respond(200, (*JSON_HEADERS, *headers), body)


async def _models(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    await list_models(edge, responder, ctx.headers, ctx.tenant)


MODEL_ID_ROUTE = "/v1/models/{id}"
"""One model: the last path segment, percent-decoded (the OpenAI SDK encodes a ``/`` in a
model id as ``%2F``)."""


async def _model(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    name = urllib.parse.unquote(request.path.rpartition("/")[2])
    if request.query:
        raise BadRequest(
            "query parameters are not supported on /v1/models/{id}", code="unsupported_parameter"
        )
    served = edge.registry.models()
    allowed = ctx.tenant is None or ctx.tenant.allows(name)
    if not allowed or (name not in served and edge.model_aliases().get(name) not in served):
        raise NotFound(
            f"The model {name!r} does not exist or is not served here", code="model_not_found"
        )
    body = orjson.dumps(_model_object(edge, name))
    await responder.respond(200, (*JSON_HEADERS, *ctx.headers), body)


_POST = ("POST",)

FRONT_END = FrontEnd(
    "openai",
    {
        "/v1/chat/completions": RouteSpec(_POST, chat_completions, "client", work=True),
        "/v1/completions": RouteSpec(_POST, tunnel_route, "client", work=True),
        "/v1/embeddings": RouteSpec(_POST, embeddings, "client", work=True),
        "/v1/models": RouteSpec(("GET", "HEAD"), _models, "client"),
        MODEL_ID_ROUTE: RouteSpec(("GET", "HEAD"), _model, "client"),
        **{path: RouteSpec(_POST, media_route, "client", work=True) for path in MEDIA_ROUTES},
    },
    openai_error,
)

__all__ = [
    "FRONT_END",
    "JSON_HEADERS",
    "MODEL_ID_ROUTE",
    "HTTPStream",
    "chat_completions",
    "collect",
    "embeddings",
    "list_models",
    "parse_chat_request",
    "served_models",
    "tunnel_route",
]
