"""Fair queueing: the rules of "Fairness" in ``docs/admission.md``, one at a time on the
core, then the acceptance numbers through the Trio layer in virtual time."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable

import attrs
import pytest
import trio
import trio.testing

from dispatcher.admission import (
    DEFAULT_SHARE,
    Admission,
    AdmissionCore,
    Needs,
    Policy,
    PolicySnapshot,
    Share,
    open_admission,
)

from .helpers import cand, only_admit

POLICY = Policy(max_queue=10_000, queue_timeout_s=10_000)
A, B, C = Share(tenant="a"), Share(tenant="b"), Share(tenant="c")


def busy_core(slots: int = 1) -> tuple[AdmissionCore, list[int]]:
    """A core whose one candidate is full (the held slot ids are returned)."""
    core = AdmissionCore(PolicySnapshot(default=POLICY))
    core.node_joined([cand(slots=slots)], 0.0)
    held = [only_admit(core.submit(f"holder-{i}", "m", Needs(), 0.0)).slot_id for i in range(slots)]
    return core, held


def queue(core: AdmissionCore, share: Share, count: int, ids: Iterable[int]) -> list[int]:
    queued = list(itertools.islice(ids, count))
    for waiter_id in queued:
        assert core.submit(waiter_id, "m", Needs(), 0.0, share=share) == []
    return queued


def drain(core: AdmissionCore, slot: int, count: int) -> list[object]:
    """Release the one slot ``count`` times, each time to the waiter it admitted (who
    holds it afterwards: see :func:`held`)."""
    order: list[object] = []
    for _ in range(count):
        admit = only_admit(core.release(slot, 1.0))
        order.append(admit.waiter_id)
        slot = admit.slot_id
    return order


def held(core: AdmissionCore, besides: Iterable[int] = ()) -> int:
    """The one slot in use (but for ``besides``)."""
    [slot] = [s for s in range(1, 1000) if core.slot_state(s) == "in_use" and s not in set(besides)]
    return slot


# --------------------------------------------------------------------------- the share


def test_default_share_is_one_tenant_of_band_zero() -> None:
    assert DEFAULT_SHARE == Share() == Share(tenant="", priority=0, weight=1.0)


@pytest.mark.parametrize("weight", [0, -1, math.inf, math.nan])
def test_weight_must_be_finite_and_positive(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        Share(tenant="a", weight=weight)


# --------------------------------------------------------------------------- the rules


def test_equal_weights_alternate_whoever_submits_more() -> None:
    core, [slot] = busy_core()
    ids = itertools.count()
    heavy = queue(core, A, 10, ids)
    light = queue(core, B, 3, ids)
    order = drain(core, slot, 8)
    assert order == [heavy[0], light[0], heavy[1], light[1], heavy[2], light[2], *heavy[3:5]]


def test_weights_share_the_admissions() -> None:
    core, [slot] = busy_core()
    ids = itertools.count()
    three = queue(core, Share(tenant="a", weight=3), 30, ids)
    one = queue(core, Share(tenant="b", weight=1), 30, ids)
    order = drain(core, slot, 40)
    assert sum(1 for w in order if w in three) == 30
    assert sum(1 for w in order if w in one) == 10
    # each round of four: three of a's and one of b's, each tenant in its own FIFO order
    assert [w for w in order if w in three] == three[:30]
    assert [w for w in order if w in one] == one[:10]


def test_higher_band_first_then_fair_within_it() -> None:
    core, [slot] = busy_core()
    ids = itertools.count()
    low = queue(core, Share(tenant="a", priority=0), 3, ids)
    high_a = queue(core, Share(tenant="a", priority=5), 2, ids)
    high_b = queue(core, Share(tenant="b", priority=5), 2, ids)
    order = drain(core, slot, 7)
    assert order == [high_a[0], high_b[0], high_a[1], high_b[1], *low]


def test_an_idle_tenant_banks_no_credit() -> None:
    """``a`` was served alone while ``b`` was idle; ``b`` comes back at the band's floor and
    alternates with ``a`` from there (it does not get the five it "missed" first)."""
    core, [slot] = busy_core()
    ids = itertools.count()
    heavy = queue(core, A, 10, ids)
    assert drain(core, slot, 5) == heavy[:5]
    light = queue(core, B, 3, ids)
    order = drain(core, held(core), 4)
    assert Counter(w in light for w in order) == Counter({True: 2, False: 2})
    assert order[0] == heavy[5]  # a tie at the floor goes to the older head


def test_a_tenant_stuck_elsewhere_does_not_lower_a_newcomers_start() -> None:
    """``s`` waits for the busy vision candidate (its start stays 0) while ``a`` and ``b``
    take turns on the plain one; newcomer ``c`` starts level with ``a`` and ``b`` (the floor
    of the queue it joins), not at ``s``'s 0: it gets one admission in three, not three in
    a row."""
    core = AdmissionCore(PolicySnapshot(default=POLICY))
    core.node_joined([cand("v", caps=("vision",)), cand("p")], 0.0)
    vision = only_admit(core.submit("hv", "m", Needs(vision=True), 0.0)).slot_id
    plain = only_admit(core.submit("hp", "m", Needs(), 0.0)).slot_id
    assert core.submit("s1", "m", Needs(vision=True), 0.0, share=Share(tenant="s")) == []
    ids = itertools.count()
    heavy = queue(core, A, 6, ids)
    light = queue(core, B, 6, ids)
    assert drain(core, plain, 6) == [heavy[0], light[0], heavy[1], light[1], heavy[2], light[2]]
    newcomer = queue(core, C, 3, ids)
    assert drain(core, held(core, besides=[vision]), 6) == [
        heavy[3],
        light[3],
        newcomer[0],
        heavy[4],
        light[4],
        newcomer[1],
    ]


def test_requeued_first_and_not_charged() -> None:
    core, [slot] = busy_core()
    ids = itertools.count()
    heavy = queue(core, A, 4, ids)
    light = queue(core, B, 4, ids)
    assert core.submit("retry-a", "m", Needs(), 0.0, requeue=True, share=A) == []
    assert core.submit("retry-b", "m", Needs(), 0.0, requeue=True, share=B) == []
    first = only_admit(core.release(slot, 1.0))
    assert (first.waiter_id, first.reason) == ("retry-a", "requeued")
    second = only_admit(core.release(first.slot_id, 1.0))
    assert second.waiter_id == "retry-b"
    # the retries cost their tenants nothing: a and b still alternate from the start
    assert drain(core, second.slot_id, 4) == [heavy[0], light[0], heavy[1], light[1]]


def test_a_cancelled_head_moves_its_tenant_on() -> None:
    core, [slot] = busy_core()
    ids = itertools.count()
    heavy = queue(core, A, 3, ids)
    light = queue(core, B, 2, ids)
    assert core.cancel(heavy[0], 0.5) == []
    assert core.cancel(light[1], 0.5) == []
    assert drain(core, slot, 3) == [heavy[1], light[0], heavy[2]]


def test_a_slot_only_some_can_use_goes_to_the_fairest_of_those() -> None:
    """The plain candidate frees: the vision waiters cannot use it, whatever their tenants'
    standing; among the plain ones, fair order."""
    core = AdmissionCore(PolicySnapshot(default=POLICY))
    core.node_joined([cand("v", caps=("vision",)), cand("p")], 0.0)
    vision_slot = only_admit(core.submit("hv", "m", Needs(vision=True), 0.0)).slot_id
    plain_slot = only_admit(core.submit("hp", "m", Needs(), 0.0)).slot_id
    assert core.submit("a-vision", "m", Needs(vision=True), 0.0, share=A) == []
    for waiter_id, share in [("a1", A), ("a2", A), ("b1", B), ("c1", C)]:
        assert core.submit(waiter_id, "m", Needs(), 0.0, share=share) == []
    order = drain(core, plain_slot, 3)
    assert order == ["a1", "b1", "c1"]
    # a was charged for a1: on the vision candidate, a's vision waiter still goes (alone)
    admit = only_admit(core.release(vision_slot, 2.0))
    assert admit.waiter_id == "a-vision"
    assert admit.candidate.node_id == "v"


def test_a_reclassification_keeps_the_fair_order() -> None:
    """A policy change of ``long_context_tokens`` rebuilds the queues: each tenant keeps its
    FIFO and its virtual start."""
    core, [slot] = busy_core()
    ids = itertools.count()
    heavy = queue(core, A, 4, ids)
    light = queue(core, B, 4, ids)
    assert drain(core, slot, 3) == [heavy[0], light[0], heavy[1]]
    core.set_policy(PolicySnapshot(default=attrs.evolve(POLICY, long_context_tokens=10**6)), 2.0)
    assert drain(core, held(core), 4) == [light[1], heavy[2], light[2], heavy[3]]


def test_waiters_rejected_on_re_resolution_leave_their_tenant_behind() -> None:
    """The only vision candidate leaves: ``a``'s vision waiters are rejected, and ``a``'s
    plain ones still alternate with ``b``'s."""
    core = AdmissionCore(PolicySnapshot(default=POLICY))
    core.node_joined([cand("v", caps=("vision",)), cand("p")], 0.0)
    only_admit(core.submit("hv", "m", Needs(vision=True), 0.0))
    plain = only_admit(core.submit("hp", "m", Needs(), 0.0)).slot_id
    for waiter_id in ["av1", "av2"]:
        assert core.submit(waiter_id, "m", Needs(vision=True), 0.0, share=A) == []
    for waiter_id, share in [("a1", A), ("b1", B), ("a2", A), ("b2", B)]:
        assert core.submit(waiter_id, "m", Needs(), 0.0, share=share) == []
    rejected = core.node_left("v", 1, 1.0)
    assert [(r.waiter_id, getattr(r, "cause", None)) for r in rejected] == [
        ("av1", "no_capable_candidate"),
        ("av2", "no_capable_candidate"),
    ]
    assert drain(core, plain, 4) == ["a1", "b1", "a2", "b2"]
    assert core.statistics().waiting == 0


def test_statistics_and_depth_count_every_tenant() -> None:
    core, _ = busy_core()
    ids = itertools.count()
    queue(core, A, 3, ids)
    queue(core, Share(tenant="b", priority=2, weight=0.25), 2, ids)
    assert core.statistics().groups["m"].depth == 5


# --------------------------------------------------------------------------- Trio layer


async def submitter(
    admission: Admission,
    share: Share,
    per_second: int,
    seconds: int,
    admitted: list[tuple[float, str]],
    nursery: trio.Nursery,
) -> None:
    """``per_second`` requests at each half second mark for ``seconds``; each holds its slot
    one second once admitted (so admissions happen on whole seconds, arrivals between)."""

    async def request() -> None:
        async with admission.open_slot("m", Needs(), share=share) as slot:
            assert slot.queue_reason == "queued"
            admitted.append((trio.current_time(), share.tenant))
            await trio.sleep(1)

    await trio.sleep(0.5)
    for _ in range(seconds):
        for _ in range(per_second):
            nursery.start_soon(request)
        await trio.sleep(1)


async def hold_every_slot(admission: Admission, slots: int, nursery: trio.Nursery) -> None:
    """Take all ``slots`` now and hold them until t = 1."""

    async def hold(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with admission.open_slot("m", Needs()) as slot:
            assert slot.queue_reason == "immediate"
            task_status.started()
            await trio.sleep_until(1.0)

    for _ in range(slots):
        await nursery.start(hold)


async def run_tenants(
    shares: list[tuple[Share, int]], *, slots: int, seconds: int
) -> list[tuple[float, str]]:
    """Every slot held until t = 1; then each (share, rate) submits for ``seconds``; returns
    (time, tenant) of each admission, cut off when the arrivals stop."""
    admitted: list[tuple[float, str]] = []
    async with open_admission(PolicySnapshot(default=POLICY)) as admission:
        admission.node_joined([cand(slots=slots)])
        async with trio.open_nursery() as nursery:
            await hold_every_slot(admission, slots, nursery)
            for share, rate in shares:
                nursery.start_soon(submitter, admission, share, rate, seconds, admitted, nursery)
            await trio.sleep(seconds)
            nursery.cancel_scope.cancel()
    return admitted


def counts_by_instant(admitted: list[tuple[float, str]]) -> list[Counter[str]]:
    """The cumulative admissions per tenant after each instant at which some happened."""
    totals: Counter[str] = Counter()
    out = []
    for _, group in itertools.groupby(admitted, key=lambda item: item[0]):
        totals.update(tenant for _, tenant in group)
        out.append(Counter(totals))
    return out


async def test_ten_times_the_requests_gets_no_more_slots(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Equal weights, ``a`` submits 10x what ``b`` does, both more than their share (4
    slots held 1 s each: 4 admissions a second; a submits 30, b 3 a second): at every
    instant their admitted counts are within one slot-round (4) of each other; in fact
    within one."""
    admitted = await run_tenants([(A, 30), (B, 3)], slots=4, seconds=30)
    counts = counts_by_instant(admitted)
    assert len(admitted) >= 4 * 25
    for totals in counts:
        assert abs(totals["a"] - totals["b"]) <= 1, totals
    assert counts[-1]["b"] >= 2 * 25  # b, backlogged, got its half


async def test_weights_three_to_one_in_the_trio_layer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Weights 3:1, both backlogged: 3:1 within one round (four admissions) at every
    instant."""
    admitted = await run_tenants(
        [(Share(tenant="a", weight=3), 10), (Share(tenant="b", weight=1), 10)],
        slots=4,
        seconds=30,
    )
    counts = counts_by_instant(admitted)
    for totals in counts:
        assert abs(totals["a"] - 3 * totals["b"]) <= 4, totals
    assert counts[-1]["a"] + counts[-1]["b"] >= 4 * 25
    assert counts[-1]["a"] >= 3 * counts[-1]["b"] - 4


async def test_a_higher_band_always_goes_first(autojump_clock: trio.testing.MockClock) -> None:
    """Band 1 submits bursts, band 0 floods: at no instant is a band-0 request admitted
    while a band-1 request that arrived before that instant still waits after it. (Every
    slot is held until t = 1 and the flood keeps the queue from emptying, so admissions
    happen on whole seconds, arrivals a quarter past.)"""
    high, low = Share(tenant="vip", priority=1), Share(tenant="bulk", priority=0)
    arrivals: list[tuple[float, str]] = []
    admitted: list[tuple[float, str]] = []
    async with open_admission(PolicySnapshot(default=POLICY)) as admission:
        admission.node_joined([cand(slots=2)])

        async def request(share: Share) -> None:
            arrivals.append((trio.current_time(), share.tenant))
            async with admission.open_slot("m", Needs(), share=share):
                admitted.append((trio.current_time(), share.tenant))
                await trio.sleep(1)

        async with trio.open_nursery() as nursery:
            await hold_every_slot(admission, 2, nursery)
            await trio.sleep(0.25)
            for second in range(30):
                for _ in range(5):
                    nursery.start_soon(request, low)
                if second % 5 == 2:
                    for _ in range(5):  # more than the two slots: band 1 queues too
                        nursery.start_soon(request, high)
                await trio.sleep(1)
            nursery.cancel_scope.cancel()
    instants = sorted({t for t, _ in admitted})
    assert all(t == int(t) for t in instants)
    vip_admitted_with_bulk = 0
    for instant in instants:
        vip_left = sum(1 for t, who in arrivals if who == "vip" and t < instant) - sum(
            1 for t, who in admitted if who == "vip" and t <= instant
        )
        bulk_now = sum(1 for t, who in admitted if who == "bulk" and t == instant)
        if bulk_now:
            assert vip_left == 0, instant
        if bulk_now and any(t == instant and who == "vip" for t, who in admitted):
            vip_admitted_with_bulk += 1
    assert sum(1 for _, who in admitted if who == "vip") == 6 * 5
    assert vip_admitted_with_bulk > 0  # the check above had something to check
