"""The edge under load, profiled: cProfile inside the edge process (issue #12).

``python -m bench.profile_edge [--path tunnel|openai|ollama|echo] [--stream] [--clients 64]
[--seconds 8] [--top 30] [--sort tottime|cumtime] [--out FILE.pstats]``;
``python -m bench.profile_edge --streams 5000 [--phase release|held]``: the streams
section's hold, profiled while the clients leave (or while the streams are held).

The edge runs *in this process* (``dispatcher.edge.open_dispatcher`` + ``serve``, the config
the ``peer`` section gives ``dispatcher serve``, logging at INFO as the daemon's default), the
rest as in ``peer``: the fake upstream (``python -m bench._fake_upstream``), one
``dispatcher node`` process with the four providers, and the asyncio load client
(``python -m bench._client``). A short warm-up turn runs unprofiled; the profiler is on only
for the counted turn, then its top entries are printed (``--out`` keeps the whole
``pstats`` file). The helpers' own work in this process (draining the children's pipes)
shows up too, but is small.

Times are the process's CPU time (``time.process_time``), not wall time. The profiler
slows the edge several times over: read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench import streams
from bench._load import raise_nofile_limit, server_process
from bench._procs import client_process, node_daemon
from bench.peer import EDGE_TOML, KEY_ENV, NODE_ID, NODE_TOML, OURS, SERVED, SLOTS, Target


async def run_streams(args: argparse.Namespace) -> str:
    """``--streams N``: the streams section's hold (``bench.streams``) on this edge, the
    profiler on only from the first held stream's end to the last slot's release -- what
    runs when the clients leave at once (``--phase held``: while they are held instead,
    from every stream established to the first one's end)."""
    from dispatcher.config import load_edge_config
    from dispatcher.edge import open_dispatcher, tune_collector_for_serving
    from dispatcher.http import Server

    n = args.streams
    profiler = cProfile.Profile(time.process_time)
    spans: dict[str, float] = {}

    def enable() -> None:
        if not args.bare:
            profiler.enable()

    def disable() -> None:
        if not args.bare:
            profiler.disable()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "edge.toml"
        toml = streams.EDGE_TOML.replace("{max_connections}", str(n + streams.EXTRA_FDS))
        path.write_text(toml.replace("{tmp}", tmp))
        config = load_edge_config(str(path))
        async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
            server: Server = await nursery.start(dispatcher.serve)
            port = server.address.port
            tune_collector_for_serving()

            def held() -> int:
                """Requests in flight (their run's block open) plus slots in use: the
                release the section measures (draining slots wait for the node)."""
                return dispatcher.runs.statistics().open + dispatcher.admission.statistics().in_use

            collections: list[float] = []
            by_generation: dict[int, list[float]] = {0: [0, 0, 0], 1: [0, 0, 0], 2: [0, 0, 0]}

            def on_gc(phase: str, info: dict[str, int]) -> None:
                if phase == "start":
                    collections.append(-time.perf_counter())
                else:
                    collections[-1] += time.perf_counter()
                    counts = by_generation[info["generation"]]
                    counts[0] += 1
                    counts[1] += collections[-1]
                    counts[2] += info["collected"]

            async def watch() -> None:
                while dispatcher.runs.statistics().open < n:
                    await trio.sleep(0.01)
                gc.callbacks.append(on_gc)
                cpu = time.process_time()
                if args.phase == "held":
                    enable()
                while dispatcher.runs.statistics().open >= n:
                    await trio.sleep(0.001)
                if args.phase == "held":
                    disable()
                    gc.callbacks.remove(on_gc)
                    spans["held cpu"] = time.process_time() - cpu
                    return
                del collections[:]
                for counts in by_generation.values():
                    counts[:] = [0, 0, 0]
                enable()
                started, cpu = time.perf_counter(), time.process_time()
                while held() > 0:
                    await trio.sleep(0.001)
                disable()
                gc.callbacks.remove(on_gc)
                spans["release wall"] = time.perf_counter() - started
                spans["release cpu"] = time.process_time() - cpu
                while dispatcher.admission.statistics().draining > 0:
                    await trio.sleep(0.01)
                spans["drained wall"] = time.perf_counter() - started

            node_toml = streams.node_toml(port, n + streams.EXTRA_SLOTS)
            async with (
                node_daemon(port, node_toml, ["echo"]) as node,
                client_process() as client,
            ):
                nursery.start_soon(watch)
                answer = await streams._hold(client, n, port, os.getpid(), node.pid)
            server.shutdown()
    out = io.StringIO()
    if not args.bare:
        if args.out:
            profiler.dump_stats(args.out)
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats(args.sort).print_stats(args.top)
    head = (
        f"profile_edge --streams {n} --phase {args.phase}: established "
        f"{answer['established']}, release {answer['release_seconds']} s (client's, under "
        f"the profiler); profiled: "
        + ", ".join(f"{name} {value:.2f} s" for name, value in spans.items())
        + f"; {len(collections)} collections in the profiled span, {sum(collections):.2f} s, "
        f"the longest {max(collections, default=0):.3f} s; by generation (count, s, "
        "collected): "
        + ", ".join(
            f"{gen}: {count:.0f} {seconds:.2f} {collected:.0f}"
            for gen, (count, seconds, collected) in by_generation.items()
        )
        + "\n"
    )
    return head + out.getvalue()


async def run(args: argparse.Namespace) -> str:
    from dispatcher.config import load_edge_config
    from dispatcher.edge import open_dispatcher
    from dispatcher.http import Server

    # CPU time, not wall time: a send that wakes the peer on a busy core is not our cost.
    profiler = cProfile.Profile(time.process_time)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "edge.toml"
        path.write_text(EDGE_TOML.replace("{tmp}", tmp))
        config = load_edge_config(str(path))
        async with (
            server_process("upstream", ["bench._fake_upstream"]) as upstream,
            open_dispatcher(config) as dispatcher,
            trio.open_nursery() as nursery,
        ):
            server: Server = await nursery.start(dispatcher.serve)
            port = server.address.port
            node_toml = NODE_TOML.format(
                node_id=NODE_ID,
                edge_port=port,
                up=upstream.port,
                key_env=KEY_ENV,
                served=SERVED,
                slots=SLOTS,
            )
            async with (
                node_daemon(port, node_toml, OURS, env={KEY_ENV: "sk-bench-upstream"}) as node,
                client_process() as client,
            ):
                target = Target(args.path, port, args.path, {"node": node.pid}, False)
                command = {
                    "cmd": "load",
                    "port": port,
                    "request": target.request(stream=args.stream).decode("latin-1"),
                    "stream": args.stream,
                    "clients": args.clients,
                    "pids": target.pids,
                }
                await client.call({**command, "warmup": 0.5, "duration": 1.0})
                profiler.enable()
                try:
                    answer = await client.call(
                        {**command, "warmup": 0.2, "duration": args.seconds},
                        timeout=args.seconds + 120,
                    )
                finally:
                    profiler.disable()
            server.shutdown()
    if args.out:
        profiler.dump_stats(args.out)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats(args.sort).print_stats(args.top)
    rate = answer["completed"] / max(answer["seconds"], 1e-9)
    head = (
        f"profile_edge: path={args.path} stream={args.stream} c={args.clients}: "
        f"{answer['completed']} completed in {answer['seconds']:.1f} s ({rate:,.0f}/s "
        f"under the profiler), errors: {answer['errors'] or 'none'}\n"
    )
    return head + out.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_edge")
    parser.add_argument("--path", choices=OURS, default="tunnel")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", choices=("tottime", "cumtime"), default="tottime")
    parser.add_argument("--out", help="write the whole profile here (pstats format)")
    parser.add_argument(
        "--streams", type=int, help="hold this many streams (bench.streams) and profile"
    )
    parser.add_argument("--phase", choices=("release", "held"), default="release")
    parser.add_argument(
        "--bare", action="store_true", help="with --streams: only the times, no profiler"
    )
    args = parser.parse_args(argv)
    raise_nofile_limit()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    print(trio.run(run_streams if args.streams else run, args))


if __name__ == "__main__":
    main()
