"""Fake LLM providers on real HTTP servers (our ``dispatcher.http.serve_http`` on 127.0.0.1,
port 0): an OpenAI-compatible server and an Ollama server. For adapter and tunnel tests.

::

    fake = await nursery.start(serve_fake_openai)                       # default knobs
    fake = await nursery.start(serve_fake_openai, FakeOpenAI(chunk_delay=0.05, api_key="k"))
    fake.base_url                  # "http://127.0.0.1:<port>" (add "/v1" if you like)
    fake.status = 503              # knobs are plain attributes, read at each request
    ...
    seen = fake.requests[0]        # method, path, query, headers, authorization, body, json
    await seen.disconnected.wait() # the client closed the connection mid-response
    await fake.wait_idle()         # no TCP connection open any more

Routes. OpenAI: ``POST /v1/chat/completions`` (SSE when ``"stream": true``, else one JSON
``chat.completion``), ``POST /v1/embeddings``, ``GET /v1/models``. Ollama: ``POST /api/chat``
(NDJSON unless ``"stream": false``), ``POST /api/embed``, ``GET /api/tags``,
``GET /api/version``. Anything else: 404 in the provider's error shape.

Embeddings (both): one vector per input, :func:`fake_vector` of it -- ``dimensions`` values
(the request's, else :attr:`FakeProvider.dimensions`), exact in float32 so that floats and
base64 compare equal; usage ``prompt_tokens``. OpenAI answers ``{"object": "list", "data":
[{"object": "embedding", "index": i, "embedding": ...}], "model", "usage": {"prompt_tokens",
"total_tokens"}}``, the embedding base64 (little-endian float32) when the request asked
``encoding_format: "base64"``; ``reverse_data`` lists ``data`` last index first (the API
promises an ``index``, not an order). Ollama answers ``{"model", "embeddings": [[...]],
"total_duration", "load_duration", "prompt_eval_count"}`` (the count only with
``include_counts``); token id inputs get its 400.

The reply is :attr:`FakeProvider.tokens`: ``reply`` split into words (each with the
whitespace after it), or ``chunk_count`` tokens ``"tok0 "``, ``"tok1 "``... when that is set;
one token per chunk (SSE event / NDJSON line). ``expected_text`` is their concatenation.
Usage: ``prompt_tokens`` (a knob) and one completion token per chunk.

Both count the requests they answer at once (``active``, ``most_active``: what bounds an
engine's concurrency).

Knobs (both fakes): ``status`` (non-200: an error response in the provider's shape, with
``error_message`` and, OpenAI only, ``error_code`` as ``error.code`` (also in the error event
of ``fail_mode="error"``); ``error_body``, when set, is sent as the JSON error body instead;
429 also gets ``retry-after: 1``), ``api_key`` (when set, requests without
``Authorization: Bearer <api_key>`` get 401), ``chunk_delay`` (seconds between two events of
a stream), ``fail_after_chunks`` with ``fail_mode`` (``"abort"``: the connection is cut, the
client sees a truncated body; ``"error"``: an error event / line, then the stream ends),
``stall_after_chunks`` (send nothing more until the client leaves). OpenAI only:
``finish_reason``, ``cached_tokens`` / ``reasoning_tokens`` (the usage's
``prompt_tokens_details`` / ``completion_tokens_details``), ``timings_cache_n`` (llama.cpp's
``timings`` on the last chunk), ``tool_call`` (an OpenAI tool call object, streamed after
the text as OpenAI does: a ``tool_calls`` delta with its ``id``, ``type``, name and empty
arguments, then the arguments in two pieces; then the finish chunk), ``models``. The usage
chunk is sent only when the request asked for it (``stream_options.include_usage``). Ollama
only: ``done_reason``,
``include_counts`` (``prompt_eval_count`` / ``eval_count`` on the done line), ``tool_calls``
(Ollama tool calls, ``[{"function": {"name", "arguments": {...}}}]``, sent in one line after
the text and before the done line), ``models``.
"""

from __future__ import annotations

import base64
import re
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import attrs
import orjson
import trio

from dispatcher.http import (
    HTTPStream,
    MalformedBody,
    PeerGone,
    Request,
    Responder,
    Server,
    serve_http,
)

_TOKEN = re.compile(r"\s*\S+\s*")
_CLIENT_GONE = frozenset(
    {"client disconnected", "client connection broken", "a write was interrupted"}
)
"""The reasons ``serve_http`` cancels a handler with when its client went away: an EOF the
reader saw, a reset the reader or a write saw. Which one a test gets depends on timing."""


def _client_gone(exc: trio.Cancelled, responder: Responder) -> bool:
    """Whether a cancelled handler was cancelled because its client went away.

    Usually its reason says so. But when the cancellation comes in the same tick as the
    deadline of a ``trio.sleep`` the handler is in (a fake sleeping between two chunks), the
    ``Cancelled`` raised is the sleep's -- source ``"deadline"``, no reason -- and goes on
    past the sleep's scope only because a scope outside it is cancelled too: then the
    handler was cancelled, and only a server shutting down is not the client leaving."""
    if exc.reason in _CLIENT_GONE:
        return True
    return exc.source == "deadline" and not responder.shutting_down


def refused_base_url() -> str:
    """An ``http://127.0.0.1:<port>`` URL where nothing listens (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@attrs.define(eq=False)
class SeenRequest:
    """One request the fake received, and how its response ended."""

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    """Lower-case names, latin-1 decoded values, in order."""
    body: bytes
    json: Any = None
    """The body parsed as JSON (None if it is not JSON)."""
    chunks_sent: int = 0
    """Content chunks (tokens) written to the client so far."""
    disconnected: trio.Event = attrs.Factory(trio.Event)
    """Set when the client closed the connection before the response was complete."""
    finished: trio.Event = attrs.Factory(trio.Event)
    """Set when the fake is done with the request, however it ended."""

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)

    @property
    def authorization(self) -> str | None:
        return self.header("authorization")


@attrs.define(eq=False, kw_only=True)
class FakeProvider:
    """What both fakes share: knobs, the request record, the chunk schedule."""

    status: int = 200
    error_message: str = "injected failure"
    error_code: str | int | None = None
    """OpenAI only: ``error.code`` of error bodies and error events (vLLM and llama.cpp put
    an HTTP status there)."""
    error_body: Any = None
    """Sent as the error response's JSON body instead of :meth:`error_body_for`."""
    api_key: str | None = None
    reply: str = "Hello from the fake provider!"
    chunk_count: int | None = None
    chunk_delay: float = 0.0
    fail_after_chunks: int | None = None
    fail_mode: Literal["abort", "error"] = "abort"
    stall_after_chunks: int | None = None
    linger_after_end: float = 0.0
    """Seconds a stream stays open after its last event (``data: [DONE]``)."""
    prompt_tokens: int = 7
    models: list[str] = attrs.Factory(lambda: ["fake-model"])
    dimensions: int = 8
    """The size of an embedding when the request asks no ``dimensions``."""

    requests: list[SeenRequest] = attrs.field(factory=list, init=False)
    disconnects: list[SeenRequest] = attrs.field(factory=list, init=False)
    """Requests whose client left mid-response, in the order they were seen leaving."""
    server: Server | None = attrs.field(default=None, init=False)
    active: int = attrs.field(default=0, init=False)
    """Requests being answered right now (an engine's runs in flight)."""
    most_active: int = attrs.field(default=0, init=False)
    """The most :attr:`active` ever was: what a node's slots must bound."""
    _changed: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot, init=False)

    # ---------------------------------------------------------------- for tests

    @property
    def base_url(self) -> str:
        assert self.server is not None, "start the fake with nursery.start(serve_fake_...)"
        return f"http://{self.server.address.host}:{self.server.address.port}"

    @property
    def connection_count(self) -> int:
        """TCP connections open right now."""
        assert self.server is not None
        return self.server.connection_count

    @property
    def tokens(self) -> list[str]:
        if self.chunk_count is not None:
            return [f"tok{i} " for i in range(self.chunk_count)]
        return _TOKEN.findall(self.reply) or ([self.reply] if self.reply else [])

    @property
    def expected_text(self) -> str:
        return "".join(self.tokens)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; it is checked after every request event."""
        while not predicate():
            await self._changed.park()

    async def wait_requests(self, count: int = 1) -> list[SeenRequest]:
        await self.wait_for(lambda: len(self.requests) >= count)
        return self.requests

    async def wait_idle(self, poll: float = 0.005) -> None:
        """Wait until no connection is open (polls the server's connection count)."""
        while self.connection_count:
            await trio.sleep(poll)

    # ---------------------------------------------------------------- serving

    async def handle(self, request: Request, responder: Responder) -> None:
        body = await request.body()
        try:
            parsed: Any = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            parsed = None
        seen = SeenRequest(
            method=request.method,
            path=request.path,
            query=request.query,
            headers=tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers),
            body=body,
            json=parsed,
        )
        self.requests.append(seen)
        self._changed.unpark_all()
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await self._answer(seen, responder)
        except PeerGone:
            self._gone(seen)
            raise
        except trio.Cancelled as exc:
            if _client_gone(exc, responder):
                self._gone(seen)
            raise
        finally:
            self.active -= 1
            seen.finished.set()
            self._changed.unpark_all()

    def _gone(self, seen: SeenRequest) -> None:
        if not seen.disconnected.is_set():
            seen.disconnected.set()
            self.disconnects.append(seen)

    async def _answer(self, seen: SeenRequest, responder: Responder) -> None:
        route = self.route(seen)
        if route is None:
            await self.respond_json(
                responder, 404, self.error_body_for(f"no route for {seen.method} {seen.path}")
            )
            return
        if self.api_key is not None and seen.authorization != f"Bearer {self.api_key}":
            await self.respond_json(responder, 401, self.error_body_for("invalid API key"))
            return
        if self.status != 200:
            headers = [(b"retry-after", b"1")] if self.status == 429 else []
            body = self.error_body
            if body is None:
                body = self.error_body_for(self.error_message)
            await self.respond_json(responder, self.status, body, headers)
            return
        await route(seen, responder)

    def route(
        self, seen: SeenRequest
    ) -> Callable[[SeenRequest, Responder], Awaitable[None]] | None:
        raise NotImplementedError

    def error_body_for(self, message: str) -> Any:
        raise NotImplementedError

    async def respond_json(
        self,
        responder: Responder,
        status: int,
        value: Any,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        await responder.respond(
            status, [(b"content-type", b"application/json"), *(headers or [])], orjson.dumps(value)
        )

    async def stream_chunks(
        self,
        seen: SeenRequest,
        stream: HTTPStream,
        *,
        encode: Callable[[Any], bytes],
        content: Callable[[str], Any],
        error: Any,
        before: list[Any],
        after: list[Any],
    ) -> None:
        """``before`` events, one ``content(token)`` event per token, then ``after`` events;
        ``chunk_delay`` between two events; the fail and stall knobs apply to the tokens."""
        sent_any = False

        async def send(event: Any) -> None:
            nonlocal sent_any
            if sent_any and self.chunk_delay:
                await trio.sleep(self.chunk_delay)
            await stream.send(encode(event))
            sent_any = True

        for event in before:
            await send(event)
        tokens = self.tokens
        for index in range(len(tokens) + 1):
            if index == self.stall_after_chunks:
                await trio.sleep_forever()
            if index == self.fail_after_chunks:
                if self.fail_mode == "error":
                    await send(error)
                    return
                # Raising after answering makes serve_http cut the connection; MalformedBody
                # is the one failure it does so for without logging a traceback.
                raise MalformedBody("fake provider: injected mid-stream failure")
            if index == len(tokens):
                break
            await send(content(tokens[index]))
            seen.chunks_sent += 1
            self._changed.unpark_all()
        for event in after:
            await send(event)
        if self.linger_after_end:
            # Like a provider that keeps the connection a while after its last event.
            await trio.sleep(self.linger_after_end)


@attrs.define(eq=False, kw_only=True)
class FakeOpenAI(FakeProvider):
    """An OpenAI-compatible server (``/v1/chat/completions``, ``/v1/models``)."""

    finish_reason: str = "stop"
    tool_call: dict[str, Any] | None = None
    cached_tokens: int | None = None
    """When set, the usage says ``prompt_tokens_details.cached_tokens`` (OpenAI, vLLM)."""
    reasoning_tokens: int | None = None
    """When set, the usage says ``completion_tokens_details.reasoning_tokens``."""
    timings_cache_n: int | None = None
    """When set, the stream's last chunk carries llama.cpp's ``timings`` with this
    ``cache_n`` (the usage chunk when there is one, else the finish chunk)."""
    reverse_data: bool = False

    def route(
        self, seen: SeenRequest
    ) -> Callable[[SeenRequest, Responder], Awaitable[None]] | None:
        if (seen.method, seen.path) == ("POST", "/v1/chat/completions"):
            return self._chat
        if (seen.method, seen.path) == ("POST", "/v1/embeddings"):
            return self._embeddings
        if (seen.method, seen.path) == ("GET", "/v1/models"):
            return self._models
        return None

    def error_body_for(self, message: str) -> Any:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": self.error_code}}

    def usage(self) -> dict[str, Any]:
        completion = len(self.tokens)
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage

    async def _embeddings(self, seen: SeenRequest, responder: Responder) -> None:
        body = seen.json if isinstance(seen.json, dict) else {}
        dimensions = body.get("dimensions", self.dimensions)
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        for index, item in enumerate(embedding_inputs(body.get("input"))):
            vector = fake_vector(item, dimensions)
            embedding: Any = _base64(vector) if as_base64 else vector
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        if self.reverse_data:
            data.reverse()
        usage = {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens}
        answer = {"object": "list", "data": data, "model": body.get("model"), "usage": usage}
        await self.respond_json(responder, 200, answer)

    async def _models(self, seen: SeenRequest, responder: Responder) -> None:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.models]
        await self.respond_json(responder, 200, {"object": "list", "data": data})

    async def _chat(self, seen: SeenRequest, responder: Responder) -> None:
        body = seen.json if isinstance(seen.json, dict) else {}
        model = body.get("model", "fake-model")
        if body.get("stream") is not True:
            message: dict[str, Any] = {"role": "assistant", "content": self.expected_text}
            if self.tool_call is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [self.tool_call]}
            await self.respond_json(
                responder,
                200,
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "choices": [
                        {"index": 0, "message": message, "finish_reason": self.finish_reason}
                    ],
                    "usage": self.usage(),
                },
            )
            return
        stream_options = body.get("stream_options")
        include_usage = isinstance(stream_options, dict) and bool(
            stream_options.get("include_usage")
        )

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            event: dict[str, Any] = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }
            if include_usage:
                event["usage"] = None
            return event

        after: list[Any] = []
        if self.tool_call is not None:
            function = self.tool_call.get("function", {})
            arguments = function.get("arguments", "")
            head = {**self.tool_call, "function": {**function, "arguments": ""}}
            half = len(arguments) // 2
            after.append(chunk({"tool_calls": [{"index": 0, **head}]}))
            for piece in (arguments[:half], arguments[half:]):
                after.append(
                    chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                )
        after.append(chunk({}, self.finish_reason))
        if include_usage:
            after.append({**chunk({}), "choices": [], "usage": self.usage()})
        if self.timings_cache_n is not None:
            after[-1]["timings"] = {
                "cache_n": self.timings_cache_n,
                "prompt_n": self.prompt_tokens - self.timings_cache_n,
                "predicted_n": len(self.tokens),
            }
        after.append("[DONE]")

        def encode(event: Any) -> bytes:
            data = event.encode() if isinstance(event, str) else orjson.dumps(event)
            return b"data: " + data + b"\n\n"

        stream = await responder.start_stream(
            200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        )
        await self.stream_chunks(
            seen,
            stream,
            encode=encode,
            content=lambda token: chunk({"content": token}),
            error={
                "error": {
                    "message": self.error_message,
                    "type": "server_error",
                    **({} if self.error_code is None else {"code": self.error_code}),
                }
            },
            before=[chunk({"role": "assistant", "content": ""})],
            after=after,
        )


@attrs.define(eq=False, kw_only=True)
class FakeOllama(FakeProvider):
    """An Ollama server (``/api/chat``, ``/api/tags``, ``/api/version``)."""

    done_reason: str = "stop"
    include_counts: bool = True
    tool_calls: list[dict[str, Any]] | None = None

    def route(
        self, seen: SeenRequest
    ) -> Callable[[SeenRequest, Responder], Awaitable[None]] | None:
        if (seen.method, seen.path) == ("POST", "/api/chat"):
            return self._chat
        if (seen.method, seen.path) == ("POST", "/api/embed"):
            return self._embed
        if (seen.method, seen.path) == ("GET", "/api/tags"):
            return self._tags
        if (seen.method, seen.path) == ("GET", "/api/version"):
            return self._version
        return None

    def error_body_for(self, message: str) -> Any:
        return {"error": message}

    async def _embed(self, seen: SeenRequest, responder: Responder) -> None:
        body = seen.json if isinstance(seen.json, dict) else {}
        inputs = embedding_inputs(body.get("input"))
        if not all(isinstance(item, str) for item in inputs):
            await self.respond_json(responder, 400, {"error": "invalid input type"})
            return
        dimensions = body.get("dimensions", self.dimensions)
        answer: dict[str, Any] = {
            "model": body.get("model"),
            "embeddings": [fake_vector(item, dimensions) for item in inputs],
            "total_duration": 1,
            "load_duration": 1,
        }
        if self.include_counts:
            answer["prompt_eval_count"] = self.prompt_tokens
        await self.respond_json(responder, 200, answer)

    async def _tags(self, seen: SeenRequest, responder: Responder) -> None:
        models = [{"name": m, "model": m, "size": 0} for m in self.models]
        await self.respond_json(responder, 200, {"models": models})

    async def _version(self, seen: SeenRequest, responder: Responder) -> None:
        await self.respond_json(responder, 200, {"version": "0.0.0-fake"})

    def done_line(self, model: Any, content: str) -> dict[str, Any]:
        line: dict[str, Any] = {
            "model": model,
            "created_at": "2024-01-01T00:00:00Z",
            "message": {"role": "assistant", "content": content},
            "done": True,
            "done_reason": self.done_reason,
            "total_duration": 1,
            "load_duration": 1,
        }
        if self.include_counts:
            line.update(prompt_eval_count=self.prompt_tokens, eval_count=len(self.tokens))
        return line

    async def _chat(self, seen: SeenRequest, responder: Responder) -> None:
        body = seen.json if isinstance(seen.json, dict) else {}
        model = body.get("model", "fake-model")
        if body.get("stream") is False:
            await self.respond_json(responder, 200, self.done_line(model, self.expected_text))
            return

        def line(token: str) -> dict[str, Any]:
            return {
                "model": model,
                "created_at": "2024-01-01T00:00:00Z",
                "message": {"role": "assistant", "content": token},
                "done": False,
            }

        stream = await responder.start_stream(200, [(b"content-type", b"application/x-ndjson")])
        await self.stream_chunks(
            seen,
            stream,
            encode=lambda event: orjson.dumps(event) + b"\n",
            content=line,
            error={"error": self.error_message},
            before=[],
            after=[
                *(
                    [
                        {
                            "model": model,
                            "created_at": "2024-01-01T00:00:00Z",
                            "message": {
                                "role": "assistant",
                                "content": "",
                                "tool_calls": self.tool_calls,
                            },
                            "done": False,
                        }
                    ]
                    if self.tool_calls
                    else []
                ),
                self.done_line(model, ""),
            ],
        )


def embedding_inputs(value: Any) -> list[Any]:
    """The inputs of an embeddings request's ``input``: a string, or a list of token ids, is
    one; a list of strings or of token id lists is one each."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(type(item) is int for item in value):
        return [value]
    return list(value) if isinstance(value, list) else []


def fake_vector(item: str | list[int], dimensions: int) -> list[float]:
    """The fakes' embedding of an input: ``len(item) + j / 8`` for ``j`` in
    ``range(dimensions)`` (exact in float32)."""
    return [len(item) + j / 8 for j in range(dimensions)]


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def _serve(fake: FakeProvider, task_status: trio.TaskStatus[Any]) -> None:
    async with trio.open_nursery() as nursery:
        fake.server = await nursery.start(serve_http, fake.handle)
        task_status.started(fake)


async def serve_fake_openai(
    fake: FakeOpenAI | None = None,
    *,
    task_status: trio.TaskStatus[FakeOpenAI] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``fake`` (default: ``FakeOpenAI()``) until cancelled; ``nursery.start`` returns
    it, bound (``fake.base_url``)."""
    await _serve(fake or FakeOpenAI(), task_status)


async def serve_fake_ollama(
    fake: FakeOllama | None = None,
    *,
    task_status: trio.TaskStatus[FakeOllama] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``fake`` (default: ``FakeOllama()``) until cancelled; ``nursery.start`` returns
    it, bound (``fake.base_url``)."""
    await _serve(fake or FakeOllama(), task_status)
