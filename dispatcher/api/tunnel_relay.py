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
up to :data:`BUFFER_LIMIT` bytes, and streamed beyond. If the tunnel fails before the answer
started the client gets a 502 error; if an SSE stream breaks off, an SSE error event ends it;
if another streamed body breaks off, the connection is cut so the client sees the body is
incomplete.

Usage: read from the JSON body or the stream's usage chunk without altering the bytes, and
reported once per tunnel (``Tunnel.on_usage``); an estimate when the provider reported none.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import orjson
import trio

from ..admission import AdmissionError, Candidate
from ..errors import BadRequest, RunError
from ..gate import GateRequest, TunnelAnswer
from ..http import PeerGone, Request, Responder
from ..pool import DispatchRequest, DispatchResult
from ..tunnel import Tunnel, TunnelFailed

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


class TunnelDispatch(Protocol):
    """What :func:`relay` needs of a dispatch: the gate's ``TunnelAnswer`` (or the pool's
    ``Dispatch``)."""

    @property
    def result(self) -> DispatchResult: ...
    @property
    def tunnel(self) -> Any: ...


class _CutResponse(PeerGone):
    """Raised after a streamed non-SSE body broke off: the server then closes the connection
    without ending the body (and without logging a handler failure), so the client can tell
    the body is incomplete."""


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

    def __init__(self, *, strip_usage_chunk: bool) -> None:
        self._strip = strip_usage_chunk
        self._pending = b""
        self._skip_next = False
        self.usage: Usage | None = None
        self.stripped = False
        self.events = 0

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
            if self._skip_next:
                self._skip_next = False
            elif 0 <= probe < end and self._inspect(buf[event_start:end]):
                out.append(buf[sent:event_start])
                sent = end
            if 0 <= probe < end:
                probe = buf.find(_USAGE_KEY, end)
            event_start = end
        out.append(buf[sent:event_start])
        self._pending = buf[event_start:]
        if len(self._pending) > MAX_SSE_EVENT:
            out.append(self._pending)
            self._pending = b""
            self._skip_next = True
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
        lines = [
            line[6:] if line.startswith(b"data: ") else line[5:]
            for line in _SSE_LINE.split(event)
            if line.startswith(b"data:")
        ]
        if not lines:
            return False
        try:
            value = orjson.loads(b"\n".join(lines))
        except orjson.JSONDecodeError:
            return False
        usage = usage_of(value)
        if usage is None:
            return False
        self.usage = usage
        if self._strip and not self.stripped and value.get("choices") == []:
            self.stripped = True
            return True
        return False


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


async def relay(
    dispatcher: Dispatcher,
    dispatch: TunnelDispatch,
    request_body: dict[str, Any],
    raw_request: Request,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
) -> str:
    """Answer ``raw_request`` (whose parsed JSON body is ``request_body``) through the tunnel
    ``dispatch`` opened; ``headers`` are the edge's own response headers (``x-dispatcher-node``,
    ``-provider`` and ``-queue-ms`` are added when missing). Returns the
    outcome for the metrics: ``completed``, ``upstream_error`` (the provider answered a
    non-2xx status, relayed as it is) or ``failed``."""
    tunnel: Tunnel = dispatch.tunnel
    body, injected = upstream_body(request_body, dispatch.result.served_model, raw_request.path)
    usage: Usage | None = None
    completion_estimate = 0
    ok = False
    try:
        await tunnel.send_request(
            method=raw_request.method,
            path=raw_request.path,
            query=raw_request.query,
            headers=upstream_headers(raw_request.headers),
            body=body.decode("utf-8"),
        )
        start = await tunnel.start()
        if not 200 <= start.status <= 599:
            raise TunnelFailed(
                f"the provider behind {tunnel.candidate.label} answered status {start.status}",
                retryable=True,
            )
        names = {name.lower() for name, _ in headers}
        own = [*headers, *(h for h in dispatch_headers(dispatch.result) if h[0] not in names)]
        out_headers = client_headers(start.headers, own)
        ok = 200 <= start.status < 300
        if ok and _is_sse(out_headers):
            sse = SSEFilter(strip_usage_chunk=injected)
            try:
                outcome = await _relay_sse(
                    dispatcher, tunnel, responder, start.status, out_headers, sse
                )
            finally:
                usage, completion_estimate = sse.usage, sse.events
            return outcome
        usage = await _relay_body(tunnel, responder, start.status, out_headers, parse=ok)
        return "completed" if ok else "upstream_error"
    finally:
        if tunnel.requested:
            if usage is not None:
                tunnel.on_usage(usage[0], usage[1], True)
            elif ok:
                tunnel.on_usage(estimate_prompt_tokens(request_body), completion_estimate, False)
            else:
                tunnel.on_usage(0, 0, False)


async def _relay_sse(
    dispatcher: Dispatcher,
    tunnel: Tunnel,
    responder: Responder,
    status: int,
    headers: Sequence[tuple[bytes, bytes]],
    sse: SSEFilter,
) -> str:
    stream = await responder.start_stream(status, headers)
    outcome = "completed"
    with dispatcher.stream_scope() as scope:
        try:
            while data := await tunnel.receive_some():
                out = sse.feed(data)
                if out:
                    await stream.send(out)
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
    status: int,
    headers: Sequence[tuple[bytes, bytes]],
    *,
    parse: bool,
) -> Usage | None:
    """Relay a body that is not an event stream: whole when it fits in
    :data:`BUFFER_LIMIT`, streamed beyond. Returns its usage when ``parse``."""
    parts: list[bytes] = []
    size = 0
    while data := await tunnel.receive_some():
        parts.append(data)
        size += len(data)
        if size > BUFFER_LIMIT:
            break
    else:
        whole = b"".join(parts)
        await responder.respond(status, headers, whole)
        return _body_usage(whole) if parse else None
    # Too large to hold: stream it, keeping the tail to find usage in.
    stream = await responder.start_stream(status, headers)
    head = b"".join(parts)
    tail = head[-USAGE_TAIL:]
    await stream.send(head)
    del parts, head
    try:
        while data := await tunnel.receive_some():
            tail = (tail + data)[-USAGE_TAIL:]
            await stream.send(data)
    except TunnelFailed as exc:
        log.info("tunnel %s broke off mid-body, cutting the response: %s", tunnel.tunnel_id, exc)
        raise _CutResponse(str(exc)) from exc
    return _tail_usage(tail) if parse else None


# --------------------------------------------------------------------------- routes


def parse_tunnel_body(raw: bytes) -> dict[str, Any]:
    """A JSON object with a string ``model`` (the provider validates the rest); ``stream``
    a boolean and ``stream_options`` an object when present."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(
            "'model': a non-empty string is required", param="model", code="invalid_value"
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream': must be a boolean", param="stream", code="invalid_value")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(
            "'stream_options': must be an object", param="stream_options", code="invalid_value"
        )
    return body


def tunnel_only(route: str) -> Callable[[Candidate], str | None]:
    """The admission predicate of a route only tunnels serve."""

    def predicate(candidate: Candidate) -> str | None:
        if candidate.path == "tunnel":
            return None
        return f"serves this model normalized, not through a tunnel, which {route} needs"

    return predicate


def dispatch_headers(result: DispatchResult) -> tuple[tuple[bytes, bytes], ...]:
    return (
        (b"x-dispatcher-node", result.node_id.encode()),
        (b"x-dispatcher-provider", result.provider_id.encode()),
        (b"x-dispatcher-queue-ms", f"{result.queue_wait * 1000:.1f}".encode()),
    )


async def tunnel_route(
    dispatcher: Dispatcher,
    request: Request,
    responder: Responder,
    ctx: RouteContext,
) -> None:
    """``POST /v1/completions`` and ``POST /v1/embeddings``: relayed through a tunnel."""
    model = "unknown"
    outcome = "bad_request"
    try:
        body = parse_tunnel_body(await request.body())
        model = dispatcher.metric_model_label(body["model"])
        session = request.header(b"x-session-id")
        gate_request = GateRequest(
            request_id=ctx.request_id,
            dispatch=DispatchRequest(
                model=body["model"],
                body=body,
                route=request.path,
                session_id=session.decode("latin-1") if session else None,
                predicate=tunnel_only(request.path),
            ),
            stream=body.get("stream") is True,
            attribution=ctx.attribution,
        )
        async with dispatcher.gate.open(gate_request) as answer:
            assert isinstance(answer, TunnelAnswer), "the predicate admits tunnels only"
            headers = (*ctx.headers, (b"x-dispatcher-attempts", str(answer.attempts).encode()))
            outcome = await relay(dispatcher, answer, body, request, responder, headers)
    except trio.Cancelled:
        outcome = "client_gone"
        raise
    except _CutResponse:
        outcome = "failed"
        raise
    except PeerGone:
        outcome = "client_gone"
        raise
    except AdmissionError:
        outcome = "rejected"
        raise
    except RunError:
        outcome = "failed"
        raise
    finally:
        dispatcher.metrics.count_request(model, outcome)


__all__ = [
    "SSEFilter",
    "TunnelDispatch",
    "client_headers",
    "estimate_prompt_tokens",
    "parse_tunnel_body",
    "relay",
    "tunnel_only",
    "tunnel_route",
    "upstream_body",
    "upstream_headers",
    "usage_of",
]
