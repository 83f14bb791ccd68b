"""Affinity (cache-aware routing, issue #26): rendezvous hashing with a bounded load and a
bounded wait in the admission core. One test per rule of "Affinity" in docs/admission.md;
the state machine (test_core_machine.py) checks the same rules over random interleavings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.admission import (
    AFFINITY_RESULTS,
    AdmissionCore,
    Candidate,
    CandidateIdentity,
    Needs,
    Policy,
    PolicySnapshot,
    open_admission,
    rendezvous_rank,
)

from .helpers import cand, only_admit

WAIT = 0.05


def core_with(
    *candidates: Candidate, policy: Policy | None = None, **fields: object
) -> AdmissionCore:
    if policy is None:
        settings: dict[str, object] = {"affinity": True, "affinity_wait_s": WAIT, **fields}
        policy = Policy(**settings)  # type: ignore[arg-type]
    core = AdmissionCore(PolicySnapshot(default=policy))
    core.node_joined(list(candidates), 0.0)
    return core


def key_homed_on(node: str, candidates: Sequence[Candidate], *, start: int = 0) -> str:
    """An affinity key whose first choice among ``candidates`` is ``node``."""
    identities = [c.identity for c in candidates]
    for n in range(start, start + 10_000):
        key = f"conversation-{n}"
        if rendezvous_rank(key, identities)[0].node_id == node:
            return key
    raise AssertionError(f"no key homed on {node}")


def ranking(key: str, candidates: Sequence[Candidate]) -> list[str]:
    return [i.node_id for i in rendezvous_rank(key, [c.identity for c in candidates])]


def results(core: AdmissionCore, group: str = "m") -> dict[str, int]:
    return {r: n for r, n in core.statistics().groups[group].affinity.items() if n}


A, B, C = (cand(n, slots=4) for n in ("a", "b", "c"))


# ------------------------------------------------------------------ the ranking


def test_the_ranking_is_pinned() -> None:
    """The hash is part of the protocol between edges (several edges, or an edge before
    and after an upgrade, must agree without talking): a change reshuffles every key."""
    identities = [CandidateIdentity(n, "p", "m") for n in ("a", "b", "c", "d")]
    assert [i.node_id for i in rendezvous_rank("hello", identities)] == ["d", "a", "c", "b"]
    assert [i.node_id for i in rendezvous_rank("conversation-7", identities)] == [
        "a",
        "b",
        "d",
        "c",
    ]


def test_the_ranking_is_the_same_in_another_process() -> None:
    """No Python ``hash()`` (salted per process): another interpreter with another hash
    seed ranks every key the same way."""
    identities = [CandidateIdentity(n, p, "m") for n in ("a", "b", "c") for p in ("x", "y")]
    keys = [f"k{n}" for n in range(50)]
    here = [[(i.node_id, i.provider_id) for i in rendezvous_rank(k, identities)] for k in keys]
    code = (
        "from dispatcher.admission import CandidateIdentity, rendezvous_rank\n"
        "ids = [CandidateIdentity(n, p, 'm') for n in 'abc' for p in 'xy']\n"
        "print([[(i.node_id, i.provider_id) for i in rendezvous_rank(f'k{n}', ids)]"
        " for n in range(50)])\n"
    )
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == repr(here)


def test_the_generation_is_not_part_of_the_ranking() -> None:
    """A reconnecting node (a new generation) keeps its keys."""
    before = [cand(n, generation=1) for n in ("a", "b", "c")]
    after = [cand(n, generation=7) for n in ("a", "b", "c")]
    for n in range(100):
        assert ranking(f"k{n}", before) == ranking(f"k{n}", after)


identity_sets = st.sets(
    st.builds(
        CandidateIdentity,
        st.sampled_from([f"node-{n}" for n in range(8)]),
        st.sampled_from(["ollama", "vllm", "llama"]),
        st.just("m"),
    ),
    min_size=2,
    max_size=12,
)
key_sets = st.sets(st.text(min_size=0, max_size=12), min_size=1, max_size=60)


@given(identities=identity_sets, keys=key_sets, data=st.data())
def test_a_candidate_leaving_moves_only_the_keys_it_ranked_first(
    identities: set[CandidateIdentity], keys: set[str], data: st.DataObject
) -> None:
    gone = data.draw(st.sampled_from(sorted(identities, key=repr)))
    rest = [i for i in identities if i != gone]
    for key in keys:
        before = rendezvous_rank(key, identities)
        after = rendezvous_rank(key, rest)
        if before[0] != gone:
            assert after[0] == before[0], key  # its home stays
        else:
            assert after[0] == before[1], key  # it moves to its second choice
        assert after == [i for i in before if i != gone]  # the order of the others holds


@given(identities=identity_sets, keys=key_sets, data=st.data())
def test_a_candidate_joining_takes_keys_only_to_itself(
    identities: set[CandidateIdentity], keys: set[str], data: st.DataObject
) -> None:
    new = data.draw(st.sampled_from(sorted(identities, key=repr)))
    old = [i for i in identities if i != new]
    for key in keys:
        home = rendezvous_rank(key, identities)[0]
        assert home in (rendezvous_rank(key, old)[0], new)


@given(
    keys=st.lists(st.text(max_size=8), min_size=1, max_size=30),
    order=st.permutations(range(4)),
    generations=st.lists(st.integers(1, 5), min_size=4, max_size=4),
)
def test_two_cores_agree_without_talking(
    keys: list[str], order: list[int], generations: list[int]
) -> None:
    """Two edges (two cores) that see the same candidates, announced in another order and
    by other sessions of the nodes, send each key to the same candidate."""
    nodes = ("a", "b", "c", "d")
    first = core_with(*(cand(n, slots=2) for n in nodes))
    second = core_with(
        *(cand(nodes[i], slots=2, generation=generations[i]) for i in order),
    )
    for n, key in enumerate(keys):
        needs = Needs(affinity_key=key)
        one = only_admit(first.submit(n, "m", needs, 0.0))
        two = only_admit(second.submit(n, "m", needs, 0.0))
        assert one.candidate.identity == two.candidate.identity
        first.release(one.slot_id, 0.0)
        second.release(two.slot_id, 0.0)


# ------------------------------------------------------------------ the policy


def test_the_policy_defaults_leave_it_off() -> None:
    policy = Policy()
    assert (policy.affinity, policy.affinity_wait_s, policy.affinity_load_factor) == (
        False,
        0.05,
        1.25,
    )
    with pytest.raises(ValueError, match="affinity_wait_s"):
        Policy(affinity_wait_s=-1)
    with pytest.raises(ValueError, match="affinity_load_factor"):
        Policy(affinity_load_factor=0.9)
    with pytest.raises(ValueError, match="affinity_load_factor"):
        Policy(affinity_load_factor=float("inf"))


def test_off_a_key_changes_nothing() -> None:
    """Affinity off (the default): least loaded, round-robin, whatever the key."""
    core = core_with(A, B, C, policy=Policy())
    chosen = [only_admit(core.submit(n, "m", Needs(affinity_key="same"), 0.0)) for n in range(3)]
    assert {a.candidate.node_id for a in chosen} == {"a", "b", "c"}
    assert results(core) == {}
    assert not core.statistics().groups["m"].affinity_on


# ------------------------------------------------------------------ the rule


def test_a_key_goes_to_its_home_every_time() -> None:
    core = core_with(A, B, C)
    assert core.statistics().groups["m"].affinity_on
    for home in ("a", "b", "c"):
        key = key_homed_on(home, [A, B, C])
        for n in range(3):
            admit = only_admit(core.submit(f"{home}{n}", "m", Needs(affinity_key=key), 0.0))
            assert admit.candidate.node_id == home
            core.release(admit.slot_id, 0.0)
    assert results(core) == {"hit": 9}


def test_affinity_wins_over_the_session() -> None:
    """With affinity on, a request with a key goes by its key, not by its session's last
    node; without a key, the session still counts."""
    core = core_with(A, B, C)
    key = key_homed_on("b", [A, B, C])
    first = only_admit(core.submit(1, "m", Needs(session_id="s", affinity_key=key), 0.0))
    assert first.candidate.node_id == "b"
    core.release(first.slot_id, 0.0)
    other = key_homed_on("c", [A, B, C])
    second = only_admit(core.submit(2, "m", Needs(session_id="s", affinity_key=other), 0.0))
    assert second.candidate.node_id == "c"  # not b, the session's last node
    core.release(second.slot_id, 0.0)
    third = only_admit(core.submit(3, "m", Needs(session_id="s"), 0.0))
    assert third.candidate.node_id == "c"  # no key: the session's last node
    assert results(core) == {"hit": 2, "unkeyed": 1}


def test_over_the_load_bound_it_spills_to_its_next_choice() -> None:
    """Home a has 2 of 4 slots held, b and c none: (2 + 1) > ceil(1.25 * (2 + 1) * 4 / 12)
    = 2, so the key goes to its second choice."""
    core = core_with(A, B, C)
    key = key_homed_on("a", [A, B, C])
    second = ranking(key, [A, B, C])[1]

    def only_a(candidate: Candidate) -> str | None:
        return None if candidate.node_id == "a" else "not a"

    pinned = Needs(affinity_key=key, predicate=only_a)
    held = [only_admit(core.submit(f"h{n}", "m", pinned, 0.0)) for n in (1, 2)]
    assert {a.candidate.node_id for a in held} == {"a"}
    admit = only_admit(core.submit(1, "m", Needs(affinity_key=key), 0.0))
    assert admit.candidate.node_id == second
    assert results(core) == {"hit": 2, "over_load": 1}
    core.release(held[0].slot_id, 0.0)  # a holds 1: (1 + 1) <= ceil(1.25 * 3 * 4 / 12)
    # the key stays where it was last served (its prefix is there now), not back home
    assert only_admit(core.submit(2, "m", Needs(affinity_key=key), 0.0)).candidate.node_id == (
        second
    )
    other = key_homed_on("a", [A, B, C], start=int(key.rpartition("-")[2]) + 1)
    assert only_admit(core.submit(3, "m", Needs(affinity_key=other), 0.0)).candidate.node_id == "a"
    assert results(core) == {"hit": 4, "over_load": 1}


def test_a_key_stays_where_it_was_last_served() -> None:
    """A turn that spilled (its home was busy past the hold) leaves its prefix on the node
    that served it: the key's next requests prefer that one, hold for it as for a home,
    and go by the ranking again once it leaves."""
    a, b, c = (cand(n, slots=1) for n in ("a", "b", "c"))
    core = core_with(a, b, c)
    key = key_homed_on("a", [a, b, c])
    second = ranking(key, [a, b, c])[1]
    busy = only_admit(core.submit("busy", "m", Needs(affinity_key=key), 0.0))
    assert core.submit("w", "m", Needs(affinity_key=key), 0.0) == []  # holds for a
    spilled = only_admit(core.tick(WAIT))
    assert (spilled.waiter_id, spilled.candidate.node_id) == ("w", second)
    assert results(core) == {"hit": 1, "busy": 1}
    core.release(busy.slot_id, WAIT)
    core.release(spilled.slot_id, WAIT)
    # a is free, but the key now goes to the node that served it last, every time
    for n in range(3):
        admit = only_admit(core.submit(f"t{n}", "m", Needs(affinity_key=key), WAIT))
        assert admit.candidate.node_id == second
        core.release(admit.slot_id, WAIT)
    assert results(core) == {"hit": 4, "busy": 1}
    # it holds for that node as for its home: freed within the hold, the slot is its
    held = only_admit(core.submit("h", "m", Needs(affinity_key=key), WAIT))
    assert core.submit("w2", "m", Needs(affinity_key=key), WAIT) == []
    assert core.tick(WAIT * 1.5) == []
    after = only_admit(core.release(held.slot_id, WAIT * 1.5))
    assert (after.waiter_id, after.candidate.node_id) == ("w2", second)
    core.release(after.slot_id, WAIT * 1.5)
    # its node leaving: the key goes by its ranking again, home first
    core.node_left(second, 1, WAIT * 2)
    back = only_admit(core.submit("x", "m", Needs(affinity_key=key), WAIT * 2))
    assert back.candidate.node_id == "a"


def test_placements_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The core remembers at most PLACEMENT_MEMORY keys' placements; a forgotten key goes by
    its ranking again."""
    from dispatcher.admission import _core

    monkeypatch.setattr(_core, "PLACEMENT_MEMORY", 2)
    a, b = cand("a", slots=1), cand("b", slots=1)
    core = core_with(a, b)
    key = key_homed_on("a", [a, b])
    busy = only_admit(core.submit("busy", "m", Needs(affinity_key=key), 0.0))
    assert core.submit("w", "m", Needs(affinity_key=key), 0.0) == []
    spilled = only_admit(core.tick(WAIT))
    assert spilled.candidate.node_id == "b"
    core.release(spilled.slot_id, WAIT)
    core.release(busy.slot_id, WAIT)
    # remembered: b, though a is free
    again = only_admit(core.submit("again", "m", Needs(affinity_key=key), WAIT))
    assert again.candidate.node_id == "b"
    core.release(again.slot_id, WAIT)
    # two other keys placed since: the first is forgotten, and goes home to a
    for n in range(2):
        other = key_homed_on("b", [a, b], start=100 * (n + 1))
        admit = only_admit(core.submit(f"o{n}", "m", Needs(affinity_key=other), WAIT))
        core.release(admit.slot_id, WAIT)
    home = only_admit(core.submit("home", "m", Needs(affinity_key=key), WAIT))
    assert home.candidate.node_id == "a"


def test_a_factor_as_large_as_the_candidates_bounds_nothing_but_slots() -> None:
    core = core_with(A, B, C, affinity_load_factor=3.0)
    key = key_homed_on("a", [A, B, C])
    got = [only_admit(core.submit(n, "m", Needs(affinity_key=key), 0.0)) for n in range(4)]
    assert {a.candidate.node_id for a in got} == {"a"}


def test_with_the_home_full_it_waits_for_it_no_longer_than_the_bound() -> None:
    a, b = cand("a", slots=1), cand("b", slots=1)
    core = core_with(a, b)
    key = key_homed_on("a", [a, b])
    busy = only_admit(core.submit("busy", "m", Needs(affinity_key=key), 0.0))
    assert busy.candidate.node_id == "a"
    assert core.submit("w", "m", Needs(affinity_key=key), 1.0) == []  # held: b is free
    assert core.is_queued("w")
    assert core.next_deadline() == 1.0 + WAIT
    assert core.tick(1.0 + WAIT / 2) == []
    admit = only_admit(core.tick(1.0 + WAIT))
    assert (admit.waiter_id, admit.candidate.node_id, admit.reason) == ("w", "b", "queued")
    assert admit.queued_for == pytest.approx(WAIT)
    assert results(core) == {"hit": 1, "busy": 1}


def test_its_home_freeing_within_the_bound_is_a_hit() -> None:
    a, b = cand("a", slots=1), cand("b", slots=1)
    core = core_with(a, b)
    key = key_homed_on("a", [a, b])
    busy = only_admit(core.submit("busy", "m", Needs(affinity_key=key), 0.0))
    assert core.submit("w", "m", Needs(affinity_key=key), 0.0) == []
    admit = only_admit(core.release(busy.slot_id, 0.01))
    assert (admit.waiter_id, admit.candidate.node_id) == ("w", "a")
    assert core.next_deadline() is None  # the hold's end went with the waiter
    assert results(core) == {"hit": 2}


def test_a_held_waiter_does_not_block_those_behind_it() -> None:
    """Head-of-line: a waiter held for its home (a, full) is not eligible for b while its
    hold lasts; a waiter behind it (no key, or another home) takes b's free slot at once,
    and one that frees on b later too."""
    a, b = cand("a", slots=1), cand("b", slots=2)
    core = core_with(a, b)
    key_a = key_homed_on("a", [a, b])
    only_admit(core.submit("busy", "m", Needs(affinity_key=key_a), 0.0))
    assert core.submit("held", "m", Needs(affinity_key=key_a), 0.0) == []
    behind = only_admit(core.submit("behind", "m", Needs(), 0.01))
    assert behind.candidate.node_id == "b"
    assert core.is_queued("held")
    full = only_admit(core.submit("full", "m", Needs(), 0.01))
    assert full.candidate.node_id == "b"
    assert core.submit("third", "m", Needs(), 0.02) == []  # nothing free: queued behind
    admit = only_admit(core.release(behind.slot_id, 0.03))
    assert admit.waiter_id == "third"  # "held" waits for a, not b, while its hold lasts
    assert core.is_queued("held")


def test_no_hold_when_the_queue_is_full_or_the_timeout_is_shorter() -> None:
    a, b = cand("a", slots=1), cand("b", slots=1)
    key = key_homed_on("a", [a, b])
    core = core_with(a, b, max_queue=0)
    only_admit(core.submit("busy", "m", Needs(affinity_key=key), 0.0))
    admit = only_admit(core.submit("w", "m", Needs(affinity_key=key), 0.0))
    assert admit.candidate.node_id == "b"  # not refused queue_full while b is free
    core = core_with(a, b, queue_timeout_s=WAIT)
    only_admit(core.submit("busy", "m", Needs(affinity_key=key), 0.0))
    assert only_admit(core.submit("w", "m", Needs(affinity_key=key), 0.0)).candidate.node_id == "b"
    core = core_with(a, b, affinity_wait_s=0.0)
    only_admit(core.submit("busy", "m", Needs(affinity_key=key), 0.0))
    assert only_admit(core.submit("w", "m", Needs(affinity_key=key), 0.0)).candidate.node_id == "b"


def test_a_home_that_cannot_serve_the_request_is_skipped() -> None:
    a, b = cand("a", slots=2), cand("b", slots=2, caps=["vision"])
    core = core_with(a, b)
    key = key_homed_on("a", [a, b])
    admit = only_admit(core.submit(1, "m", Needs(vision=True, affinity_key=key), 0.0))
    assert admit.candidate.node_id == "b"
    excluded = Needs(affinity_key=key, exclude=frozenset({a.key}))  # a retry, a failed
    assert only_admit(core.submit(2, "m", excluded, 0.0)).candidate.node_id == "b"
    # the first placed the key on b: b is where its prefix is, the second a hit
    assert results(core) == {"ineligible": 1, "hit": 1}


def test_an_ejected_home_is_last() -> None:
    a, b = cand("a", slots=2), cand("b", slots=2)
    core = core_with(a, b, eject_after_failures=1)
    key = key_homed_on("a", [a, b])
    core.report_failure(a.key, 0.0)
    assert only_admit(core.submit(1, "m", Needs(affinity_key=key), 0.0)).candidate.node_id == "b"
    assert results(core) == {"ejected": 1}


def test_a_home_leaving_while_a_waiter_holds_for_it_sends_it_on_at_once() -> None:
    a, b = cand("a", slots=1), cand("b", slots=1)
    core = core_with(a, b)
    key = key_homed_on("a", [a, b])
    only_admit(core.submit("busy", "m", Needs(affinity_key=key), 0.0))
    assert core.submit("w", "m", Needs(affinity_key=key), 0.0) == []
    admit = only_admit(core.node_left("a", 1, 0.01))
    assert (admit.waiter_id, admit.candidate.node_id) == ("w", "b")
    assert results(core) == {"hit": 2}  # b is its home among the candidates left


def test_a_candidate_leaving_moves_only_its_keys_in_the_core() -> None:
    nodes = [cand(n, slots=100) for n in ("a", "b", "c", "d")]
    core = core_with(*nodes, affinity_load_factor=4.0)
    keys = [f"k{n}" for n in range(60)]

    def placed() -> dict[str, str]:
        found = {}
        for key in keys:
            admit = only_admit(core.submit(key, "m", Needs(affinity_key=key), 0.0))
            found[key] = admit.candidate.node_id
            core.release(admit.slot_id, 0.0)
        return found

    before = placed()
    assert len(set(before.values())) == 4
    core.node_left("c", 1, 0.0)
    after = placed()
    for key in keys:
        if before[key] != "c":
            assert after[key] == before[key]
    assert "c" not in after.values()


def test_statistics_list_every_result() -> None:
    core = core_with(A)
    assert set(core.statistics().groups["m"].affinity) == set(AFFINITY_RESULTS)


# ------------------------------------------------------------------ the Trio layer


async def test_the_bounded_wait_in_virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    """Through ``Admission``: a request whose home is full waits exactly ``affinity_wait_s``
    (the driver wakes at the hold's end), then takes the free candidate."""
    a, b = cand("a", slots=1), cand("b", slots=1)
    key = key_homed_on("a", [a, b])
    policy = PolicySnapshot(default=Policy(affinity=True, affinity_wait_s=0.25))
    async with open_admission(policy) as admission:
        admission.node_joined([a, b])
        async with admission.open_slot("m", Needs(affinity_key=key)) as busy:
            assert busy.candidate.node_id == "a"
            start = trio.current_time()
            async with admission.open_slot("m", Needs(affinity_key=key)) as slot:
                assert slot.candidate.node_id == "b"
                assert trio.current_time() - start == pytest.approx(0.25)
                assert slot.queue_wait == pytest.approx(0.25)
        # and one whose home frees within the bound gets it (another key: this one's
        # place is b now, where it was last served)
        key = key_homed_on("a", [a, b], start=int(key.rpartition("-")[2]) + 1)
        async with (
            trio.open_nursery() as nursery,
            admission.open_slot("m", Needs(affinity_key=key)) as busy,
        ):

            async def free_soon() -> None:
                await trio.sleep(0.1)
                busy.release()

            nursery.start_soon(free_soon)
            async with admission.open_slot("m", Needs(affinity_key=key)) as slot:
                assert slot.candidate.node_id == "a"
                assert slot.queue_wait == pytest.approx(0.1)
        stats = admission.statistics().groups["m"].affinity
        assert (stats["hit"], stats["busy"]) == (3, 1)
