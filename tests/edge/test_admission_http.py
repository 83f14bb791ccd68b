"""Admission seen from a client: a real edge on 127.0.0.1 port 0 with scripted nodes attached.

Queue full -> 429, queue timeout -> 503 (both with Retry-After), a client leaving the queue,
capability rejections before any slot is taken, tools routing, long-context classes, nodes
joining and leaving while requests wait, and ``/metrics`` after a scripted scenario.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import httpx
import orjson
import trio

from dispatcher import wire
from dispatcher.admission import AdmissionStatistics
from dispatcher.config import EdgeConfig, QueuePolicySettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.shared.transport import ConnectionClosed

from .fakes import ScriptedNode, connect, hello, wait_until


@attrs.frozen
class Edge:
    dispatcher: Dispatcher
    server: Server

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"

    def stats(self) -> AdmissionStatistics:
        return self.dispatcher.admission.statistics()


@asynccontextmanager
async def open_edge(**policy: object) -> AsyncIterator[Edge]:
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        admission=QueuePolicySettings(**policy),  # type: ignore[arg-type]
        models={"m": QueuePolicySettings()},  # "m" is known even while no node serves it
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        yield Edge(dispatcher, server)
        server.shutdown()


def body(content: str = "hi", **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


async def post(edge: Edge, payload: dict[str, object]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        return await client.post("/v1/chat/completions", json=payload)


async def serve_runs(node: ScriptedNode, count: int, hold: trio.Event | None = None) -> None:
    """Answer ``count`` runs on ``node`` (after ``hold`` is set, if given), until the node's
    connection closes."""
    try:
        for _ in range(count):
            request = await node.receive_run()
            if hold is not None:
                await hold.wait()
            await node.emit(request.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))
    except ConnectionClosed:
        pass


async def test_queue_full_429_and_timeout_503_with_retry_after() -> None:
    async with open_edge(max_queue=1, queue_timeout_s=0.5) as edge, trio.open_nursery() as n:
        node = await connect(edge.dispatcher, hello(slots=1))
        release = trio.Event()
        n.start_soon(serve_runs, node, 1, release)
        results: list[httpx.Response] = []

        async def call() -> None:
            results.append(await post(edge, body()))

        n.start_soon(call)  # holds the only slot until released
        await wait_until(lambda: edge.stats().in_use == 1)
        n.start_soon(call)  # queued: the queue is now full
        await wait_until(lambda: edge.stats().waiting == 1)
        full = await post(edge, body())
        assert full.status_code == 429
        assert full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        # The queued request times out after 0.5 s.
        await wait_until(lambda: len(results) == 1)
        timed_out = results[0]
        assert timed_out.status_code == 503
        assert timed_out.headers["retry-after"] == "1"
        assert timed_out.json()["error"]["code"] == "queue_timeout"
        release.set()
        await wait_until(lambda: len(results) == 2)
        assert results[1].status_code == 200
    assert edge.stats().in_use == 0


async def test_client_leaving_the_queue_is_gone_at_once() -> None:
    async with open_edge(queue_timeout_s=60) as edge, trio.open_nursery() as n:
        node = await connect(edge.dispatcher, hello(slots=1))
        release = trio.Event()
        n.start_soon(serve_runs, node, 1, release)
        n.start_soon(post, edge, body())
        await wait_until(lambda: edge.stats().in_use == 1)
        payload = orjson.dumps(body())
        stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        await wait_until(lambda: edge.stats().waiting == 1)
        admitted_before = dict(edge.stats().admissions)
        await stream.aclose()
        await wait_until(lambda: edge.stats().waiting == 0, timeout=2)
        assert edge.stats().in_use == 1  # only the first request's slot
        assert edge.stats().cancellations == 1
        release.set()
        await wait_until(lambda: edge.stats().in_use == 0)
        # The departed waiter was never admitted.
        assert sum(edge.stats().admissions.values()) == sum(admitted_before.values())
        requests = [m for m in node.seen if isinstance(m, wire.RunRequest)]
        assert len(requests) == 1


async def test_every_candidate_rejected_is_a_400_naming_each_reason() -> None:
    async with open_edge() as edge:
        await connect(edge.dispatcher, hello("node-a", slots=2))
        await connect(edge.dispatcher, hello("node-b", slots=2, capabilities=["json"]))
        response = await post(edge, body(tools=TOOLS))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "no_capable_candidate"
        assert "node-a/p1: lacks capability 'tools'" in error["message"]
        assert "node-b/p1: lacks capability 'tools'" in error["message"]
        stats = edge.stats()
        assert stats.in_use == 0
        assert stats.waiting == 0
        assert sum(stats.admissions.values()) == 0
        assert stats.rejections.get("no_capable_candidate") == 1


async def test_tools_requests_only_go_to_tools_candidates() -> None:
    async with open_edge() as edge, trio.open_nursery() as n:
        plain = await connect(edge.dispatcher, hello("plain", slots=4))
        tooled = await connect(edge.dispatcher, hello("tooled", slots=4, capabilities=["tools"]))
        n.start_soon(serve_runs, tooled, 6)
        n.start_soon(plain.answer_pings)
        responses = [await post(edge, body(tools=TOOLS)) for _ in range(6)]
        n.cancel_scope.cancel()
    assert {r.headers["x-dispatcher-node"] for r in responses} == {"tooled"}
    assert not [m for m in plain.seen if isinstance(m, wire.RunRequest)]


async def test_node_joining_admits_waiters_without_new_requests() -> None:
    async with open_edge(queue_timeout_s=30) as edge, trio.open_nursery() as n:
        results: list[httpx.Response] = []

        async def call(content: str) -> None:
            results.append(await post(edge, body(content)))

        for i in range(3):
            n.start_soon(call, f"waiter {i}")
        await wait_until(lambda: edge.stats().waiting == 3)
        node = await connect(edge.dispatcher, hello(slots=3))
        await serve_runs(node, 3)
        await wait_until(lambda: len(results) == 3)
    assert [r.status_code for r in results] == [200, 200, 200]
    assert edge.stats().admissions.get("queued") == 3


async def test_node_leaving_moves_waiters_to_remaining_capable_candidates() -> None:
    async with open_edge(queue_timeout_s=30) as edge, trio.open_nursery() as n:
        first = await connect(edge.dispatcher, hello("first", slots=1, capabilities=["tools"]))
        second = await connect(edge.dispatcher, hello("second", slots=1, capabilities=["tools"]))
        hold = trio.Event()
        n.start_soon(serve_runs, first, 1, hold)  # never released: "first" leaves instead
        n.start_soon(serve_runs, second, 3, hold)
        results: list[httpx.Response] = []

        async def call() -> None:
            results.append(await post(edge, body(tools=TOOLS)))

        for _ in range(3):
            n.start_soon(call)
        await wait_until(lambda: (edge.stats().in_use, edge.stats().waiting) == (2, 1))
        # "first" leaves: the waiter stays queued for "second", and the request that was
        # running on "first" is recovered there too (nothing had been streamed yet).
        await first.conn.aclose()
        await wait_until(lambda: edge.stats().waiting == 2)
        assert results == []
        hold.set()  # "second" finishes its run, then serves the other two
        await wait_until(lambda: len(results) == 3)
    assert [r.status_code for r in results] == [200, 200, 200]
    assert {r.headers["x-dispatcher-node"] for r in results} == {"second"}
    assert sorted(r.headers["x-dispatcher-attempts"] for r in results) == ["1", "1", "2"]


async def test_last_capable_candidate_leaving_gives_the_400() -> None:
    async with open_edge(queue_timeout_s=30) as edge, trio.open_nursery() as n:
        tooled = await connect(edge.dispatcher, hello("tooled", slots=1, capabilities=["tools"]))
        await connect(edge.dispatcher, hello("plain", slots=1))
        n.start_soon(serve_runs, tooled, 1, trio.Event())  # holds the slot forever
        results: list[httpx.Response] = []

        async def call() -> None:
            results.append(await post(edge, body(tools=TOOLS)))

        n.start_soon(call)
        await wait_until(lambda: edge.stats().in_use == 1)
        n.start_soon(call)
        await wait_until(lambda: edge.stats().waiting == 1)
        await tooled.conn.aclose()
        await wait_until(lambda: len(results) == 2)
        n.cancel_scope.cancel()
    # The queued request gets the capability 400; so does the running one, whose recovery
    # admission finds no capable candidate left (the same 400 as a first admission).
    assert [r.status_code for r in results] == [400, 400]
    for rejected in results:
        assert "plain/p1: lacks capability 'tools'" in rejected.json()["error"]["message"]


async def test_long_and_short_classes_keep_to_their_slots() -> None:
    """slots=2, long_context_slots=1: one slot for long prompts, one for short ones. With
    two of each queued, neither class ever takes the other's slot."""
    announce = attrs.evolve(
        hello(),
        providers=(
            wire.ProviderInfo(
                id="p1",
                type="echo",
                adapter="echo",
                models=(wire.ModelInfo(name="m", served_name="m", slots=2, long_context_slots=1),),
            ),
        ),
    )
    long_text = "x" * 800  # ~200 estimated tokens, over the 100-token threshold

    def kind(request: wire.RunRequest) -> str:
        return "long" if request.body["messages"][0]["content"] == long_text else "short"

    async with open_edge(long_context_tokens=100, queue_timeout_s=60) as edge:
        node = await connect(edge.dispatcher, announce)
        async with trio.open_nursery() as n:

            async def submit(text: str) -> None:
                await post(edge, body(text))

            n.start_soon(submit, long_text)
            first_long = await node.receive_run()
            n.start_soon(submit, long_text)
            await wait_until(lambda: edge.stats().groups["m"].long == 1)
            # One slot is free, but it is the short class's: the long request waits.
            assert edge.stats().in_use == 1
            n.start_soon(submit, "hi")
            first_short = await node.receive_run()
            assert (kind(first_long), kind(first_short)) == ("long", "short")
            n.start_soon(submit, "hi again")
            await wait_until(lambda: edge.stats().groups["m"].short == 1)
            (candidate,) = edge.stats().candidates.values()
            assert (candidate.in_use, candidate.long_in_use) == (2, 1)

            # The short run ends: its slot goes to the waiting short request, not the long.
            await node.emit(first_short.run_id, ("run.completed", {}))
            second_short = await node.receive_run()
            assert kind(second_short) == "short"
            assert edge.stats().groups["m"].long == 1
            # The long run ends: now the long waiter gets its slot.
            await node.emit(first_long.run_id, ("run.completed", {}))
            second_long = await node.receive_run()
            assert kind(second_long) == "long"
            for request in (second_short, second_long):
                await node.emit(request.run_id, ("run.completed", {}))
        assert edge.stats().in_use == 0


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if match is None:
            continue
        got = ",".join(sorted(match.group(2).split(","))) if match.group(2) else ""
        if match.group(1) == name and got == want:
            return float(match.group(3))
    raise AssertionError(f"no sample {name}{{{want}}} in:\n{text}")


async def test_metrics_after_a_scripted_scenario() -> None:
    async with open_edge(max_queue=1, queue_timeout_s=30) as edge, trio.open_nursery() as n:
        node = await connect(edge.dispatcher, hello("n1", slots=1))
        hold = trio.Event()
        n.start_soon(serve_runs, node, 2, hold)
        n.start_soon(post, edge, body())  # admitted at once
        await wait_until(lambda: edge.stats().in_use == 1)
        n.start_soon(post, edge, body())  # queued
        await wait_until(lambda: edge.stats().waiting == 1)
        assert (await post(edge, body())).status_code == 429
        assert (await post(edge, body(tools=TOOLS))).status_code == 400
        assert (await post(edge, {**body(), "model": "nope"})).status_code == 404
        async with httpx.AsyncClient(base_url=edge.url) as client:
            during = (await client.get("/metrics")).text
        hold.set()
        await wait_until(lambda: (edge.stats().in_use, edge.stats().waiting) == (0, 0))
        async with httpx.AsyncClient(base_url=edge.url) as client:
            response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = response.text
    assert metric(during, "dispatcher_queue_depth", model="m", **{"class": "short"}) == 1
    assert metric(during, "dispatcher_slots_in_use", node="n1", provider="p1", model="m") == 1
    assert metric(after, "dispatcher_queue_depth", model="m", **{"class": "short"}) == 0
    assert metric(after, "dispatcher_slots_total", node="n1", provider="p1", model="m") == 1
    assert metric(after, "dispatcher_slots_in_use", node="n1", provider="p1", model="m") == 0
    assert metric(after, "dispatcher_slots_draining", node="n1", provider="p1", model="m") == 0
    assert metric(after, "dispatcher_admissions_total", reason="immediate") == 1
    assert metric(after, "dispatcher_admissions_total", reason="queued") == 1
    assert metric(after, "dispatcher_rejections_total", cause="queue_full") == 1
    assert metric(after, "dispatcher_rejections_total", cause="no_capable_candidate") == 1
    assert metric(after, "dispatcher_rejections_total", cause="unknown_model") == 1
    assert metric(after, "dispatcher_requests_total", model="m", outcome="completed") == 2
    assert metric(after, "dispatcher_requests_total", model="m", outcome="rejected") == 2
    assert metric(after, "dispatcher_requests_total", model="unknown", outcome="rejected") == 1
    assert (
        metric(after, "dispatcher_queue_wait_seconds_count", model="m", **{"class": "short"}) == 2
    )
