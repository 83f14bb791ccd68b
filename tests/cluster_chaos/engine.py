"""Fake engines for the cluster soak, run as their own process::

    python -m tests.cluster_chaos.engine --spec '[{"name": "node-1/engine", "slots": 3}, ...]'

Each engine is an OpenAI-compatible server on 127.0.0.1 (port 0; ``engine NAME listening on
http://127.0.0.1:PORT`` on stdout once bound) that **counts its concurrency**: the requests it
is answering whose client (the node) has not closed the connection. A request arriving while
``slots`` others are answered is a *violation*, recorded with the ids of all of them: the node
in front of the engine ran more than its slots.

The count is exact, not sampled: a node frees a slot only once the engine's answer ended --
the engine read it out (the request leaves the count *before* its last bytes are written, so
the node cannot start the next run on that slot first) -- or once the node closed the
connection of a run it cancelled. In that second case the close is in the kernel before the
node even sends its next request, so at each arrival the engine first drops every request
whose socket reads end-of-file (``MSG_PEEK``): a slot freed by a cancel is never counted
twice, a slot run twice always is.

``POST /v1/chat/completions`` mirrors the last user message word by word (each word with the
whitespace after it) with ``engine.token_delay`` seconds before each word and
``engine.first_token_delay`` before the first (both from the request body); usage is the
words of every message in, the words sent out. ``stream: true`` answers in SSE (with the
usage chunk when ``stream_options.include_usage``), otherwise one ``chat.completion``: the
tunnel path relays the client's own body. ``fail_rate`` (spec) is the share of requests
answered HTTP 500 before any token (a retryable failure: the edge recovers on another
candidate). ``GET /_status`` answers the engine's record: ``active``, ``most_active``,
``violations`` and every request (its ``user``, the body's ``user`` field: the soak's
request id; its ``fault``; how it ``ended``: ``answered``, ``gone`` or ``failed``).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import signal
import socket
import sys
import time
from typing import Any

import attrs
import h11
import orjson
import trio

_WORD = re.compile(r"\s*\S+\s*")
MAX_BODY = 1 << 22


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else ""


def _peer_closed(peek: socket.socket) -> bool:
    """Whether the connection's peer closed it (end-of-file or a reset is waiting)."""
    try:
        return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@attrs.define(eq=False)
class Call:
    """One chat completion the engine answers."""

    user: str | None
    fault: str
    started: float
    peek: socket.socket
    ended: float | None = None
    how: str = ""

    def record(self) -> dict[str, Any]:
        return {
            "user": self.user,
            "fault": self.fault,
            "started": self.started,
            "ended": self.ended,
            "how": self.how,
        }


@attrs.define(eq=False)
class Engine:
    name: str
    slots: int
    fail_rate: float
    rng: random.Random
    active: list[Call] = attrs.field(factory=list)
    most_active: int = 0
    calls: list[Call] = attrs.field(factory=list)
    violations: list[dict[str, Any]] = attrs.field(factory=list)

    def prune(self) -> None:
        """Drop the requests whose node closed the connection (cancelled runs)."""
        for call in list(self.active):
            if _peer_closed(call.peek):
                self.end(call, "gone")

    def arrive(self, call: Call) -> None:
        self.prune()
        self.active.append(call)
        self.calls.append(call)
        self.most_active = max(self.most_active, len(self.active))
        if len(self.active) > self.slots:
            self.violations.append(
                {
                    "at": call.started,
                    "running": len(self.active),
                    "slots": self.slots,
                    "users": [c.user for c in self.active],
                }
            )

    def end(self, call: Call, how: str) -> None:
        if call in self.active:
            self.active.remove(call)
            call.ended = time.time()
            call.how = how

    def status(self) -> dict[str, Any]:
        self.prune()
        return {
            "name": self.name,
            "slots": self.slots,
            "active": len(self.active),
            "most_active": self.most_active,
            "violations": self.violations,
            "calls": [call.record() for call in self.calls],
        }

    # ------------------------------------------------------------------ serving

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        peek = socket.fromfd(stream.socket.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_BODY)
        try:
            async with stream:
                while True:
                    head, body = await _read_request(stream, conn)
                    if head is None:
                        return
                    await self._answer(stream, conn, head, body, peek)
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            peek.close()

    async def _answer(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        head: h11.Request,
        raw: bytes,
        peek: socket.socket,
    ) -> None:
        target = head.target.decode("latin-1")
        if head.method == b"GET" and target == "/_status":
            await _send(stream, conn, *_json(200, self.status()), end=True)
            return
        if head.method != b"POST" or target != "/v1/chat/completions":
            await _send(stream, conn, *_json(404, _error(f"no route for {target}")), end=True)
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            await _send(stream, conn, *_json(400, _error("expected a chat body")), end=True)
            return
        fault = "http_500" if self.rng.random() < self.fail_rate else "ok"
        user = body.get("user")
        call = Call(user if isinstance(user, str) else None, fault, time.time(), peek)
        self.arrive(call)
        try:
            await self._complete(stream, conn, body, call)
        finally:
            self.end(call, "failed")

    async def _complete(
        self, stream: trio.SocketStream, conn: h11.Connection, body: dict[str, Any], call: Call
    ) -> None:
        if call.fault == "http_500":
            self.end(call, "answered")
            await _send(stream, conn, *_json(500, _error("injected failure")), end=True)
            return
        messages = body["messages"]
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        words = _WORD.findall(_text(users[-1])) if users else []
        prompt = sum(len(_text(m).split()) for m in messages)
        found = body.get("engine")
        knobs: dict[str, Any] = found if isinstance(found, dict) else {}
        delay = float(knobs.get("token_delay", 0.0))
        first = float(knobs.get("first_token_delay", 0.0))
        model = body.get("model", "fake-model")
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(words),
            "total_tokens": prompt + len(words),
        }
        if body.get("stream") is not True:
            await trio.sleep(first + delay * len(words))
            answer = {
                "id": "chatcmpl-engine",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(words)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
            self.end(call, "answered")
            await _send(stream, conn, *_json(200, answer), end=True)
            return
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True

        def event(choices: list[Any], **extra: Any) -> bytes:
            chunk = {
                "id": "chatcmpl-engine",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": choices,
                **extra,
            }
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await _send(stream, conn, h11.Response(status_code=200, headers=headers), b"")
        await trio.sleep(first)
        role = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        await _send(stream, conn, None, event(role))
        for word in words:
            if delay:
                await trio.sleep(delay)
            delta = [{"index": 0, "delta": {"content": word}, "finish_reason": None}]
            await _send(stream, conn, None, event(delta))
        tail = event([{"index": 0, "delta": {}, "finish_reason": "stop"}])
        if include_usage:
            tail += event([], usage=usage)
        self.end(call, "answered")  # before its last bytes: see the module docstring
        await _send(stream, conn, None, tail + b"data: [DONE]\n\n", end=True)


async def _read_request(
    stream: trio.SocketStream, conn: h11.Connection
) -> tuple[h11.Request | None, bytes]:
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return head, bytes(body)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None, b""


async def _send(
    stream: trio.SocketStream,
    conn: h11.Connection,
    head: h11.Response | None,
    data: bytes,
    *,
    end: bool = False,
) -> None:
    """The head (if any), ``data`` and (``end``) the end of the message in one write."""
    out = b""
    if head is not None:
        out += conn.send(head) or b""
    if data:
        out += conn.send(h11.Data(data=data)) or b""
    if end:
        out += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(out)


def _json(status: int, value: Any) -> tuple[h11.Response, bytes]:
    data = orjson.dumps(value)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    return h11.Response(status_code=status, headers=headers), data


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


async def _main(spec: list[dict[str, Any]], seed: int) -> None:
    async with trio.open_nursery() as nursery:
        for index, item in enumerate(spec):
            engine = Engine(
                str(item["name"]),
                int(item["slots"]),
                float(item.get("fail_rate", 0.0)),
                random.Random(seed + index),
            )
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, host="127.0.0.1"), engine.serve_connection, 0
            )
            port = listeners[0].socket.getsockname()[1]
            print(f"engine {engine.name} listening on http://127.0.0.1:{port}", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster_chaos.engine")
    parser.add_argument("--spec", required=True, help="a JSON list of {name, slots, fail_rate}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    trio.run(_main, json.loads(args.spec), args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
