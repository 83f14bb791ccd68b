"""The node's CPU and websocket frames per request, tunnel and normalized ``openai`` paths
(issue #12: pools for the node's life, fewer frames per stream).

::

    python -m bench.node_frames [--runs 200] [--concurrency 1 8] [--path tunnel normalized]
                                [--stream yes no]

This process is the node: :func:`nodes.agent.serve_node_session` over a real websocket
(:func:`nodes.dial.dial_edge`). A child process holds a fake OpenAI-compatible provider
(``tests.nodes.fake_providers``, 64 tokens per answer, one per SSE event) and a *fake edge*: a
websocket server that welcomes the node and sends ``--runs`` ``run.request`` or
``tunnel.request`` frames, ``c`` at a time, each after the previous one on its worker
ended. A ``ping`` before and after the measured runs marks the window (after a warm-up of 10
requests). Printed per cell: the node's CPU per request (``time.process_time``: this process
only), the websocket frames the node sent per request (control, events and body frames),
the batched sends it made per request (``sends/req``: each one socket write, fewer when
joined behind a write in flight), and requests per second. Not a section of
``python -m bench``: a focused before/after probe.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import orjson
import trio
import trio_websocket

from dispatcher import wire
from dispatcher.shared.transport import Connection, RawFrame
from nodes.agent import serve_node_session
from nodes.config import ModelConfig, NodeConfig, ProviderConfig
from nodes.dial import dial_edge

TOKENS = 64
WARMUP = 10
START, STOP = 1, 2
"""The ping nonces that open and close the measured window."""
WINDOW = 1 << 20
"""Each tunnel's credit window: more than an answer, so no tunnel.credit is needed."""


# --------------------------------------------------------------------------- the child


async def _serve(path: str, stream: bool, runs: int, concurrency: int) -> None:
    """The fake provider and the fake edge; prints the edge's port, serves one node, exits."""
    from tests.nodes.fake_providers import serve_fake_openai

    async with trio.open_nursery() as nursery:
        fake: Any = await nursery.start(serve_fake_openai)
        fake.chunk_count = TOKENS
        fake.requests = _Forgetful()  # no record of thousands of requests
        done = trio.Event()

        async def handler(request: trio_websocket.WebSocketRequest) -> None:
            ws = await request.accept()
            await ws.get_message()  # hello
            welcome = wire.Welcome(
                protocol=wire.PROTOCOL_VERSION, generation=1, heartbeat_interval=0
            )
            await ws.send_message(wire.encode(welcome))
            edge = _FakeEdge(ws, path, stream, concurrency)
            async with trio.open_nursery() as inner:
                inner.start_soon(edge.read)
                await edge.drive(WARMUP)
                await edge.ping(START)
                await edge.drive(runs)
                await edge.ping(STOP)
                inner.cancel_scope.cancel(reason="measured")
            await ws.aclose()
            done.set()

        server = await nursery.start(
            partial(
                trio_websocket.serve_websocket,
                handler,
                "127.0.0.1",
                0,
                None,
                max_message_size=wire.MAX_FRAME_SIZE,
            )
        )
        print(server.port, fake.server.address.port, flush=True)
        await done.wait()
        nursery.cancel_scope.cancel(reason="done")


class _Forgetful(list[Any]):
    def append(self, item: Any) -> None:
        pass


class _FakeEdge:
    """Sends requests ``concurrency`` at a time; one reader routes the node's answers."""

    def __init__(self, ws: Any, path: str, stream: bool, concurrency: int) -> None:
        self._ws = ws
        self._path = path
        self._stream = stream
        self._concurrency = concurrency
        self._ended: dict[str, trio.Event] = {}
        self._pong = trio.Event()
        self._ids = iter(range(10**9))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        self._body = body
        self._json = orjson.dumps(body).decode()

    async def read(self) -> None:
        while True:
            frame = await self._ws.get_message()
            if isinstance(frame, bytes):
                continue  # tunnel body bytes
            message = wire.decode(frame)
            if isinstance(message, wire.Pong):
                self._pong.set()
            elif isinstance(message, wire.TERMINAL_EVENTS):
                self._ended[message.run_id].set()
            elif isinstance(message, wire.TunnelEnd):
                self._ended[message.tunnel_id].set()

    async def ping(self, nonce: int) -> None:
        self._pong = trio.Event()
        await self._ws.send_message(wire.encode(wire.Ping(nonce=nonce)))
        await self._pong.wait()

    async def drive(self, count: int) -> None:
        remaining = iter(range(count))

        async def worker() -> None:
            for _ in remaining:
                await self._one()

        async with trio.open_nursery() as nursery:
            for _ in range(self._concurrency):
                nursery.start_soon(worker)

    async def _one(self) -> None:
        work_id = f"w{next(self._ids)}"
        ended = self._ended[work_id] = trio.Event()
        message: wire.EdgeMessage
        if self._path == "tunnel":
            message = wire.TunnelRequest(
                tunnel_id=work_id,
                provider_id="p",
                method="POST",
                path="/v1/chat/completions",
                headers=(("content-type", "application/json"),),
                body=self._json,
                window=WINDOW,
            )
        else:
            message = wire.RunRequest(
                run_id=work_id, provider_id="p", model="m", served_model="m", body=self._body
            )
        await self._ws.send_message(wire.encode(message))
        await ended.wait()
        del self._ended[work_id]


# --------------------------------------------------------------------------- the node


class _Counting:
    """The node's connection, counting what it sends inside the measured window.
    :meth:`on_start` and :meth:`on_stop` run when the window opens and closes (a profiler
    hooks there: ``bench.profile_node``)."""

    def __init__(self, inner: Connection) -> None:
        self._inner = inner
        self.counting = False
        self.frames = 0
        self.writes = 0
        """Batched sends (each one socket write, or joined into one in flight)."""
        self.cpu = self.wall = 0.0

    def on_start(self) -> None:
        """The measured window opens."""

    def on_stop(self) -> None:
        """The measured window closed."""

    async def send(self, frame: RawFrame) -> None:
        if self.counting:
            self.frames += 1
        await self._inner.send(frame)

    async def send_many(self, frames: Sequence[RawFrame]) -> None:
        """The websocket's batched send (``nodes.websocket``), counted: one write."""
        if self.counting:
            self.frames += len(frames)
            self.writes += 1
        await self._inner.send_many(frames)  # type: ignore[attr-defined]

    async def receive(self) -> RawFrame:
        frame = await self._inner.receive()
        if isinstance(frame, str) and '"ping"' in frame:
            ping = wire.decode(frame)
            assert isinstance(ping, wire.Ping)
            if ping.nonce == START:
                self.counting = True
                self.on_start()
                self.cpu, self.wall = time.process_time(), time.perf_counter()
            elif ping.nonce == STOP:
                self.counting = False
                self.cpu = time.process_time() - self.cpu
                self.wall = time.perf_counter() - self.wall
                self.on_stop()
        return frame

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        await self._inner.aclose(code, reason)


async def _cell(
    path: str,
    stream: bool,
    runs: int,
    concurrency: int,
    counting: Callable[[Connection], _Counting] = _Counting,
) -> dict[str, float]:
    command = [
        sys.executable,
        "-m",
        "bench.node_frames",
        "--serve",
        path,
        "--stream",
        "yes" if stream else "no",
        "--runs",
        str(runs),
        "--concurrency",
        str(concurrency),
    ]
    async with trio.open_nursery() as nursery:
        child: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert child.stdout is not None
        ports = (await _read_line(child.stdout)).split()
        edge_port, provider_port = int(ports[0]), int(ports[1])
        config = NodeConfig(
            node_id="bench",
            edge_url=f"ws://127.0.0.1:{edge_port}/v1/nodes/connect",
            providers=(
                ProviderConfig(
                    id="p",
                    type="openai",
                    path="tunnel" if path == "tunnel" else "normalized",
                    base_url=f"http://127.0.0.1:{provider_port}/v1",
                    models=(ModelConfig(name="m", served_name="m", slots=concurrency),),
                ),
            ),
        )
        async with dial_edge(config) as conn:
            counted = counting(conn)
            await serve_node_session(counted, config)
        nursery.cancel_scope.cancel(reason="measured")
    return {
        "cpu_ms": counted.cpu / runs * 1000,
        "frames": counted.frames / runs,
        "writes": counted.writes / runs,
        "per_s": runs / counted.wall if counted.wall else 0.0,
    }


async def _read_line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while not data.endswith(b"\n"):
        piece = await stream.receive_some(64)
        if not piece:
            raise RuntimeError("the child exited before it said its ports")
        data += piece
    return data.decode()


async def _main(args: argparse.Namespace) -> None:
    print(
        f"{'path':10} {'stream':>6} {'c':>3} {'runs':>5} {'node CPU ms':>12} "
        f"{'frames/req':>10} {'sends/req':>9} {'req/s':>7}"
    )
    for path in args.path:
        for stream in args.stream:
            for concurrency in args.concurrency:
                result = await _cell(path, stream == "yes", args.runs, concurrency)
                print(
                    f"{path:10} {stream:>6} {concurrency:>3} {args.runs:>5} "
                    f"{result['cpu_ms']:>12.3f} {result['frames']:>10.1f} "
                    f"{result['writes']:>9.1f} "
                    f"{result['per_s']:>7.0f}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--path", nargs="+", default=["tunnel", "normalized"])
    parser.add_argument("--stream", nargs="+", default=["yes", "no"], choices=["yes", "no"])
    parser.add_argument("--serve", choices=["tunnel", "normalized"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(_serve, args.serve, args.stream[0] == "yes", args.runs, args.concurrency[0])
    else:
        trio.run(_main, args)


if __name__ == "__main__":
    main()
