"""CPU and wall time per run of the node's normalized HTTP adapters (``openai``, ``ollama``)
against a fake provider in another process (issue #12: connections reused).

::

    python -m bench.adapter_reuse [--runs 200] [--concurrency 1 8] [--adapter openai ollama]

The node side -- the runner and one adapter, in this process -- drives ``--runs`` runs of a
short (5-token) answer, one after the other (concurrency 1) and then ``c`` at a time, with a
provider of ``c`` slots; it prints the node's CPU per run (``time.process_time``: this
process only, the fake provider runs in a child), the wall time per run (p50 at concurrency
1) and runs per second. Not a section of ``python -m bench``: a focused before/after probe.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any

import trio

from dispatcher import wire
from nodes.adapters import build_adapters
from nodes.config import ModelConfig, ProviderConfig
from nodes.runner import open_runner

KINDS = ("openai", "ollama")
BODY = {"messages": [{"role": "user", "content": "say hello"}]}


async def _serve_fake(kind: str) -> None:
    """The child: a fake provider on 127.0.0.1 port 0; prints its port, serves until killed."""
    from tests.nodes.fake_providers import serve_fake_ollama, serve_fake_openai

    serve = serve_fake_openai if kind == "openai" else serve_fake_ollama
    async with trio.open_nursery() as nursery:
        fake: Any = await nursery.start(serve)
        fake.reply = "one two three four five"
        # Do not keep a record of every request: the probe sends thousands.
        fake.requests = _Forgetful()
        print(fake.server.address.port, flush=True)


class _Forgetful(list[Any]):
    def append(self, item: Any) -> None:
        pass


def _provider(kind: str, port: int, slots: int) -> ProviderConfig:
    return ProviderConfig(
        id="p",
        type=kind,
        base_url=f"http://127.0.0.1:{port}",
        models=(ModelConfig(name="m", slots=slots),),
    )


async def _measure(kind: str, port: int, runs: int, concurrency: int) -> dict[str, float]:
    adapters = build_adapters([_provider(kind, port, concurrency)])
    done: dict[str, trio.Event] = {}
    failures: list[wire.NodeMessage] = []

    async def send(message: wire.NodeMessage) -> None:
        if isinstance(message, wire.TERMINAL_EVENTS):
            if not isinstance(message, wire.RunCompleted):
                failures.append(message)
            done[message.run_id].set()

    walls: list[float] = []
    counter = iter(range(10**9))

    async def one(runner: Any) -> None:
        run_id = f"r{next(counter)}"
        done[run_id] = finished = trio.Event()
        started = time.perf_counter()
        runner.start(
            wire.RunRequest(run_id=run_id, provider_id="p", model="m", served_model="m", body=BODY)
        )
        await finished.wait()
        del done[run_id]
        walls.append(time.perf_counter() - started)

    async with open_runner(send, adapters=adapters) as runner:
        for _ in range(min(10, runs)):  # warm up (imports, the first pool)
            await one(runner)
        walls.clear()
        cpu0, wall0 = time.process_time(), time.perf_counter()

        async def worker(count: int) -> None:
            for _ in range(count):
                await one(runner)

        async with trio.open_nursery() as nursery:
            for index in range(concurrency):
                nursery.start_soon(worker, runs // concurrency + (index < runs % concurrency))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if failures:
        raise RuntimeError(f"{len(failures)} runs failed, e.g. {failures[0]!r}")
    return {
        "cpu_ms": cpu / runs * 1000,
        "p50_ms": statistics.median(walls) * 1000,
        "per_s": runs / wall,
    }


async def _main(args: argparse.Namespace) -> None:
    print(f"{'adapter':8} {'c':>3} {'runs':>5} {'node CPU ms/run':>16} {'p50 ms':>8} {'runs/s':>8}")
    for kind in args.adapter:
        command = [sys.executable, "-m", "bench.adapter_reuse", "--serve", kind]
        async with trio.open_nursery() as nursery:
            # The child lives in this nursery: cancelling it at the end kills the child.
            child: trio.Process = await nursery.start(
                partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
            )
            assert child.stdout is not None
            port = int(await _read_line(child.stdout))
            for concurrency in args.concurrency:
                result = await _measure(kind, port, args.runs, concurrency)
                print(
                    f"{kind:8} {concurrency:>3} {args.runs:>5} {result['cpu_ms']:>16.2f} "
                    f"{result['p50_ms']:>8.2f} {result['per_s']:>8.0f}",
                    flush=True,
                )
            nursery.cancel_scope.cancel(reason="measured")


async def _read_line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while not data.endswith(b"\n"):
        piece = await stream.receive_some(64)
        if not piece:
            raise RuntimeError("the fake provider exited before it said its port")
        data += piece
    return data.decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--adapter", nargs="+", default=["openai", "ollama"])
    parser.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(_serve_fake, args.serve)
    else:
        trio.run(_main, args)


if __name__ == "__main__":
    main()
