"""The tunnel path end to end: a client over real HTTP -> the edge (127.0.0.1 port 0) -> a real
websocket -> a node (``nodes.agent.serve_node``) -> httpx -> a fake OpenAI-compatible provider
on a real HTTP server, and back. No mocks: the fake records what it received and the exact
bytes it sent, the node's connection is wrapped only to watch its frames.

Plus the pieces on their own: the SSE filter, the credit window enforced on a scripted node,
and the node's tunnel runner against the fake with no credit granted.
"""

from __future__ import annotations

import base64
import functools
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import h11
import httpx
import openai
import orjson
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from dispatcher import wire
from dispatcher.config import EdgeConfig, NodeSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.errors import TunnelFailed
from dispatcher.gate.pool import DispatchRequest
from dispatcher.http import (
    Headers,
    HTTPStream,
    Responder,
    Server,
    WebSocket,
)
from dispatcher.paths.tunnel_http import (
    ModelRewrite,
    SSEFilter,
    upstream_body,
    upstream_headers,
    usage_of,
)
from dispatcher.shared.transport import Connection, ConnectionClosed, RawFrame
from nodes.agent import dial_edge, serve_node
from nodes.config import ModelConfig, NodeConfig, ProviderConfig
from nodes.tunnel import MAX_PENDING, TunnelProvider, open_tunnels

from ..nodes.fake_providers import FakeOpenAI, SeenRequest, refused_base_url, serve_fake_openai
from .fakes import ScriptedNode, connect, wait_until

KEY_ENV = "TRIO_DISPATCHER_TEST_PROVIDER_KEY"
PROVIDER_KEY = "sk-provider-secret-4f9c2a71"
CLIENT_KEY = "client-secret-77d1e0"
MODEL = "tunneled"
SERVED = "fake-model"


# --------------------------------------------------------------------------- the fake provider


@attrs.define(eq=False)
class SentResponse:
    """What the fake wrote for one request: status, headers and the body as sent."""

    status: int = 0
    headers: list[tuple[bytes, bytes]] = attrs.Factory(list)
    chunks: list[bytes] = attrs.Factory(list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


class _RecordingStream:
    def __init__(self, inner: HTTPStream, record: SentResponse) -> None:
        self._inner = inner
        self._record = record

    async def send(self, data: bytes) -> None:
        await self._inner.send(data)
        self._record.chunks.append(data)

    async def end(self) -> None:
        await self._inner.end()


class _RecordingResponder:
    def __init__(self, inner: Responder, record: SentResponse) -> None:
        self._inner = inner
        self._record = record

    @property
    def shutting_down(self) -> bool:
        return self._inner.shutting_down

    async def respond(self, status: int, headers: Headers = (), body: bytes = b"") -> None:
        self._record.status, self._record.headers = status, list(headers)
        await self._inner.respond(status, headers, body)
        self._record.chunks.append(body)

    async def start_stream(self, status: int, headers: Headers = ()) -> HTTPStream:
        self._record.status, self._record.headers = status, list(headers)
        return _RecordingStream(await self._inner.start_stream(status, headers), self._record)

    async def accept_websocket(
        self, subprotocol: str | None = None, headers: Headers = ()
    ) -> WebSocket:
        raise NotImplementedError


Handler = Callable[[SeenRequest, Responder], Awaitable[None]]


@attrs.define(eq=False, kw_only=True)
class TunnelFake(FakeOpenAI):
    """The fake OpenAI server plus ``/v1/completions`` and ``/v1/embeddings``, recording the
    bytes of every response it sends."""

    embedding_dims: int = 4
    responses: dict[SeenRequest, SentResponse] = attrs.field(factory=dict, init=False)

    def route(self, seen: SeenRequest) -> Handler | None:
        extra: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/embeddings"): self._embeddings,
        }
        handler = extra.get((seen.method, seen.path)) or super().route(seen)
        if handler is None:
            return None
        inner = handler

        async def recorded(seen: SeenRequest, responder: Responder) -> None:
            record = self.responses[seen] = SentResponse()
            await inner(seen, _RecordingResponder(responder, record))

        return recorded

    def sent(self, index: int = -1) -> SentResponse:
        return self.responses[self.requests[index]]

    def bytes_sent(self) -> int:
        return sum(len(chunk) for r in self.responses.values() for chunk in r.chunks)

    async def _completions(self, seen: SeenRequest, responder: Responder) -> None:
        body = seen.json if isinstance(seen.json, dict) else {}
        model = body.get("model", SERVED)
        base = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": model}
        if body.get("stream") is not True:
            choice = {"text": self.expected_text, "index": 0, "logprobs": None}
            await self.respond_json(
                responder,
                200,
                {
                    **base,
                    "choices": [{**choice, "finish_reason": self.finish_reason}],
                    "usage": self.usage(),
                },
            )
            return
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))

        def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
            event: dict[str, Any] = {**base, "choices": [choice]}
            if include_usage:
                event["usage"] = None
            return event

        after: list[Any] = [chunk("", self.finish_reason)]
        if include_usage:
            after.append({**base, "choices": [], "usage": self.usage()})
        after.append("[DONE]")
        stream = await responder.start_stream(200, [(b"content-type", b"text/event-stream")])
        await self.stream_chunks(
            seen,
            stream,
            encode=_sse,
            content=chunk,
            error={"error": {"message": self.error_message, "type": "server_error"}},
            before=[],
            after=after,
        )

    async def _embeddings(self, seen: SeenRequest, responder: Responder) -> None:
        body = seen.json if isinstance(seen.json, dict) else {}
        inputs = body.get("input")
        texts = inputs if isinstance(inputs, list) else [inputs]
        data = []
        for index, _ in enumerate(texts):
            vector = [round(index + i / 1000, 3) for i in range(self.embedding_dims)]
            embedding: Any = vector
            if body.get("encoding_format") == "base64":
                packed = struct.pack(f"<{len(vector)}f", *vector)
                embedding = base64.b64encode(packed).decode()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        prompt = sum(len(str(t).split()) for t in texts)
        await self.respond_json(
            responder,
            200,
            {
                "object": "list",
                "data": data,
                "model": body.get("model", SERVED),
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            },
        )


def _sse(event: Any) -> bytes:
    data = event.encode() if isinstance(event, str) else orjson.dumps(event)
    return b"data: " + data + b"\n\n"


def sse_events(raw: bytes) -> list[bytes]:
    """``raw`` split into SSE events (each with its terminator)."""
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def without_usage_chunk(raw: bytes) -> bytes:
    """The stream minus its usage chunk (``"choices": []``)."""
    return b"".join(e for e in sse_events(raw) if b'"choices":[]' not in e)


# --------------------------------------------------------------------------- the wire watch


@attrs.define(eq=False)
class WireWatch:
    """Every frame between the node and the edge passes here: counted, and searched for the
    provider key (both directions)."""

    needle: bytes
    frames: int = 0
    frames_with_needle: int = 0
    text_frames: list[str] = attrs.Factory(list)

    def see(self, frame: RawFrame) -> None:
        self.frames += 1
        raw = frame.encode() if isinstance(frame, str) else frame
        if self.needle in raw:
            self.frames_with_needle += 1
        if isinstance(frame, str) and len(self.text_frames) < 10_000:
            self.text_frames.append(frame)

    def messages(self, kind: type[Any]) -> list[Any]:
        return [m for f in self.text_frames if isinstance(m := wire.decode(f), kind)]


class WatchedConnection:
    def __init__(self, inner: Connection, watch: WireWatch) -> None:
        self._inner = inner
        self._watch = watch

    async def send(self, frame: RawFrame) -> None:
        self._watch.see(frame)
        await self._inner.send(frame)

    async def receive(self) -> RawFrame:
        frame = await self._inner.receive()
        self._watch.see(frame)
        return frame

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        await self._inner.aclose(code, reason)


def watched_dial(
    config: NodeConfig, watch: WireWatch
) -> Callable[[], AbstractAsyncContextManager[Connection]]:
    @asynccontextmanager
    async def dial() -> AsyncIterator[Connection]:
        async with dial_edge(config) as conn:
            yield WatchedConnection(conn, watch)

    return dial


# --------------------------------------------------------------------------- the setup


@attrs.define(eq=False)
class Env:
    dispatcher: Dispatcher
    server: Server
    fake: TunnelFake
    watch: WireWatch
    edge_config: EdgeConfig
    node_scope: trio.CancelScope

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"

    @property
    def port(self) -> int:
        return self.server.address.port

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url,
            headers={"authorization": f"Bearer {CLIENT_KEY}"},
            timeout=10,
            **kwargs,
        )

    async def wait_slots_free(self) -> None:
        admission = self.dispatcher.admission
        await wait_until(
            lambda: admission.statistics().in_use == 0 and admission.statistics().draining == 0
        )


def tunnel_node_config(edge_port: int, base_url: str, *, slots: int = 2) -> NodeConfig:
    return NodeConfig(
        node_id="tunnel-node",
        edge_url=f"ws://127.0.0.1:{edge_port}/v1/nodes/connect",
        providers=(
            ProviderConfig(
                id="vllm",
                type="openai",
                path="tunnel",
                base_url=base_url,
                api_key_env=KEY_ENV,
                models=(ModelConfig(name=MODEL, served_name=SERVED, slots=slots),),
            ),
        ),
    )


@asynccontextmanager
async def open_env(
    monkeypatch: pytest.MonkeyPatch,
    fake: TunnelFake | None = None,
    *,
    base_url: str | None = None,
    local_node: bool = False,
) -> AsyncIterator[Env]:
    monkeypatch.setenv(KEY_ENV, PROVIDER_KEY)
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        api_keys=(CLIENT_KEY,),
        nodes=NodeSettings(heartbeat_interval=1, heartbeat_timeout=5),
    )
    watch = WireWatch(PROVIDER_KEY.encode())
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        started_fake: TunnelFake = await nursery.start(serve_fake_openai, fake or TunnelFake())
        started_fake.api_key = PROVIDER_KEY
        server: Server = await nursery.start(dispatcher.serve)
        if local_node:
            await dispatcher.attach_local_node()
        node_config = tunnel_node_config(
            server.address.port, base_url or started_fake.base_url + "/v1"
        )
        node_scope = trio.CancelScope()

        async def run_node(task_status: trio.TaskStatus[None]) -> None:
            with node_scope:
                await serve_node(
                    node_config, dial=watched_dial(node_config, watch), task_status=task_status
                )

        await nursery.start(run_node)
        try:
            yield Env(dispatcher, server, started_fake, watch, config, node_scope)
        finally:
            # The node first, so that the edge sees its close frame instead of waiting out
            # the close handshake of a node that is gone.
            node_scope.cancel()
            with trio.move_on_after(5):
                while node_config.node_id in dispatcher.registry.sessions:
                    await dispatcher.registry.wait_changed()
            nursery.cancel_scope.cancel()


def renamed(sent: bytes) -> bytes:
    """What the client gets of the provider's bytes: the served model name in a ``"model"``
    member replaced by the one the client asked for (the fake writes compact JSON)."""
    served, asked = orjson.dumps(SERVED), orjson.dumps(MODEL)
    return sent.replace(b'"model":' + served, b'"model":' + asked)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "say hello"}], **extra}


def headers_of(response: httpx.Response) -> list[tuple[str, str]]:
    return [(k.decode().lower(), v.decode()) for k, v in response.headers.raw]


def assert_provider_saw_node_key(seen: SeenRequest) -> None:
    assert seen.authorization == f"Bearer {PROVIDER_KEY}"
    assert [k for k, _ in seen.headers].count("authorization") == 1
    assert all(CLIENT_KEY not in value for _, value in seen.headers)
    assert CLIENT_KEY.encode() not in seen.body


# --------------------------------------------------------------------------- bytes in, bytes out


async def test_chat_non_stream_is_relayed_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_env(monkeypatch) as env, env.client() as client:
        response = await client.post(
            "/v1/chat/completions",
            content=orjson.dumps(chat_body(temperature=0.5)),
            headers={"content-type": "application/json", "x-custom": "kept"},
        )
        sent = env.fake.sent()
        assert response.status_code == sent.status == 200
        assert response.content == renamed(sent.body)
        assert response.headers["content-type"] == "application/json"
        assert response.headers["x-dispatcher-node"] == "tunnel-node"
        assert int(response.headers["content-length"]) == len(renamed(sent.body))

        (seen,) = env.fake.requests
        assert (seen.method, seen.path) == ("POST", "/v1/chat/completions")
        assert seen.json == {**chat_body(temperature=0.5), "model": SERVED}
        assert seen.header("x-custom") == "kept"
        assert seen.header("accept-encoding") == "identity"
        assert_provider_saw_node_key(seen)

        stats = env.dispatcher.tunnels.statistics()
        assert (stats.usage_reported, stats.usage_estimated) == (1, 0)
        assert (stats.prompt_tokens, stats.completion_tokens) == (7, 5)
        assert stats.ended == {"completed": 1}
        await env.wait_slots_free()


async def test_chat_stream_strips_only_the_injected_usage_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_env(monkeypatch) as env, env.client() as client:
        env.fake.chunk_count = 50
        response = await client.post(
            "/v1/chat/completions", content=orjson.dumps(chat_body(stream=True))
        )
        (seen,) = env.fake.requests
        assert seen.json["stream_options"] == {"include_usage": True}  # added by the edge
        sent = env.fake.sent()
        assert b'"choices":[],"usage":{' in sent.body
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["cache-control"] == "no-cache"
        assert response.content == renamed(without_usage_chunk(sent.body))
        assert response.content.endswith(b"data: [DONE]\n\n")
        assert len(sse_events(response.content)) == len(sse_events(sent.body)) - 1
        stats = env.dispatcher.tunnels.statistics()
        assert (stats.usage_reported, stats.prompt_tokens, stats.completion_tokens) == (1, 7, 50)
        await env.wait_slots_free()


async def test_chat_stream_that_asked_for_usage_is_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_env(monkeypatch) as env, env.client() as client:
        body = chat_body(stream=True, stream_options={"include_usage": True})
        response = await client.post("/v1/chat/completions", content=orjson.dumps(body))
        assert env.fake.requests[0].json["stream_options"] == {"include_usage": True}
        assert response.content == renamed(env.fake.sent().body)
        assert b'"choices":[],"usage":{' in response.content
        assert env.dispatcher.tunnels.statistics().usage_reported == 1


async def test_answers_carry_the_model_name_the_client_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The provider answers under its served name; the client reads the name it asked for,
    on chat and completions, streamed and not, through the OpenAI SDK too."""
    async with open_env(monkeypatch) as env, env.client() as client:
        chat = await client.post("/v1/chat/completions", json=chat_body())
        assert b'"model":"fake-model"' in env.fake.sent().body
        assert chat.json()["model"] == MODEL
        streamed = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        payloads = [e.strip().removeprefix(b"data: ") for e in sse_events(streamed.content)]
        assert payloads[-1] == b"[DONE]"
        models = {orjson.loads(payload)["model"] for payload in payloads[:-1]}
        assert models == {MODEL}
        plain = await client.post("/v1/completions", json={"model": MODEL, "prompt": "once"})
        assert plain.json()["model"] == MODEL
        streamed = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "once", "stream": True}
        )
        assert b"fake-model" not in streamed.content
        assert streamed.content.count(b'"model":"tunneled"') >= 2
        stats = env.dispatcher.tunnels.statistics()
        assert stats.usage_reported == 4  # usage still read from what the provider sent
        sdk = openai.AsyncOpenAI(base_url=f"{env.url}/v1", api_key=CLIENT_KEY, max_retries=0)
        async with sdk:
            answer = await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
            completion = await sdk.completions.create(model=MODEL, prompt="once")
        assert (answer.model, completion.model) == (MODEL, MODEL)


async def test_completions_and_embeddings(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_env(monkeypatch) as env, env.client() as client:
        plain = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "once upon", "max_tokens": 5}
        )
        assert plain.status_code == 200
        assert plain.content == renamed(env.fake.sent().body)
        assert env.fake.requests[-1].path == "/v1/completions"

        streamed = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "once upon", "stream": True}
        )
        assert streamed.content == renamed(without_usage_chunk(env.fake.sent().body))
        assert b'"object":"text_completion"' in streamed.content

        embedded = await client.post(
            "/v1/embeddings", params={"probe": "1"}, json={"model": MODEL, "input": ["a b", "c"]}
        )
        assert embedded.status_code == 200
        assert embedded.content == renamed(env.fake.sent().body)
        seen = env.fake.requests[-1]
        assert (seen.path, seen.query) == ("/v1/embeddings", "probe=1")
        assert seen.json["model"] == SERVED
        for seen in env.fake.requests:
            assert_provider_saw_node_key(seen)
        stats = env.dispatcher.tunnels.statistics()
        assert stats.usage_reported == 3
        assert stats.prompt_tokens == 7 + 7 + 3


async def test_large_body_is_streamed_and_its_usage_read(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_env(monkeypatch, TunnelFake(embedding_dims=60_000)) as env:
        async with env.client() as client:
            response = await client.post(
                "/v1/embeddings", json={"model": MODEL, "input": ["x y z"] * 3}
            )
        body = env.fake.sent().body
        assert len(body) > 1_000_000
        assert response.content == renamed(body)
        assert "content-length" not in response.headers  # streamed: chunked
        assert env.dispatcher.tunnels.statistics().prompt_tokens == 9
        assert env.dispatcher.tunnels.statistics().peak_buffered_bytes <= wire.DEFAULT_TUNNEL_WINDOW


async def test_provider_error_status_is_relayed(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_env(monkeypatch) as env, env.client() as client:
        env.fake.status = 400
        env.fake.error_message = "bad temperature"
        response = await client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "bad temperature"
        assert len(env.fake.requests) == 1  # not retried
        await env.wait_slots_free()


@pytest.mark.parametrize(
    ("status", "code"), [(429, "upstream_rate_limited"), (503, "upstream_5xx")]
)
async def test_provider_5xx_or_429_is_recovered_then_a_502(
    monkeypatch: pytest.MonkeyPatch, status: int, code: str
) -> None:
    """A 5xx / 429 is a failure before the commit: the attempt is aborted and retried on the
    other candidates; with only this one, the client gets a 502 naming the cause."""
    async with open_env(monkeypatch) as env, env.client() as client:
        env.fake.status = status
        response = await client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == code
        assert f"answered status {status}" in error["message"]
        assert len(env.fake.requests) == 1
        await env.wait_slots_free()


# --------------------------------------------------------------------------- the key stays home


async def test_the_provider_key_never_reaches_the_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_env(monkeypatch) as env, env.client() as client:
        env.fake.chunk_count = 20
        await client.post("/v1/chat/completions", json=chat_body())
        await client.post("/v1/chat/completions", json=chat_body(stream=True))
        await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
        assert len(env.fake.requests) == 3
        for seen in env.fake.requests:
            assert_provider_saw_node_key(seen)
        # The edge's configuration holds no provider key, ...
        assert PROVIDER_KEY not in repr(attrs.asdict(env.edge_config))
        session = env.dispatcher.registry.sessions["tunnel-node"]
        assert PROVIDER_KEY not in repr(session.hello)
        # ... and no frame between node and edge carried it, either way.
        assert env.watch.frames > 10
        assert env.watch.frames_with_needle == 0
        requests = env.watch.messages(wire.TunnelRequest)
        assert len(requests) == 3
        for request in requests:
            assert all(key != "authorization" for key, _ in request.headers)


def test_upstream_headers_drop_hop_by_hop_and_the_client_key() -> None:
    headers = [
        (b"host", b"edge:8700"),
        (b"authorization", b"Bearer client"),
        (b"connection", b"keep-alive, x-hop"),
        (b"x-hop", b"1"),
        (b"keep-alive", b"timeout=5"),
        (b"transfer-encoding", b"chunked"),
        (b"content-length", b"12"),
        (b"accept-encoding", b"gzip"),
        (b"user-agent", b"OpenAI/Python"),
        (b"openai-organization", b"org"),
    ]
    assert upstream_headers(headers) == [
        ("user-agent", "OpenAI/Python"),
        ("openai-organization", "org"),
        ("content-type", "application/json"),
    ]


def test_upstream_body_adds_include_usage_only_when_needed() -> None:
    body, injected = upstream_body(chat_body(stream=True), SERVED, "/v1/chat/completions")
    assert injected
    assert orjson.loads(body)["stream_options"] == {"include_usage": True}
    keep = chat_body(stream=True, stream_options={"include_usage": False, "x": 1})
    body, injected = upstream_body(keep, SERVED, "/v1/chat/completions")
    assert injected
    assert orjson.loads(body)["stream_options"] == {"include_usage": True, "x": 1}
    for route, body_in in [
        ("/v1/chat/completions", chat_body()),
        ("/v1/chat/completions", chat_body(stream=True, stream_options={"include_usage": True})),
        ("/v1/embeddings", {"model": MODEL, "input": "x", "stream": True}),
    ]:
        body, injected = upstream_body(body_in, SERVED, route)
        assert not injected
        assert orjson.loads(body) == {**body_in, "model": SERVED}


# --------------------------------------------------------------------------- disconnects, memory


async def test_client_disconnect_closes_the_provider_stream_and_frees_the_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_env(monkeypatch) as env:
        env.fake.chunk_count = 100_000
        env.fake.chunk_delay = 0.005
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", env.port)
            async with stream:
                await stream.send_all(raw_post("/v1/chat/completions", chat_body(stream=True)))
                received = b""
                while received.count(b"\n\n") < 6:  # the head, then five events
                    received += await stream.receive_some(65536)
                assert received.startswith(b"HTTP/1.1 200 ")
            # The client is gone: the node closes the upstream request.
            (seen,) = env.fake.requests
            await seen.disconnected.wait()
            assert seen.chunks_sent < 100_000
            await env.wait_slots_free()
            stats = env.dispatcher.tunnels.statistics()
            assert stats.ended == {"cancelled": 1}
            assert stats.cancels_sent == 1
            assert stats.open_tunnels == 0
            # The node confirmed with a late tunnel.end: the slot was not left to the timeout.
            await wait_until(lambda: len(env.watch.messages(wire.TunnelEnd)) == 1)
            (end,) = env.watch.messages(wire.TunnelEnd)
            assert end.error == "cancelled"
            assert env.dispatcher.admission.statistics().drains_expired == 0


@attrs.define(eq=False)
class HoldingUpstream:
    """An upstream that treats a non-streamed request as llama-server does (issue #21): it
    keeps connections alive, answers a short request (``max_tokens`` <= 8) at once, with
    ``Content-Length``, and holds a long one's answer -- head and all -- until it is done,
    which here is never; it learns that its client left only from the socket ending (EOF or
    reset), the only thing llama-server looks at. Raw h11 over TCP on 127.0.0.1."""

    port: int = 0
    accepted: int = 0
    """TCP connections accepted so far."""
    held: list[tuple[int, trio.Event]] = attrs.Factory(list)
    """Per long request held: the connection it came on (1, 2, ...) and an event set when
    that connection's client ends it."""
    changed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)

    async def serve(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        number = self.accepted
        self.changed.unpark_all()
        connection = h11.Connection(h11.SERVER)
        body = b""
        async with stream:
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = await stream.receive_some(65536)
                    except trio.BrokenResourceError:
                        data = b""
                    if not data:
                        return
                    connection.receive_data(data)
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    if orjson.loads(body).get("max_tokens", 0) > 8:
                        await self._hold(stream, number)
                        return
                    answer = orjson.dumps({"choices": [{"message": {"content": "hi"}}]})
                    await stream.send_all(
                        connection.send(
                            h11.Response(
                                status_code=200,
                                headers=[
                                    ("content-type", "application/json"),
                                    ("content-length", str(len(answer))),
                                ],
                            )
                        )
                        + connection.send(h11.Data(data=answer))
                        + connection.send(h11.EndOfMessage())
                    )
                    connection.start_next_cycle()
                    body = b""
                elif isinstance(event, h11.ConnectionClosed):
                    return

    async def _hold(self, stream: trio.SocketStream, number: int) -> None:
        left = trio.Event()
        self.held.append((number, left))
        self.changed.unpark_all()
        try:
            while await stream.receive_some(65536):
                pass  # a client's further bytes are not its leaving
        except trio.BrokenResourceError:
            pass
        left.set()
        self.changed.unpark_all()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self.changed.park()


async def test_a_client_leaving_a_held_whole_answer_closes_the_reused_upstream_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue #21, on the node's pooled connection: a client leaves a non-streamed request
    whose answer the upstream holds (no head yet) on a connection an earlier request left
    in the pool. The node closes that connection -- the upstream's only sign -- and does not
    give it back to the pool: the next request comes on a new one."""
    upstream = HoldingUpstream()
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(
            functools.partial(trio.serve_tcp, upstream.serve, 0, host="127.0.0.1")
        )
        upstream.port = listener.socket.getsockname()[1]
        async with (
            open_env(monkeypatch, base_url=f"http://127.0.0.1:{upstream.port}/v1") as env,
            env.client() as client,
        ):
            with trio.fail_after(10):
                short = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
                assert short.status_code == 200, short.text
                assert upstream.accepted == 1
                stream = await trio.open_tcp_stream("127.0.0.1", env.port)
                async with stream:
                    await stream.send_all(
                        raw_post("/v1/chat/completions", chat_body(max_tokens=1500))
                    )
                    await upstream.wait_for(lambda: bool(upstream.held))
                    ((number, left),) = upstream.held
                    assert number == 1, "the long request did not reuse the pooled connection"
                # The client is gone: the node closes the upstream connection.
                await left.wait()
                await env.wait_slots_free()
                assert env.dispatcher.tunnels.statistics().ended == {
                    "completed": 1,
                    "cancelled": 1,
                }
                again = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
                assert again.status_code == 200, again.text
                assert upstream.accepted == 2, "a closed connection came back from the pool"
        nursery.cancel_scope.cancel()


async def test_a_slow_reader_keeps_every_buffer_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long stream read slowly through a small socket: the provider is held back (its
    writes stall while the client does not read), the edge never buffers more than the
    window, and the gap between what the provider wrote and what the client read stays
    bounded; then everything arrives, byte for byte."""
    fake = TunnelFake(reply=("x" * 2000 + " ") * 6000)  # 6,000 events of ~2.1 KB: ~12.6 MB
    async with open_env(monkeypatch, fake) as env:
        body = chat_body(stream=True, stream_options={"include_usage": True})
        request = raw_post("/v1/chat/completions", body)
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 16 * 1024)
        await sock.connect(("127.0.0.1", env.port))
        stream = trio.SocketStream(sock)
        received = bytearray()
        gaps: list[int] = []
        with trio.fail_after(60):
            async with stream:
                await stream.send_all(request)
                received += await stream.receive_some(4096)
                # Stop reading: everything between provider and client fills, then stalls.
                seen = env.fake.requests[0]
                await wait_until(lambda: seen.chunks_sent > 0)
                last = -1
                while seen.chunks_sent != last:
                    last = seen.chunks_sent
                    await trio.sleep(0.3)
                assert not seen.finished.is_set()
                assert seen.chunks_sent < 6000 // 2
                stats = env.dispatcher.tunnels.statistics()
                assert stats.buffered_bytes <= wire.DEFAULT_TUNNEL_WINDOW
                stalled_gap = env.fake.bytes_sent() - len(received)
                # Now read slowly to the end, checking the bounds as we go.
                while not received.endswith(b"0\r\n\r\n"):
                    data = await stream.receive_some(8192)
                    if not data:
                        break
                    received += data
                    gaps.append(env.fake.bytes_sent() - len(received))
                    assert env.dispatcher.tunnels.statistics().buffered_bytes <= (
                        wire.DEFAULT_TUNNEL_WINDOW
                    )
                    if len(gaps) % 64 == 0:
                        await trio.sleep(0.001)
        assert seen.finished.is_set()
        sent = env.fake.sent().body
        assert len(sent) > 12_000_000
        head, _, chunked = bytes(received).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert _dechunk(chunked) == renamed(sent)
        # The provider never got further ahead of the client than the stalled pipeline holds
        # (socket buffers, the node's pending bytes, the edge's window), although 12 MB went
        # through: nothing grows with the stream.
        # (1 MiB of slack for the kernel growing its socket buffers as the reads resume.)
        assert stalled_gap < 4 * 1024 * 1024
        assert max(gaps) <= stalled_gap + 1024 * 1024
        stats = env.dispatcher.tunnels.statistics()
        assert stats.peak_buffered_bytes <= wire.DEFAULT_TUNNEL_WINDOW
        assert stats.ended == {"completed": 1}


def raw_post(path: str, body: dict[str, Any]) -> bytes:
    """An HTTP/1.1 POST of ``body`` as JSON, with the client's key."""
    data = orjson.dumps(body)
    return (
        f"POST {path} HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer {CLIENT_KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    ).encode() + data


def _dechunk(raw: bytes) -> bytes:
    out: list[bytes] = []
    pos = 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        start = eol + 2
        out.append(raw[start : start + size])
        pos = start + size + 2


async def test_node_tunnel_reads_only_while_it_has_credit(nursery: trio.Nursery) -> None:
    """The node's side alone, against the fake: with no credit granted past the window, the
    node holds at most MAX_PENDING plus one read and stops reading the provider."""
    fake: TunnelFake = await nursery.start(
        serve_fake_openai, TunnelFake(reply=("y" * 1000 + " ") * 8000)
    )
    frames: list[bytes] = []
    messages: list[wire.NodeMessage] = []
    changed = trio.Event()

    async def send(message: wire.NodeMessage) -> None:
        nonlocal changed
        messages.append(message)
        changed.set()
        changed = trio.Event()
        await trio.lowlevel.checkpoint()

    async def send_data(tunnel_id: str, data: bytes) -> None:
        nonlocal changed
        frames.append(data)
        changed.set()
        changed = trio.Event()
        await trio.lowlevel.checkpoint()

    provider = TunnelProvider(id="p", base_url=fake.base_url)
    window = 100_000
    body = orjson.dumps(chat_body(stream=True)).decode()
    with trio.fail_after(30):
        async with open_tunnels(send, send_data, {"p": provider}) as tunnels:
            tunnels.start(
                wire.TunnelRequest(
                    tunnel_id="t",
                    provider_id="p",
                    method="POST",
                    path="/v1/chat/completions",
                    headers=(("content-type", "application/json"),),
                    body=body,
                    window=window,
                )
            )
            await wait_until(lambda: sum(map(len, frames)) == window)
            seen = fake.requests[0]
            last = -1
            while seen.chunks_sent != last:
                last = seen.chunks_sent
                await trio.sleep(0.2)
            assert sum(map(len, frames)) == window  # not a byte past the window
            assert not seen.finished.is_set()
            assert tunnels.statistics().peak_pending <= MAX_PENDING + wire.MAX_TUNNEL_CHUNK
            # Grant as the edge would, until the end.
            granted = window
            while not any(isinstance(m, wire.TunnelEnd) for m in messages):
                got = sum(map(len, frames))
                if got == granted:
                    tunnels.credit("t", 50_000)
                    granted += 50_000
                await changed.wait()
                assert sum(map(len, frames)) <= granted
    start, end = messages[0], messages[-1]
    assert isinstance(start, wire.TunnelStart)
    assert start.status == 200
    assert ("content-type", "text/event-stream") in start.headers
    assert end == wire.TunnelEnd(tunnel_id="t")
    assert all(len(f) <= wire.MAX_TUNNEL_CHUNK for f in frames)
    assert b"".join(frames) == fake.sent().body
    assert tunnels.statistics().peak_pending <= MAX_PENDING + wire.MAX_TUNNEL_CHUNK


# --------------------------------------------------------------------------- failures


async def test_unreachable_provider_is_a_502(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_env(monkeypatch, base_url=refused_base_url()) as env, env.client() as client:
        response = await client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "tunnel_failed"
        assert "upstream_unreachable" in error["message"]
        await env.wait_slots_free()
        assert env.dispatcher.tunnels.statistics().ended == {"failed": 1}


async def test_provider_breaking_off_mid_stream_ends_with_an_error_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_env(monkeypatch) as env, env.client() as client:
        env.fake.chunk_count = 10
        env.fake.fail_after_chunks = 4
        response = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert response.status_code == 200
        events = sse_events(response.content)
        assert events[:5] == sse_events(renamed(env.fake.sent().body))[:5]
        last = orjson.loads(events[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == "tunnel_failed"
        assert "upstream_disconnected" in last["error"]["message"]
        assert b"[DONE]" not in response.content
        await env.wait_slots_free()


async def test_node_lost_mid_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_env(monkeypatch) as env, env.client() as client:
        env.fake.chunk_count = 10
        env.fake.stall_after_chunks = 3

        async def lose_node() -> None:
            requests = env.fake.requests
            await env.fake.wait_for(lambda: bool(requests) and requests[0].chunks_sent == 3)
            await trio.sleep(0.05)
            env.node_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lose_node)
            response = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        last = orjson.loads(sse_events(response.content)[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == "node_lost"
        assert env.dispatcher.tunnels.statistics().ended == {"node_lost": 1}
        await env.fake.requests[0].disconnected.wait()


async def test_tunnel_only_routes_refuse_normalized_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_env(monkeypatch, local_node=True) as env, env.client() as client:
        response = await client.post("/v1/completions", json={"model": "echo", "prompt": "x"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "no_capable_candidate"
        assert "its 'echo' adapter does not serve 'completions'" in error["message"]
        bad = await client.post("/v1/embeddings", content=b"[1]")
        assert bad.status_code == 400
        assert "JSON object" in bad.json()["error"]["message"]
        unknown = await client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        assert unknown.status_code == 404
        # The tunnel model still serves the chat route, through the relay.
        ok = await client.post("/v1/chat/completions", json=chat_body())
        assert ok.status_code == 200
        assert ok.content == renamed(env.fake.sent().body)


# --------------------------------------------------------------------------- the openai client


async def test_openai_client_through_the_tunnel(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_env(monkeypatch) as env:
        env.fake.chunk_count = 12
        async with openai.AsyncOpenAI(
            base_url=f"{env.url}/v1", api_key=CLIENT_KEY, max_retries=0
        ) as client:
            completion = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
            assert completion.choices[0].message.content == env.fake.expected_text
            assert completion.usage is not None
            assert completion.usage.completion_tokens == 12
            text = await client.completions.create(model=MODEL, prompt="hi")
            assert text.choices[0].text == env.fake.expected_text
            embedding = await client.embeddings.create(model=MODEL, input=["one", "two"])
            assert [e.index for e in embedding.data] == [0, 1]
            assert embedding.data[1].embedding == pytest.approx([1.0, 1.001, 1.002, 1.003])

        def consume() -> tuple[str, str, Any]:
            parts: list[str] = []
            texts: list[str] = []
            usage = None
            with openai.OpenAI(base_url=f"{env.url}/v1", api_key=CLIENT_KEY) as sync:
                with sync.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
                ) as stream:
                    for chunk in stream:
                        assert chunk.usage is None  # the injected usage chunk was stripped
                        parts.extend(c.delta.content or "" for c in chunk.choices)
                with sync.completions.create(
                    model=MODEL,
                    prompt="hi",
                    stream=True,
                    stream_options={"include_usage": True},
                ) as text_stream:
                    for piece in text_stream:
                        texts.extend(c.text for c in piece.choices)
                        usage = piece.usage or usage
            return "".join(parts), "".join(texts), usage

        chat_text, completion_text, usage = await trio.to_thread.run_sync(consume)
        assert chat_text == completion_text == env.fake.expected_text
        assert usage is not None
        assert usage.completion_tokens == 12
        for seen in env.fake.requests:
            assert_provider_saw_node_key(seen)


# --------------------------------------------------------------------------- protocol edges


async def test_sse_filter_passes_bytes_through_in_any_split() -> None:
    events = [
        b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n',
        b": comment line\n\n",
        b'data: {"choices":[{"delta":{"content":"b"}}],"usage":null}\r\n\r\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]
    raw = b"".join(events)
    expected = raw.replace(events[3], b"")
    for size in (1, 2, 3, 7, 64, len(raw)):
        sse = SSEFilter(strip_usage_chunk=True)
        out = b"".join(sse.feed(raw[i : i + size]) for i in range(0, len(raw), size))
        assert out + sse.finish() == expected
        assert sse.usage == wire.Usage(prompt_tokens=3, completion_tokens=2)
        assert sse.stripped
        keep = SSEFilter(strip_usage_chunk=False)
        out = b"".join(keep.feed(raw[i : i + size]) for i in range(0, len(raw), size))
        assert out + keep.finish() == raw
        assert keep.usage == wire.Usage(prompt_tokens=3, completion_tokens=2)
    await trio.lowlevel.checkpoint()


_USAGES = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"prompt_tokens": st.integers(0, 99), "completion_tokens": st.integers(0, 99)}
    ),
)
_CHUNKS = st.fixed_dictionaries(
    {"choices": st.sampled_from([[], [{"delta": {"content": "usage"}}], [{"text": '"usage"'}]])},
    optional={"usage": _USAGES, "note": st.just("usage")},
)


@given(
    chunks=st.lists(_CHUNKS, max_size=6),
    spaced=st.lists(st.booleans(), min_size=6, max_size=6),
    ends=st.lists(
        st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n"]), min_size=6, max_size=6
    ),
    done=st.booleans(),
    size=st.integers(1, 80),
)
def test_the_sse_filter_reads_usage_as_a_parse_of_every_event_would(
    chunks: list[dict[str, Any]],
    spaced: list[bool],
    ends: list[bytes],
    done: bool,
    size: int,
) -> None:
    """Events whose ``"usage"`` is null (OpenAI's every chunk but the last, spaced or not) or
    only a string are passed without parsing their JSON (pieces of such events without
    reading them one by one): the usage noted, the chunk stripped, the events counted, the
    end seen and the bytes passed on are what parsing every event gives."""
    events = [
        b"data: "
        + (
            # JSON's blanks (an SSE data line holds no newline): around colons and commas
            json.dumps(chunk, separators=(" , ", " :\t ")).encode()
            if spaced[i]
            else orjson.dumps(chunk)
        )
        + ends[i]
        for i, chunk in enumerate(chunks)
    ]
    raw = b"".join(events) + (b"data: [DONE]\n\n" if done else b"")
    usage, stripped = None, None
    for event, chunk in zip(events, chunks, strict=True):
        counts = usage_of(chunk)
        if counts is not None:
            usage = counts
            if stripped is None and chunk["choices"] == []:
                stripped = event
    for find_content in (False, True):  # (True: read event by event until the first content)
        sse = SSEFilter(strip_usage_chunk=True, find_content=find_content)
        out = b"".join(sse.feed(raw[i : i + size]) for i in range(0, len(raw), size))
        assert out + sse.finish() == (raw if stripped is None else raw.replace(stripped, b"", 1))
        assert sse.usage == usage
        assert sse.stripped == (stripped is not None)
        if not raw.endswith(b"\r"):  # (a CR at the very end may be half a CRLF: pending)
            assert sse.events == len(events) + done
        assert sse.done == done
        assert sse.content_seen == (not find_content or any(c["choices"] for c in chunks))


def test_the_model_rewrite_renames_only_model_members_with_the_served_name() -> None:
    rewrite = ModelRewrite("org/served-7b", 'asked "x"\\')
    asked = orjson.dumps('asked "x"\\')
    compact = b'{"id":"c","model":"org/served-7b","choices":[]}'
    assert rewrite(compact) == b'{"id":"c","model":' + asked + b',"choices":[]}'
    spaced = b'{\n  "model" :\t "org/served-7b",\n  "x": 1}'
    assert orjson.loads(rewrite(spaced)) == {"model": 'asked "x"\\', "x": 1}
    untouched = [
        b'{"model":"org/served-7b-instruct"}',  # another name
        b'{"model":"other"}',
        # Inside a string every quote is escaped: content quoting the served name stays.
        b'{"choices":[{"delta":{"content":"{\\"model\\":\\"org/served-7b\\"}"}}]}',
        b'{"modelx":"org/served-7b"}',
    ]
    for body in untouched:
        assert rewrite(body) == body
    assert ModelRewrite.between("same", "same") is None
    assert ModelRewrite.between("served", None) is None


def test_the_model_rewrite_of_a_body_in_pieces_matches_at_every_split() -> None:
    rewrite = ModelRewrite("served-name", "asked")
    raw = b'{"data":[' + b"1," * 50 + b'0],"model" : "served-name","usage":{}}' * 3
    expected = rewrite(raw)
    assert expected.count(b'"asked"') == 3
    for size in (1, 2, 3, 5, 17, 40, len(raw)):
        stream = rewrite.stream()
        out = b"".join(stream.feed(raw[i : i + size]) for i in range(0, len(raw), size))
        assert out + stream.finish() == expected, size


def test_the_sse_filter_renames_the_events_it_passes_on_and_reads_usage_as_sent() -> None:
    events = [
        b'data: {"model":"served","choices":[{"delta":{"content":"a"}}],"usage":null}\n\n',
        b'data: {"model":"served","choices":[],"usage":{"prompt_tokens":3,'
        b'"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]
    raw = b"".join(events)
    for size in (1, 4, len(raw)):
        sse = SSEFilter(strip_usage_chunk=True, rewrite=ModelRewrite("served", "asked"))
        out = b"".join(sse.feed(raw[i : i + size]) for i in range(0, len(raw), size))
        out += sse.finish()
        assert out == events[0].replace(b'"served"', b'"asked"') + events[2]
        assert sse.usage == wire.Usage(prompt_tokens=3, completion_tokens=2)


def tunnel_hello(node_id: str = "scripted", slots: int = 1) -> wire.Hello:
    return wire.Hello(
        protocol=wire.PROTOCOL_VERSION,
        node_id=node_id,
        providers=(
            wire.ProviderInfo(
                id="p",
                type="openai",
                adapter="openai",
                path="tunnel",
                models=(wire.ModelInfo(name="t", served_name="t-served", slots=slots),),
            ),
        ),
    )


async def closed_by_edge(node: ScriptedNode) -> ConnectionClosed:
    """Read until the edge closes the node's connection; how it closed."""
    with trio.fail_after(5):
        while True:
            try:
                await node.receive()
            except ConnectionClosed as closed:
                return closed


@asynccontextmanager
async def scripted_edge() -> AsyncIterator[tuple[Dispatcher, ScriptedNode]]:
    config = EdgeConfig(local_node=False, nodes=NodeSettings(heartbeat_interval=100))
    async with open_dispatcher(config) as dispatcher:
        node = await connect(dispatcher, tunnel_hello())
        yield dispatcher, node


async def open_scripted_tunnel(
    dispatcher: Dispatcher, node: ScriptedNode, nursery: trio.Nursery
) -> tuple[trio.MemoryReceiveChannel[Any], wire.TunnelRequest]:
    """Open a tunnel through the embedding API in a task; its results arrive on a channel."""
    send, receive = trio.open_memory_channel[Any](100)

    async def client() -> None:
        request = DispatchRequest(model="t", body={"model": "t"}, route="/v1/embeddings")
        async with send, dispatcher.open_dispatch(request) as dispatch:
            tunnel = dispatch.tunnel
            assert tunnel is not None
            await tunnel.send_request(method="POST", path="/v1/embeddings", body="{}")
            try:
                await send.send(await tunnel.start())
                while data := await tunnel.receive_some():
                    await send.send(data)
                await send.send("end")
            except TunnelFailed as exc:
                await send.send(exc)

    nursery.start_soon(client)
    message = await node.receive()
    assert isinstance(message, wire.TunnelRequest)
    return receive, message


async def test_data_past_the_window_closes_the_session(nursery: trio.Nursery) -> None:
    async with scripted_edge() as (dispatcher, node):
        results, request = await open_scripted_tunnel(dispatcher, node, nursery)
        assert request.window == wire.DEFAULT_TUNNEL_WINDOW
        await node.send(wire.TunnelStart(tunnel_id=request.tunnel_id, status=200))
        too_much = b"x" * (request.window + 1)
        await node.conn.send(wire.encode_tunnel_data(request.tunnel_id, too_much))
        closed = await closed_by_edge(node)
        assert closed.code == 1002
        assert f"{request.window + 1} body bytes with only {request.window} granted" in (
            closed.reason
        )
        start = await results.receive()
        assert start.status == 200
        failure = await results.receive()
        assert isinstance(failure, TunnelFailed)
        assert failure.code == "node_lost"
        assert failure.retryable


async def test_credit_is_granted_as_the_consumer_reads(nursery: trio.Nursery) -> None:
    async with scripted_edge() as (dispatcher, node):
        results, request = await open_scripted_tunnel(dispatcher, node, nursery)
        tunnel_id = request.tunnel_id
        await node.send(wire.TunnelStart(tunnel_id=tunnel_id, status=200, headers=(("a", "b"),)))
        assert (await results.receive()).headers == (("a", "b"),)
        step = wire.DEFAULT_TUNNEL_WINDOW // 4
        await node.conn.send(wire.encode_tunnel_data(tunnel_id, b"z" * (step - 1)))
        sent = step - 1
        for _ in range(12):  # three windows' worth: each quarter consumed is granted back
            await node.conn.send(wire.encode_tunnel_data(tunnel_id, b"z" * step))
            sent += step
            credit = await node.receive()
            assert isinstance(credit, wire.TunnelCredit)
            assert credit.tunnel_id == tunnel_id
            assert credit.bytes >= step
        await node.send(wire.TunnelEnd(tunnel_id=tunnel_id))
        total = 0
        while isinstance(item := await results.receive(), bytes):
            total += len(item)
        assert item == "end"
        assert total == sent
        await wait_until(lambda: dispatcher.admission.statistics().in_use == 0)
        assert dispatcher.tunnels.statistics().ended == {"completed": 1}


async def test_messages_for_tunnels_never_given_close_the_session() -> None:
    async with scripted_edge() as (_, node):
        await node.send(wire.TunnelStart(tunnel_id="never", status=200))
        closed = await closed_by_edge(node)
        assert closed.code == 1002
        assert "'tunnel.start' for no open tunnel" in closed.reason


def _types(messages: Sequence[wire.Message]) -> list[str]:
    return [type(m).TYPE for m in messages]


async def test_leaving_early_cancels_and_a_late_end_confirms_the_drain(
    nursery: trio.Nursery,
) -> None:
    async with scripted_edge() as (dispatcher, node):
        scope = trio.CancelScope()
        opened = trio.Event()

        async def client() -> None:
            with scope:
                request = DispatchRequest(model="t", body={"model": "t"})
                async with dispatcher.open_dispatch(request) as dispatch:
                    tunnel = dispatch.tunnel
                    assert tunnel is not None
                    await tunnel.send_request(method="POST", path="/v1/embeddings")
                    opened.set()
                    await tunnel.start()

        nursery.start_soon(client)
        request = await node.receive()
        assert isinstance(request, wire.TunnelRequest)
        await opened.wait()
        scope.cancel()
        assert await node.receive() == wire.TunnelCancel(tunnel_id=request.tunnel_id)
        await wait_until(lambda: dispatcher.admission.statistics().draining == 1)
        assert dispatcher.admission.statistics().in_use == 0
        # Frames in flight before the node saw the cancel are tolerated, then the end.
        await node.send(wire.TunnelStart(tunnel_id=request.tunnel_id, status=200))
        await node.conn.send(wire.encode_tunnel_data(request.tunnel_id, b"late"))
        await node.send(wire.TunnelEnd(tunnel_id=request.tunnel_id, error="cancelled"))
        await wait_until(lambda: dispatcher.admission.statistics().draining == 0)
        assert dispatcher.tunnels.statistics().ended == {"cancelled": 1}
        assert "scripted" in dispatcher.registry.sessions
        assert _types(node.seen) == ["welcome", "tunnel.request", "tunnel.cancel"]
