"""The node websocket under hostile use: upgrades that are not, hellos that must be refused
(close 4001 for credentials, 1002 for the protocol, 1008 for silence), sessions that break the
protocol after their welcome, nodes that misbehave with the runs they are given, and nodes
that try to take over another node's identity (4004). Whatever they do, only their own
session ends: the legitimate node, its stream and its slots are untouched."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio
from wsproto.events import AcceptConnection

from dispatcher import wire

from ._support import (
    BOUND_NODE_TOKEN,
    CLIENT_KEY,
    EVIL_MODEL,
    HELLO_TIMEOUT,
    LEGIT,
    NODE_TOKEN,
    OTHER_NODE_TOKEN,
    STREAM_SECONDS,
    Edge,
    RawWebSocket,
    Response,
    assert_error,
    chat,
    edge_config,
    hello,
    open_edge,
    open_node,
    params,
    request_bytes,
)

NODE_PATH = "/v1/nodes/connect"


def upgrade(*extra: tuple[str, str], version: str = "13") -> list[tuple[str, str]]:
    return [
        ("upgrade", "websocket"),
        ("connection", "Upgrade"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("sec-websocket-version", version),
        *extra,
    ]


@attrs.frozen
class NotAnUpgrade:
    method: str
    headers: tuple[tuple[str, str], ...]
    status: int


NOT_UPGRADES: dict[str, NotAnUpgrade] = {
    "plain-get": NotAnUpgrade("GET", (), 400),
    "websocket-version-8": NotAnUpgrade("GET", tuple(upgrade(version="8")), 400),
    "no-websocket-key": NotAnUpgrade(
        "GET", tuple(h for h in upgrade() if h[0] != "sec-websocket-key"), 400
    ),
    "upgrade-to-something-else": NotAnUpgrade(
        "GET", (("upgrade", "h2c"), ("connection", "Upgrade")), 400
    ),
    "post-with-upgrade": NotAnUpgrade("POST", tuple(upgrade()), 405),
}


@params(NOT_UPGRADES)
async def test_requests_that_are_not_upgrades(edge: Edge, case: NotAnUpgrade) -> None:
    async with edge.case():
        response = await edge.exchange(
            request_bytes(case.method, NODE_PATH, case.headers), closes=False
        )
        assert_error(response, case.status)


# --------------------------------------------------------------------------- hellos


def text(message: wire.Message) -> str:
    return wire.encode(message)


def many_models(count: int) -> tuple[wire.ProviderInfo, ...]:
    models = tuple(wire.ModelInfo(name=f"m{i}", served_name=f"m{i}", slots=1) for i in range(count))
    return (wire.ProviderInfo(id="p", type="echo", adapter="echo", models=models),)


def provider(pid: str, model: str = "m") -> wire.ProviderInfo:
    return wire.ProviderInfo(
        id=pid,
        type="echo",
        adapter="echo",
        models=(wire.ModelInfo(name=model, served_name=model, slots=1),),
    )


@attrs.frozen
class Refusal:
    """The first frame(s) a node sends, and the close the edge answers with."""

    frames: tuple[str | bytes, ...]
    code: int
    reason: str
    stream_seconds: float = STREAM_SECONDS


def hello_frame(node_id: str = "hostile", **fields: Any) -> tuple[str, ...]:
    return (text(hello(node_id, **fields)),)


REFUSALS: dict[str, Refusal] = {
    "no-token": Refusal(hello_frame(token=None), 4001, "missing node token"),
    "wrong-token": Refusal(hello_frame(token="node-token-wrong"), 4001, "invalid node token"),
    "empty-token": Refusal(hello_frame(token=""), 4001, "invalid node token"),
    "client-key-as-token": Refusal(hello_frame(token=CLIENT_KEY), 4001, "invalid node token"),
    "bound-token-claiming-another-id": Refusal(
        hello_frame("gpu-1", token=BOUND_NODE_TOKEN), 4001, "not allowed for node id"
    ),
    "binary-hello": Refusal((b"\x00\x01hello",), 1002, "binary"),
    "not-json": Refusal(("garbage",), 1002, "bad hello"),
    "a-json-array": Refusal(("[1, 2]",), 1002, "bad hello"),
    "unknown-message-type": Refusal(('{"type": "nonsense"}',), 1002, "bad hello"),
    "hello-without-fields": Refusal(('{"type": "hello"}',), 1002, "bad hello"),
    "pong-instead-of-hello": Refusal((text(wire.Pong(nonce=1)),), 1002, "expected hello"),
    "wrong-protocol-version": Refusal(hello_frame(protocol=999), 1002, "protocol version"),
    "negative-slots": Refusal(hello_frame(slots=-1), 1002, "slots -1"),
    "a-million-slots": Refusal(hello_frame(slots=1_000_000), 1002, "slots 1000000"),
    "10000-models": Refusal(
        hello_frame(providers=many_models(10_000)), 1002, "10000 models announced", 0.3
    ),
    "crlf-in-node-id": Refusal(hello_frame("evil\r\nx-injected: 1"), 1002, "node_id"),
    "empty-node-id": Refusal(hello_frame(""), 1002, "node_id"),
    "node-id-of-300-characters": Refusal(hello_frame("n" * 300), 1002, "node_id"),
    "control-characters-in-label": Refusal(hello_frame(label="\x1b[31mred\x1b[0m"), 1002, "label"),
    "duplicate-provider-ids": Refusal(
        hello_frame(providers=(provider("p"), provider("p", "m2"))), 1002, "announced twice"
    ),
    "model-name-with-a-space": Refusal(
        hello_frame(providers=(provider("p", "a model"),)), 1002, "model name"
    ),
}


@params(REFUSALS)
async def test_refused_hellos(edge: Edge, case: Refusal) -> None:
    async with edge.case(stream_seconds=case.stream_seconds):
        ws, event = await RawWebSocket.connect(edge.port)
        assert isinstance(event, AcceptConnection)
        async with ws.stream:
            for frame in case.frames:
                if isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_text(frame)
            code, reason = await ws.closed_with()
        assert code == case.code, (code, reason)
        assert case.reason in reason, reason
        assert "\r" not in reason
        assert "\n" not in reason
        assert set(edge.dispatcher.registry.sessions) == {LEGIT}


@pytest.mark.short_timeouts
async def test_no_hello_is_closed_with_1008(edge: Edge) -> None:
    async with edge.case(stream_seconds=HELLO_TIMEOUT + 0.4):
        ws, event = await RawWebSocket.connect(edge.port)
        assert isinstance(event, AcceptConnection)
        async with ws.stream:
            code, reason = await ws.closed_with()
        assert (code, reason) == (1008, f"no hello within {HELLO_TIMEOUT} s")


@pytest.mark.parametrize(
    "garbage",
    [b"\xff\xff\xff\xff\xff\xff", b"\x81\x05hello", b"\x8f\x80\x00\x00\x00\x00"],
    ids=["not-a-frame", "unmasked-frame", "unknown-opcode"],
)
async def test_garbage_frames_are_a_protocol_error(edge: Edge, garbage: bytes) -> None:
    async with edge.case():
        ws, event = await RawWebSocket.connect(edge.port)
        assert isinstance(event, AcceptConnection)
        async with ws.stream:
            await ws.stream.send_all(garbage)
            code, _ = await ws.closed_with()
        assert code == 1002


async def test_a_message_over_the_limit_is_closed_with_1009(edge: Edge) -> None:
    async with edge.case(stream_seconds=0.3):
        ws, event = await RawWebSocket.connect(edge.port)
        assert isinstance(event, AcceptConnection)
        async with ws.stream:
            with trio.move_on_after(5):
                try:
                    await ws.send_text("x" * (4 * 1024 * 1024 + 1))
                except trio.BrokenResourceError:
                    pass
            code, _ = await ws.closed_with()
        assert code == 1009


async def test_a_bound_token_may_claim_its_own_ids(edge: Edge) -> None:
    async with edge.case():
        ws = await open_node(edge.port, hello("bound-7", token=BOUND_NODE_TOKEN))
        async with ws.stream:
            assert "bound-7" in edge.dispatcher.registry.sessions


# --------------------------------------------------------------------------- after the welcome


BROKEN_SESSIONS: dict[str, Refusal] = {
    "unknown-message-type": Refusal(('{"type": "nonsense"}',), 1002, "nonsense"),
    "not-json": Refusal(("{{{",), 1002, ""),
    "event-for-a-run-it-was-not-given": Refusal(
        (text(wire.RunDelta(run_id="run-nobody-gave", seq=0, text="x")),),
        1002,
        "which this session was not given",
    ),
    "completion-for-a-run-it-was-not-given": Refusal(
        (text(wire.RunCompleted(run_id="run-nobody-gave", seq=0)),), 1002, "not given"
    ),
    "tunnel-start-for-an-unknown-tunnel": Refusal(
        (text(wire.TunnelStart(tunnel_id="t-nobody-gave", status=200)),), 1002, ""
    ),
    "binary-garbage": Refusal((b"\x00\x01\x02",), 1002, ""),
    "negative-capacity": Refusal(
        (text(wire.Capacity(provider_id="p", model=EVIL_MODEL, slots=-5)),), 1002, "capacity"
    ),
    "a-second-hello": Refusal(hello_frame(), 1002, "unexpected 'hello'"),
    "an-edge-message": Refusal(
        (text(wire.RunCancel(run_id="r")),), 1002, "unexpected 'run.cancel'"
    ),
}


@params(BROKEN_SESSIONS)
async def test_sessions_that_break_the_protocol(edge: Edge, case: Refusal) -> None:
    async with edge.case():
        ws = await open_node(edge.port)
        async with ws.stream:
            assert "hostile" in edge.dispatcher.registry.sessions
            for frame in case.frames:
                if isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_text(frame)
            code, reason = await ws.closed_with()
        assert code == case.code, (code, reason)
        assert case.reason in reason
        await edge.wait_until(lambda: "hostile" not in edge.dispatcher.registry.sessions)


async def test_a_silent_node_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    config = edge_config()
    # The legitimate node lives under the same timeout and must keep its session: 1.5 s, not
    # less, so that a loaded machine's stall does not drop it too.
    config = attrs.evolve(
        config, nodes=attrs.evolve(config.nodes, heartbeat_interval=0.1, heartbeat_timeout=1.5)
    )
    async with open_edge(caplog, config) as edge, edge.case(stream_seconds=2.5):
        ws, _ = await RawWebSocket.connect(edge.port)
        async with ws.stream:
            await ws.send_message(hello())
            code, reason = None, ""
            with trio.fail_after(10):
                while code is None:  # read, never answer a ping
                    event = await ws.next_event()
                    code = getattr(event, "code", None)
                    reason = getattr(event, "reason", "") or ""
        assert code == 4003, (code, reason)
        assert "heartbeat timeout" in reason
        assert "hostile" not in edge.dispatcher.registry.sessions


# --------------------------------------------------------------------------- hostile runs


async def serve_one_run(
    edge: Edge,
    misbehave: Any,
    *,
    body: dict[str, Any] | None = None,
    closed: bool | None = True,
) -> tuple[Response, tuple[int, str] | None]:
    """A hostile node serving ``evil`` gets one client request; ``misbehave(ws, run)`` is
    what it does with it. The client's response, and (``closed``) the code and reason the
    edge closed the node's session with; ``closed=False``: the session must still be there;
    None: the node left by itself."""
    ws = await open_node(edge.port)
    close: tuple[int, str] | None = None
    response: Response | None = None
    async with ws.stream:
        async with trio.open_nursery() as nursery:

            async def client() -> None:
                nonlocal response
                response = await edge.post(
                    "/v1/chat/completions", body or {**chat(), "model": EVIL_MODEL}
                )

            nursery.start_soon(client)
            run = await ws.receive_message()
            assert isinstance(run, wire.RunRequest), run
            await misbehave(ws, run)
            if closed:
                close = await ws.closed_with()
        if closed is False:
            assert "hostile" in edge.dispatcher.registry.sessions
    assert response is not None
    return response, close


async def test_events_for_another_run_end_the_session(edge: Edge) -> None:
    async def misbehave(ws: RawWebSocket, run: wire.RunRequest) -> None:
        await ws.send_message(wire.RunDelta(run_id=run.run_id + "-other", seq=0, text="x"))

    async with edge.case():
        response, closed = await serve_one_run(edge, misbehave)
        assert closed is not None
        assert closed[0] == 1002
        assert_error(response, 502)
        assert "hostile" not in edge.dispatcher.registry.sessions


async def test_a_node_that_fails_with_hostile_text(edge: Edge) -> None:
    async def misbehave(ws: RawWebSocket, run: wire.RunRequest) -> None:
        await ws.send_message(
            wire.RunFailed(
                run_id=run.run_id,
                seq=0,
                code="boom\r\nx-injected: 1",
                message="\x1b[2J\r\nset-cookie: evil=1",
                retryable=False,
            )
        )

    async with edge.case():
        response, _ = await serve_one_run(edge, misbehave, closed=False)
        assert response.header("x-injected") is None
        assert response.header("set-cookie") is None
        assert_error(response, 502)
        json.dumps(response.json())  # a well-formed body, whatever the node said


async def test_a_node_that_dies_mid_stream(edge: Edge) -> None:
    async def misbehave(ws: RawWebSocket, run: wire.RunRequest) -> None:
        await ws.send_message(wire.RunStarted(run_id=run.run_id, seq=0))
        await ws.send_message(wire.RunDelta(run_id=run.run_id, seq=1, text="half "))
        await trio.sleep(0.05)
        await ws.stream.send_eof()  # gone without a close frame

    async with edge.case(stream_seconds=0.3):
        response, _ = await serve_one_run(
            edge, misbehave, body={**chat(stream=True), "model": EVIL_MODEL}, closed=None
        )
        assert response.status == 200
        events = [part for part in response.body.split(b"\n\n") if part]
        assert events[-1] != b"data: [DONE]"
        assert b'"error"' in events[-1]
        await edge.wait_until(lambda: "hostile" not in edge.dispatcher.registry.sessions)


async def test_a_node_that_reports_negative_usage(edge: Edge) -> None:
    async def misbehave(ws: RawWebSocket, run: wire.RunRequest) -> None:
        rid = run.run_id
        await ws.send_message(wire.RunDelta(run_id=rid, seq=0, text="fine"))
        usage = wire.Usage(prompt_tokens=-5, completion_tokens=-1_000_000)
        await ws.send_message(wire.RunUsage(run_id=rid, seq=1, usage=usage))
        await ws.send_message(wire.RunCompleted(run_id=rid, seq=2))

    async with edge.case():
        response, _ = await serve_one_run(edge, misbehave, closed=False)
        # Refused (a 502) or made sane; never relayed as it is, never a failure of the edge.
        if response.status == 200:
            usage = response.json()["usage"]
            assert usage["prompt_tokens"] >= 0
            assert usage["completion_tokens"] >= 0
        else:
            assert_error(response, 502)


async def test_events_after_the_end_close_the_session(edge: Edge) -> None:
    """A run ends with exactly one terminal event: anything after it breaks the protocol
    (the session state machine says so); the client keeps the answer it already had."""

    async def misbehave(ws: RawWebSocket, run: wire.RunRequest) -> None:
        rid = run.run_id
        await ws.send_message(wire.RunDelta(run_id=rid, seq=0, text="the end"))
        await ws.send_message(wire.RunCompleted(run_id=rid, seq=1))
        await ws.send_message(wire.RunDelta(run_id=rid, seq=2, text=" and more"))
        await ws.send_message(wire.RunCompleted(run_id=rid, seq=3))

    async with edge.case():
        response, close = await serve_one_run(edge, misbehave, closed=True)
        assert response.status == 200
        assert response.json()["choices"][0]["message"]["content"] == "the end"
        assert close is not None
        code, reason = close
        assert code == 1002
        assert "after its terminal event" in reason


# --------------------------------------------------------------------------- identity


@attrs.frozen
class Takeover:
    token: str | None
    code: int
    reason: str


TAKEOVERS: dict[str, Takeover] = {
    "another-token": Takeover(OTHER_NODE_TOKEN, 4004, ""),
    "no-token": Takeover(None, 4001, "missing node token"),
    "wrong-token": Takeover("node-token-wrong", 4001, "invalid node token"),
    "bound-token": Takeover(BOUND_NODE_TOKEN, 4001, "not allowed for node id"),
}


@params(TAKEOVERS)
async def test_a_takeover_of_the_legitimate_node_is_refused(edge: Edge, case: Takeover) -> None:
    """The guard stream runs on the victim: it must finish intact, its session unchanged."""
    async with edge.case():
        ws, event = await RawWebSocket.connect(edge.port)
        assert isinstance(event, AcceptConnection)
        async with ws.stream:
            await ws.send_message(hello(LEGIT, token=case.token, model="echo", slots=64))
            code, reason = await ws.closed_with()
        assert code == case.code, (code, reason)
        assert case.reason in reason
        session = edge.dispatcher.registry.sessions[LEGIT]
        assert session.hello.token == NODE_TOKEN
        assert {m.slots for p in session.hello.providers for m in p.models} == {4}
