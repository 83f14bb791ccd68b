"""Admission: the core's cost per request as the queue grows, and timeout accuracy.

``python bench/admission_bench.py`` (or ``python -m bench admission``) prints:

* the sans-IO core's cost of one submit + admit + release cycle with 10, 1,000 and 100,000
  requests waiting, four ways: the waiting requests parked in *another* group whose candidate
  is full; the steady state of the *same* group (each cycle's submit joins the tail, the
  release admits the head, so the queue stays at N); the same group where the waiting
  requests need a capability the cycling requests' candidate lacks; and the fair core's
  steady state, the N waiting requests spread over 1,000 tenants of weights 1, 2 and 3 (over
  N tenants when N < 1,000), each cycle's submit from the next tenant in turn and each
  release admitting the fairest waiter. The target: the cost at 100,000 is at most 2x the
  cost at 10.
  The same with affinity on (cache-aware routing, ``docs/admission.md`` "Affinity"): each
  request with one of 1,000 affinity keys over a group of 4 candidates, so every decision
  ranks the candidates by rendezvous hashing and checks the bounded load: an immediate
  admission with N waiting elsewhere; the steady state of the same group (no hold: every
  waiter's wait is over); and the same with holds (``affinity_wait_s`` 50 ms, the clock
  advancing 1 ms per cycle, so the newest ~50 waiters hold for their preferred candidate and
  a release looks past them).
* the Trio layer's timeout accuracy with the real clock: requests that can never be admitted,
  ``queue_timeout_s = 0.05``; how late ``QueueTimeout`` arrives (mean, p50, p99, max).
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio

from bench import Table, render
from dispatcher.admission import (
    DEFAULT_SHARE,
    AdmissionCore,
    Admit,
    Candidate,
    Needs,
    Policy,
    PolicySnapshot,
    QueueTimeout,
    Share,
    open_admission,
)

TIME_LIMIT = 60.0
SIZES = (10, 1_000, 100_000)
TENANTS = 1_000
CYCLES = 20_000
REPEATS = 5
TIMEOUT = 0.05
TIMEOUT_WAITERS = 500


def _candidate(node: str, model: str, slots: int, caps: frozenset[str] = frozenset()) -> Candidate:
    return Candidate(
        node_id=node,
        generation=1,
        provider_id="p",
        provider_type="bench",
        adapter="echo",
        model=model,
        served_model=model,
        capabilities=caps,
        slots=slots,
    )


def _core(**fields: float) -> AdmissionCore:
    policy = Policy(max_queue=10**9, queue_timeout_s=10**9, **fields)  # type: ignore[arg-type]
    return AdmissionCore(PolicySnapshot(default=policy))


KEYS = 1_000
AFFINITY_NODES = ("a", "b", "c", "d")
KEYED = [Needs(affinity_key=f"conversation-{i}") for i in range(KEYS)]
"""Requests of 1,000 conversations."""


def _admitted(decisions: Sequence[object]) -> Admit:
    [admit] = decisions
    assert isinstance(admit, Admit), admit
    return admit


def _other_group(waiting: int) -> Callable[[int], None]:
    """N parked in group "busy"; cycles in group "free" (immediate admission)."""
    core = _core()
    core.node_joined([_candidate("a", "busy", 1), _candidate("b", "free", 1)], 0.0)
    _admitted(core.submit("holder", "busy", Needs(), 0.0))
    for i in range(waiting):
        assert core.submit(("w", i), "busy", Needs(), 0.0) == []  # type: ignore[arg-type]
    needs = Needs()

    def cycles(count: int) -> None:
        submit, release = core.submit, core.release
        for i in range(count):
            slot = _admitted(submit(i, "free", needs, 1.0)).slot_id
            release(slot, 1.0)

    return cycles


def _steady_state(waiting: int, shares: Sequence[Share]) -> Callable[[int], None]:
    """N parked in the group, their shares taken from ``shares`` in turn; each cycle joins
    the queue (with the next share) and a release admits the first in queue order, so the
    queue stays at N."""
    core = _core()
    core.node_joined([_candidate("a", "busy", 1)], 0.0)
    slot = [_admitted(core.submit("holder", "busy", Needs(), 0.0)).slot_id]
    turn = itertools.cycle(shares)
    for i in range(waiting):
        assert core.submit(f"w{i}", "busy", Needs(), 0.0, share=next(turn)) == []
    needs = Needs()
    ids = itertools.count()

    def cycles(count: int) -> None:
        submit, release = core.submit, core.release
        current = slot[0]
        for i in itertools.islice(ids, count):
            assert submit(i, "busy", needs, 1.0, share=next(turn)) == []
            current = _admitted(release(current, 1.0)).slot_id
        slot[0] = current

    return cycles


def _same_group(waiting: int) -> Callable[[int], None]:
    """One tenant (the default share): each cycle joins the tail, a release admits the head."""
    return _steady_state(waiting, [DEFAULT_SHARE])


def _fair_tenants(waiting: int) -> Callable[[int], None]:
    """Spread over min(N, 1,000) tenants of weights 1, 2, 3; each cycle from the next tenant,
    each release admits the fairest waiter."""
    count = min(waiting, TENANTS)
    return _steady_state(waiting, [Share(tenant=f"t{i}", weight=1 + i % 3) for i in range(count)])


def _other_capability(waiting: int) -> Callable[[int], None]:
    """N needing vision parked on the full vision candidate; cycles on the plain one."""
    core = _core()
    vision = frozenset({"vision"})
    core.node_joined([_candidate("a", "m", 1, vision), _candidate("b", "m", 1)], 0.0)
    _admitted(core.submit("holder", "m", Needs(vision=True), 0.0))
    for i in range(waiting):
        assert core.submit(("w", i), "m", Needs(vision=True), 0.0) == []  # type: ignore[arg-type]
    needs = Needs()

    def cycles(count: int) -> None:
        submit, release = core.submit, core.release
        for i in range(count):
            slot = _admitted(submit(i, "m", needs, 1.0)).slot_id
            release(slot, 1.0)

    return cycles


def _affinity_other_group(waiting: int) -> Callable[[int], None]:
    """Affinity on: N keyed requests parked in group "busy"; each cycle a keyed request to
    group "free" (4 candidates of 8 slots) is admitted at once onto its key's choice."""
    core = _core(affinity=True)
    free = [_candidate(node, "free", 8) for node in AFFINITY_NODES]
    core.node_joined([_candidate("z", "busy", 1), *free], 0.0)
    _admitted(core.submit("holder", "busy", Needs(), 0.0))
    for i in range(waiting):
        assert core.submit(("w", i), "busy", KEYED[i % KEYS], 0.0) == []  # type: ignore[arg-type]
    core.tick(1.0)  # their holds are over

    def cycles(count: int) -> None:
        submit, release = core.submit, core.release
        for i in range(count):
            slot = _admitted(submit(i, "free", KEYED[i % KEYS], 1.0)).slot_id
            release(slot, 1.0)

    return cycles


def _affinity_steady(waiting: int) -> Callable[[int], None]:
    """Affinity on, no hold (``affinity_wait_s = 0``): 4 candidates of 1 slot, all held; N
    keyed waiters; each cycle a keyed request joins the tail and the release of the oldest
    slot admits the head, onto the candidate it freed."""
    core = _core(affinity=True, affinity_wait_s=0.0)
    core.node_joined([_candidate(node, "busy", 1) for node in AFFINITY_NODES], 0.0)
    slots = [_admitted(core.submit(f"h{n}", "busy", Needs(), 0.0)).slot_id for n in range(4)]
    for i in range(waiting):
        assert core.submit(f"w{i}", "busy", KEYED[i % KEYS], 0.0) == []
    ids = itertools.count()

    def cycles(count: int) -> None:
        submit, release = core.submit, core.release
        for i in itertools.islice(ids, count):
            assert submit(i, "busy", KEYED[i % KEYS], 1.0) == []
            slots.append(_admitted(release(slots.pop(0), 1.0)).slot_id)

    return cycles


def _affinity_holds(waiting: int) -> Callable[[int], None]:
    """Affinity on, ``affinity_wait_s = 0.05``, 1 ms per cycle: as the steady state, but the
    newest ~50 waiters hold for their preferred candidate (a release skips them; the end of a
    hold may admit one). Whatever is admitted, by a submit, a release or a hold's end, joins
    the held slots; each cycle releases the oldest."""
    core = _core(affinity=True, affinity_wait_s=0.05)
    core.node_joined([_candidate(node, "busy", 1) for node in AFFINITY_NODES], 0.0)
    slots = [_admitted(core.submit(f"h{n}", "busy", Needs(), 0.0)).slot_id for n in range(4)]
    for i in range(waiting):
        assert core.submit(f"w{i}", "busy", KEYED[i % KEYS], 0.0) == []
    ids = itertools.count()
    clock = [1.0]

    def cycles(count: int) -> None:
        submit, release = core.submit, core.release
        now = clock[0]
        for i in itertools.islice(ids, count):
            now += 0.001
            decisions = submit(i, "busy", KEYED[i % KEYS], now)
            if slots:
                decisions += release(slots.pop(0), now)
            slots.extend(d.slot_id for d in decisions if isinstance(d, Admit))
        clock[0] = now

    return cycles


def _cost_ns(setup: Callable[[int], Callable[[int], None]], waiting: int) -> float:
    cycles = setup(waiting)
    cycles(1_000)  # warm-up
    best = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(REPEATS):
            started = time.perf_counter_ns()
            cycles(CYCLES)
            best = min(best, (time.perf_counter_ns() - started) / CYCLES)
    finally:
        gc.enable()
    return best


def core_table() -> Table:
    table = Table(
        title="admission core: one submit + admit + release cycle",
        columns=["waiting", *(f"{n:,}" for n in SIZES), "100k / 10"],
    )
    setups = {
        "other group, ns": _other_group,
        "same group (steady state), ns": _same_group,
        "same group, other capability, ns": _other_capability,
        f"fair: same group, {TENANTS:,} tenants, ns": _fair_tenants,
        "affinity on: other group, ns": _affinity_other_group,
        "affinity on: same group (steady state), ns": _affinity_steady,
        "affinity on: same group, 50 ms holds, ns": _affinity_holds,
    }
    worst = 0.0
    for name, setup in setups.items():
        costs = [_cost_ns(setup, n) for n in SIZES]
        ratio = costs[-1] / costs[0]
        worst = max(worst, ratio)
        table.rows.append([name, *(f"{c:,.0f}" for c in costs), f"{ratio:.2f}x"])
    table.notes.append(
        f"best of {REPEATS} runs of {CYCLES:,} cycles each; target 100k / 10 <= 2x "
        f"({'met' if worst <= 2 else 'NOT met'}: worst {worst:.2f}x)"
    )
    return table


async def _timeouts() -> list[float]:
    """Lateness (s) of each QueueTimeout past its 0.05 s deadline."""
    late: list[float] = []
    policy = PolicySnapshot(default=Policy(queue_timeout_s=TIMEOUT, max_queue=10**6))
    async with open_admission(policy) as admission:
        admission.node_joined([_candidate("a", "m", 1)])
        async with admission.open_slot("m", Needs()):

            async def wait() -> None:
                started = trio.current_time()
                try:
                    async with admission.open_slot("m", Needs()):
                        raise AssertionError("admitted while the only slot is held")
                except QueueTimeout:
                    late.append(trio.current_time() - started - TIMEOUT)

            async with trio.open_nursery() as nursery:
                for i in range(TIMEOUT_WAITERS):
                    nursery.start_soon(wait)
                    if i % 10 == 9:
                        await trio.sleep(0.002)  # arrivals spread over ~0.1 s
    return late


async def _trio_cycle_us(count: int = 20_000) -> float:
    async with open_admission() as admission:
        admission.node_joined([_candidate("a", "m", 1)])
        needs = Needs()
        started = time.perf_counter()
        for _ in range(count):
            async with admission.open_slot("m", needs):
                pass
        return (time.perf_counter() - started) / count * 1e6


async def run() -> Sequence[Table]:
    tables = [core_table()]
    late = sorted(await _timeouts())
    ms = [x * 1000 for x in late]
    trio_table = Table(
        title=f"admission Trio layer: QueueTimeout lateness ({TIMEOUT * 1000:g} ms, real clock)",
        columns=["waiters", "mean ms", "p50 ms", "p99 ms", "max ms", "min ms"],
        rows=[
            [
                f"{len(ms)}",
                f"{statistics.fmean(ms):.3f}",
                f"{ms[len(ms) // 2]:.3f}",
                f"{ms[min(len(ms) - 1, int(0.99 * len(ms)))]:.3f}",
                f"{ms[-1]:.3f}",
                f"{ms[0]:.3f}",
            ]
        ],
        notes=[
            "one driver task sleeps until the core's next deadline and ticks it; the "
            "lateness is timer + scheduling delay (never early: min >= 0)",
            f"open_slot + exit with a free slot: {await _trio_cycle_us():.1f} us per request",
        ],
    )
    assert min(late) >= 0, "a QueueTimeout came early"
    tables.append(trio_table)
    return tables


def main() -> None:
    for table in trio.run(run):
        print(render(table), flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
