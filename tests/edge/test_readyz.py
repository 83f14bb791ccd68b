"""``/readyz`` on a real server on 127.0.0.1: ready only while the edge is not draining and a
node that is not draining serves a model; the body says why not. Nodes are scripted over
in-memory connections (their drains are the test's to decide)."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from dispatcher import wire
from dispatcher.config import EdgeConfig
from dispatcher.edge import open_dispatcher
from dispatcher.http import Server
from tests.edge.fakes import connect, hello, wait_until


async def test_readyz_follows_the_nodes_and_their_drains() -> None:
    bodies: list[tuple[int, Any]] = []
    async with (
        open_dispatcher(EdgeConfig(port=0, local_node=False)) as dispatcher,
        trio.open_nursery() as nursery,
    ):
        server: Server = await nursery.start(dispatcher.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.address.port}") as c:

            async def probe() -> None:
                answer = await c.get("/readyz")
                bodies.append((answer.status_code, answer.json()))

            await probe()  # no node
            a = await connect(dispatcher, hello("node-a", model="m"))
            await probe()  # node-a serves m
            b = await connect(dispatcher, hello("node-b", model="n"))
            await a.send(wire.NodeDraining(grace=30))
            await wait_until(lambda: dispatcher.registry.sessions["node-a"].draining)
            await probe()  # node-b still serves n
            await b.send(wire.NodeDraining(grace=30))
            await wait_until(lambda: dispatcher.registry.sessions["node-b"].draining)
            await probe()  # both connected, both draining
            dispatcher.start_draining(5)
            await probe()
        nursery.cancel_scope.cancel()
    no_node, ready, one_left, all_draining, edge_draining = bodies
    assert no_node == (
        503,
        {
            "ready": False,
            "status": "no_models",
            "reason": "no node serves a model",
            "nodes": 0,
            "draining_nodes": 0,
            "models": [],
        },
    )
    assert ready == (
        200,
        {"ready": True, "status": "ready", "nodes": 1, "draining_nodes": 0, "models": ["m"]},
    )
    assert one_left == (
        200,
        {"ready": True, "status": "ready", "nodes": 2, "draining_nodes": 1, "models": ["n"]},
    )
    assert all_draining[0] == 503
    assert all_draining[1]["reason"] == "no node serves a model (2 node(s) draining)"
    assert all_draining[1]["models"] == []
    assert edge_draining[0] == 503
    assert edge_draining[1]["ready"] is False
    assert (edge_draining[1]["status"], edge_draining[1]["reason"]) == (
        "draining",
        "the edge is draining",
    )
