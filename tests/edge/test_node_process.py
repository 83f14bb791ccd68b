"""A node in another process (``dispatcher node``) registers over a real websocket; killing it
removes its models; restarting it brings them back, without restarting the edge."""

from __future__ import annotations

import functools
import signal
import sys

import httpx
import trio

from dispatcher.config import EdgeConfig, NodeSettings
from dispatcher.edge import open_dispatcher
from dispatcher.http import Server


async def models(client: httpx.AsyncClient) -> list[str]:
    response = await client.get("/v1/models")
    return [model["id"] for model in response.json()["data"]]


async def wait_for_models(client: httpx.AsyncClient, expected: list[str]) -> None:
    with trio.fail_after(30):
        while await models(client) != expected:
            await trio.sleep(0.05)


async def test_node_process_joins_leaves_and_rejoins() -> None:
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        nodes=NodeSettings(tokens=("t0k3n",), heartbeat_interval=1, heartbeat_timeout=5),
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        port = server.address.port
        command = [
            sys.executable,
            "-m",
            "dispatcher",
            "node",
            "--edge",
            f"ws://127.0.0.1:{port}/v1/nodes/connect",
            "--id",
            "proc-node",
            "--token",
            "t0k3n",
        ]
        run = functools.partial(trio.run_process, command, check=False)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert await models(client) == []
            node = await nursery.start(run)
            await wait_for_models(client, ["echo"])
            completion = await client.post(
                "/v1/chat/completions",
                json={"model": "echo", "messages": [{"role": "user", "content": "from afar"}]},
            )
            assert completion.json()["choices"][0]["message"]["content"] == "from afar"
            assert completion.headers["x-dispatcher-node"] == "proc-node"

            node.send_signal(signal.SIGKILL)
            await wait_for_models(client, [])
            assert "proc-node" not in dispatcher.registry.sessions

            node = await nursery.start(run)
            await wait_for_models(client, ["echo"])
            assert dispatcher.registry.sessions["proc-node"].generation >= 2
            node.send_signal(signal.SIGTERM)
            await wait_for_models(client, [])
        server.shutdown()
