"""A tunnel's request body as binary frames (``tunnel.request.body_size``): the edge's side on
a scripted node (the frames it writes, in order and in size), and the node's side
(``nodes.tunnel``) against a fake provider: the body is performed whole, once complete; a
cancel before it is complete never reaches the provider."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from dispatcher import wire
from dispatcher.errors import TunnelFailed
from dispatcher.gate.pool import DispatchRequest
from dispatcher.paths.tunnel import INLINE_BODY_LIMIT
from nodes.tunnel import CANCELLED, TunnelProvider, open_tunnels

from ..nodes.fake_providers import _serve
from .fake_media import FakeMedia, parse_form
from .fakes import ScriptedNode, wait_until
from .test_tunnel import MODEL, open_env, scripted_edge


async def next_frame(node: ScriptedNode) -> wire.Message | wire.TunnelData:
    """The edge's next frame to the node but pings (answered) and demands."""
    while True:
        frame = await node.conn.receive()
        if isinstance(frame, bytes):
            return wire.decode_binary(frame)
        message = wire.decode(frame)
        if isinstance(message, wire.Ping):
            await node.send(wire.Pong(nonce=message.nonce))
        elif not isinstance(message, wire.Demand):
            return message


async def upload_through_the_edge(
    dispatcher: Any, body: bytes, results: trio.MemorySendChannel[Any]
) -> None:
    request = DispatchRequest(model="t", body={"model": "t"}, route="/v1/audio/transcriptions")
    async with results, dispatcher.open_dispatch(request) as dispatch:
        tunnel = dispatch.tunnel
        assert tunnel is not None
        try:
            await tunnel.send_request(method="POST", path="/v1/audio/transcriptions", body=body)
            await results.send(await tunnel.start())
            while data := await tunnel.receive_some():
                await results.send(data)
            await results.send("end")
        except TunnelFailed as exc:
            await results.send(exc)


async def test_a_bytes_body_follows_its_request_in_chunk_frames(nursery: trio.Nursery) -> None:
    body = bytes(i % 253 for i in range(5 * wire.MAX_TUNNEL_CHUNK + 1234))
    async with scripted_edge() as (dispatcher, node):
        send, results = trio.open_memory_channel[Any](100)
        nursery.start_soon(upload_through_the_edge, dispatcher, body, send)
        with trio.fail_after(10):
            request = await next_frame(node)
            assert isinstance(request, wire.TunnelRequest)
            assert (request.body, request.body_size) == ("", len(body))
            pieces: list[bytes] = []
            while sum(map(len, pieces)) < len(body):
                frame = await next_frame(node)
                assert isinstance(frame, wire.TunnelData)
                assert frame.tunnel_id == request.tunnel_id
                assert 0 < len(frame.data) <= wire.MAX_TUNNEL_CHUNK
                pieces.append(frame.data)
            assert b"".join(pieces) == body
            assert len(pieces) == 6
            tunnel_id = request.tunnel_id
            await node.send(wire.TunnelStart(tunnel_id=tunnel_id, status=200))
            await node.conn.send(wire.encode_tunnel_data(tunnel_id, b'{"text":"ok"}'))
            await node.send(wire.TunnelEnd(tunnel_id=tunnel_id))
            assert (await results.receive()).status == 200
            assert await results.receive() == b'{"text":"ok"}'
            assert await results.receive() == "end"
        await wait_until(lambda: dispatcher.admission.statistics().in_use == 0)


async def test_a_node_ending_the_tunnel_stops_the_upload(nursery: trio.Nursery) -> None:
    """The node refuses the tunnel at once (here: a provider it does not serve): the edge
    stops writing the body -- what was already on its way the node drops -- and the session
    lives on."""
    frames = 256
    body = b"u" * (frames * wire.MAX_TUNNEL_CHUNK)
    async with scripted_edge() as (dispatcher, node):
        send, results = trio.open_memory_channel[Any](100)
        nursery.start_soon(upload_through_the_edge, dispatcher, body, send)
        with trio.fail_after(10):
            request = await next_frame(node)
            assert isinstance(request, wire.TunnelRequest)
            await node.send(
                wire.TunnelEnd(tunnel_id=request.tunnel_id, error="unknown_provider: no such")
            )
            failure = await results.receive()
            assert isinstance(failure, TunnelFailed)
            assert "unknown_provider" in failure.message
            received = 0
            while received < len(body):
                with trio.move_on_after(0.5) as quiet:
                    frame = await next_frame(node)
                if quiet.cancelled_caught:
                    break
                assert isinstance(frame, wire.TunnelData)
                received += len(frame.data)
            assert received < len(body)
        await wait_until(lambda: dispatcher.admission.statistics().in_use == 0)
        assert "scripted" in dispatcher.registry.sessions


# --------------------------------------------------------------------------- the node's side


def _runner_io() -> tuple[list[wire.NodeMessage], list[bytes], Any, Any]:
    messages: list[wire.NodeMessage] = []
    frames: list[bytes] = []

    async def send(message: wire.NodeMessage) -> None:
        messages.append(message)
        await trio.lowlevel.checkpoint()

    async def send_data(tunnel_id: str, data: bytes) -> None:
        frames.append(data)
        await trio.lowlevel.checkpoint()

    return messages, frames, send, send_data


def form_upload() -> tuple[bytes, str]:
    request = httpx.Request(
        "POST",
        "http://x/",
        data={"model": "whisper-1"},
        files={"file": ("a.wav", bytes(range(256)) * 1000, "audio/wav")},
    )
    return request.read(), request.headers["content-type"]


async def test_the_node_calls_the_provider_once_the_whole_body_came(
    nursery: trio.Nursery,
) -> None:
    fake: FakeMedia = await nursery.start(_serve, FakeMedia())
    messages, frames, send, send_data = _runner_io()
    body, content_type = form_upload()
    provider = TunnelProvider(id="p", base_url=fake.base_url + "/v1")
    with trio.fail_after(10):
        async with open_tunnels(send, send_data, {"p": provider}) as tunnels:
            tunnels.start(
                wire.TunnelRequest(
                    tunnel_id="t",
                    provider_id="p",
                    method="POST",
                    path="/v1/audio/transcriptions",
                    headers=(("content-type", content_type),),
                    body_size=len(body),
                )
            )
            chunk = wire.MAX_TUNNEL_CHUNK
            for at in range(0, len(body), chunk):
                await trio.sleep(0.01)
                assert not fake.requests  # nothing is sent before the last piece
                tunnels.body("t", body[at : at + chunk])
            tunnels.body("t", b"late bytes are ignored")
            await wait_until(lambda: any(isinstance(m, wire.TunnelEnd) for m in messages))
    (seen,) = fake.requests
    assert seen.body == body
    assert parse_form(seen)["file"][0].value == bytes(range(256)) * 1000
    start, end = messages[0], messages[-1]
    assert isinstance(start, wire.TunnelStart)
    assert start.status == 200
    assert end == wire.TunnelEnd(tunnel_id="t")
    assert b'"text"' in b"".join(frames)


async def test_a_tunnel_cancelled_before_its_body_came_never_calls_the_provider(
    nursery: trio.Nursery,
) -> None:
    fake: FakeMedia = await nursery.start(_serve, FakeMedia())
    messages, _, send, send_data = _runner_io()
    provider = TunnelProvider(id="p", base_url=fake.base_url)
    with trio.fail_after(10):
        async with open_tunnels(send, send_data, {"p": provider}) as tunnels:
            tunnels.start(
                wire.TunnelRequest(
                    tunnel_id="t",
                    provider_id="p",
                    method="POST",
                    path="/v1/audio/transcriptions",
                    body_size=1000,
                )
            )
            tunnels.body("t", b"x" * 999)
            await trio.sleep(0.05)
            tunnels.cancel("t")
            await wait_until(lambda: bool(messages))
    assert messages == [wire.TunnelEnd(tunnel_id="t", error=CANCELLED)]
    assert not fake.requests


async def test_a_json_body_too_long_for_one_frame_goes_as_body_frames(
    nursery: trio.Nursery,
) -> None:
    """A text body past ``INLINE_BODY_LIMIT`` bytes (here: 1.5 MiB of JSON with non-ASCII
    text, which would be over the wire's frame limit escaped inside ``tunnel.request``
    for a large enough one) is sent as request body frames, in UTF-8; a shorter one inline."""
    text = '{"model": "t", "input": "' + "é€" * (INLINE_BODY_LIMIT // 4) + '"}'
    encoded = text.encode()
    assert len(encoded) > INLINE_BODY_LIMIT
    async with scripted_edge() as (dispatcher, node):
        for body, inline in ((text, False), ('{"model": "t", "input": "short"}', True)):
            request = DispatchRequest(model="t", body={"model": "t"}, route="/v1/embeddings")

            async def client(body: str = body, request: DispatchRequest = request) -> None:
                async with dispatcher.open_dispatch(request) as dispatch:
                    assert dispatch.tunnel is not None
                    await dispatch.tunnel.send_request(
                        method="POST", path="/v1/embeddings", body=body
                    )
                    await dispatch.tunnel.start()
                    assert await dispatch.tunnel.receive_some() == b""  # the end came

            nursery.start_soon(client)
            with trio.fail_after(10):
                message = await next_frame(node)
                assert isinstance(message, wire.TunnelRequest)
                if inline:
                    assert (message.body, message.body_size) == (body, 0)
                else:
                    assert (message.body, message.body_size) == ("", len(encoded))
                    received = b""
                    while len(received) < len(encoded):
                        frame = await next_frame(node)
                        assert isinstance(frame, wire.TunnelData)
                        received += frame.data
                    assert received == encoded
                await node.send(wire.TunnelStart(tunnel_id=message.tunnel_id, status=200))
                await node.send(wire.TunnelEnd(tunnel_id=message.tunnel_id))
            await wait_until(lambda: dispatcher.admission.statistics().in_use == 0)


async def test_a_5_mib_embeddings_request_reaches_the_provider(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under the edge's 8 MiB body limit but over the wire's 4 MiB frame limit once escaped
    inside ``tunnel.request``: sent as request body frames, it is answered (it used to close
    the node's session, and every request on it)."""
    inputs = ['say "hello" ' * 1000] * 440  # quotes: escaped twice on the way
    async with open_env(monkeypatch) as env, env.client() as client:
        response = await client.post("/v1/embeddings", json={"model": MODEL, "input": inputs})
        assert response.status_code == 200, response.text
        (seen,) = env.fake.requests
        assert len(seen.body) > 5 * 1024 * 1024
        assert seen.json["input"] == inputs
        assert env.dispatcher.registry.sessions["tunnel-node"].generation == 1
