"""``Usage.estimated``: usage the node estimated never travels as if it had been measured."""

from __future__ import annotations

import orjson
import trio

from dispatcher import wire
from nodes.adapters import Adapter, AdapterError, EchoAdapter, EchoOptions, RunOutput
from nodes.adapters.base import estimate_tokens
from nodes.runner import open_runner
from tests.nodes._helpers import Recorder, assert_well_formed, request


class Silent:
    """Streams ``pieces`` and never reports usage; then completes, fails or stalls."""

    def __init__(self, *pieces: str, then: str = "complete") -> None:
        self.pieces = pieces
        self.then = then

    async def run(self, req: wire.RunRequest, out: RunOutput) -> None:
        for piece in self.pieces:
            await out.delta(piece)
        if self.then == "stall":
            await trio.sleep_forever()
        if self.then == "fail":
            raise AdapterError("upstream_down", "it broke", retryable=True)


class Reporting:
    """Reports the given usage (once, before any text), then streams ``pieces``."""

    def __init__(self, *pieces: str, estimated: bool = False, stall: bool = False) -> None:
        self.pieces = pieces
        self.estimated = estimated
        self.stall = stall

    async def run(self, req: wire.RunRequest, out: RunOutput) -> None:
        out.usage(11, 0, estimated=self.estimated)
        for piece in self.pieces:
            await out.delta(piece)
        if self.stall:
            await trio.sleep_forever()


async def run_one(adapter: Adapter, req: wire.RunRequest) -> Recorder:
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={req.provider_id: adapter}) as runner:
            runner.start(req)
            await rec.wait_terminal(req.run_id)
    assert_well_formed(rec.events(req.run_id))
    return rec


async def cancel_after_text(adapter: Adapter, req: wire.RunRequest, text: str) -> Recorder:
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={req.provider_id: adapter}) as runner:
            runner.start(req)
            await rec.wait_text(req.run_id, text)
            runner.cancel(req.run_id, "client gone")
            await rec.wait_terminal(req.run_id)
    assert_well_formed(rec.events(req.run_id))
    return rec


def usages(rec: Recorder) -> list[wire.Usage]:
    return [e.usage for e in rec.events("r1") if isinstance(e, wire.RunUsage)]


async def test_runner_estimate_is_marked_estimated_in_run_usage() -> None:
    rec = await run_one(Silent("twelve chars"), request(text="one two three", provider_id="p"))
    assert usages(rec) == [
        wire.Usage(
            prompt_tokens=estimate_tokens("one two three"),
            completion_tokens=estimate_tokens("twelve chars"),
            estimated=True,
        )
    ]
    # and it says so on the wire
    (event,) = [e for e in rec.events("r1") if isinstance(e, wire.RunUsage)]
    assert orjson.loads(wire.encode(event))["usage"]["estimated"] is True


async def test_runner_estimate_before_a_failure_is_marked_estimated() -> None:
    rec = await run_one(Silent("some text", then="fail"), request(provider_id="p"))
    assert rec.types("r1")[-2:] == ["run.usage", "run.failed"]
    (usage,) = usages(rec)
    assert usage.estimated is True


async def test_runner_estimate_in_run_cancelled_is_marked_estimated() -> None:
    rec = await cancel_after_text(
        Silent("a b c ", then="stall"), request(provider_id="p"), "a b c "
    )
    terminal = rec.terminal("r1")
    assert isinstance(terminal, wire.RunCancelled)
    assert terminal.usage == wire.Usage(
        prompt_tokens=estimate_tokens("hello world"),
        completion_tokens=estimate_tokens("a b c "),
        estimated=True,
    )


async def test_reported_usage_is_measured_even_when_the_runner_saw_more_text() -> None:
    # The adapter reported (prompt 11, completion 0) and then streamed without reporting
    # again: the runner sends what was reported and does not estimate over it -- on the first
    # delta (a count made before any content) and as the run's usage at the end.
    rec = await run_one(Reporting("more text here"), request(provider_id="p"))
    reported = wire.Usage(prompt_tokens=11, completion_tokens=0, estimated=False)
    assert usages(rec) == [reported]
    first = next(e for e in rec.events("r1") if isinstance(e, wire.RunDelta))
    assert first.usage == reported
    rec = await cancel_after_text(
        Reporting("partial ", stall=True), request(provider_id="p"), "partial "
    )
    terminal = rec.terminal("r1")
    assert terminal.usage == wire.Usage(prompt_tokens=11, completion_tokens=0, estimated=False)


async def test_an_adapter_that_reports_an_estimate_says_so() -> None:
    rec = await run_one(Reporting("x", estimated=True), request(provider_id="p"))
    assert usages(rec) == [wire.Usage(prompt_tokens=11, completion_tokens=0, estimated=True)]


async def test_echo_counts_its_own_tokens_so_its_usage_is_measured() -> None:
    adapter = EchoAdapter(EchoOptions())
    rec = await run_one(adapter, request(text="one two three"))
    assert usages(rec) == [wire.Usage(prompt_tokens=3, completion_tokens=3, estimated=False)]
    first = next(e for e in rec.events("r1") if isinstance(e, wire.RunDelta))
    assert first.usage == wire.Usage(prompt_tokens=3, completion_tokens=0)  # before its text

    stalling = EchoAdapter(EchoOptions(stall_after_tokens=2))
    rec = await cancel_after_text(stalling, request(text="one two three"), "one two ")
    terminal = rec.terminal("r1")
    assert isinstance(terminal, wire.RunCancelled)
    assert terminal.usage == wire.Usage(prompt_tokens=3, completion_tokens=2, estimated=False)
