"""Draining the edge: nothing new is admitted, in-flight work gets the grace, what is left is
ended explicitly. Timeouts in virtual time over in-memory node connections; the HTTP answers
(503, /readyz, streams that finish within the grace) against a real server on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.config import EdgeConfig, HTTPSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.errors import ShuttingDown
from dispatcher.http import Server
from dispatcher.paths.runs import RunSpec

from .fakes import connect, hello, wait_until


def body(words: int, delay: float, *, stream: bool = False) -> dict[str, Any]:
    text = " ".join(f"w{i}" for i in range(words))
    return {
        "model": "echo",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "echo": {"token_delay": delay},
    }


async def run_to_end(dispatcher: Dispatcher, spec: RunSpec, ends: list[Any]) -> None:
    try:
        async with dispatcher.open_run(spec) as run:
            async for event in run:
                if isinstance(event, wire.TERMINAL_EVENTS):
                    ends.append((trio.current_time(), type(event).__name__))
    except ShuttingDown as exc:
        ends.append((trio.current_time(), exc.code))


# --------------------------------------------------------------------- virtual time


async def test_drain_waits_for_in_flight_runs_and_refuses_new_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as dispatcher:
        await dispatcher.attach_local_node()
        ends: list[Any] = []
        async with trio.open_nursery() as nursery:
            # 10 tokens, 0.5 s each: the run ends at about t0 + 5.
            spec = RunSpec(model="echo", body=body(10, 0.5))
            nursery.start_soon(run_to_end, dispatcher, spec, ends)
            await wait_until(lambda: dispatcher.in_flight() == 1)
            start = trio.current_time()
            assert await dispatcher.drain(30) is True
            drained_at = trio.current_time()
        assert dispatcher.draining
        [(ended_at, kind)] = ends
        assert kind == "RunCompleted"
        assert drained_at == ended_at  # not the grace: the moment the last run ended
        assert 4.5 <= drained_at - start <= 5.5
        with pytest.raises(ShuttingDown) as info:
            async with dispatcher.open_run(RunSpec(model="echo", body=body(1, 0))):
                pass  # pragma: no cover
        assert (info.value.status, info.value.code) == (503, "shutting_down")
        assert info.value.retry_after is not None


async def test_drain_grace_over_ends_what_is_left(autojump_clock: trio.testing.MockClock) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as dispatcher:
        await dispatcher.attach_local_node()
        ends: list[Any] = []
        async with trio.open_nursery() as nursery:
            spec = RunSpec(model="echo", body=body(100, 1.0))  # 100 s
            nursery.start_soon(run_to_end, dispatcher, spec, ends)
            await wait_until(lambda: dispatcher.in_flight() == 1)
            start = trio.current_time()
            assert await dispatcher.drain(2) is False
            assert trio.current_time() - start == 2
        # The block was left by the drain: the caller learns why, nothing hangs.
        [(ended_at, code)] = ends
        assert code == "shutting_down"
        assert ended_at - start == pytest.approx(2)
        assert dispatcher.in_flight() == 0
        assert dispatcher.shutting_down


async def test_every_node_session_is_told_the_edge_is_draining(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as dispatcher:
        node = await connect(dispatcher, hello("node-a", model="m"))
        dispatcher.start_draining(7)
        message = await node.receive()
        assert message == wire.EdgeDraining(grace=7)
        # start_draining is idempotent: no second notice.
        dispatcher.start_draining(3)
        with trio.move_on_after(1):
            await node.receive()
        assert [m for m in node.seen if isinstance(m, wire.EdgeDraining)] == [message]


async def test_a_draining_node_gets_nothing_new_and_finishes_what_it_has(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as dispatcher:
        a = await connect(dispatcher, hello("node-a", model="m", slots=2))
        got: list[Any] = []

        async def first_run() -> None:
            async with dispatcher.open_run(RunSpec(model="m", body={"model": "m"})) as run:
                got.append(run.node_id)
                async for event in run:
                    got.append(type(event).__name__)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first_run)
            request = await a.receive_run()
            await a.send(wire.NodeDraining(grace=30))
            await wait_until(lambda: dispatcher.registry.sessions["node-a"].draining)
            stats = dispatcher.admission.statistics()
            assert stats.in_use == 1
            # node-a has a free slot left, but it is draining: a new run waits for another
            # node, and gets node-b when it joins.
            second: list[str] = []

            async def second_run() -> None:
                async with dispatcher.open_run(RunSpec(model="m", body={"model": "m"})) as run:
                    second.append(run.node_id)

            nursery.start_soon(second_run)
            await trio.sleep(1)
            assert second == []
            # A capacity message from the draining node does not reopen it.
            await a.send(wire.Capacity(provider_id="p1", model="m", slots=4))
            await trio.sleep(1)
            assert second == []
            b = await connect(dispatcher, hello("node-b", model="m"))
            run_b = await b.receive_run()
            await b.emit(run_b.run_id, ("run.started", {}), ("run.completed", {}))
            await wait_until(lambda: second == ["node-b"])
            # node-a's run goes on and completes normally; its slot is released.
            await a.emit(
                request.run_id,
                ("run.started", {}),
                ("run.delta", {"text": "still here"}),
                ("run.completed", {}),
            )
        assert got == ["node-a", "RunStarted", "RunDelta", "RunCompleted"]
        assert dispatcher.admission.statistics().in_use == 0


# --------------------------------------------------------------------- HTTP


async def start_edge(nursery: trio.Nursery, grace: float) -> tuple[Dispatcher, Server, str]:
    config = EdgeConfig(port=0, http=HTTPSettings(shutdown_grace=grace))
    dispatcher = await nursery.start(_open, config)
    server: Server = await nursery.start(dispatcher.serve)
    return dispatcher, server, f"http://127.0.0.1:{server.address.port}"


async def _open(config: EdgeConfig, task_status: trio.TaskStatus[Dispatcher]) -> None:
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        task_status.started(dispatcher)
        await trio.sleep_forever()


async def test_readyz_and_healthz() -> None:
    async with trio.open_nursery() as nursery:
        config = EdgeConfig(port=0, local_node=False)
        dispatcher = await nursery.start(_open_bare, config)
        server: Server = await nursery.start(dispatcher.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.address.port}") as c:
            empty = await c.get("/readyz")
            await dispatcher.attach_local_node()
            ready = await c.get("/readyz")
            dispatcher.start_draining(5)
            draining = await c.get("/readyz")
            alive = await c.get("/healthz")
            node_upgrade = await c.get(
                "/v1/nodes/connect",
                headers={
                    "connection": "upgrade",
                    "upgrade": "websocket",
                    "sec-websocket-version": "13",
                    "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
                },
            )
        nursery.cancel_scope.cancel()
    assert (empty.status_code, empty.json()["status"]) == (503, "no_models")
    assert ready.status_code == 200
    assert ready.json() == {
        "ready": True,
        "status": "ready",
        "nodes": 1,
        "draining_nodes": 0,
        "models": ["echo"],
    }
    assert (draining.status_code, draining.json()["status"]) == (503, "draining")
    assert alive.status_code == 200  # liveness is not readiness
    assert node_upgrade.status_code == 503  # a node retries later, maybe elsewhere


async def _open_bare(config: EdgeConfig, task_status: trio.TaskStatus[Dispatcher]) -> None:
    async with open_dispatcher(config) as dispatcher:
        task_status.started(dispatcher)
        await trio.sleep_forever()


async def test_streams_finish_within_the_grace_and_new_requests_get_503() -> None:
    async with trio.open_nursery() as nursery:
        _, server, url = await start_edge(nursery, grace=30)
        lines: list[str] = []
        async with (
            httpx.AsyncClient(base_url=url) as client,
            # 20 tokens, 0.02 s each: well within the grace.
            client.stream("POST", "/v1/chat/completions", json=body(20, 0.02, stream=True)) as s,
        ):
            async for line in s.aiter_lines():
                lines.append(line)
                if len(lines) == 4:
                    server.shutdown()
                    refused = await client.post("/v1/chat/completions", json=body(1, 0))
                    models = await client.get("/v1/models")
        with trio.fail_after(10):
            await server._stopped.wait()
        nursery.cancel_scope.cancel()
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert not any("shutting_down" in line for line in data)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert refused.json()["error"]["type"] == "server_error"
    assert models.status_code == 200  # reads still work while draining


async def test_an_unanswered_request_gets_503_when_the_grace_is_over() -> None:
    async with trio.open_nursery() as nursery:
        dispatcher, server, url = await start_edge(nursery, grace=0.3)
        async with httpx.AsyncClient(base_url=url) as client:

            async def shut_down_soon() -> None:
                await wait_until(lambda: dispatcher.in_flight() == 1)
                server.shutdown()

            nursery.start_soon(shut_down_soon)
            # Not streamed: the answer comes at the end, 100 tokens x 0.05 s from now.
            response = await client.post("/v1/chat/completions", json=body(100, 0.05))
        nursery.cancel_scope.cancel()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "shutting_down"
    assert "retry-after" in response.headers
