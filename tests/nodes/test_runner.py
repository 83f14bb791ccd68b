from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from dispatcher import wire
from nodes.adapters import AdapterError, DropConnection, RunOutput, build_adapters
from nodes.adapters.base import estimate_tokens
from nodes.config import ModelConfig, ProviderConfig
from nodes.runner import MAX_DELTA_CHARS, MAX_PENDING_CHARS, open_runner
from tests.nodes._helpers import Recorder, assert_well_formed, request


class Scripted:
    """An adapter that emits ``pieces``, then does ``then``."""

    def __init__(
        self,
        pieces: tuple[str, ...] = ("hello ", "world"),
        *,
        then: str = "complete",
        usage: tuple[int, int] | None = (2, 2),
    ) -> None:
        self.pieces = pieces
        self.then = then
        self.usage = usage
        self.emitted = 0

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        for piece in self.pieces:
            await out.delta(piece)
            self.emitted += 1
        if self.usage is not None:
            out.usage(*self.usage)
        if self.then == "fail":
            raise AdapterError("upstream_down", "the upstream said 503", retryable=True)
        if self.then == "crash":
            raise ValueError("boom")
        if self.then == "stall":
            await trio.sleep_forever()
        if self.then == "drop":
            raise DropConnection("drop it")
        if self.then == "ignore_cancel_then_sleep":
            out.ignore_cancel()
            await trio.sleep(10)
        out.finish("length" if self.then == "length" else "stop")


async def test_completed_run_events_in_order() -> None:
    rec = Recorder()
    async with open_runner(rec.send, adapters={"p": Scripted(then="length")}) as runner:
        runner.start(request("r1", provider_id="p"))
        terminal = await rec.wait_terminal("r1")
    events = rec.events("r1")
    assert_well_formed(events)
    assert rec.text("r1") == "hello world"
    assert isinstance(terminal, wire.RunCompleted)
    assert terminal.finish_reason == "length"
    assert isinstance(events[-2], wire.RunUsage)
    assert events[-2].usage == wire.Usage(prompt_tokens=2, completion_tokens=2)


async def test_what_a_run_has_ready_is_sent_at_once() -> None:
    """With ``send_many``, the writer hands over everything a run had ready in one call (one
    socket write over the websocket): the rest of the text, the usage and the end together."""
    rec = Recorder()
    batches: list[list[str]] = []

    async def send_many(messages: Sequence[wire.NodeMessage]) -> None:
        batches.append([message.TYPE for message in messages])
        for message in messages:
            await rec.send(message)

    pieces = tuple(f"w{n} " for n in range(10))
    adapters = {"p": Scripted(pieces=pieces)}
    async with open_runner(rec.send, adapters=adapters, send_many=send_many) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_terminal("r1")
    assert_well_formed(rec.events("r1"))
    assert rec.text("r1") == "".join(pieces)
    assert len(batches) < len(rec.events("r1"))
    assert batches[-1][-2:] == ["run.usage", "run.completed"]
    assert sum(len(batch) for batch in batches) == len(rec.events("r1"))


async def test_adapter_error_becomes_run_failed() -> None:
    rec = Recorder()
    async with open_runner(rec.send, adapters={"p": Scripted(then="fail")}) as runner:
        runner.start(request("r1", provider_id="p"))
        terminal = await rec.wait_terminal("r1")
    assert_well_formed(rec.events("r1"))
    assert terminal == wire.RunFailed(
        run_id="r1",
        seq=terminal.seq,
        code="upstream_down",
        message="the upstream said 503",
        retryable=True,
    )
    # the partial usage precedes the failure
    assert rec.types("r1")[-2:] == ["run.usage", "run.failed"]


async def test_failure_before_any_output_has_no_usage() -> None:
    rec = Recorder()
    adapter = Scripted((), then="fail", usage=None)
    async with open_runner(rec.send, adapters={"p": adapter}) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_terminal("r1")
    assert rec.types("r1") == ["run.started", "run.failed"]


async def test_adapter_crash_is_internal_error_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Recorder()
    async with open_runner(rec.send, adapters={"p": Scripted(then="crash")}) as runner:
        runner.start(request("r1", provider_id="p"))
        terminal = await rec.wait_terminal("r1")
        # the runner survives a crashing adapter
        runner.start(request("r2", provider_id="p"))
        await rec.wait_terminal("r2")
    assert_well_formed(rec.events("r1"))
    assert isinstance(terminal, wire.RunFailed)
    assert (terminal.code, terminal.retryable) == ("internal", False)
    assert "boom" in terminal.message
    (record, _) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "r1" in record.getMessage()
    assert record.exc_info is not None


async def test_cancel_sends_run_cancelled_with_estimated_usage() -> None:
    rec = Recorder()
    adapter = Scripted(("hello ", "brave new ", "world "), then="stall", usage=None)
    async with open_runner(rec.send, adapters={"p": adapter}) as runner:
        runner.start(request("r1", text="one two three four five six seven", provider_id="p"))
        await rec.wait_text("r1", "hello brave new world ")
        assert runner.statistics().active_runs == 1
        runner.cancel("r1", "client went away")
        terminal = await rec.wait_terminal("r1")
        await trio.testing.wait_all_tasks_blocked()
        assert runner.statistics().active_runs == 0
    assert_well_formed(rec.events("r1"))
    assert isinstance(terminal, wire.RunCancelled)
    # prompt: 7 words, 33 chars -> max(7, ceil(33/4) = 9); completion: 4 words, 22 chars -> 6
    assert terminal.usage == wire.Usage(prompt_tokens=9, completion_tokens=6, estimated=True)
    assert "run.usage" not in rec.types("r1")


async def test_cancel_uses_reported_usage_when_known() -> None:
    rec = Recorder()

    class Reporting:
        async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
            await out.delta("a b c")
            out.usage(40, 3)
            await trio.sleep_forever()

    async with open_runner(rec.send, adapters={"p": Reporting()}) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_text("r1", "a b c")
        runner.cancel("r1")
        terminal = await rec.wait_terminal("r1")
    assert terminal.usage == wire.Usage(prompt_tokens=40, completion_tokens=3)


async def test_cancel_before_the_run_got_going() -> None:
    rec = Recorder()
    async with open_runner(rec.send, adapters={"p": Scripted()}) as runner:
        runner.start(request("r1", provider_id="p"))
        runner.cancel("r1")
        terminal = await rec.wait_terminal("r1")
    assert rec.types("r1") == ["run.started", "run.cancelled"]
    # "hello world": 2 words, 11 chars -> 3 tokens
    assert terminal.usage == wire.Usage(prompt_tokens=3, completion_tokens=0, estimated=True)


async def test_completed_without_reported_usage_gets_an_estimate() -> None:
    rec = Recorder()
    adapter = Scripted(("twelve chars",), usage=None)
    async with open_runner(rec.send, adapters={"p": adapter}) as runner:
        runner.start(request("r1", text="hi", provider_id="p"))
        await rec.wait_terminal("r1")
    usage = [e for e in rec.events("r1") if isinstance(e, wire.RunUsage)]
    assert [u.usage for u in usage] == [
        wire.Usage(prompt_tokens=1, completion_tokens=3, estimated=True)
    ]


async def test_connection_lost_cancels_runs_and_sends_nothing_more() -> None:
    rec = Recorder()
    stalled = Scripted(("partial ",), then="stall")
    async with open_runner(rec.send, adapters={"p": stalled}) as runner:
        runner.start(request("r1", provider_id="p"))
        runner.start(request("r2", provider_id="p"))
        await rec.wait_text("r1", "partial ")
        await rec.wait_text("r2", "partial ")
        sent = list(rec.messages)
    # leaving the block is what the agent does when the connection is gone
    assert rec.messages == sent
    assert rec.terminal("r1") is None
    assert rec.terminal("r2") is None
    with pytest.raises(RuntimeError, match="closed"):
        runner.start(request("r3", provider_id="p"))


async def test_drop_connection_escapes_the_runner_and_nothing_more_is_sent() -> None:
    rec = Recorder()
    adapters = {"stall": Scripted(then="stall"), "drop": Scripted(then="drop")}
    with pytest.RaisesGroup(DropConnection, flatten_subgroups=True):
        async with open_runner(rec.send, adapters=adapters) as runner:
            runner.start(request("r1", provider_id="stall"))
            await rec.wait_text("r1", "hello world")
            runner.start(request("r2", provider_id="drop"))
            await trio.sleep_forever()
    assert rec.terminal("r1") is None
    assert rec.terminal("r2") is None


async def test_a_second_start_for_a_running_run_is_a_local_protocol_error() -> None:
    """The session's machine refuses the edge's second ``run.request`` for a running run
    (the session closes with 1002); the runner does not paper over a caller that skipped it:
    the second start raises, sends nothing, and the running run goes on to its own end."""
    rec = Recorder()
    release = trio.Event()

    class Waiting:
        async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
            await out.delta("first")
            await release.wait()

    async with open_runner(rec.send, adapters={"p": Waiting()}) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_text("r1", "first")
        with pytest.raises(wire.LocalProtocolError, match="run 'r1' is already running"):
            runner.start(request("r1", provider_id="p"))
        assert runner.statistics().active_runs == 1
        release.set()
        await rec.wait_for(lambda: "run.completed" in rec.types("r1"))
    assert not any(isinstance(e, wire.RunFailed) for e in rec.events("r1"))
    assert_well_formed(rec.events("r1"))


async def test_unknown_provider_and_unsupported_adapter_fail() -> None:
    rec = Recorder()
    # A type in no registry (a config built in Python) is refused per run.
    odd = ProviderConfig(id="odd", type="llamacpp", models=(ModelConfig(name="m"),))
    async with open_runner(rec.send, adapters=build_adapters([odd])) as runner:
        runner.start(request("r1", provider_id="nope"))
        runner.start(request("r2", provider_id="odd"))
        unknown = await rec.wait_terminal("r1")
        unsupported = await rec.wait_terminal("r2")
    assert (unknown.code, unknown.retryable) == ("unknown_provider", True)
    assert (unsupported.code, unsupported.retryable) == ("unsupported_adapter", True)
    assert "llamacpp" in unsupported.message


async def test_ignore_cancel_runs_to_completion(autojump_clock: trio.testing.MockClock) -> None:
    rec = Recorder()
    adapter = Scripted(("a",), then="ignore_cancel_then_sleep")
    async with open_runner(rec.send, adapters={"p": adapter}) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_text("r1", "a")
        await trio.sleep(1)
        runner.cancel("r1")
        terminal = await rec.wait_terminal("r1")
    assert isinstance(terminal, wire.RunCompleted)
    assert trio.current_time() == pytest.approx(10)


async def test_cancel_of_unknown_run_is_ignored() -> None:
    rec = Recorder()
    async with open_runner(rec.send, adapters={}) as runner:
        runner.cancel("nope", "whatever")
        await trio.testing.wait_all_tasks_blocked()
    assert rec.messages == []


@pytest.mark.parametrize("outcome", ["complete", "fail", "crash", "stall", "cancel-late"])
async def test_exactly_one_terminal_for_many_concurrent_runs(
    outcome: str, autojump_clock: trio.testing.MockClock
) -> None:
    rec = Recorder(delay=0.001)
    then = "stall" if outcome == "cancel-late" else outcome
    adapter = Scripted(tuple(f"w{i} " for i in range(20)), then=then)
    async with open_runner(rec.send, adapters={"p": adapter}) as runner:
        for i in range(50):
            runner.start(request(f"r{i}", provider_id="p"))
        if outcome in ("stall", "cancel-late"):
            if outcome == "cancel-late":
                await rec.wait_for(
                    lambda: all(rec.text(f"r{i}").endswith("w19 ") for i in range(50))
                )
            for i in range(50):
                runner.cancel(f"r{i}")
                runner.cancel(f"r{i}")  # twice: still one terminal
        await rec.wait_for(lambda: all(rec.terminal(f"r{i}") for i in range(50)))
        await trio.sleep(1)
    for i in range(50):
        assert_well_formed(rec.events(f"r{i}"))


async def test_slow_connection_coalesces_deltas(autojump_clock: trio.testing.MockClock) -> None:
    rec = Recorder(delay=0.1)
    words = tuple(f"word{i} " for i in range(500))
    async with open_runner(rec.send, adapters={"p": Scripted(words)}) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_terminal("r1")
    deltas = [e for e in rec.events("r1") if isinstance(e, wire.RunDelta)]
    assert rec.text("r1") == "".join(words)
    assert len(deltas) < 10
    assert_well_formed(rec.events("r1"))


async def test_unsent_text_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    """A connection that takes nothing stops the adapter once MAX_PENDING_CHARS are unsent."""
    gate = trio.Event()

    async def stuck_send(message: wire.NodeMessage) -> None:
        await gate.wait()

    piece = "x" * 1000
    adapter = Scripted((piece,) * 1000)
    async with open_runner(stuck_send, adapters={"p": adapter}) as runner:
        runner.start(request("r1", provider_id="p"))
        await trio.sleep(5)
        # one batch taken by the (stuck) writer, then at most MAX_PENDING_CHARS more
        assert adapter.emitted <= 2 * math.ceil(MAX_PENDING_CHARS / len(piece)) + 2
        assert adapter.emitted < 1000


async def test_huge_delta_is_split_into_frames_under_the_limit() -> None:
    rec = Recorder()
    big = "é" * (MAX_DELTA_CHARS * 2 + 5)
    async with open_runner(rec.send, adapters={"p": Scripted((big,))}) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_terminal("r1")
    deltas = [e for e in rec.events("r1") if isinstance(e, wire.RunDelta)]
    assert len(deltas) == 3
    assert rec.text("r1") == big
    assert all(len(wire.encode(d)) < wire.MAX_FRAME_SIZE for d in deltas)


class WithToolCalls:
    """An adapter that emits ``script``: strings as text, lists as tool-call deltas."""

    def __init__(self, script: list[str | list[dict[str, Any]]]) -> None:
        self.script = script

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        for item in self.script:
            if isinstance(item, str):
                await out.delta(item)
            else:
                await out.tool_calls(item)
        out.finish("tool_calls")


def call_head(index: int, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def call_args(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


async def test_tool_call_deltas_keep_their_order_among_coalesced_text(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script: list[str | list[dict[str, Any]]] = [
        "let ",
        "me ",
        "check",
        [call_head(0, "get_weather")],
        [call_args(0, '{"city":'), call_args(0, '"Paris"}')],
        [call_args(0, "")],
        "done ",
        "now",
        [call_head(1, "get_time")],
    ]
    rec = Recorder(delay=0.1)  # slow: everything piles up and is coalesced where it may be
    async with open_runner(rec.send, adapters={"p": WithToolCalls(script)}) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_terminal("r1")
    events = rec.events("r1")
    assert_well_formed(events)
    frames: list[tuple[str, list[Any]]] = []
    for event in events:
        if not isinstance(event, wire.RunDelta):
            continue
        assert not (event.text and event.tool_calls)
        if event.text and frames and frames[-1][0]:  # text frames may split anywhere
            frames[-1] = (frames[-1][0] + event.text, [])
        else:
            frames.append((event.text, list(event.tool_calls)))
    assert frames == [
        ("let me check", []),
        ("", [call_head(0, "get_weather")]),
        ("", [call_args(0, '{"city":'), call_args(0, '"Paris"}')]),
        ("", [call_args(0, "")]),
        ("done now", []),
        ("", [call_head(1, "get_time")]),
    ]
    assert rec.terminal("r1").finish_reason == "tool_calls"
    # the usage estimate counts the text only
    (usage,) = [e.usage for e in events if isinstance(e, wire.RunUsage)]
    assert usage.completion_tokens == estimate_tokens("let me check" + "done now")


async def test_huge_tool_call_arguments_are_split_into_frames_under_the_limit() -> None:
    rec = Recorder()
    arguments = '"' + "é" * (MAX_DELTA_CHARS * 2) + '"'
    head = {**call_head(0, "write"), "function": {"name": "write", "arguments": arguments}}
    async with open_runner(rec.send, adapters={"p": WithToolCalls([[head]])}) as runner:
        runner.start(request("r1", provider_id="p"))
        await rec.wait_terminal("r1")
    deltas = [e for e in rec.events("r1") if isinstance(e, wire.RunDelta)]
    assert len(deltas) == 3
    assert all(len(wire.encode(d)) < wire.MAX_FRAME_SIZE for d in deltas)
    pieces = [call for d in deltas for call in d.tool_calls]
    assert pieces[0]["id"] == "call_0"
    assert {p["index"] for p in pieces} == {0}
    assert "".join(p["function"]["arguments"] for p in pieces) == arguments
