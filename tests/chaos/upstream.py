"""A fault-injecting OpenAI-compatible upstream for the chaos soak, run as its own process::

    python -m tests.chaos.upstream --seed 7 --log faults.jsonl

It serves ``POST /v1/chat/completions`` (SSE; the ``openai`` adapter always streams) on
127.0.0.1, port 0, with our own ``dispatcher.http.serve_http`` (as ``tests/nodes/
fake_providers.py`` does), and prints ``chaos upstream listening on http://127.0.0.1:PORT``
on stdout once bound.

The answer mirrors the ``echo`` model, so a client cannot tell from the text which provider
served it: the last user message streamed back word by word (each word with the whitespace
after it), ``echo.token_delay`` from the body honoured before each word, usage
``prompt_tokens`` = words of all messages, ``completion_tokens`` = words sent.

Each request draws one fault (see :data:`FAULTS`) from a ``random.Random(seed)`` in arrival
order, and appends a JSON line ``{"user", "fault", "after", "t"}`` to ``--log`` (``user`` is
the body's ``user`` field: the soak puts its request id there). Faults before the first
token: an HTTP 500 or 429, a reset after the 200 headers, a close without any answer, a stall
(nothing more until the client leaves). After ``after`` words: an SSE error event, a reset,
a stall.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import time
from typing import Any, TextIO

import orjson
import trio

from dispatcher.http import (
    MalformedBody,
    PeerGone,
    Request,
    Responder,
    serve_http,
)

_WORD = re.compile(r"\s*\S+\s*")

FAULTS: tuple[tuple[str, float], ...] = (
    ("ok", 0.55),
    ("http_500", 0.10),
    ("http_429", 0.03),
    ("reset_before_first", 0.08),
    ("close_without_answer", 0.05),
    ("stall_before_first", 0.04),
    ("error_mid_stream", 0.06),
    ("reset_mid_stream", 0.05),
    ("stall_mid_stream", 0.04),
)
"""Fault kinds and their weights. ``*_mid_stream`` faults happen after 1..n-1 words."""

BEFORE_FIRST_TOKEN = frozenset(
    {"http_500", "http_429", "reset_before_first", "close_without_answer", "stall_before_first"}
)


def _text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


class ChaosUpstream:
    def __init__(self, seed: int, log: TextIO) -> None:
        self._rng = random.Random(seed)
        self._log = log
        self._kinds = [kind for kind, _ in FAULTS]
        self._weights = [weight for _, weight in FAULTS]

    def _draw(self, words: int) -> tuple[str, int | None]:
        kind = self._rng.choices(self._kinds, self._weights)[0]
        if kind.endswith("_mid_stream"):
            if words < 2:
                return "ok", None
            return kind, self._rng.randint(1, words - 1)
        return kind, None

    async def handle(self, request: Request, responder: Responder) -> None:
        body_bytes = await request.body()
        if (request.method, request.path) != ("POST", "/v1/chat/completions"):
            await self._error(responder, 404, f"no route for {request.method} {request.path}")
            return
        try:
            body = orjson.loads(body_bytes)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            await self._error(responder, 400, "expected a chat completions body")
            return
        messages = body["messages"]
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        words = _WORD.findall(_text(users[-1])) if users else []
        prompt_tokens = sum(len(_text(m).split()) for m in messages)
        knobs = body.get("echo")
        delay = knobs.get("token_delay", 0.0) if isinstance(knobs, dict) else 0.0
        delay = float(delay) if type(delay) in (int, float) and delay >= 0 else 0.0
        kind, after = self._draw(len(words))
        record = {"user": body.get("user"), "fault": kind, "after": after, "t": time.time()}
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

        if kind == "http_500":
            await self._error(responder, 500, "injected failure: HTTP 500")
            return
        if kind == "http_429":
            await self._error(responder, 429, "injected failure: HTTP 429", retry_after=True)
            return
        if kind == "close_without_answer":
            # Raised before answering, PeerGone makes serve_http close the connection
            # without a response (and without logging anything).
            raise PeerGone("chaos upstream: injected close without an answer")

        model = body.get("model", "chaos")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True

        def event(delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
            chunk: dict[str, Any] = {
                "id": "chatcmpl-chaos",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": []
                if delta is None
                else [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            if include_usage:
                chunk["usage"] = None
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        stream = await responder.start_stream(
            200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        )
        await stream.send(event({"role": "assistant", "content": ""}))
        if kind == "reset_before_first":
            # Failing after answering makes serve_http abort the connection (a TCP reset);
            # MalformedBody is the failure it does so for without logging a traceback.
            raise MalformedBody("chaos upstream: injected reset before the first token")
        if kind == "stall_before_first":
            await trio.sleep_forever()
        for index, word in enumerate(words):
            if index == after:
                if kind == "error_mid_stream":
                    error = {"error": {"message": "injected mid-stream failure", "type": "x"}}
                    await stream.send(b"data: " + orjson.dumps(error) + b"\n\n")
                    return
                if kind == "reset_mid_stream":
                    raise MalformedBody("chaos upstream: injected reset mid-stream")
                await trio.sleep_forever()  # stall_mid_stream
            if delay:
                await trio.sleep(delay)
            await stream.send(event({"content": word}))
        tail = [event({}, "stop")]
        if include_usage:
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(words),
                "total_tokens": prompt_tokens + len(words),
            }
            tail.append(
                b"data: "
                + orjson.dumps(
                    {
                        "id": "chatcmpl-chaos",
                        "object": "chat.completion.chunk",
                        "created": 0,
                        "model": model,
                        "choices": [],
                        "usage": usage,
                    }
                )
                + b"\n\n"
            )
        tail.append(b"data: [DONE]\n\n")
        await stream.send(b"".join(tail))

    async def _error(
        self, responder: Responder, status: int, message: str, *, retry_after: bool = False
    ) -> None:
        headers = [(b"content-type", b"application/json")]
        if retry_after:
            headers.append((b"retry-after", b"1"))
        body = {"error": {"message": message, "type": "server_error", "code": None}}
        await responder.respond(status, headers, orjson.dumps(body))


async def _main(seed: int, log_path: str) -> None:
    with open(log_path, "a", encoding="utf-8") as log:
        upstream = ChaosUpstream(seed, log)
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_http, upstream.handle)
            address = server.address
            print(f"chaos upstream listening on http://{address.host}:{address.port}", flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.upstream")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--log", required=True, help="where to append one JSON line per request")
    args = parser.parse_args(argv)
    trio.run(_main, args.seed, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
