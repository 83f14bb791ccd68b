"""Drains with real processes: ``dispatcher serve`` and ``dispatcher node`` on 127.0.0.1, a
real signal, a real exit status. Bounds are generous (a hang fails, a slow machine does not);
the timing logic itself is tested in virtual time (test_drain.py, tests/nodes/test_drain.py).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from dispatcher.config import EdgeConfig
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from nodes.config import default_node_config

BOUND = 30.0
"""Generous bound on anything that should happen soon."""


@attrs.define(eq=False)
class Proc:
    process: trio.Process
    stderr_path: Path
    stdout: list[str] = attrs.Factory(list)
    _changed: trio.Event = attrs.Factory(trio.Event)

    async def pump(self) -> None:
        assert self.process.stdout is not None
        buffer = b""
        async for data in self.process.stdout:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            self.stdout.extend(line.decode() for line in lines)
            self._changed.set()
            self._changed = trio.Event()

    async def wait_stdout(self, pattern: str) -> re.Match[str]:
        with trio.fail_after(BOUND):
            while True:
                for line in self.stdout:
                    if match := re.search(pattern, line):
                        return match
                await self._changed.wait()

    async def wait_exit(self, bound: float = BOUND) -> int:
        with trio.fail_after(bound):
            return await self.process.wait()

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@asynccontextmanager
async def dispatcher_process(tmp_path: Path, name: str, *args: str) -> AsyncIterator[Proc]:
    """``python -m dispatcher ARGS``, stdout read line by line, stderr (the log) to a file;
    killed if still running when the block is left."""
    stderr_path = tmp_path / f"{name}.stderr"
    with stderr_path.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "dispatcher", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    proc = Proc(process, stderr_path)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proc.pump)
            try:
                yield proc
            finally:
                if process.returncode is None:
                    process.kill()
                with trio.move_on_after(5, shield=True):
                    await process.wait()
                nursery.cancel_scope.cancel()
    finally:
        assert process.stdout is not None
        await process.stdout.aclose()


def start_edge(tmp_path: Path, *, grace: float, local_node: bool = False) -> Any:
    config = tmp_path / "edge.toml"
    config.write_text(
        f"local_node = {str(local_node).lower()}\n"
        "expose_node_ids = true\n"
        f'usage_db = "{tmp_path / "usage.sqlite3"}"\n'
        f"[http]\nshutdown_grace = {grace}\n"
        "[nodes]\nheartbeat_interval = 1\nheartbeat_timeout = 5\n"
    )
    return dispatcher_process(tmp_path, "edge", "serve", "--config", str(config), "--port", "0")


async def edge_port(edge: Proc) -> int:
    match = await edge.wait_stdout(r"listening on http://127\.0\.0\.1:(\d+)/v1")
    return int(match.group(1))


def node_process(tmp_path: Path, port: int, node_id: str = "proc-node") -> Any:
    return dispatcher_process(
        tmp_path,
        node_id,
        "node",
        "--edge",
        f"ws://127.0.0.1:{port}/v1/nodes/connect",
        "--id",
        node_id,
    )


async def wait_for(check: Callable[[], Any]) -> Any:
    with trio.fail_after(BOUND):
        while not (result := await check()):
            await trio.sleep(0.02)
        return result


def chat(words: int, delay: float, *, stream: bool = True) -> dict[str, Any]:
    text = " ".join(f"w{i}" for i in range(words))
    return {
        "model": "echo",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "echo": {"token_delay": delay},
    }


def data_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("data: ")]


def quiet(stderr: str) -> bool:
    """A log with nothing an operator should worry about after a drain."""
    return "Traceback" not in stderr and " WARNING " not in stderr and " ERROR " not in stderr


async def test_sigterm_drains_the_edge_an_external_stream_completes_and_exit_is_0(
    tmp_path: Path,
) -> None:
    async with (
        start_edge(tmp_path, grace=20) as edge,
        node_process(tmp_path, await edge_port(edge)) as node,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{await edge_port(edge)}") as client,
    ):

        async def ready() -> bool:
            return (await client.get("/readyz")).status_code == 200

        await wait_for(ready)
        lines: list[str] = []
        # 40 tokens x 0.05 s: about 2 s, well inside the 20 s grace.
        async with client.stream("POST", "/v1/chat/completions", json=chat(40, 0.05)) as stream:
            assert stream.headers["x-dispatcher-node"] == "proc-node"
            async for line in stream.aiter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(data_lines(lines)) == 3:
                    edge.signal(signal.SIGTERM)

                    async def draining() -> bool:
                        return (await client.get("/readyz")).status_code == 503

                    await wait_for(draining)
                    refused = await client.post("/v1/chat/completions", json=chat(1, 0))
        assert await edge.wait_exit() == 0
        # The node saw edge.draining, then the close, and keeps trying to reconnect
        # quietly; SIGTERM while disconnected stops it at once.
        node.signal(signal.SIGTERM)
        assert await node.wait_exit() == 0
    data = data_lines(lines)
    assert data[-1] == "data: [DONE]"
    assert len(data) > 40
    assert not any("shutting_down" in line for line in data)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert "retry-after" in refused.headers
    assert quiet(edge.stderr), edge.stderr
    assert quiet(node.stderr), node.stderr
    assert "the edge is draining" in node.stderr
    assert "the edge closed the session after draining (code 1001)" in node.stderr


@asynccontextmanager
async def in_process_edge() -> AsyncIterator[tuple[Dispatcher, int]]:
    # Default heartbeats (5 s): nothing here waits for one, and each ping the edge sends is a
    # chance to hit the nodelink race where a node's close ends its session before the edge
    # read the node's last frames (reported; nodelink.py is not ours).
    config = EdgeConfig(port=0, local_node=False, expose_node_ids=True)
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        yield dispatcher, server.address.port
        nursery.cancel_scope.cancel()


async def test_sigterm_drains_a_node_mid_stream_new_requests_go_elsewhere(
    tmp_path: Path,
) -> None:
    async with (
        in_process_edge() as (dispatcher, port),
        node_process(tmp_path, port) as node,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        await wait_for(lambda: _has_session(dispatcher, "proc-node"))
        lines: list[str] = []
        async with client.stream("POST", "/v1/chat/completions", json=chat(40, 0.05)) as stream:
            assert stream.headers["x-dispatcher-node"] == "proc-node"
            async for line in stream.aiter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(data_lines(lines)) == 3:
                    await dispatcher.attach_local_node(default_node_config("local"))
                    node.signal(signal.SIGTERM)
                    await wait_for(lambda: _draining(dispatcher, "proc-node"))
                    elsewhere = await client.post(
                        "/v1/chat/completions", json=chat(3, 0, stream=False)
                    )
        assert await node.wait_exit() == 0
        await wait_for(lambda: _gone(dispatcher, "proc-node"))
    data = data_lines(lines)
    assert data[-1] == "data: [DONE]"
    assert len(data) > 40
    assert elsewhere.status_code == 200
    assert elsewhere.headers["x-dispatcher-node"] == "local"
    assert quiet(node.stderr), node.stderr


async def _has_session(dispatcher: Dispatcher, node_id: str) -> bool:
    await trio.lowlevel.checkpoint()
    return node_id in dispatcher.registry.sessions


async def _draining(dispatcher: Dispatcher, node_id: str) -> bool:
    await trio.lowlevel.checkpoint()
    session = dispatcher.registry.sessions.get(node_id)
    return session is not None and session.draining


async def _gone(dispatcher: Dispatcher, node_id: str) -> bool:
    return not await _has_session(dispatcher, node_id)


async def test_a_second_signal_stops_the_node_at_once(tmp_path: Path) -> None:
    async with (
        in_process_edge() as (dispatcher, port),
        node_process(tmp_path, port) as node,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        await wait_for(lambda: _has_session(dispatcher, "proc-node"))
        lines: list[str] = []
        # 100 s of tokens; the node's drain grace is 30 s.
        async with client.stream("POST", "/v1/chat/completions", json=chat(100, 1.0)) as stream:
            async for line in stream.aiter_lines():
                lines.append(line)
                if line.startswith("data: ") and len(data_lines(lines)) == 1:
                    node.signal(signal.SIGTERM)
                    await wait_for(lambda: _draining(dispatcher, "proc-node"))
                    node.signal(signal.SIGTERM)
                    assert await node.wait_exit(bound=10) == 128 + signal.SIGTERM
    assert "data: [DONE]" not in lines  # the run was cut off, the client was told
    assert "stopping now" in node.stderr
    assert "Traceback" not in node.stderr


async def test_a_second_signal_stops_the_edge_at_once(tmp_path: Path) -> None:
    async with (
        start_edge(tmp_path, grace=60, local_node=True) as edge,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{await edge_port(edge)}") as client,
    ):
        lines: list[str] = []
        status: int | None = None
        async with client.stream("POST", "/v1/chat/completions", json=chat(100, 1.0)) as stream:
            try:
                async for line in stream.aiter_lines():
                    lines.append(line)
                    if line.startswith("data: ") and len(data_lines(lines)) == 1:
                        edge.signal(signal.SIGINT)

                        async def draining() -> bool:
                            return (await client.get("/readyz")).status_code == 503

                        await wait_for(draining)
                        edge.signal(signal.SIGINT)
                        status = await edge.wait_exit(bound=10)
            except httpx.HTTPError:
                pass  # the edge stopped mid-stream: the body is cut off
    assert status == 128 + signal.SIGINT
    assert "data: [DONE]" not in lines
    assert "stopping now" in edge.stderr
    assert "Traceback" not in edge.stderr


async def test_ctrl_c_on_a_connected_node_exits_0_without_a_traceback(tmp_path: Path) -> None:
    async with in_process_edge() as (dispatcher, port), node_process(tmp_path, port) as node:
        await wait_for(lambda: _has_session(dispatcher, "proc-node"))
        node.signal(signal.SIGINT)
        assert await node.wait_exit() == 0
        await wait_for(lambda: _gone(dispatcher, "proc-node"))
    assert quiet(node.stderr), node.stderr
    assert "KeyboardInterrupt" not in node.stderr
