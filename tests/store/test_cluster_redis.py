"""The edges of one cluster on Redis (:mod:`dispatcher.store.cluster_redis`), against a real
``redis-server`` (``redis_server.py``):

* two edges on one Redis list each other, with what each said of itself;
* an edge closed cleanly leaves the list at once; one killed (SIGKILL, a real process) is
  still listed, then gone once its expiry (three heartbeats) has passed;
* a reload one edge publishes reaches every other edge's callback, not its own;
* Redis going away: the list is the last one read, saying why; the heartbeat comes back by
  itself when Redis does;
* two in-process edges with their own config files: ``POST /admin/reload?scope=cluster`` on
  one makes the other read its file again (a broken file there is refused there, and shown
  in the list), and ``/admin/status`` on either lists both.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from dispatcher.config import EdgeConfig, load_edge_config
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.store.cluster import EdgeIdentity
from dispatcher.store.cluster_redis import MISSED, RedisCluster, open_redis_cluster
from dispatcher.store.seam import EdgeReport

from . import redis_server

pytestmark = pytest.mark.skipif(redis_server.BINARY is None, reason="no redis-server")

BEAT = 0.2
"""Seconds between heartbeats in these tests (the expiry is three of them)."""


@pytest.fixture
async def url() -> str:
    url = redis_server.url()
    async with open_redis_cluster(url, EdgeIdentity(id="flush", address="-")) as cluster:
        await cluster.client.flushdb()
    return url


def report(in_flight: int = 0, started_at: float = 1_700_000_000.0) -> Callable[[], EdgeReport]:
    return lambda: EdgeReport(started_at=started_at, in_flight=in_flight)


async def no_reload() -> None:
    raise AssertionError("no reload was asked")


@asynccontextmanager
async def edge(url: str, edge_id: str, **options: float) -> AsyncIterator[RedisCluster]:
    identity = EdgeIdentity(id=edge_id, address=f"{edge_id}.example:8700", version="9.9")
    async with open_redis_cluster(url, identity, heartbeat=options.get("heartbeat", BEAT)) as c:
        yield c


async def ids(cluster: RedisCluster) -> list[str]:
    return [record.id for record in (await cluster.edges()).edges]


async def test_two_edges_on_one_redis_list_each_other(url: str) -> None:
    async with edge(url, "edge-a") as a, edge(url, "edge-b") as b:
        a.bind(report(in_flight=3, started_at=1_700_000_001.5), no_reload)
        b.bind(report(), no_reload)
        a.changed()  # what it reports now goes at once
        await trio.sleep(BEAT)
        seen_by_b = await b.edges()
        assert await ids(a) == ["edge-a", "edge-b"]
        assert seen_by_b.error is None
        first = seen_by_b.edges[0]
        assert (first.id, first.address, first.version) == ("edge-a", "edge-a.example:8700", "9.9")
        assert (first.started_at, first.in_flight) == (1_700_000_001.5, 3)
        assert 0 <= first.heard_s < MISSED * BEAT
        assert (first.reloaded_at, first.reload_error) == (None, None)


async def test_an_edge_closed_cleanly_leaves_the_list_at_once(url: str) -> None:
    async with edge(url, "stays", heartbeat=60) as stays:
        async with edge(url, "goes", heartbeat=60):
            assert await ids(stays) == ["goes", "stays"]
        # Its record expires in 180 s: it was deleted, not forgotten.
        assert await ids(stays) == ["stays"]


CHILD = textwrap.dedent(
    """
    import sys, trio
    from dispatcher.store.cluster import EdgeIdentity
    from dispatcher.store.cluster_redis import open_redis_cluster

    async def main():
        identity = EdgeIdentity(id="doomed", address="doomed:1")
        async with open_redis_cluster(sys.argv[1], identity, heartbeat=float(sys.argv[2])):
            print("up", flush=True)
            await trio.sleep_forever()

    trio.run(main)
    """
)


async def test_an_edge_killed_is_forgotten_once_its_heartbeats_are_missed(url: str) -> None:
    heartbeat = 0.5
    async with edge(url, "survivor", heartbeat=60) as survivor:
        command = [sys.executable, "-c", CHILD, url, str(heartbeat)]
        with subprocess.Popen(command, stdout=subprocess.PIPE) as child:
            try:
                assert child.stdout is not None
                line = await trio.to_thread.run_sync(child.stdout.readline)
                assert line == b"up\n"
                assert await ids(survivor) == ["doomed", "survivor"]
                os.kill(child.pid, signal.SIGKILL)
                await trio.to_thread.run_sync(child.wait)
                # Nothing deleted it: still listed until its expiry...
                killed_at = trio.current_time()
                assert await ids(survivor) == ["doomed", "survivor"]
                # ... and gone once three heartbeats have passed.
                while "doomed" in await ids(survivor):
                    assert trio.current_time() - killed_at < MISSED * heartbeat + 2
                    await trio.sleep(0.05)
                assert trio.current_time() - killed_at > heartbeat  # not deleted at once
            finally:
                child.kill()


async def test_a_published_reload_reaches_the_other_edges_not_its_publisher(url: str) -> None:
    asked: list[str] = []

    def on_reload(name: str) -> Callable[[], Awaitable[None]]:
        async def reload() -> None:
            asked.append(name)

        return reload

    async with edge(url, "a") as a, edge(url, "b") as b, edge(url, "c") as c:
        a.bind(report(), on_reload("a"))
        b.bind(report(), on_reload("b"))
        c.bind(report(), on_reload("c"))
        with trio.fail_after(5):
            while not (a._subscribed and b._subscribed and c._subscribed):
                await trio.sleep(0.01)
        assert await a.publish_reload() == 2
        with trio.fail_after(5):
            while len(asked) < 2:
                await trio.sleep(0.01)
        await trio.sleep(0.1)  # a's own subscription heard it too, and did nothing
        assert sorted(asked) == ["b", "c"]


# coredis 6.9 opens six anyio memory streams in each connection's __init__ and never closes
# those of a connection that failed to connect: their ResourceWarnings, at garbage collection,
# are its, not ours (a retry while Redis is down is such a connection). They are collected
# before the test ends, so that they do not surface in the next one.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function MemoryObject(Send|Receive)Stream.__del__"
    ":pytest.PytestUnraisableExceptionWarning"
)
async def test_redis_gone_the_list_says_so_and_the_heartbeat_comes_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with redis_server.own_server() as server:
        url = server.url
        async with edge(url, "lonely") as lonely:
            lonely.bind(report(in_flight=1), no_reload)
            assert await ids(lonely) == ["lonely"]
            server.stop()
            with caplog.at_level(logging.INFO, "dispatcher.store.cluster"):
                await trio.sleep(4 * BEAT)  # several heartbeats fail
                gone = await lonely.edges()
                assert [record.id for record in gone.edges] == ["lonely"]  # the last list read
                assert gone.error is not None
                assert "did not answer" in gone.error
                with pytest.raises(RuntimeError, match="reload each edge on its own"):
                    await lonely.publish_reload()
                failed = [r for r in caplog.records if "heartbeat" in r.getMessage()]
                assert len(failed) == 1, "one line per outage, not one per heartbeat"
                await trio.to_thread.run_sync(server.start)
                with trio.fail_after(10):
                    while (await lonely.edges()).error is not None:
                        await trio.sleep(0.05)
                # The server came back empty: the heartbeat wrote the record again.
                with trio.fail_after(10):
                    while await ids(lonely) != ["lonely"]:
                        await trio.sleep(0.05)
            assert any("works again" in r.getMessage() for r in caplog.records)

        gc.collect()  # those connections' warnings come here, under this test's filter


# ------------------------------------------------------------------ two edges, end to end

ADMIN = {"authorization": "Bearer sk-admin"}


def edge_toml(url: str, edge_id: str, rpm: int) -> str:
    return textwrap.dedent(
        f"""
        admin_keys = ["sk-admin"]

        [store]
        redis_url = "{url}"
        edge_id = "{edge_id}"
        heartbeat_s = {BEAT}

        [[keys]]
        id = "alice"
        key = "sk-alice"
        rpm = {rpm}
        """
    )


@attrs.frozen
class Edge:
    dispatcher: Dispatcher
    server: Server
    path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"

    def rpm(self) -> int | None:
        return self.dispatcher.tenants.keys.tenants["alice"].limits.rpm


@asynccontextmanager
async def open_edge(path: Path) -> AsyncIterator[Edge]:
    def load() -> EdgeConfig:
        return attrs.evolve(load_edge_config(path), port=0, local_node=False)

    async with open_dispatcher(load()) as dispatcher, trio.open_nursery() as nursery:
        dispatcher.config_source = load
        server: Server = await nursery.start(dispatcher.serve)
        yield Edge(dispatcher, server, path)
        server.shutdown()


@asynccontextmanager
async def two_edges(url: str, tmp_path: Path) -> AsyncIterator[tuple[Edge, Edge]]:
    for name in ("a", "b"):
        (tmp_path / f"{name}.toml").write_text(edge_toml(url, f"edge-{name}", rpm=100))
    async with open_edge(tmp_path / "a.toml") as a, open_edge(tmp_path / "b.toml") as b:
        yield a, b


async def wait_until(condition: Callable[[], bool], seconds: float = 10) -> None:
    with trio.fail_after(seconds):
        while not condition():
            await trio.sleep(0.02)


async def test_a_cluster_reload_on_one_edge_reloads_the_others(
    url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        two_edges(url, tmp_path) as (a, b),
        httpx.AsyncClient(base_url=a.url, timeout=30) as client_a,
        httpx.AsyncClient(base_url=b.url, timeout=30) as client_b,
    ):
        await wait_until(lambda: b.dispatcher.cluster._subscribed)  # type: ignore[attr-defined]
        b.path.write_text(edge_toml(url, "edge-b", rpm=7))
        a.path.write_text(edge_toml(url, "edge-a", rpm=5))

        # Without the scope: this edge alone, as before.
        alone = await client_a.post("/admin/reload", headers=ADMIN)
        assert alone.json() == {"status": "reloaded", "restart_required": []}
        assert (a.rpm(), b.rpm()) == (5, 100)

        answer = await client_a.post("/admin/reload?scope=cluster", headers=ADMIN)
        assert answer.status_code == 200
        assert answer.json() == {
            "status": "reloaded",
            "restart_required": [],
            "scope": "cluster",
            "edges_told": 1,
        }
        await wait_until(lambda: b.rpm() == 7)  # b read its own file

        # A broken file on b: refused there, b keeps its config, the list says why.
        b.path.write_text(edge_toml(url, "edge-b", rpm=-1))
        with caplog.at_level(logging.ERROR, "dispatcher"):
            answer = await client_a.post("/admin/reload?scope=cluster", headers=ADMIN)
            assert answer.status_code == 200

            def refused() -> bool:
                return any("reload refused" in r.getMessage() for r in caplog.records)

            await wait_until(refused)
        assert b.rpm() == 7

        async def b_as_a_sees_it() -> dict[str, object]:
            edges = (await client_a.get("/admin/status", headers=ADMIN)).json()["edges"]
            return {edge["id"]: edge for edge in edges}["edge-b"]  # type: ignore[no-any-return]

        with trio.fail_after(10):
            while (await b_as_a_sees_it())["reload_error"] is None:
                await trio.sleep(0.05)
        assert "keys[0].rpm: must be > 0" in str((await b_as_a_sees_it())["reload_error"])

        # A scope that is neither: 400, nothing reloaded.
        bad = await client_b.post("/admin/reload?scope=everyone", headers=ADMIN)
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "scope"


async def test_admin_status_on_either_edge_lists_both(url: str, tmp_path: Path) -> None:
    async with two_edges(url, tmp_path) as (a, b):
        for one in (a, b):
            async with httpx.AsyncClient(base_url=one.url, timeout=30) as client:
                status = (await client.get("/admin/status", headers=ADMIN)).json()
            assert status["edge_id"] == one.dispatcher.cluster.edge_id
            assert [edge["id"] for edge in status["edges"]] == ["edge-a", "edge-b"]
            assert status["edges_error"] is None
            for edge in status["edges"]:
                assert edge["address"].endswith(":0")  # as configured: port 0 here
                assert edge["in_flight"] >= 0
                assert edge["started_at"] > 0
                assert edge["version"]
