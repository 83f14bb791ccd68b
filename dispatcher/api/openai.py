"""The OpenAI front end: ``POST /v1/chat/completions``, ``GET /v1/models`` (served groups and
their configured aliases), ``GET /v1/models/{id}``, and the
tunnel-only ``POST /v1/completions`` and ``POST /v1/embeddings`` (``api.tunnel_relay``);
errors in OpenAI's shape (:func:`~dispatcher.api.common.openai_error`).

Streaming follows OpenAI's ``chat.completion.chunk`` SSE shape. Nothing is sent to the client
until the run's first content (or its end): until then a failure is still an HTTP status. After
that, a failure becomes an SSE error event and the stream ends without ``[DONE]`` -- never a
silent clean end.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import attrs
import orjson
import trio

from .. import wire
from ..errors import BadRequest, NotFound, openai_error_object
from ..gate.attempts import Answer, GateRequest, TunnelAnswer
from ..http import (
    HTTPStream,
    PeerGone,
    Request,
    Responder,
)
from ..paths.runs import Run
from ..tenants import Tenant
from . import schema
from .common import (
    JSON_HEADERS,
    ModelCall,
    Pending,
    dispatch_headers,
    model_route,
    openai_error,
    relay_rest,
)
from .front import FrontEnd, RouteContext, RouteSpec
from .seam import EdgeServices
from .tunnel_relay import relay, tunnel_route

SSE_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


@attrs.frozen(kw_only=True)
class ChatRequest:
    model: str
    body: dict[str, Any]
    stream: bool
    include_usage: bool


def parse_chat_request(raw: bytes, *, max_size: int | None = None) -> ChatRequest:
    """Parse and validate a chat-completions body (:data:`schema.CHAT_COMPLETIONS`); raise
    :class:`BadRequest` naming the bad field. The body is kept as the client sent it."""
    body = schema.parse(raw, schema.CHAT_COMPLETIONS, max_size=max_size)
    options = body.get("stream_options")
    return ChatRequest(
        model=body["model"],
        body=body,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
    )


def _usage_object(usage: wire.Usage | None) -> dict[str, int]:
    # A node's counts are not trusted to be sane: never relay a negative count.
    prompt = max(0, usage.prompt_tokens) if usage else 0
    completion = max(0, usage.completion_tokens) if usage else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@model_route
async def chat_completions(call: ModelCall, responder: Responder) -> str:
    chat = parse_chat_request(await call.request.body())
    gated = await call.gate_request(chat.body, stream=chat.stream)
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
    ``run.completed``). Tool-call deltas are assembled into ``message.tool_calls``; the
    ``content`` is null when there was no text but tool calls, as OpenAI answers."""
    answered = collect(answer.head)
    usage, finish, text = answered.usage, answered.finish_reason, answered.text
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if answered.tool_calls:
        message["content"] = text or None
        message["tool_calls"] = answered.tool_calls
    body = {
        "id": f"chatcmpl-{answer.run.run_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": _usage_object(usage),
    }
    await responder.respond(200, (*JSON_HEADERS, *headers), orjson.dumps(body))


@attrs.frozen
class Collected:
    """A complete run's answer, as a non-streamed response renders it."""

    text: str
    tool_calls: list[dict[str, Any]]
    """Assembled, in OpenAI's ``message.tool_calls`` shape (:class:`ToolCallAccumulator`)."""
    usage: wire.Usage | None
    finish_reason: str


def collect(head: Sequence[wire.RunEvent]) -> Collected:
    """The events of a complete run (its head ends with ``run.completed``) as one answer: the
    text, the tool calls assembled, the last usage reported, the finish reason."""
    parts: list[str] = []
    calls = ToolCallAccumulator()
    usage: wire.Usage | None = None
    finish = "stop"
    for event in head:
        if isinstance(event, wire.RunDelta):
            parts.append(event.text)
            calls.add(event.tool_calls)
        elif isinstance(event, wire.RunUsage):
            usage = event.usage
        elif isinstance(event, wire.RunCompleted):
            finish = event.finish_reason
    return Collected("".join(parts), calls.result(), usage, finish)


class ToolCallAccumulator:
    """Streaming tool-call deltas (``{"index", "id"?, "type"?, "function": {"name"?,
    "arguments"?}}``) assembled into complete calls, by ``index``: the first ``id``, ``type``
    and ``name`` seen win, ``arguments`` pieces are concatenated."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, deltas: Sequence[wire.JSONObject]) -> None:
        for delta in deltas:
            index = delta.get("index", 0)
            if type(index) is not int:
                continue
            call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": []})
            if isinstance(delta.get("id"), str) and not call["id"]:
                call["id"] = delta["id"]
            function = delta.get("function")
            if not isinstance(function, dict):
                continue
            if isinstance(function.get("name"), str) and not call["name"]:
                call["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                call["arguments"].append(function["arguments"])

    def result(self) -> list[dict[str, Any]]:
        """The calls in ``index`` order, in OpenAI's ``message.tool_calls`` shape."""
        return [
            {
                "id": call["id"] or f"call_{index}",
                "type": "function",
                "function": {"name": call["name"], "arguments": "".join(call["arguments"])},
            }
            for index, call in sorted(self._calls.items())
        ]


class _ChunkWriter:
    """Builds ``chat.completion.chunk`` SSE events for one response."""

    def __init__(self, chat: ChatRequest, run: Run) -> None:
        self._prefix = (
            b'data: {"id":"chatcmpl-'
            + run.run_id.encode()
            + b'","object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + orjson.dumps(chat.model)
            + b',"system_fingerprint":null,"choices":'
        )
        self._suffix = b',"usage":null}\n\n' if chat.include_usage else b"}\n\n"

    def choice(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._prefix + orjson.dumps([choice]) + self._suffix

    def usage(self, usage: wire.Usage | None) -> bytes:
        return self._prefix + b'[],"usage":' + orjson.dumps(_usage_object(usage)) + b"}\n\n"


def sse_error(message: str, code: str) -> bytes:
    body = openai_error_object(message, error_type="server_error", code=code)
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def _stream(
    edge: EdgeServices,
    chat: ChatRequest,
    answer: Answer,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
) -> None:
    """A streamed answer: the gate committed at its first content; from here a failure is an
    SSE error event and the stream ends without ``[DONE]``."""
    writer = _ChunkWriter(chat, answer.run)
    usage: wire.Usage | None = None
    stream = await responder.start_stream(200, (*SSE_HEADERS, *headers))
    pending = Pending(stream)

    def render(event: wire.RunEvent) -> bool:
        nonlocal usage
        usage, ended = _render(writer, event, usage, pending.out)
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
        with trio.move_on_after(1, shield=True):
            await stream.send(sse_error("the dispatcher is shutting down", "shutting_down"))


def _render(
    writer: _ChunkWriter, event: wire.RunEvent, usage: wire.Usage | None, out: list[bytes]
) -> tuple[wire.Usage | None, bool]:
    """Append the SSE bytes for ``event``; return the usage so far and whether it ended."""
    if isinstance(event, wire.RunDelta):
        delta: dict[str, Any] = {}
        if event.text or not event.tool_calls:
            delta["content"] = event.text
        if event.tool_calls:
            delta["tool_calls"] = list(event.tool_calls)
        out.append(writer.choice(delta))
    elif isinstance(event, wire.RunUsage):
        return event.usage, False
    elif isinstance(event, wire.RunCompleted):
        out.append(writer.choice({}, event.finish_reason))
        return usage, True
    elif isinstance(event, wire.RunFailed):
        out.append(sse_error(f"the model run failed: {event.message}", event.code))
        return usage, True
    elif isinstance(event, wire.RunCancelled):
        out.append(sse_error("the node cancelled the run", "cancelled"))
        return usage, True
    return usage, False


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
        "/v1/embeddings": RouteSpec(_POST, tunnel_route, "client", work=True),
        "/v1/models": RouteSpec(("GET", "HEAD"), _models, "client"),
        MODEL_ID_ROUTE: RouteSpec(("GET", "HEAD"), _model, "client"),
    },
    openai_error,
)

__all__ = [
    "FRONT_END",
    "JSON_HEADERS",
    "MODEL_ID_ROUTE",
    "HTTPStream",
    "chat_completions",
    "list_models",
    "parse_chat_request",
    "served_models",
]
