"""The gate's cost: a request through ``gate.open`` versus ``open_run`` directly.

Both go through the same in-process dispatcher and the same in-memory echo node (no sockets,
so the difference is the gate's own work: its attempt bookkeeping, commit detection and the
usage row). Requests run one at a time, non-streamed, alternating between the two paths in
rounds so background load falls on both alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import trio

from bench import Table, fmt_int
from dispatcher import wire
from dispatcher.config import EdgeConfig
from dispatcher.gate.attempts import Answer, GateRequest
from dispatcher.gate.pool import DispatchRequest
from dispatcher.paths.runs import RunSpec
from dispatcher.service import Service, open_service

TIME_LIMIT = 60.0
ROUNDS = 5
PER_ROUND = 400
BODY = {"model": "echo", "messages": [{"role": "user", "content": "hello there general"}]}


async def _direct(dispatcher: Service) -> None:
    async with dispatcher.open_run(RunSpec(model="echo", body=BODY)) as run:
        async for event in run:
            if wire.is_terminal(event):
                assert isinstance(event, wire.RunCompleted)


async def _through_gate(dispatcher: Service, index: int) -> None:
    request = GateRequest(
        request_id=f"bench-{index}",
        dispatch=DispatchRequest(model="echo", body=BODY),
        stream=False,
    )
    async with dispatcher.gate.open(request) as answer:
        assert isinstance(answer, Answer)
        assert isinstance(answer.head[-1], wire.RunCompleted)


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run() -> Sequence[Table]:
    direct: list[float] = []
    gated: list[float] = []
    counter = 0
    async with open_service(EdgeConfig(local_node=False)) as dispatcher:
        await dispatcher.attach_local_node()
        for _ in range(50):  # warm-up
            await _direct(dispatcher)
            counter += 1
            await _through_gate(dispatcher, counter)
        for _ in range(ROUNDS):
            for _ in range(PER_ROUND):
                start = time.perf_counter()
                await _direct(dispatcher)
                direct.append(time.perf_counter() - start)
            for _ in range(PER_ROUND):
                counter += 1
                start = time.perf_counter()
                await _through_gate(dispatcher, counter)
                gated.append(time.perf_counter() - start)
        await dispatcher.ledger.flush()
        rows = dispatcher.ledger.statistics().rows_written

    def ms(value: float) -> str:
        return f"{value * 1000:.3f}"

    table = Table(
        "gate: added latency per non-streamed request (in-process echo node)",
        ["path", "p50 ms", "p99 ms", "mean ms", "requests/s"],
    )
    for name, samples in (("open_run directly", direct), ("through the gate", gated)):
        table.rows.append(
            [
                name,
                ms(_pct(samples, 0.5)),
                ms(_pct(samples, 0.99)),
                ms(statistics.fmean(samples)),
                fmt_int(1 / statistics.fmean(samples)),
            ]
        )
    table.rows.append(
        [
            "added by the gate",
            ms(_pct(gated, 0.5) - _pct(direct, 0.5)),
            ms(_pct(gated, 0.99) - _pct(direct, 0.99)),
            ms(statistics.fmean(gated) - statistics.fmean(direct)),
            "",
        ]
    )
    table.notes.append(
        f"{len(direct)} requests per path in {ROUNDS} alternating rounds; "
        f"{rows} usage rows written to the ledger (:memory:)"
    )
    return [table]


if __name__ == "__main__":
    from bench import render

    for result in trio.run(run):
        print(render(result))
