"""The edge under load, profiled: cProfile inside the edge process (issue #12).

``python -m bench.profile_edge [--path tunnel|openai|ollama|echo] [--stream] [--clients 64]
[--seconds 8] [--top 30] [--sort tottime|cumtime] [--out FILE.pstats]``

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
import io
import logging
import pstats
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench._load import raise_nofile_limit, server_process
from bench._procs import client_process, node_daemon
from bench.peer import EDGE_TOML, KEY_ENV, NODE_ID, NODE_TOML, OURS, SERVED, SLOTS, Target


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
    args = parser.parse_args(argv)
    raise_nofile_limit()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    print(trio.run(run, args))


if __name__ == "__main__":
    main()
