"""A cheap fake LLM upstream for the ``peer`` and ``streams`` sections, in its own process.

``python -m bench._fake_upstream`` listens on an ephemeral 127.0.0.1 port, prints
``BENCH-PORT <n>`` and serves until SIGTERM / SIGINT:

* ``POST /v1/chat/completions`` (also ``/chat/completions``), OpenAI-compatible. ``max_tokens``
  (else ``max_completion_tokens``, default 16) content tokens ``tok0 ``, ``tok1 ``...
  Non-streaming: one ``chat.completion`` JSON with ``usage``. ``"stream": true``: SSE over a
  chunked body, one event per chunk: the tokens (the first with the role), a finish chunk, the
  usage chunk when ``stream_options.include_usage`` is true, then ``data: [DONE]``.
* ``POST /api/chat``, Ollama's native API: NDJSON (``application/x-ndjson``), one line per
  token then the ``done`` line with ``prompt_eval_count`` / ``eval_count``; ``"stream":
  false`` gives the one JSON object. Token count: ``options.num_predict`` (default 16).
* ``GET /v1/models``: one model, for clients that ask.

It is a bare asyncio ``Protocol`` with a hand-written HTTP/1.1 parser (keep-alive,
``Content-Length`` or chunked request bodies), and every response is built once per distinct
(route, model, tokens, stream, usage) and cached, so a request costs a JSON parse and one
``transport.write``: a few tens of microseconds, far below the paths it is the baseline of.
The whole response is written at once, so time-to-first-token measured *through* it is
the relays' own delay, not the upstream's pacing.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import orjson

from bench._load import announce_port, raise_nofile_limit

CREATED = 1_700_000_000
DEFAULT_TOKENS = 16
MAX_TOKENS = 100_000
MAX_HEAD = 64 * 1024
MAX_BODY = 8 * 1024 * 1024


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _head(status: str, content_type: bytes, length: int | None) -> bytes:
    framing = (
        b"Content-Length: %d" % length if length is not None else b"Transfer-Encoding: chunked"
    )
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\nContent-Type: "
        + content_type
        + b"\r\n"
        + framing
        # no Date: cheap, and every client here ignores it
        + b"\r\nServer: bench-fake-upstream\r\n\r\n"
    )


def _json_response(body: bytes, status: str = "200 OK") -> bytes:
    return _head(status, b"application/json", len(body)) + body


def openai_response(model: str, tokens: int, *, stream: bool, include_usage: bool) -> bytes:
    """The whole HTTP response to a chat completion (head and body)."""
    usage = {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": tokens + 9}
    finish = "length"
    if not stream:
        body = orjson.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": CREATED,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": "".join(f"tok{i} " for i in range(tokens)),
                        },
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            }
        )
        return _json_response(body)

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "choices": choices,
            **extra,
        }
        return _chunk(b"data: " + orjson.dumps(chunk) + b"\n\n")

    null_usage: dict[str, Any] = {"usage": None} if include_usage else {}
    parts = [_head("200 OK", b"text/event-stream", None)]
    for i in range(tokens):
        delta: dict[str, Any] = {"content": f"tok{i} "}
        if i == 0:
            delta = {"role": "assistant", **delta}
        parts.append(event([{"index": 0, "delta": delta, "finish_reason": None}], **null_usage))
    parts.append(event([{"index": 0, "delta": {}, "finish_reason": finish}], **null_usage))
    if include_usage:
        parts.append(event([], usage=usage))
    parts.append(_chunk(b"data: [DONE]\n\n"))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


def ollama_response(model: str, tokens: int, *, stream: bool) -> bytes:
    """The whole HTTP response to Ollama's ``/api/chat``."""
    created = "2024-01-01T00:00:00Z"
    done = {
        "model": model,
        "created_at": created,
        "message": {"role": "assistant", "content": ""},
        "done_reason": "length",
        "done": True,
        "total_duration": 1000,
        "prompt_eval_count": 9,
        "eval_count": tokens,
    }
    if not stream:
        done["message"] = {
            "role": "assistant",
            "content": "".join(f"tok{i} " for i in range(tokens)),
        }
        return _json_response(orjson.dumps(done))
    parts = [_head("200 OK", b"application/x-ndjson", None)]
    for i in range(tokens):
        line = {
            "model": model,
            "created_at": created,
            "message": {"role": "assistant", "content": f"tok{i} "},
            "done": False,
        }
        parts.append(_chunk(orjson.dumps(line) + b"\n"))
    parts.append(_chunk(orjson.dumps(done) + b"\n"))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


NOT_FOUND = _json_response(b'{"error":"not found"}', "404 Not Found")
BAD_REQUEST = _json_response(b'{"error":{"message":"bad request"}}', "400 Bad Request")
MODELS = _json_response(
    b'{"object":"list","data":[{"id":"bench-model","object":"model","owned_by":"bench"}]}'
)

_cache: dict[tuple[Any, ...], bytes] = {}


def _tokens(value: Any) -> int:
    if type(value) is int and 0 < value <= MAX_TOKENS:
        return value
    return DEFAULT_TOKENS


def respond(method: bytes, target: bytes, body: bytes) -> bytes:
    """The response bytes for one request."""
    path = target.partition(b"?")[0]
    if method == b"GET" and path in (b"/v1/models", b"/models"):
        return MODELS
    if method != b"POST":
        return NOT_FOUND
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return BAD_REQUEST
    if not isinstance(data, dict):
        return BAD_REQUEST
    model = str(data.get("model", ""))
    stream = data.get("stream") is True
    if path in (b"/v1/chat/completions", b"/chat/completions"):
        tokens = _tokens(data.get("max_tokens") or data.get("max_completion_tokens"))
        options = data.get("stream_options")
        usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        key: tuple[Any, ...] = ("openai", model, tokens, stream, usage)
        if (cached := _cache.get(key)) is None:
            cached = _cache[key] = openai_response(
                model, tokens, stream=stream, include_usage=usage
            )
        return cached
    if path == b"/api/chat":
        options = data.get("options")
        tokens = _tokens(options.get("num_predict") if isinstance(options, dict) else None)
        stream = data.get("stream") is not False  # Ollama streams unless told not to
        key = ("ollama", model, tokens, stream)
        if (cached := _cache.get(key)) is None:
            cached = _cache[key] = ollama_response(model, tokens, stream=stream)
        return cached
    return NOT_FOUND


class _Connection(asyncio.Protocol):
    """One client connection: parse requests as they arrive, answer each in order."""

    def __init__(self) -> None:
        self._buf = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            while self._one():
                pass
        except ValueError:
            assert self._transport is not None
            self._transport.write(BAD_REQUEST)
            self._transport.close()

    def _one(self) -> bool:
        """Answer one complete request from the buffer; False when more bytes are needed."""
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                raise ValueError("header block too large")
            return False
        lines = buf[:end].split(b"\r\n")
        method, target, _version = lines[0].split(b" ", 2)
        length = 0
        chunked = False
        close = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
        start = end + 4
        if chunked:
            parsed = _dechunk(buf, start)
            if parsed is None:
                return False
            body, consumed = parsed
        else:
            if length > MAX_BODY:
                raise ValueError("body too large")
            if len(buf) - start < length:
                return False
            body, consumed = buf[start : start + length], start + length
        self._buf = buf[consumed:]
        assert self._transport is not None
        self._transport.write(respond(method, target, body))
        if close:
            self._transport.close()
            return False
        return True


def _dechunk(buf: bytes, at: int) -> tuple[bytes, int] | None:
    """A chunked body starting at ``at``: (body, index after it), or None if incomplete."""
    parts: list[bytes] = []
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(buf[at:eol].split(b";")[0], 16)
        at = eol + 2
        if size == 0:
            # no trailers from our clients: the empty line follows
            if len(buf) < at + 2:
                return None
            return b"".join(parts), at + 2
        if len(buf) < at + size + 2:
            return None
        parts.append(buf[at : at + size])
        at += size + 2


async def serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Connection, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announce_port(port)
    async with server:
        await stop.wait()


def main(argv: list[str]) -> None:
    if argv:
        sys.exit("usage: python -m bench._fake_upstream")
    raise_nofile_limit(1_000_000)
    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1:])
