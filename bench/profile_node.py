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
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from functools import partial
from pathlib import Path

import trio

from bench.node_frames import _cell, _Counting
from dispatcher.transport import Connection


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4])
    parser.add_argument("--path", nargs="+", default=["tunnel", "normalized"])
    parser.add_argument("--stream", nargs="+", default=["yes", "no"], choices=["yes", "no"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", nargs="+", default=["tottime"])
    parser.add_argument("--dump", help="a directory for each cell's .prof file")
    trio.run(partial(_main, parser.parse_args()))


if __name__ == "__main__":
    main()
