"""The tunnel relay: answer an OpenAI request through a tunnel, bytes as the provider sent them.

Routes: ``POST /v1/completions`` and ``POST /v1/embeddings`` (:func:`tunnel_route`: only
candidates served through a tunnel can take them; others are rejected with 400), and
``POST /v1/chat/completions`` when admission chose a tunnel candidate (the chat route calls
:func:`relay`).

What the provider receives: the client's method, path, query and body with ``model`` replaced
by the served name; the client's headers minus hop-by-hop ones, ``Host``, ``Content-Length``,
``Accept-Encoding`` and the client's own ``Authorization`` (the node adds the provider's key).
For ``"stream": true`` without ``stream_options.include_usage`` the edge adds that option so
that the stream reports usage, and strips the extra usage chunk it causes (the SSE event whose
JSON has ``"choices": []`` and a ``usage`` object) from what the client receives.

What the client receives: the provider's status, its headers minus hop-by-hop ones,
``Content-Length``, ``Date`` and any the edge sets itself (``x-request-id``,
``x-dispatcher-*``), and the body byte for byte (apart from that stripped chunk). An SSE
response is streamed as it arrives; another body is answered whole (with ``Content-Length``)
up to :data:`BUFFER_LIMIT` bytes, and streamed beyond.

Two phases. :func:`commit_tunnel` is the pre-commit phase, which the gate runs inside its
attempt (``GateRequest.tunnel_call``): send the request, await the start, read up to the
commit point (the first SSE event that carries content; a whole body); a 5xx / 429 or a
failure before that fails the attempt and the gate recovers on another candidate.
:func:`relay` is the relay phase of the committed answer: the head, then the rest. If an SSE
stream breaks off (or stalls) after the commit, an SSE error event ends it; if another
streamed body does, the connection is cut so the client sees the body is incomplete.

Usage: read from the JSON body or the stream's usage chunk without altering the bytes, and
reported once per tunnel (``Tunnel.on_usage``); an estimate when the provider reported none.
The gate's usage row of the attempt reads it from there.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson
import trio

from .. import wire
from ..admission import Candidate
from ..errors import TunnelFailed
from ..gate import AttemptFailed, PreCommit, TunnelAnswer, TunnelCall
from ..http import PeerGone, Request, Responder
from ..pool import DispatchResult
from ..tunnel import Tunnel
from . import schema
from .common import CutResponse, counted_request, dispatch_headers, gate_request

if TYPE_CHECKING:
    from ..service import Dispatcher
    from .app import RouteContext

log = logging.getLogger("dispatcher.api.tunnel")

BUFFER_LIMIT: Final = 256 * 1024
"""A non-streamed body up to this size is answered whole, with ``Content-Length``."""
USAGE_TAIL: Final = 16 * 1024
"""Of a larger non-streamed body, how much of the end is kept to find ``usage`` in."""
MAX_SSE_EVENT: Final = 64 * 1024
"""An unfinished SSE event longer than this is passed on without waiting for its end (it
cannot be the usage chunk)."""
SHUTDOWN_SEND_TIMEOUT: Final = 1.0

HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
_REQUEST_DROP: Final = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"authorization",
    b"accept-encoding",
    b"expect",
}
_RESPONSE_DROP: Final = HOP_BY_HOP | {b"content-length", b"date"}
_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_FIELD_VALUE: Final = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")
_SSE_BOUNDARY: Final = re.compile(rb"(?>\r\n|\n|\r)(?>\r\n|\n|\r)")
_SSE_LINE: Final = re.compile(rb"\r\n|\n|\r")
_USAGE_KEY: Final = b'"usage"'

TUNNEL_ROUTES: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_STREAM_USAGE_ROUTES: Final = frozenset({"/v1/chat/completions", "/v1/completions"})


# --------------------------------------------------------------------------- headers


def _connection_listed(headers: Sequence[tuple[bytes, bytes]]) -> set[bytes]:
    return {
        name.strip().lower()
        for key, value in headers
        if key.lower() == b"connection"
        for name in value.split(b",")
    }


def upstream_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The client's headers for the provider: minus hop-by-hop ones (and those the
    ``Connection`` header names), ``Host``, ``Content-Length``, ``Accept-Encoding``,
    ``Expect`` and ``Authorization``; ``Content-Type: application/json`` when the client
    sent none."""
    listed = _connection_listed(headers)
    out = [
        (key.decode("latin-1"), value.decode("latin-1"))
        for key, value in headers
        if key.lower() not in _REQUEST_DROP and key.lower() not in listed
    ]
    if not any(key.lower() == "content-type" for key, _ in out):
        out.append(("content-type", "application/json"))
    return out


def client_headers(
    start_headers: Sequence[tuple[str, str]], own: Sequence[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """The provider's response headers for the client, then ``own``: minus hop-by-hop ones,
    ``Content-Length`` and ``Date`` (our server frames the body and dates the response), the
    names in ``own``, and anything that is not a valid header."""
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in start_headers]
    drop = _RESPONSE_DROP | _connection_listed(raw) | {name.lower() for name, _ in own}
    out: list[tuple[bytes, bytes]] = []
    for key, value in raw:
        key = key.lower()
        value = value.strip()
        if key in drop or not _TOKEN.match(key) or not _FIELD_VALUE.match(value):
            continue
        out.append((key, value))
    out.extend(own)
    return out


def _is_sse(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    for key, value in headers:
        if key == b"content-type":
            return value.split(b";")[0].strip().lower() == b"text/event-stream"
    return False


# --------------------------------------------------------------------------- usage


Usage = tuple[int, int]
"""``(prompt_tokens, completion_tokens)``."""


def usage_of(value: Any) -> Usage | None:
    """The ``usage`` of an OpenAI response object, if it has a well-formed one
    (``completion_tokens`` may be absent, as in embeddings)."""
    if not isinstance(value, dict):
        return None
    usage = value.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens", 0)
    if completion is None:
        completion = 0
    if type(prompt) is not int or type(completion) is not int or prompt < 0 or completion < 0:
        return None
    return prompt, completion


def _body_usage(body: bytes) -> Usage | None:
    try:
        return usage_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def _tail_usage(tail: bytes) -> Usage | None:
    """``usage`` from the end of a JSON body too large to keep whole (OpenAI puts it last)."""
    at = tail.rfind(_USAGE_KEY)
    if at < 0:
        return None
    brace = tail.find(b"{", at)
    if brace < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(tail[brace:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return usage_of({"usage": value})


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Characters of the request's text (messages, prompt, input) / 4, rounded up."""
    chars = 0

    def add(value: Any) -> None:
        nonlocal chars
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    chars += len(item)
                elif isinstance(item, dict):
                    add(item.get("content"))
                    add(item.get("text"))

    add(body.get("messages"))
    add(body.get("prompt"))
    add(body.get("input"))
    return (chars + 3) // 4


class SSEFilter:
    """Passes an SSE byte stream through unchanged, event by event, except the one usage
    chunk the edge asked for (``strip_usage_chunk``); notes the stream's ``usage``.

    Complete events are passed on as soon as they are complete; an unfinished one waits for
    its end (or :meth:`finish`). Only events that mention ``"usage"`` are parsed."""

    def __init__(self, *, strip_usage_chunk: bool, find_content: bool = False) -> None:
        self._strip = strip_usage_chunk
        self._pending = b""
        self._skip_next = False
        self.usage: Usage | None = None
        self.stripped = False
        self.done = False
        """``data: [DONE]`` went through: the client has the whole answer once it is sent."""
        self.events = 0
        self.content_seen = not find_content
        """An event that carries content went through (with ``find_content``, every event
        is parsed until then)."""

    def feed(self, data: bytes) -> bytes:
        buf = self._pending + data if self._pending else data
        out: list[bytes] = []
        sent = 0  # buf[:sent] is decided (passed on or stripped)
        event_start = 0
        probe = buf.find(_USAGE_KEY)
        for match in _SSE_BOUNDARY.finditer(buf):
            end = match.end()
            if end == len(buf) and buf[-1] == 0x0D:
                break  # a CR at the very end may be the first half of a CRLF
            self.events += 1
            if buf.startswith(_DONE_EVENT, event_start) or buf.startswith(
                _DONE_EVENT_NO_SPACE, event_start
            ):
                self.done = True
            if self._skip_next:
                self._skip_next = False
            elif 0 <= probe < end:
                if self._inspect(buf[event_start:end]):
                    out.append(buf[sent:event_start])
                    sent = end
            elif not self.content_seen and _carries_content(buf[event_start:end]):
                self.content_seen = True
            if 0 <= probe < end:
                probe = buf.find(_USAGE_KEY, end)
            event_start = end
        out.append(buf[sent:event_start])
        self._pending = buf[event_start:]
        if len(self._pending) > MAX_SSE_EVENT:
            out.append(self._pending)
            self._pending = b""
            self._skip_next = True
            self.content_seen = True  # an event this large is output, whatever it holds
        return b"".join(out)

    def finish(self) -> bytes:
        """What is left: an unfinished last event, passed on as it is."""
        rest, self._pending = self._pending, b""
        if rest and not self._skip_next and _USAGE_KEY in rest:
            self.events += 1
            if self._inspect(rest):
                return b""
        return rest

    def _inspect(self, event: bytes) -> bool:
        """Note the event's usage; True if it is the usage chunk to strip."""
        value = _event_json(event)
        if value is None:
            return False
        if not self.content_seen and _has_content(value):
            self.content_seen = True
        usage = usage_of(value)
        if usage is None:
            return False
        self.usage = usage
        if self._strip and not self.stripped and value.get("choices") == []:
            self.stripped = True
            return True
        return False


_DONE_EVENT: Final = b"data: [DONE]"
_DONE_EVENT_NO_SPACE: Final = b"data:[DONE]"
_CONTENT_KEYS: Final = ("content", "text", "tool_calls", "function_call", "refusal")
_REASONING_KEYS: Final = ("reasoning_content", "reasoning")


def _event_json(event: bytes) -> Any:
    """The JSON of an SSE event's ``data`` lines, or None."""
    lines = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in _SSE_LINE.split(event)
        if line.startswith(b"data:")
    ]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None


def _has_content(value: Any) -> bool:
    """A chunk (chat or text completion) with a choice whose delta carries content, text,
    tool calls or reasoning; role-only preambles, finish chunks and usage chunks do not."""
    if not isinstance(value, dict):
        return False
    choices = value.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):  # /v1/completions
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(key) for key in (*_CONTENT_KEYS, *_REASONING_KEYS)
        ):
            return True
    return False


def _carries_content(event: bytes) -> bool:
    return _has_content(_event_json(event))


# --------------------------------------------------------------------------- the relay


def _sse_error(message: str, code: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + b"\n\n"


def upstream_body(body: dict[str, Any], served_model: str, route: str) -> tuple[bytes, bool]:
    """The body for the provider and whether the edge added ``include_usage`` to it."""
    body = {**body, "model": served_model}
    if route in _STREAM_USAGE_ROUTES and body.get("stream") is True:
        options = body.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            body["stream_options"] = {
                **(options if isinstance(options, dict) else {}),
                "include_usage": True,
            }
            return orjson.dumps(body), True
    return orjson.dumps(body), False


@attrs.frozen(kw_only=True)
class TunnelHead:
    """What a tunnel attempt's pre-commit phase read (:func:`commit_tunnel`): the relay sends
    it first, then the rest of the response."""

    start: wire.TunnelStart
    data: bytes = b""
    """The body bytes read before the commit, as the client gets them (filtered, for SSE)."""
    sse: SSEFilter | None = None
    """For a 2xx event stream: the filter the rest goes through."""
    complete: bool = False
    """The body ended within ``data``."""

    @property
    def ok(self) -> bool:
        return 200 <= self.start.status < 300


async def commit_tunnel(
    tunnel: Tunnel, call: TunnelCall, result: DispatchResult, pre_commit: PreCommit
) -> TunnelHead:
    """The pre-commit phase of a tunnel attempt (the gate's :attr:`TunnelCall.commit`): send
    the request, await the response's start, and read up to the commit point -- the first SSE
    event that carries content (or the end of the stream), or a whole non-streamed body (or
    its first :data:`BUFFER_LIMIT` bytes). A 5xx or 429 status fails the attempt (the body is
    not read: leaving the tunnel aborts it); any other status commits at once, relayed as it
    is. The body breaking off before the commit fails the attempt, retryably: the client has
    seen nothing of it."""
    body, injected = upstream_body(call.body, result.served_model, call.path)
    await tunnel.send_request(
        method=call.method,
        path=call.path,
        query=call.query,
        headers=upstream_headers(call.headers),
        body=body.decode("utf-8"),
    )
    start = await tunnel.start()
    where = f"{result.node_id}/{result.provider_id}"
    if not 200 <= start.status <= 599:
        raise TunnelFailed(
            f"the provider behind {where} answered status {start.status}", retryable=True
        )
    if start.status >= 500 or start.status == 429:
        raise AttemptFailed(
            "upstream_rate_limited" if start.status == 429 else "upstream_5xx",
            f"{where}: the provider answered status {start.status}",
            retryable=True,
        )
    if not 200 <= start.status < 300:
        return TunnelHead(start=start)
    try:
        if _is_sse(client_headers(start.headers, ())):
            return await _sse_head(tunnel, start, injected)
        return await _body_head(tunnel, start, pre_commit)
    except TunnelFailed as exc:
        raise AttemptFailed(exc.code, exc.message, retryable=True) from exc


async def _sse_head(tunnel: Tunnel, start: wire.TunnelStart, injected: bool) -> TunnelHead:
    sse = SSEFilter(strip_usage_chunk=injected, find_content=True)
    parts: list[bytes] = []
    size = 0
    while not sse.content_seen and size <= BUFFER_LIMIT:
        data = await tunnel.receive_some()
        if not data:
            parts.append(sse.finish())
            return TunnelHead(start=start, data=b"".join(parts), sse=sse, complete=True)
        out = sse.feed(data)
        parts.append(out)
        size += len(out)
    return TunnelHead(start=start, data=b"".join(parts), sse=sse)


async def _body_head(tunnel: Tunnel, start: wire.TunnelStart, pre_commit: PreCommit) -> TunnelHead:
    parts: list[bytes] = []
    size = 0
    while data := await tunnel.receive_some():
        pre_commit.output()
        parts.append(data)
        size += len(data)
        if size > BUFFER_LIMIT:
            return TunnelHead(start=start, data=b"".join(parts))
    return TunnelHead(start=start, data=b"".join(parts), complete=True)


async def relay(
    dispatcher: Dispatcher,
    answer: TunnelAnswer,
    request_body: dict[str, Any],
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
) -> str:
    """The relay phase of the committed tunnel ``answer``: send its head, then the rest of
    the response (``request_body`` is the client's parsed JSON body, for the usage estimate);
    ``headers`` are the edge's own response headers (``x-dispatcher-node``, ``-provider`` and
    ``-queue-ms`` are added when missing). Returns the outcome for the metrics:
    ``completed``, ``upstream_error`` (the provider answered a non-2xx status, relayed as it
    is) or ``failed``; an error delivered to the client is marked on ``answer``."""
    tunnel = answer.tunnel
    head = answer.head
    assert isinstance(head, TunnelHead), "the answer of commit_tunnel"
    usage: Usage | None = None
    completion_estimate = 0
    names = {name.lower() for name, _ in headers}
    own = [
        *headers,
        *(h for h in dispatch_headers(answer.result, answer.attempts) if h[0] not in names),
    ]
    out_headers = client_headers(head.start.headers, own)
    stall = answer.stall_timeout
    try:
        if head.sse is not None:
            sse = head.sse
            try:
                outcome = await _relay_sse(
                    dispatcher, tunnel, responder, out_headers, head, sse, stall, answer.delivered
                )
            finally:
                usage, completion_estimate = sse.usage, sse.events
            if outcome == "failed":
                answer.failed()
            return outcome
        usage = await _relay_body(tunnel, responder, out_headers, head, stall)
        return "completed" if head.ok else "upstream_error"
    except CutResponse:
        answer.failed()
        raise
    except PeerGone:
        answer.client_gone()
        raise
    finally:
        if usage is not None and head.ok:
            tunnel.on_usage(usage[0], usage[1], True)
        elif head.ok:
            tunnel.on_usage(estimate_prompt_tokens(request_body), completion_estimate, False)
        else:
            tunnel.on_usage(0, 0, False)


async def _receive(tunnel: Tunnel, stall: float) -> bytes:
    """The next piece of the body (``b""`` at the clean end); TunnelFailed when it broke
    off, or when nothing came for ``stall`` seconds."""
    with trio.move_on_after(stall):
        return await tunnel.receive_some()
    raise TunnelFailed(
        f"no output from the provider behind {tunnel.candidate.label} for {stall:g} s",
        code="stall_timeout",
        retryable=False,
    )


async def _relay_sse(
    dispatcher: Dispatcher,
    tunnel: Tunnel,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
    head: TunnelHead,
    sse: SSEFilter,
    stall: float,
    delivered: Callable[[], None],
) -> str:
    """Relay the rest of an event stream; ``delivered`` is called once the client has been
    sent the stream's ``data: [DONE]`` (it then has the whole answer)."""
    stream = await responder.start_stream(head.start.status, headers)
    outcome = "completed"
    with dispatcher.stream_scope() as scope:
        try:
            if head.data:
                await stream.send(head.data)
                if sse.done:
                    delivered()
            if not head.complete:
                while data := await _receive(tunnel, stall):
                    out = sse.feed(data)
                    if out:
                        await stream.send(out)
                        if sse.done:
                            delivered()
                rest = sse.finish()
                if rest:
                    await stream.send(rest)
        except TunnelFailed as exc:
            log.info("tunnel %s broke off mid-stream: %s", tunnel.tunnel_id, exc)
            # An unfinished event is dropped: our error event must not merge into it.
            await stream.send(_sse_error(exc.message, exc.code))
            outcome = "failed"
    if scope.cancelled_caught:
        with trio.move_on_after(SHUTDOWN_SEND_TIMEOUT, shield=True):
            await stream.send(_sse_error("the dispatcher is shutting down", "shutting_down"))
        outcome = "failed"
    return outcome


async def _relay_body(
    tunnel: Tunnel,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
    head: TunnelHead,
    stall: float,
) -> Usage | None:
    """Relay a body that is not an event stream: whole when it fits in
    :data:`BUFFER_LIMIT`, streamed beyond. Returns its usage for a 2xx answer."""
    status, parse = head.start.status, head.ok
    parts: list[bytes] = [head.data] if head.data else []
    size = len(head.data)
    if not head.complete:
        while size <= BUFFER_LIMIT:
            data = await _receive(tunnel, stall)
            if not data:
                break
            parts.append(data)
            size += len(data)
    if size <= BUFFER_LIMIT:
        whole = b"".join(parts)
        await responder.respond(status, headers, whole)
        return _body_usage(whole) if parse else None
    # Too large to hold: stream it, keeping the tail to find usage in.
    stream = await responder.start_stream(status, headers)
    first = b"".join(parts)
    tail = first[-USAGE_TAIL:]
    await stream.send(first)
    del parts, first
    try:
        while data := await _receive(tunnel, stall):
            tail = (tail + data)[-USAGE_TAIL:]
            await stream.send(data)
    except TunnelFailed as exc:
        log.info("tunnel %s broke off mid-body, cutting the response: %s", tunnel.tunnel_id, exc)
        raise CutResponse(str(exc)) from exc
    return _tail_usage(tail) if parse else None


# --------------------------------------------------------------------------- routes


def parse_tunnel_body(
    raw: bytes, *, route: str | None = None, max_size: int | None = None
) -> dict[str, Any]:
    """Parse and validate a ``/v1/completions`` or ``/v1/embeddings`` body (without ``route``,
    the body says which: :func:`schema.tunnel_schema`); raise :class:`BadRequest` naming the
    bad field. The body is kept as the client sent it."""
    body = schema.load_object(raw, max_size=max_size)
    schema.validate(body, schema.tunnel_schema(body, route))
    return body


def tunnel_only(route: str) -> Callable[[Candidate], str | None]:
    """The admission predicate of a route only tunnels serve."""

    def predicate(candidate: Candidate) -> str | None:
        if candidate.path == "tunnel":
            return None
        return f"serves this model normalized, not through a tunnel, which {route} needs"

    return predicate


def tunnel_call(request: Request, body: dict[str, Any]) -> TunnelCall:
    """What a tunnel attempt relays of ``request`` (whose parsed JSON body is ``body``)."""
    return TunnelCall(
        method=request.method,
        path=request.path,
        query=request.query,
        headers=tuple(request.headers),
        body=body,
        commit=commit_tunnel,
    )


async def tunnel_route(
    dispatcher: Dispatcher,
    request: Request,
    responder: Responder,
    ctx: RouteContext,
) -> None:
    """``POST /v1/completions`` and ``POST /v1/embeddings``: relayed through a tunnel."""
    with counted_request(dispatcher) as counted:
        body = parse_tunnel_body(await request.body(), route=request.path)
        counted.model = dispatcher.metric_model_label(body["model"])
        gated = gate_request(
            request,
            ctx,
            body,
            stream=body.get("stream") is True,
            tunnel_call=tunnel_call(request, body),
            predicate=tunnel_only(request.path),
        )
        counted.gate = gated.result
        async with dispatcher.gate.open(gated) as answer:
            assert isinstance(answer, TunnelAnswer), "the predicate admits tunnels only"
            counted.outcome = await relay(dispatcher, answer, body, responder, ctx.headers)


__all__ = [
    "SSEFilter",
    "TunnelHead",
    "client_headers",
    "commit_tunnel",
    "estimate_prompt_tokens",
    "parse_tunnel_body",
    "relay",
    "tunnel_call",
    "tunnel_only",
    "tunnel_route",
    "upstream_body",
    "upstream_headers",
    "usage_of",
]
