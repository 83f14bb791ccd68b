"""Where the node's CPU goes, per path: :mod:`bench.node_frames`'s cells under cProfile.

::

    python -m bench.profile_node [--runs 300] [--concurrency 4] [--path tunnel normalized]
                                 [--stream yes no] [--top 25] [--sort tottime cumulative]
                                 [--dump DIR]

Each cell is the node of ``bench.node_frames`` (this process, over a real websocket to a fake
edge, a fake OpenAI-compatible provider in a child process, 64 tokens per answer), profiled
by CPU time (``time.thread_time``: a socket send that waits for the scheduler counts only
what it computed, not the wall time it was descheduled, which swamps a wall-clock profile on
2 shared cores); the profiler runs only inside the measured window (after the warm-up), so
the entries are the steady state of ``--runs`` requests. Printed per cell: the node's CPU
per request (profiled: a CPU-time cProfile inflates it several times, more for functions
called often, so compare the shares, and take the absolute numbers from
``bench.node_frames``), then the top ``--top`` functions by each ``--sort`` key, their
times per request in microseconds. ``--dump DIR`` also writes each cell's ``.prof`` file
(``snakeviz``, ``pstats``). Not a section of ``python -m bench``: a focused probe.

``--clients`` instead measures the node's upstream client alone, in this process, against the
fake provider in a child process (64-token SSE answers, one keep-alive connection, ``--runs``
requests per turn, ``--rounds`` (3) rounds taking turns, then each one's min, median and max):
CPU per request of httpx (what the node used before), h11 over a Trio stream, and the node's
own client (``nodes.upstream.client``), each body split by the same
:class:`~nodes.upstream.lines.SSEDecoder` and decoded by orjson.
``--baseline FILE...`` adds a turn for each other version of ``nodes/upstream/client.py``
(loaded from FILE, named by its stem; a version from before it moved there, when it was
``nodes/adapters/_client.py`` and its pool ``Pool``, is measured too), to compare a change in
one process, e.g. ``git show HEAD~1:nodes/upstream/client.py > /tmp/before.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import h11
import httpx
import orjson
import trio

from bench.node_frames import _cell, _Counting, _read_line
from dispatcher.shared.transport import Connection
from nodes.upstream.client import Target, UpstreamPool
from nodes.upstream.lines import SSEDecoder
from nodes.upstream.tls import tls_context


class _Profiled(_Counting):
    """The measured window under cProfile."""

    def __init__(self, inner: Connection) -> None:
        super().__init__(inner)
        self.profile = cProfile.Profile(time.thread_time)

    def on_start(self) -> None:
        self.profile.enable()

    def on_stop(self) -> None:
        self.profile.disable()


def _report(profile: cProfile.Profile, runs: int, sort: str, top: int) -> str:
    """The top entries by ``sort``, times in microseconds per request."""
    stats = pstats.Stats(profile)
    stats.sort_stats(sort)
    lines = [f"  {'calls/req':>9} {'tottime':>8} {'cumtime':>8}  function (us per request)"]
    order = stats.fcn_list or []  # type: ignore[attr-defined]
    raw = stats.stats  # type: ignore[attr-defined]
    for key in order[:top]:
        _, calls, tottime, cumtime, _ = raw[key]
        filename, line, name = key
        where = "~" if filename == "~" else f"{_short(filename)}:{line}"
        lines.append(
            f"  {calls / runs:>9.1f} {tottime / runs * 1e6:>8.1f} {cumtime / runs * 1e6:>8.1f}"
            f"  {where}({name})"
        )
    return "\n".join(lines)


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/work/main/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


async def _main(args: argparse.Namespace) -> None:
    for path in args.path:
        for stream in args.stream:
            for concurrency in args.concurrency:
                holder: list[_Profiled] = []

                def counting(conn: Connection, holder: list[_Profiled] = holder) -> _Counting:
                    profiled = _Profiled(conn)
                    holder.append(profiled)
                    return profiled

                result = await _cell(path, stream == "yes", args.runs, concurrency, counting)
                profile = holder[0].profile
                print(
                    f"== {path} stream={stream} c={concurrency} runs={args.runs}: "
                    f"{result['cpu_ms']:.3f} ms node CPU per request under the profiler, "
                    f"{result['frames']:.1f} frames/req",
                    flush=True,
                )
                for sort in args.sort:
                    print(f"-- by {sort}")
                    print(_report(profile, args.runs, sort, args.top), flush=True)
                if args.dump:
                    directory = Path(args.dump)
                    directory.mkdir(parents=True, exist_ok=True)
                    name = f"{path}-{'stream' if stream == 'yes' else 'plain'}-c{concurrency}"
                    profile.dump_stats(directory / f"{name}.prof")


# --------------------------------------------------------------------------- --clients

_BODY = orjson.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
)
_HEADERS = [("content-type", "application/json"), ("accept", "text/event-stream")]


def _consume(decoder: SSEDecoder, piece: bytes) -> int:
    events = 0
    for data in decoder.feed(piece):
        if data.strip() != b"[DONE]":
            orjson.loads(data)
            events += 1
    return events


async def _via_httpx(port: int) -> Callable[[], Awaitable[int]]:
    client = httpx.AsyncClient(verify=tls_context())
    url = httpx.URL(f"http://127.0.0.1:{port}/v1/chat/completions")

    async def one() -> int:
        decoder, events = SSEDecoder(), 0
        async with client.stream("POST", url, content=_BODY, headers=_HEADERS) as response:
            async for piece in response.aiter_bytes():
                events += _consume(decoder, piece)
        return events

    one.client = client  # type: ignore[attr-defined]
    return one


async def _via_h11(port: int) -> Callable[[], Awaitable[int]]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    headers = [("host", f"127.0.0.1:{port}"), *_HEADERS, ("content-length", str(len(_BODY)))]

    async def one() -> int:
        decoder, events = SSEDecoder(), 0
        request = h11.Request(method="POST", target="/v1/chat/completions", headers=headers)
        data = conn.send(request) + conn.send(h11.Data(data=_BODY)) + conn.send(h11.EndOfMessage())
        await stream.send_all(data)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                events += _consume(decoder, bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
        conn.start_next_cycle()
        return events

    one.client = stream  # type: ignore[attr-defined]
    return one


async def _via_pool(port: int, module: Any = None) -> Callable[[], Awaitable[int]]:
    if module is None:
        pool_class, target_class = UpstreamPool, Target
    else:  # a version from before the pool was named UpstreamPool calls it Pool
        pool_class = getattr(module, "UpstreamPool", None) or module.Pool
        target_class = module.Target
    pool = pool_class(
        connect=10, read=60, write=10, max_connections=1, tls_context=tls_context(), proxies={}
    )
    target = target_class.from_url(httpx.URL(f"http://127.0.0.1:{port}/v1/chat/completions"))

    async def one() -> int:
        decoder, events = SSEDecoder(), 0
        async with pool.stream("POST", target, _HEADERS, _BODY) as response:
            async for piece in response.aiter_bytes():
                events += _consume(decoder, piece)
        return events

    one.client = pool  # type: ignore[attr-defined]
    return one


async def _serve_fake() -> None:
    from tests.nodes.fake_providers import serve_fake_openai

    async with trio.open_nursery() as nursery:
        fake: Any = await nursery.start(serve_fake_openai)
        fake.chunk_count = 64
        fake.requests = _Forgetful()
        print(fake.server.address.port, flush=True)
        await trio.sleep_forever()


class _Forgetful(list[Any]):
    def append(self, item: Any) -> None:
        pass


def _load_client(path: str) -> Any:
    """Another version of ``nodes.upstream.client``, from a file."""
    name = f"bench._baseline_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def _clients(runs: int, rounds: int, baselines: list[str]) -> None:
    command = [sys.executable, "-m", "bench.profile_node", "--serve-fake"]
    async with trio.open_nursery() as nursery:
        child: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert child.stdout is not None
        port = int((await _read_line(child.stdout)).split()[0])
        makers: dict[str, Callable[[int], Awaitable[Callable[[], Awaitable[int]]]]] = {
            "httpx": _via_httpx,
            "h11": _via_h11,
            "ours": _via_pool,
        }
        for path in baselines:
            makers[Path(path).stem] = partial(_via_pool, module=_load_client(path))
        width = max(8, *map(len, makers))
        print(f"{'round':>5} {'client':{width}} {'client CPU ms/request':>22}")
        results: dict[str, list[float]] = {name: [] for name in makers}
        for round_ in range(rounds):
            for name, make in makers.items():
                one = await make(port)
                async with one.client:  # type: ignore[attr-defined]
                    for _ in range(20):
                        assert await one() >= 64
                    cpu = time.process_time()
                    for _ in range(runs):
                        await one()
                    cpu = time.process_time() - cpu
                results[name].append(cpu / runs * 1000)
                print(f"{round_:>5} {name:{width}} {results[name][-1]:>22.3f}", flush=True)
        print(f"{'':>5} {'client':{width}} {'min':>7} {'median':>7} {'max':>7}")
        for name, times in results.items():
            print(
                f"{'':>5} {name:{width}} {min(times):>7.3f} {statistics.median(times):>7.3f}"
                f" {max(times):>7.3f}"
            )
        nursery.cancel_scope.cancel(reason="measured")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4])
    parser.add_argument("--path", nargs="+", default=["tunnel", "normalized"])
    parser.add_argument("--stream", nargs="+", default=["yes", "no"], choices=["yes", "no"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", nargs="+", default=["tottime"])
    parser.add_argument("--dump", help="a directory for each cell's .prof file")
    parser.add_argument("--clients", action="store_true", help="compare the upstream clients")
    parser.add_argument("--rounds", type=int, default=3, help="with --clients: turns each")
    parser.add_argument(
        "--baseline",
        nargs="+",
        default=[],
        metavar="FILE",
        help="with --clients: other versions of nodes/upstream/client.py to measure too",
    )
    parser.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        trio.run(_serve_fake)
    elif args.clients:
        trio.run(_clients, args.runs, args.rounds, args.baseline)
    else:
        trio.run(partial(_main, args))


if __name__ == "__main__":
    main()
