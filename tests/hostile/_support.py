"""The hostile-input suite's edge, clients and checks.

Every case runs against a fresh real edge on 127.0.0.1 port 0 (it starts in about 10 ms):
client keys, an admin key and node tokens configured, and a legitimate node -- a real
``nodes.agent.serve_node`` running the echo adapter over a real websocket. Each case is
wrapped in :meth:`Edge.case`, which holds a streamed chat completion open on the legitimate
node around the case and then checks that the edge came through it:

* the stream was still open when the case ended, and finishes intact (every word, then
  ``data: [DONE]``, no error event);
* a normal request is served right afterwards;
* every slot is back (none in use, none draining);
* the legitimate node is still registered, with the generation it had before the case;
* nothing was logged at ERROR (hostile input is never the edge's own failure).
"""

from __future__ import annotations

import functools
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import orjson
import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    TextMessage,
)
from wsproto.events import Event as WSEvent
from wsproto.events import Request as WSRequest

from dispatcher import wire
from dispatcher.config import (
    EdgeConfig,
    HTTPSettings,
    MetricsSettings,
    NodeSettings,
    NodeToken,
)
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server, ServerLimits
from nodes.agent import serve_node
from nodes.config import ModelConfig, NodeConfig, ProviderConfig

BOUND = 10.0
"""Bound on anything that should happen at once: a hang fails instead of hanging."""

CLIENT_KEY = "sk-client-hostile"
OTHER_CLIENT_KEY = "sk-client-second"
ADMIN_KEY = "sk-admin-hostile"
METRICS_TOKEN = "metrics-token-hostile"
NODE_TOKEN = "node-token-legit"
OTHER_NODE_TOKEN = "node-token-other"
BOUND_NODE_TOKEN = "node-token-bound"
"""May only claim node ids matching ``bound-*``."""

LEGIT = "legit"
MODEL = "echo"
EVIL_MODEL = "evil"
"""Served by hostile test nodes only, never by the legitimate node."""

MAX_BODY = 64 * 1024
HEADER_TIMEOUT = 0.3
BODY_TIMEOUT = 0.3
HELLO_TIMEOUT = 0.3
"""The edge's header, body and hello timeouts in the cases that probe them (marked
``short_timeouts``), short so that those cases end soon."""
GENEROUS_TIMEOUT = 10.0
"""Those timeouts in every other case: on a loaded machine a test process can stall for more
than 0.3 s between connecting and sending its first bytes, and an innocent connection --
the guard stream's, say -- must not be timed out for it."""

TOKEN_DELAY = 0.01
"""Seconds between two words of the guard stream."""
STREAM_SECONDS = 0.06
"""How long the guard stream lasts by default: longer than any quick case takes."""


def chat(content: str = "still here", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def bearer(key: str = CLIENT_KEY) -> tuple[str, str]:
    return ("authorization", f"Bearer {key}")


# --------------------------------------------------------------------------- HTTP


@attrs.frozen
class Response:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    http_version: str = "1.1"

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def json(self) -> Any:
        return orjson.loads(self.body)


def _response_of(event: h11.Response, body: bytes) -> Response:
    headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers)
    return Response(event.status_code, headers, body, event.http_version.decode("ascii"))


class RawHTTP:
    """One client connection that writes raw bytes and parses what comes back with h11, one
    response at a time (pipelined responses included)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.eof = False
        self.informational: list[int] = []

    @classmethod
    async def open(cls, port: int) -> RawHTTP:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _receive(self) -> bytes:
        try:
            return await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            return b""  # a reset is an end too

    async def read_response(self, method: str = "GET", *, bound: float = BOUND) -> Response:
        """The next response (its body read to the end, close-delimited ones included)."""
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        if self.buffer:
            conn.receive_data(self.buffer)
        if self.eof:
            conn.receive_data(b"")
        head: h11.Response | None = None
        body = bytearray()
        with trio.fail_after(bound):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await self._receive()
                    if not data:
                        self.eof = True
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.InformationalResponse):
                    self.informational.append(event.status_code)
                elif isinstance(event, h11.Response):
                    head = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    pytest.fail(f"no response: {event!r}")
        assert head is not None
        self.buffer = conn.trailing_data[0]
        return _response_of(head, bytes(body))

    async def read_to_eof(self, *, bound: float = BOUND) -> bytes:
        """Whatever is left until the server closes (asserts that it does within ``bound``)."""
        chunks = [self.buffer]
        self.buffer = b""
        with trio.fail_after(bound):
            while not self.eof:
                data = await self._receive()
                if not data:
                    self.eof = True
                chunks.append(data)
        return b"".join(chunks)

    async def assert_closed(self, *, bound: float = BOUND) -> None:
        """The server closed the connection and sent nothing more."""
        rest = await self.read_to_eof(bound=bound)
        assert rest == b"", f"more after the last response: {rest[:200]!r}"


def request_bytes(
    method: str,
    target: str,
    headers: Iterable[tuple[str, str]] = (),
    body: bytes | None = None,
    *,
    version: str = "1.1",
    host: str | None = "edge",
) -> bytes:
    """A request written by hand (nothing is checked, nothing added but Host and, with a
    body and no framing header of its own, Content-Length)."""
    lines = [f"{method} {target} HTTP/{version}"]
    headers = list(headers)
    if host is not None:
        lines.append(f"host: {host}")
    names = {name.lower() for name, _ in headers}
    if body is not None and not names & {"content-length", "transfer-encoding"}:
        headers.append(("content-length", str(len(body))))
    lines.extend(f"{name}: {value}" for name, value in headers)
    head = "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n"
    return head + (body or b"")


def json_request(
    path: str,
    body: Any,
    headers: Iterable[tuple[str, str]] = (bearer(),),
    *,
    version: str = "1.1",
) -> bytes:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return request_bytes(
        "POST",
        path,
        [("content-type", "application/json"), *headers],
        raw,
        version=version,
    )


def assert_error(
    response: Response,
    status: int,
    *,
    code: str | None = None,
    param: str | type[Any] | None = Any,
    error_type: str | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    """``response`` is ``status`` with the OpenAI error body: exactly ``message``, ``type``,
    ``param`` and ``code``; the type is ``error_type`` (default: invalid_request_error for a
    4xx, server_error for a 5xx). ``message``: a piece of the message."""
    assert response.status == status, (response.status, response.body[:300])
    assert response.header("content-type") == "application/json", response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if error_type is None:
        error_type = "invalid_request_error" if status < 500 else "server_error"
    assert error["type"] == error_type, error
    assert isinstance(error["message"], str), error
    assert error["message"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not Any:
        assert error["param"] == param, error
    if message is not None:
        assert message in error["message"], error
    return dict(error)


# --------------------------------------------------------------------------- websockets


class RawWebSocket:
    """A websocket client on wsproto over a raw socket: the test controls every byte."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.events: deque[WSEvent] = deque()

    @classmethod
    async def connect(
        cls, port: int, target: str = "/v1/nodes/connect"
    ) -> tuple[RawWebSocket, WSEvent]:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await client.stream.send_all(client.ws.send(WSRequest(host="edge", target=target)))
        return client, await client.next_event()

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def next_event(self, *, bound: float = BOUND) -> WSEvent:
        with trio.fail_after(bound):
            while not self.events:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                self.ws.receive_data(data or None)
                self.events.extend(self.ws.events())
            return self.events.popleft()

    async def send_text(self, text: str) -> None:
        await self.stream.send_all(self.ws.send(TextMessage(data=text)))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(self.ws.send(BytesMessage(data=data)))

    async def send_message(self, message: wire.Message) -> None:
        await self.send_text(wire.encode(message))

    async def receive_message(self, *, bound: float = BOUND) -> wire.Message:
        """The next wire message from the edge (pings answered on the way)."""
        while True:
            event = await self.next_event(bound=bound)
            if isinstance(event, Ping):
                await self.stream.send_all(self.ws.send(event.response()))
                continue
            if isinstance(event, CloseConnection):
                pytest.fail(f"closed by the edge: {event.code} {event.reason}")
            assert isinstance(event, TextMessage), event
            message = wire.decode(event.data)
            if isinstance(message, wire.Ping):
                await self.send_message(wire.Pong(nonce=message.nonce))
                continue
            return message

    async def closed_with(self, *, bound: float = BOUND) -> tuple[int, str]:
        """Read until the edge's close frame (answered); its code and reason. Wire pings on
        the way are answered (so a slow close is not a heartbeat timeout)."""
        while True:
            event = await self.next_event(bound=bound)
            if isinstance(event, CloseConnection):
                try:
                    await self.stream.send_all(self.ws.send(event.response()))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                return event.code, event.reason or ""
            if isinstance(event, TextMessage):
                message = wire.decode(event.data)
                if isinstance(message, wire.Ping):
                    await self.send_message(wire.Pong(nonce=message.nonce))


def hello(
    node_id: str = "hostile",
    *,
    token: str | None = OTHER_NODE_TOKEN,
    model: str = EVIL_MODEL,
    slots: int = 1,
    **fields: Any,
) -> wire.Hello:
    provider = wire.ProviderInfo(
        id="p",
        type="echo",
        adapter="echo",
        models=(wire.ModelInfo(name=model, served_name=model, slots=slots),),
    )
    settings: dict[str, Any] = {
        "protocol": wire.PROTOCOL_VERSION,
        "label": f"{node_id} label",
        "providers": (provider,),
        **fields,
    }
    return wire.Hello(node_id=node_id, token=token, **settings)


async def open_node(port: int, greeting: wire.Hello | None = None) -> RawWebSocket:
    """A raw node that is through the handshake and welcomed."""
    ws, event = await RawWebSocket.connect(port)
    assert isinstance(event, AcceptConnection), event
    await ws.send_message(greeting or hello())
    welcome = await ws.receive_message()
    assert isinstance(welcome, wire.Welcome), welcome
    return ws


def upgrade_refused(event: WSEvent) -> int:
    """The status of a refused upgrade."""
    assert isinstance(event, RejectConnection), event
    return event.status_code


async def rejection_body(ws: RawWebSocket, event: WSEvent) -> bytes:
    assert isinstance(event, RejectConnection)
    body = b""
    if event.has_body:
        while True:
            part = await ws.next_event()
            assert isinstance(part, RejectData), part
            body += part.data
            if part.body_finished:
                break
    return body


# --------------------------------------------------------------------------- the guard stream


@attrs.define(eq=False)
class GuardStream:
    """A streamed chat completion on the legitimate node, read to its end by its own task."""

    port: int
    words: int
    text: str = ""
    raw: bytes = b""
    status: int | None = None
    ended: trio.Event = attrs.Factory(trio.Event)

    @property
    def expected(self) -> str:
        return " ".join(f"w{i}" for i in range(self.words))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        body = chat(self.expected, stream=True, echo={"token_delay": TOKEN_DELAY})
        client = await RawHTTP.open(self.port)
        try:
            await client.send(json_request("/v1/chat/completions", body))
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
            conn.send(h11.EndOfMessage())
            started = False
            with trio.fail_after(BOUND + self.words * TOKEN_DELAY * 4):
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await client._receive())
                        continue
                    if isinstance(event, h11.Response):
                        self.status = event.status_code
                    elif isinstance(event, h11.Data):
                        self.raw += event.data
                        if not started and b'"content":"w' in self.raw:
                            started = True
                            task_status.started()
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        pytest.fail(f"guard stream: {event!r}")
            if not started:
                task_status.started()
        finally:
            self.ended.set()
            await client.aclose()

    def events(self) -> list[str]:
        return [
            part[len("data: ") :]
            for part in self.raw.decode().split("\n\n")
            if part.startswith("data: ")
        ]

    def assert_intact(self) -> None:
        assert self.status == 200, (self.status, self.raw[:300])
        events = self.events()
        assert events[-1] == "[DONE]", events[-3:]
        text = ""
        for data in events[:-1]:
            chunk = orjson.loads(data)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
        assert text == self.expected


# --------------------------------------------------------------------------- the edge


@attrs.define(eq=False)
class Edge:
    dispatcher: Dispatcher
    server: Server
    nursery: trio.Nursery
    caplog: pytest.LogCaptureFixture

    @property
    def port(self) -> int:
        return self.server.address.port

    @property
    def node_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/nodes/connect"

    async def start_node(self, node_id: str, token: str | None, slots: int = 4) -> None:
        config = NodeConfig(
            node_id=node_id,
            edge_url=self.node_url,
            token=token,
            providers=(
                ProviderConfig(
                    id="echo", type="echo", models=(ModelConfig(name=MODEL, slots=slots),)
                ),
            ),
        )
        await self.nursery.start(functools.partial(serve_node, config))

    def generation(self, node_id: str = LEGIT) -> int | None:
        session = self.dispatcher.registry.sessions.get(node_id)
        return None if session is None else session.generation

    async def wait_until(self, predicate: Callable[[], bool], *, bound: float = BOUND) -> None:
        with trio.fail_after(bound):
            while not predicate():
                await trio.sleep(0.002)

    def slots(self) -> tuple[int, int]:
        stats = self.dispatcher.admission.statistics()
        return stats.in_use, stats.draining

    async def raw(self) -> RawHTTP:
        return await RawHTTP.open(self.port)

    async def exchange(self, data: bytes, *, method: str = "GET", closes: bool = True) -> Response:
        """Send ``data`` on a fresh connection; the response, and (``closes``) that the edge
        then closed the connection."""
        client = await self.raw()
        try:
            await client.send(data)
            response = await client.read_response(method)
            if closes:
                await client.assert_closed()
            return response
        finally:
            await client.aclose()

    async def request(
        self,
        method: str,
        target: str,
        headers: Sequence[tuple[str, str]] = (),
        body: bytes | None = None,
    ) -> Response:
        """One well-formed request on a fresh connection (kept alive: not asserted closed)."""
        return await self.exchange(
            request_bytes(method, target, headers, body), method=method, closes=False
        )

    async def post(self, path: str, body: Any, key: str | None = CLIENT_KEY) -> Response:
        headers = [bearer(key)] if key is not None else []
        return await self.exchange(json_request(path, body, headers), closes=False)

    async def assert_serves(self) -> None:
        """A normal request is served."""
        response = await self.post("/v1/chat/completions", chat("served right after"))
        assert response.status == 200, response.body[:300]
        assert response.json()["choices"][0]["message"]["content"] == "served right after"

    @asynccontextmanager
    async def case(self, *, stream_seconds: float = STREAM_SECONDS) -> AsyncIterator[None]:
        """Run a case inside the guard (see the module docstring)."""
        generation = self.generation()
        assert generation is not None, "the legitimate node is not registered"
        guard = GuardStream(self.port, words=max(5, math.ceil(stream_seconds / TOKEN_DELAY)))
        async with trio.open_nursery() as nursery:
            await nursery.start(guard.run)
            assert not guard.ended.is_set(), "the guard stream ended before the case began"
            yield
            assert not guard.ended.is_set(), (
                "the guard stream ended before the case did: give the case a longer one"
            )
            await self.assert_serves()
            with trio.fail_after(BOUND):
                await guard.ended.wait()
        guard.assert_intact()
        await self.wait_until(lambda: self.slots() == (0, 0))
        assert self.generation() == generation, "the legitimate node lost its session"
        errors = [
            record
            for record in self.caplog.records
            if record.levelno >= logging.ERROR and record.name.startswith(("dispatcher", "nodes"))
        ]
        assert not errors, [record.getMessage() for record in errors]


def edge_config(*, short_timeouts: bool = False, **overrides: Any) -> EdgeConfig:
    header_timeout = HEADER_TIMEOUT if short_timeouts else GENEROUS_TIMEOUT
    hello_timeout = HELLO_TIMEOUT if short_timeouts else GENEROUS_TIMEOUT
    settings: dict[str, Any] = {
        "port": 0,
        "local_node": False,
        "api_keys": (CLIENT_KEY, OTHER_CLIENT_KEY),
        "admin_keys": (ADMIN_KEY,),
        "metrics": MetricsSettings(token=METRICS_TOKEN),
        "http": HTTPSettings(
            max_body_size=MAX_BODY, header_timeout=header_timeout, shutdown_grace=1
        ),
        "nodes": NodeSettings(
            tokens=(
                NODE_TOKEN,
                OTHER_NODE_TOKEN,
                NodeToken(value=BOUND_NODE_TOKEN, ids=("bound-*",)),
            ),
            hello_timeout=hello_timeout,
            heartbeat_interval=0.5,
            heartbeat_timeout=2,
        ),
    }
    settings.update(overrides)
    return EdgeConfig(**settings)


def limits_for(config: EdgeConfig) -> ServerLimits:
    http = config.http
    # The body timeout is not in the config file's settings: short when the header's is.
    body_timeout = BODY_TIMEOUT if http.header_timeout == HEADER_TIMEOUT else GENEROUS_TIMEOUT
    return ServerLimits(
        max_header_size=http.max_header_size,
        max_body_size=http.max_body_size,
        header_timeout=http.header_timeout,
        keepalive_timeout=http.keepalive_timeout,
        write_timeout=http.write_timeout,
        max_connections=http.max_connections,
        shutdown_grace=http.shutdown_grace,
        body_timeout=body_timeout,
        linger_timeout=0.5,
    )


@asynccontextmanager
async def open_edge(
    caplog: pytest.LogCaptureFixture, config: EdgeConfig | None = None
) -> AsyncIterator[Edge]:
    """A real edge with the legitimate node registered."""
    config = config or edge_config()
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        served = trio.Event()

        async def serve(task_status: trio.TaskStatus[Server]) -> None:
            try:
                await dispatcher.serve(limits=limits_for(config), task_status=task_status)
            finally:
                served.set()

        server: Server = await nursery.start(serve)
        edge = Edge(dispatcher, server, nursery, caplog)
        await edge.start_node(LEGIT, NODE_TOKEN)
        yield edge
        # Shutting the server down first closes the node's websocket with a handshake (a
        # cancelled node would wait out its close budget).
        server.shutdown()
        with trio.move_on_after(BOUND):
            await served.wait()
        nursery.cancel_scope.cancel()


def params(cases: Mapping[str, Any]) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize`` over a table of named cases."""
    return pytest.mark.parametrize(
        "case", [pytest.param(value, id=name) for name, value in cases.items()]
    )
