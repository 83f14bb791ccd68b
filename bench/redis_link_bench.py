"""The Redis link (``dispatcher.store.redis_link``) against ``coredis`` on one fresh
``redis-server``, same run: µs per GET and per EVALSHA at one caller (wall time and this
process's CPU time per call, and Trio task steps per call), and calls per second at 64
concurrent callers on one client. ``python -m bench.redis_link_bench [--n N]``.

Not a section of ``python -m bench`` (yet): it compares two clients of one store, which the
edge will not both use.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable

import coredis
import trio

from dispatcher.store.redis_link import open_redis_link

from ._stores import running_redis

SCRIPT = "return redis.call('GET', KEYS[1])"
Call = Callable[[], Awaitable[object]]


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


async def sequential(call: Call, n: int) -> tuple[float, float, float]:
    """µs of wall and CPU time, and task steps, per call at one caller."""
    for _ in range(200):
        await call()
    steps = _Steps()
    trio.lowlevel.add_instrument(steps)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        await call()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    trio.lowlevel.remove_instrument(steps)
    return wall / n * 1e6, cpu / n * 1e6, steps.steps / n


async def concurrent(call: Call, n: int, callers: int = 64) -> float:
    """Calls per second with ``callers`` tasks calling in a loop."""
    each = n // callers

    async def caller() -> None:
        for _ in range(each):
            await call()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(callers):
            nursery.start_soon(caller)
    return each * callers / (time.perf_counter() - start)


async def main(n: int) -> None:
    async with running_redis() as server:
        client: coredis.Redis[bytes] = coredis.Redis.from_url(server.url)
        async with client, open_redis_link(server.url) as link:
            await link.call("SET", "k", "v" * 20)
            script = client.register_script(SCRIPT)
            calls: dict[str, dict[str, Call]] = {
                "coredis": {
                    "GET": lambda: client.get("k"),
                    "EVALSHA": lambda: script(keys=["k"]),
                },
                "link": {
                    "GET": lambda: link.call("GET", "k"),
                    "EVALSHA": lambda: link.evalsha(SCRIPT, ["k"]),
                },
            }
            print(f"n={n} per measure; redis at {server.url}")
            print(
                f"{'client':8} {'command':8} {'c=1 µs':>8} {'CPU µs':>8} {'steps':>6} {'c=64/s':>8}"
            )
            for name, commands in calls.items():
                for command, call in commands.items():
                    wall, cpu, steps = await sequential(call, n)
                    rate = await concurrent(call, n * 4)
                    print(f"{name:8} {command:8} {wall:8.0f} {cpu:8.0f} {steps:6.1f} {rate:8.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5000, help="calls per measure at c=1")
    trio.run(main, parser.parse_args().n)
