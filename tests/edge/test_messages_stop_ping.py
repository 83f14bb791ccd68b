"""``/v1/messages``: ``stop_reason: "stop_sequence"`` with the sequence a run says ended its
text (``run.completed.stop_sequence``), and ``ping`` events on a stream that is silent for
:data:`~dispatcher.api.anthropic.PING_INTERVAL` seconds -- the pinger in virtual time over a
stand-in stream, then a real edge on 127.0.0.1 with a scripted node and the official
``anthropic`` SDK."""

from __future__ import annotations

from typing import Any, cast

import anthropic
import orjson
import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.api import anthropic as messages_api
from dispatcher.api.anthropic import _Keepalive
from dispatcher.api.anthropic._answer import PING, message_body, stop_reason
from dispatcher.api.common import Pending
from dispatcher.http import HTTPStream

from .fakes import ScriptedNode, connect, hello
from .test_messages import Edge, open_edge, sse_events, user


def test_stop_reason_says_which_sequence_only_for_a_stop() -> None:
    assert stop_reason("stop", tool_calls=False, stop_sequence="END") == "stop_sequence"
    assert stop_reason("stop", tool_calls=False) == "end_turn"
    assert stop_reason("length", tool_calls=False, stop_sequence="END") == "max_tokens"
    assert stop_reason("stop", tool_calls=True, stop_sequence="END") == "tool_use"
    head: list[wire.RunEvent] = [
        wire.RunStarted(run_id="r", seq=0),
        wire.RunDelta(run_id="r", seq=1, text="one two "),
        wire.RunCompleted(run_id="r", seq=2, stop_sequence="END"),
    ]
    body = message_body(message_id="msg_r", model="m", head=head, input_estimate=3)
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")


def test_run_completed_leaves_out_a_missing_stop_sequence() -> None:
    assert "stop_sequence" not in wire.encode(wire.RunCompleted(run_id="r", seq=0))
    frame = wire.encode(wire.RunCompleted(run_id="r", seq=0, stop_sequence="END"))
    assert wire.decode(frame) == wire.RunCompleted(run_id="r", seq=0, stop_sequence="END")


class FakeStream:
    """What the pinger sends on, with the (virtual) time of each send."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, bytes]] = []

    async def send(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.sent.append((trio.current_time(), data))


async def test_a_ping_after_each_interval_of_silence_and_none_while_events_flow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = FakeStream()
    pending = Pending(cast(HTTPStream, stream))
    start = trio.current_time()
    keepalive = _Keepalive(pending, 10.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keepalive.ping)
        await trio.sleep(25)  # silence: pings at 10 and 20
        pending.out.append(b"event: content_block_delta\n\n")
        await keepalive.send()  # at 25
        for _ in range(5):  # an event every 4 s: no ping
            await trio.sleep(4)
            pending.out.append(b"event: content_block_delta\n\n")
            await keepalive.send()
        await trio.sleep(12)  # the last event at 45 -> a ping at 55
        nursery.cancel_scope.cancel()
    assert [(when - start, data == PING) for when, data in stream.sent] == [
        (10.0, True),
        (20.0, True),
        (25.0, False),
        (29.0, False),
        (33.0, False),
        (37.0, False),
        (41.0, False),
        (45.0, False),
        (55.0, True),
    ]


async def _answer_slowly(
    node: ScriptedNode, silence: float | trio.Event, sequence: str | None
) -> None:
    """Answer the node's next run: ``one ``, a silence (seconds, or until the event is set),
    ``two``, then done (``stop_sequence``: ``sequence``)."""
    request = await node.receive_run()
    run_id = request.run_id
    await node.send(wire.RunStarted(run_id=run_id, seq=0))
    await node.send(wire.RunDelta(run_id=run_id, seq=1, text="one "))
    if isinstance(silence, trio.Event):
        await silence.wait()
    else:
        await trio.sleep(silence)
    await node.send(wire.RunDelta(run_id=run_id, seq=2, text="two"))
    usage = wire.Usage(prompt_tokens=3, completion_tokens=2)
    await node.send(wire.RunUsage(run_id=run_id, seq=3, usage=usage))
    await node.send(wire.RunCompleted(run_id=run_id, seq=4, stop_sequence=sequence))


async def _streamed(edge: Edge, **fields: Any) -> list[tuple[str, dict[str, Any]]]:
    def consume(client: anthropic.Anthropic) -> bytes:
        with client.messages.with_streaming_response.create(
            model="m", max_tokens=50, messages=user("count"), stream=True, **fields
        ) as raw:
            read: bytes = raw.read()
            return read

    return sse_events(await edge.sdk(consume))


async def test_a_silent_stream_sends_pings_and_the_sdk_reads_through_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node stays silent after its first delta until the client has seen two pings."""
    monkeypatch.setattr(messages_api, "PING_INTERVAL", 0.05)
    async with open_edge(node=None) as edge:
        node = await connect(edge.dispatcher, hello("n1", model="m"))
        resume = trio.Event()
        payload = orjson.dumps(
            {"model": "m", "max_tokens": 50, "stream": True, "messages": user("count")}
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_slowly, node, resume, None)
            stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
            await stream.send_all(
                b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            received = b""
            with trio.fail_after(10):
                while b"event: message_stop" not in received:
                    chunk = await stream.receive_some()
                    assert chunk, "the edge closed the stream early"
                    received += chunk
                    _, delta, after = received.partition(b"event: content_block_delta")
                    if delta and after.count(b"event: ping") >= 2:
                        resume.set()
            await stream.aclose()
        head, _, after = received.partition(b"event: content_block_delta")
        assert head.count(b"event: ping") == 1  # the one after message_start
        silence = after.partition(b"event: content_block_delta")[0]
        assert silence.count(b"event: ping") >= 2
        assert b'data: {"type":"ping"}' in silence

        # the SDK's own stream reader takes the pings in its stride
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_slowly, node, 0.3, None)

            def text(client: anthropic.Anthropic) -> str:
                with client.messages.stream(
                    model="m", max_tokens=50, messages=user("count")
                ) as stream:
                    return "".join(stream.text_stream)

            assert await edge.sdk(text) == "one two"


async def test_a_stream_that_keeps_talking_sends_only_the_first_ping() -> None:
    async with open_edge(node=None) as edge:
        node = await connect(edge.dispatcher, hello("n1", model="m"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_slowly, node, 0.01, None)
            events = await _streamed(edge)
    assert [name for name, _ in events].count("ping") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_stop_sequence_reaches_the_client(stream: bool) -> None:
    async with open_edge(node=None) as edge:
        node = await connect(edge.dispatcher, hello("n1", model="m"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_slowly, node, 0.0, "END")

            def ask(client: anthropic.Anthropic) -> Any:
                request: dict[str, Any] = {
                    "model": "m",
                    "max_tokens": 50,
                    "messages": user("count"),
                    "stop_sequences": ["END"],
                }
                if not stream:
                    return client.messages.create(**request)
                with client.messages.stream(**request) as events:
                    return events.get_final_message()

            message = await edge.sdk(ask)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    assert "".join(block.text for block in message.content) == "one two"
