"""Acceptance 3 of several edges: faults injected into the real servers under load from the
official openai SDK through two ``dispatcher serve`` processes -- PostgreSQL stopped for 30 s,
an edge SIGKILLed with rows in its outbox, Redis stopped (each failure mode)."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from tests.store import postgres_server

from .cluster import TOKENS, Cluster, Edge, Tenant, open_cluster
from .test_limits_across_edges import Outcome, admitted, ask, ledger_totals

pytestmark = pytest.mark.slow


async def steady_load(
    cluster: Cluster, key: str, stop: trio.Event, *, workers: int = 4, **options: Any
) -> list[Outcome]:
    """``workers`` clients, each sending one request after another through the edges in turn,
    until ``stop`` is set: every outcome."""
    outcomes: list[Outcome] = []

    async def worker(index: int) -> None:
        while not stop.is_set():
            edge = cluster.edges[index % len(cluster.edges)]
            index += 1
            call = functools.partial(ask, edge, key, **options)
            outcomes.append(await trio.to_thread.run_sync(call))

    async with trio.open_nursery() as nursery:
        for index in range(workers):
            nursery.start_soon(worker, index)
    return outcomes


async def test_postgres_stopped_for_30_s_under_load_fails_no_request_and_loses_no_row(
    tmp_path: Path,
) -> None:
    tenants = (
        Tenant("load", {"rpm": 100_000, "budget_tokens_day": 10_000_000}),
        Tenant("talk", {}),
    )
    with open_cluster(tmp_path, "shared", tenants) as cluster:
        stop = trio.Event()
        outcomes: list[Outcome] = []
        during: list[int] = []

        async def load() -> None:
            outcomes.extend(await steady_load(cluster, "sk-load", stop))

        edge_a, edge_b = cluster.edges
        first = await trio.to_thread.run_sync(respond, edge_a, None)
        assert first[0] == 200
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load)
            await trio.sleep(3)
            await trio.to_thread.run_sync(postgres_server.halt)
            try:
                halted = time.monotonic()
                await trio.sleep(2)
                # What cannot be read says so: the ledger's report is a 503, not a 500.
                report = await trio.to_thread.run_sync(
                    lambda: edge_a.admin("GET", "/v1/usage?attribution=load")
                )
                during.append(report.status_code)
                # A conversation cannot be continued (503, retryable); a new answer goes out
                # unstored.
                during.append((await trio.to_thread.run_sync(respond, edge_b, first[1]))[0])
                during.append((await trio.to_thread.run_sync(respond, edge_b, None))[0])
                # The rows wait in the edges' outboxes, and /metrics says so.
                waiting = await trio.to_thread.run_sync(metric, edge_a, "usage_rows_in_outbox")
                assert waiting > 0
                assert time.monotonic() - halted < 28
                await trio.sleep(30 - (time.monotonic() - halted))
            finally:
                await trio.to_thread.run_sync(postgres_server.resume)
            await trio.sleep(3)
            stop.set()
        assert during == [503, 503, 200]
        for edge in cluster.edges:  # every outbox empties once PostgreSQL is back
            await wait_for_metric(edge, "usage_rows_in_outbox", 0.0, bound=30)
        # The database back, the other edge continues the conversation edge-a stored.
        assert (await trio.to_thread.run_sync(respond, edge_b, first[1]))[0] == 200
        assert {outcome.status for outcome in outcomes} == {200}, "a client request failed"
        served = len(outcomes)
        assert served > 100
        for edge in cluster.edges:  # every row is in PostgreSQL once: either edge reads them
            totals = await ledger_totals(edge, "load", requests=served, bound=60)
            assert totals["billable"]["client"]["total_tokens"] == served * TOKENS


async def test_an_edge_sigkilled_with_rows_in_its_outbox_sends_them_when_restarted(
    tmp_path: Path,
) -> None:
    with open_cluster(tmp_path, "shared", (Tenant("kept", {"rpm": 1000}),)) as cluster:
        edge_a = cluster.edges[0]
        await trio.to_thread.run_sync(postgres_server.halt)
        try:
            outcomes = [await trio.to_thread.run_sync(ask, edge_a, "sk-kept") for _ in range(20)]
            assert len(admitted(outcomes)) == 20
            await trio.sleep(1)  # the rows are in the outbox file (written every 50 ms)
            kill_with_node(cluster, edge_a)
        finally:
            await trio.to_thread.run_sync(postgres_server.resume)
        edge_b = cluster.edges[0]
        await ledger_totals(edge_b, "kept", requests=0)  # edge-a's rows are not there yet
        restarted = await trio.to_thread.run_sync(cluster.start_edge, "edge-a")
        for edge in (edge_b, restarted):
            totals = await ledger_totals(edge, "kept", requests=20, bound=30)
            assert totals["billable"]["client"]["total_tokens"] == 20 * TOKENS


def respond(edge: Edge, previous: str | None) -> tuple[int, str | None]:
    """A Responses API turn through the official SDK (continuing ``previous``): the status
    and the response's id."""
    with edge.client("sk-talk") as client:
        try:
            answer = client.responses.create(
                model="echo", input="one two three", previous_response_id=previous
            )
        except openai.APIStatusError as error:
            return error.status_code, None
        return 200, answer.id


def kill_with_node(cluster: Cluster, edge: Edge) -> None:
    cluster.kill(edge)
    if edge.node is not None and edge.node.running:
        cluster.processes.kill(edge.node)


def metric(edge: Edge, name: str) -> float:
    """The value of the series ``dispatcher_<name>`` (no labels) in the edge's /metrics."""
    for line in edge.admin("GET", "/metrics").text.splitlines():
        if line.startswith(f"dispatcher_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no dispatcher_{name} in {edge.name}'s /metrics")


async def wait_for_metric(edge: Edge, name: str, value: float, *, bound: float) -> None:
    with trio.move_on_after(bound):
        while await trio.to_thread.run_sync(metric, edge, name) != value:
            await trio.sleep(0.2)
        return
    raise AssertionError(f"{edge.name}: dispatcher_{name} is not {value} after {bound} s")


def store_up(edge: Edge) -> bool:
    """``dispatcher_limit_store_up`` in the edge's ``/metrics``."""
    text = edge.admin("GET", "/metrics").text
    return "\ndispatcher_limit_store_up 1.0" in text


async def normal_within(cluster: Cluster, key: str, bound: float) -> float:
    """Seconds until every edge admits ``key``'s requests again (fails past ``bound``)."""
    started = time.monotonic()
    for edge in cluster.edges:
        while (await trio.to_thread.run_sync(ask, edge, key)).status != 200:
            assert time.monotonic() - started < bound, f"{edge.name} not serving again"
            await trio.sleep(0.1)
    return time.monotonic() - started


async def test_redis_stopped_mid_load_refuse_fails_new_requests_and_admitted_streams_finish(
    tmp_path: Path,
) -> None:
    tenants = (Tenant("busy", {"rpm": 100_000}), Tenant("exact", {"rpm": 4}))
    with open_cluster(tmp_path, "shared", tenants) as cluster:
        assert cluster.redis is not None
        streams: list[Outcome] = []

        async def stream(edge: Edge) -> None:
            call = functools.partial(ask, edge, "sk-busy", stream=True, delay=0.6)
            streams.append(await trio.to_thread.run_sync(call))

        async with trio.open_nursery() as nursery:
            for edge in cluster.edges:
                nursery.start_soon(stream, edge)
            await trio.sleep(1)  # admitted and streaming: five tokens 0.6 s apart
            await trio.to_thread.run_sync(cluster.redis.stop)
            refused = [
                await trio.to_thread.run_sync(ask, edge, "sk-busy") for edge in cluster.edges
            ]
        assert [(o.status, o.code) for o in refused] == [(503, "limit_store_unavailable")] * 2
        assert [(o.status, o.tokens) for o in streams] == [(200, TOKENS)] * 2
        await trio.to_thread.run_sync(cluster.redis.start)
        await normal_within(cluster, "sk-busy", 5.0)
        # Normal means shared again: the two edges admit 4 of 12 in total.
        outcomes = [
            await trio.to_thread.run_sync(ask, cluster.edges[i % 2], "sk-exact") for i in range(12)
        ]
        assert len(admitted(outcomes)) == 4
        for edge in cluster.edges:
            warnings = [line for line in edge.proc.stderr().splitlines() if "WARNING" in line]
            outage = [line for line in warnings if "limit store" in line]
            assert len(outage) == 1, outage  # one per outage, not one per request


async def test_redis_stopped_with_local_limits_each_edge_holds_its_share(tmp_path: Path) -> None:
    tenants = (Tenant("shared", {"rpm": 10}), Tenant("after", {"rpm": 4}))
    store = {"on_store_error": "local", "edge_count": 2}
    with open_cluster(tmp_path, "shared", tenants, store=store) as cluster:
        assert cluster.redis is not None
        await trio.to_thread.run_sync(cluster.redis.stop)
        outcomes = [
            await trio.to_thread.run_sync(ask, cluster.edges[i % 2], "sk-shared") for i in range(30)
        ]
        by_edge = {
            edge.name: len([o for o in admitted(outcomes) if o.edge == edge.name])
            for edge in cluster.edges
        }
        assert by_edge == {"edge-a": 5, "edge-b": 5}
        assert {o.status for o in outcomes} == {200, 429}
        await trio.to_thread.run_sync(cluster.redis.start)
        back = time.monotonic()
        for edge in cluster.edges:  # each edge's own word that it decides on Redis again
            while not await trio.to_thread.run_sync(store_up, edge):
                assert time.monotonic() - back < 5.0, f"{edge.name} still local"
                await trio.sleep(0.1)
        outcomes = [
            await trio.to_thread.run_sync(ask, cluster.edges[i % 2], "sk-after") for i in range(12)
        ]
        assert len(admitted(outcomes)) == 4  # in total across both edges: shared again
