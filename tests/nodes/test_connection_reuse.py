"""The node reuses its provider connections (issue #12, acceptance 2): N runs through the
normalized ``openai`` and ``ollama`` adapters open at most ``slots`` TCP connections to the
provider -- one after the other and ``slots`` at a time, through the runner and end to end
through the edge's HTTP API -- and a cancelled run still closes *its* request at once, so no
later run can read what was left of its answer.

The fake providers (``tests.nodes.fake_providers``) sit behind a :class:`CountingRelay`: a
TCP relay on 127.0.0.1 port 0 that counts the connections it accepts (each relayed on a
connection of its own to the fake) and closes both sides when either one closes. Not a
timing test: it counts connections.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import certifi
import httpx
import orjson
import pytest
import trio

from dispatcher import EdgeConfig, open_dispatcher, wire
from nodes.adapters import HasLifetime, build_adapters, open_adapters
from nodes.config import ModelConfig, NodeConfig, ProviderConfig
from nodes.runner import Runner, open_runner
from nodes.upstream import client as upstream_client
from nodes.upstream.tls import tls_context
from tests.nodes._helpers import Recorder, assert_well_formed
from tests.nodes.fake_providers import (
    FakeOllama,
    FakeOpenAI,
    FakeProvider,
    serve_fake_ollama,
    serve_fake_openai,
)

Kind = Literal["openai", "ollama"]
KINDS: tuple[Kind, ...] = ("openai", "ollama")
SLOTS = 3
RUNS = 24
TIMEOUT = 30  # seconds: a bound on a hang, never reached when the code works


# --------------------------------------------------------------------------- the relay


@attrs.define(eq=False)
class CountingRelay:
    """Relays every accepted TCP connection to ``target_port`` and counts them."""

    target_port: int
    port: int = 0
    accepted: int = 0
    """TCP connections accepted so far."""
    open: int = 0
    """Relayed connections not closed yet."""
    peak_open: int = 0
    _changed: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.park()

    async def relay(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        self._changed.unpark_all()
        try:
            async with (
                client,
                await trio.open_tcp_stream("127.0.0.1", self.target_port) as peer,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(_pipe, client, peer, nursery.cancel_scope)
                nursery.start_soon(_pipe, peer, client, nursery.cancel_scope)
        finally:
            self.open -= 1
            self._changed.unpark_all()


async def _pipe(source: trio.SocketStream, sink: trio.SocketStream, both: trio.CancelScope) -> None:
    """Copy ``source`` to ``sink`` until either breaks or ``source`` ends; then end both."""
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
    except trio.BrokenResourceError:
        pass
    both.cancel(reason="one side of the relayed connection closed")


async def serve_counting_relay(
    target_port: int, *, task_status: trio.TaskStatus[CountingRelay] = trio.TASK_STATUS_IGNORED
) -> None:
    relay = CountingRelay(target_port)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    relay.port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, relay.relay, listeners)
        task_status.started(relay)


@attrs.frozen
class Upstream:
    kind: Kind
    fake: FakeProvider
    relay: CountingRelay


async def start_upstream(nursery: trio.Nursery, kind: Kind) -> Upstream:
    serve = serve_fake_openai if kind == "openai" else serve_fake_ollama
    fake: FakeOpenAI | FakeOllama = await nursery.start(serve)
    fake.reply = "a short answer from the fake"
    assert fake.server is not None
    relay: CountingRelay = await nursery.start(serve_counting_relay, fake.server.address.port)
    return Upstream(kind, fake, relay)


@pytest.fixture(autouse=True)
def patient_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A response's body is always read to its end before its connection goes back to the
    pool: the fake ends every body right after its last event, and on a loaded machine that
    end can take longer than :data:`nodes.upstream.client.REUSE_WAIT` to be read (the
    connection is then closed, not reused, and a test counting connections sees one more)."""
    monkeypatch.setattr(upstream_client, "REUSE_WAIT", 30.0)


@pytest.fixture(params=KINDS)
async def upstream(request: pytest.FixtureRequest, nursery: trio.Nursery) -> Upstream:
    return await start_upstream(nursery, request.param)


def provider(up: Upstream, slots: int = SLOTS) -> ProviderConfig:
    return ProviderConfig(
        id="up",
        type=up.kind,
        base_url=up.relay.url,
        models=(ModelConfig(name="m", served_name="fake-model", slots=slots),),
    )


def run_request(run_id: str, *, stream: bool) -> wire.RunRequest:
    return wire.RunRequest(
        run_id=run_id,
        provider_id="up",
        model="m",
        served_model="fake-model",
        body={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream},
    )


async def run_many(
    runner: Runner, rec: Recorder, count: int, *, concurrency: int, stream: bool, prefix: str
) -> list[str]:
    """``count`` runs, ``concurrency`` at a time; their ids."""
    ids = [f"{prefix}{index}" for index in range(count)]
    pending = iter(ids)

    async def worker() -> None:
        for run_id in pending:
            runner.start(run_request(run_id, stream=stream))
            await rec.wait_terminal(run_id)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return ids


def assert_completed(rec: Recorder, run_id: str, text: str) -> None:
    events = rec.events(run_id)
    assert_well_formed(events)
    assert isinstance(events[-1], wire.RunCompleted), events[-1]
    assert rec.text(run_id) == text


# --------------------------------------------------------------------------- through the runner


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("concurrency", [1, SLOTS], ids=["one-at-a-time", "slots-at-a-time"])
async def test_runs_through_the_runner_open_at_most_slots_connections(
    upstream: Upstream, concurrency: int, stream: bool
) -> None:
    relay, fake = upstream.relay, upstream.fake
    rec = Recorder()
    with trio.fail_after(TIMEOUT):
        async with open_runner(rec.send, adapters=build_adapters([provider(upstream)])) as runner:
            ids = await run_many(
                runner, rec, RUNS, concurrency=concurrency, stream=stream, prefix="r"
            )
            assert relay.accepted <= concurrency
            assert relay.open == relay.accepted  # kept alive between runs
        # Leaving the runner closes the pool: every connection with it.
        await relay.wait_for(lambda: relay.open == 0)
    for run_id in ids:
        assert_completed(rec, run_id, fake.expected_text)
    assert len(fake.requests) == RUNS
    assert relay.accepted >= 1
    assert fake.disconnects == []  # no answer was cut short


async def test_the_pool_is_sized_to_the_providers_slots(nursery: trio.Nursery) -> None:
    """More runs at once than the provider has slots (the edge never sends that many) wait
    for a connection instead of opening more: the pool holds ``slots``, summed over the
    provider's models."""
    up = await start_upstream(nursery, "openai")
    up.fake.chunk_delay = 0.01  # each run holds its connection a while
    config = attrs.evolve(
        provider(up, slots=1),
        models=(
            ModelConfig(name="m", served_name="fake-model", slots=1),
            ModelConfig(name="n", served_name="fake-model", slots=1),
        ),
    )
    rec = Recorder()
    with trio.fail_after(TIMEOUT):
        async with open_runner(rec.send, adapters=build_adapters([config])) as runner:
            ids = await run_many(runner, rec, 8, concurrency=4, stream=True, prefix="r")
    for run_id in ids:
        assert_completed(rec, run_id, up.fake.expected_text)
    assert up.relay.peak_open == up.relay.accepted == 2


async def test_a_cancelled_run_closes_its_request_and_the_next_run_gets_its_own_answer(
    upstream: Upstream,
) -> None:
    relay, fake = upstream.relay, upstream.fake
    rec = Recorder()
    with trio.fail_after(TIMEOUT):
        adapters = build_adapters([provider(upstream, slots=1)])
        async with open_runner(rec.send, adapters=adapters) as runner:
            # A completed run first: its connection is in the pool when the stalled run
            # starts, so the stalled run is on a reused connection.
            await run_many(runner, rec, 1, concurrency=1, stream=True, prefix="warm")
            fake.stall_after_chunks = 2  # then nothing more until the client leaves
            runner.start(run_request("stalled", stream=True))
            (_, stalled) = await fake.wait_requests(2)
            await rec.wait_text("stalled", "".join(fake.tokens[:2]))
            assert relay.accepted == 1

            runner.cancel("stalled", "client gone")
            # At once: the fake sees its client leave mid-answer, the relay its connection
            # close, and the run answers run.cancelled.
            await stalled.disconnected.wait()
            await relay.wait_for(lambda: relay.open == 0)
            assert isinstance(await rec.wait_terminal("stalled"), wire.RunCancelled)

            fake.stall_after_chunks = None
            fake.reply = "the next run's own answer"
            await run_many(runner, rec, 1, concurrency=1, stream=True, prefix="next")
    assert_completed(rec, "next0", "the next run's own answer")
    assert fake.disconnects == [stalled]
    assert relay.accepted == 2  # the cancelled run's connection was not reused
    assert rec.text("stalled") == "a short "


# --------------------------------------------------------------------------- end to end


@pytest.fixture
async def edge_and_node(upstream: Upstream, nursery: trio.Nursery) -> AsyncIterator[str]:
    """An edge on 127.0.0.1 port 0 with an in-process node serving model ``m`` from the
    fake provider (``SLOTS`` slots); its base URL."""
    node = NodeConfig(node_id="local", providers=(provider(upstream),))
    async with open_dispatcher(EdgeConfig(port=0, local_node=False)) as dispatcher:
        await dispatcher.attach_local_node(node)
        server = await nursery.start(dispatcher.serve)
        yield f"http://127.0.0.1:{server.address.port}"
        server.shutdown()


async def chat(client: httpx.AsyncClient, *, stream: bool) -> str:
    """One chat completion through the edge; the answer's text."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if not stream:
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        content: str = response.json()["choices"][0]["message"]["content"]
        return content
    text: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():  # read to the end: nothing left open
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk: Any = orjson.loads(line.removeprefix("data: "))
                for choice in chunk.get("choices", []):
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("concurrency", [1, SLOTS], ids=["one-at-a-time", "slots-at-a-time"])
async def test_requests_through_the_edge_open_at_most_slots_connections(
    upstream: Upstream, edge_and_node: str, concurrency: int, stream: bool
) -> None:
    answers: list[str] = []
    limits = httpx.Limits(max_connections=concurrency)
    with trio.fail_after(TIMEOUT):
        async with httpx.AsyncClient(base_url=edge_and_node, limits=limits, timeout=20) as client:

            async def worker(count: int) -> None:
                for _ in range(count):
                    answers.append(await chat(client, stream=stream))

            async with trio.open_nursery() as nursery:
                for index in range(concurrency):
                    nursery.start_soon(worker, RUNS // concurrency + (index < RUNS % concurrency))
    assert answers == [upstream.fake.expected_text] * RUNS
    assert len(upstream.fake.requests) == RUNS
    assert 1 <= upstream.relay.accepted <= concurrency


# --------------------------------------------------------------------------- the pieces


def test_one_tls_context_per_tls_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    default = tls_context()
    assert tls_context() is default
    assert default.verify_mode == ssl.CERT_REQUIRED
    assert default.check_hostname
    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    from_file = tls_context()
    assert from_file is not default
    assert tls_context() is from_file


async def test_open_adapters_opens_those_with_a_lifetime_once(nursery: trio.Nursery) -> None:
    up = await start_upstream(nursery, "ollama")
    echo = ProviderConfig(id="echo", type="echo", models=(ModelConfig(name="echo"),))
    adapters = build_adapters([provider(up), echo])
    assert isinstance(adapters["up"], HasLifetime)
    async with open_adapters(adapters) as opened:
        assert opened["echo"] is adapters["echo"]  # no lifetime: as it is
        assert not isinstance(opened["up"], HasLifetime)
        async with open_adapters(opened) as again:  # e.g. open_runner inside the agent's
            assert again == opened
            rec = Recorder()
            async with open_runner(rec.send, adapters=again) as runner:
                await run_many(runner, rec, 3, concurrency=1, stream=True, prefix="r")
        assert up.relay.open == up.relay.accepted == 1  # still open: the outer block holds it
    await up.relay.wait_for(lambda: up.relay.open == 0)
    assert up.relay.accepted == 1


async def test_a_run_outside_open_adapters_has_a_client_of_its_own(nursery: trio.Nursery) -> None:
    up = await start_upstream(nursery, "openai")
    adapter = build_adapters([provider(up)])["up"]
    for index in range(2):
        out = Collected()
        with trio.fail_after(TIMEOUT):
            await adapter.run(run_request(f"r{index}", stream=True), out)
            await up.relay.wait_for(lambda: up.relay.open == 0)  # closed with the run
        assert ("".join(out.text), out.reason) == (up.fake.expected_text, "stop")
    assert up.relay.accepted == 2


@attrs.define
class Collected:
    """A RunOutput for an adapter run called directly (no runner)."""

    text: list[str] = attrs.Factory(list)
    reason: str = ""

    async def delta(self, text: str) -> None:
        await trio.lowlevel.checkpoint()
        self.text.append(text)

    async def tool_calls(self, calls: Sequence[Mapping[str, Any]]) -> None:
        await trio.lowlevel.checkpoint()

    async def embeddings(self, vectors: Sequence[str]) -> None:
        await trio.lowlevel.checkpoint()

    def usage(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        estimated: bool = False,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
        reasoning_tokens: int = 0,
    ) -> None:
        pass

    def finish(self, reason: str, *, stop_sequence: str | None = None) -> None:
        self.reason = reason

    def ignore_cancel(self) -> None:
        pass
