"""``python -m bench [SECTION ...]``: run benchmark sections and print their tables.

With no section named, every section of :data:`SECTIONS` runs, in order, in one run.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from types import ModuleType

import trio

from bench import Table, render
from bench._options import RunOptions

SECTIONS: dict[str, str] = {
    "http": "bench.http_bench",
    # Added by the admission work; skipped (with a note) while the module does not exist.
    "admission": "bench.admission_bench",
    "edge": "bench.edge_bench",
    "gate": "bench.gate_bench",
    "usage": "bench.usage_bench",
    # The shared stores next to the embedded ones: limits on Redis, the ledger on PostgreSQL.
    "store": "bench.store_bench",
    # A node behind several edges: one edge vs two, a slot handed from a busy edge to another.
    "cluster": "bench.cluster_bench",
    "tunnel": "bench.tunnel_bench",
    "peer": "bench.peer",
    "streams": "bench.streams",
}
"""Section name -> module. A module defines ``async def run() -> Sequence[Table]`` (or
``run(options)``, to be given the :class:`~bench._options.RunOptions` of the command line) and
may define ``TIME_LIMIT`` (seconds, default :data:`DEFAULT_TIME_LIMIT`). Imported only when
run."""

DEFAULT_TIME_LIMIT = 120.0


def _import_section(module_name: str) -> ModuleType | None:
    """The section's module, or None if it does not exist (yet)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the section module itself being absent is tolerated, not a broken import in it.
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            return None
        raise


async def _run_section(name: str, module_name: str, options: RunOptions) -> bool:
    """Run one section and print its tables; False if it failed."""
    started = time.perf_counter()
    limit = DEFAULT_TIME_LIMIT
    try:
        module = _import_section(module_name)
        if module is None:
            print(f"== {name}: skipped ({module_name} does not exist yet) ==\n", flush=True)
            return True
        limit = float(getattr(module, "TIME_LIMIT", DEFAULT_TIME_LIMIT))
        with trio.fail_after(limit):
            if "options" in inspect.signature(module.run).parameters:
                tables: Sequence[Table] = await module.run(options=options)
            else:
                tables = await module.run()
    except trio.TooSlowError:
        print(f"== {name}: FAILED: did not finish in {limit:g} s ==\n", flush=True)
        return False
    except Exception:
        print(f"== {name}: FAILED ==\n{traceback.format_exc()}", flush=True)
        return False
    for table in tables:
        print(render(table), flush=True)
        print(flush=True)
    print(f"({name}: {time.perf_counter() - started:.1f} s)\n", flush=True)
    return True


async def _main(names: Sequence[str], options: RunOptions) -> bool:
    ok = True
    for name in names:
        ok = await _run_section(name, SECTIONS[name], options) and ok
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Run benchmark sections and print their tables."
    )
    parser.add_argument(
        "sections", nargs="*", metavar="SECTION", help=f"any of: {', '.join(SECTIONS)}"
    )
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke runs, for the sections that have one (peer, store, cluster)",
    )
    parser.add_argument(
        "--n",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="streams: hold N streams (repeatable; default 1,000, 5,000 and 10,000)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, module_name in SECTIONS.items():
            print(f"{name}\t{module_name}")
        return 0
    unknown = [name for name in args.sections if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    names = args.sections or list(SECTIONS)
    cpus = os.cpu_count() or math.nan
    print(
        f"bench: Python {platform.python_version()}, trio {trio.__version__}, "
        f"{cpus} CPUs, {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n",
        flush=True,
    )
    options = RunOptions(quick=args.quick, n=tuple(args.n))
    return 0 if trio.run(_main, names, options) else 1


if __name__ == "__main__":
    sys.exit(main())
