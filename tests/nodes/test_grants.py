"""The node's slot allocator (``nodes.grants``), one rule at a time: the grants sent on each
event, what the node counts each edge as holding, and when a lowered grant frees its slots.
The Hypothesis state machine in ``test_grants_machine.py`` checks the same rules under every
ordering of the messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodes.grants import Allocator, Grant, Key, water_fill

K: Key = ("p", "m")
K2: Key = ("p", "other")


def sent(grants: list[Grant]) -> list[tuple[str, Key, int]]:
    """What the grants say, in order, without their serials."""
    return [(g.edge, g.key, g.slots) for g in grants]


def confirm(
    alloc: Allocator, edge: str, grants: list[Grant], *, waiting: int = 0, in_use: int = 0
) -> list[Grant]:
    """The edge applied ``grants`` (its own among them) and reports ``K``."""
    serial = max(g.serial for g in grants if g.edge == edge)
    return alloc.report(edge, K, waiting=waiting, in_use=in_use, serial=serial)


def test_one_edge_gets_every_slot_at_join_and_a_grant_per_key() -> None:
    alloc = Allocator({K: (4, 2), K2: (0, 0)})
    assert alloc.join("A") == [Grant("A", K, 4, 2, 1), Grant("A", K2, 0, 0, 2)]
    assert alloc.held("A", K) == 4
    assert alloc.edges() == frozenset({"A"})


def test_two_idle_edges_split_evenly_once_the_first_gives_up_half() -> None:
    alloc = Allocator({K: (4, 2)})
    first = alloc.join("A")
    joined = alloc.join("B")
    # A's grant is lowered at once; B gets nothing until A confirms it
    assert joined == [Grant("A", K, 2, 1, 2), Grant("B", K, 0, 0, 3)]
    assert alloc.held("A", K) == 4
    assert alloc.report("A", K, waiting=0, in_use=0, serial=first[0].serial) == []  # too old
    assert alloc.held("A", K) == 4
    assert confirm(alloc, "A", joined) == [Grant("B", K, 2, 1, 4)]
    assert [alloc.held(e, K) for e in "AB"] == [2, 2]


def test_an_odd_slot_stays_with_the_edge_that_has_it() -> None:
    alloc = Allocator({K: (3, 0)})
    alloc.join("A")
    joined = alloc.join("B")
    assert confirm(alloc, "A", joined) == [Grant("B", K, 1, 0, 4)]
    assert [alloc.granted(e, K) for e in "AB"] == [2, 1]


def test_a_grant_grows_only_by_what_nobody_may_be_using() -> None:
    alloc = Allocator({K: (4, 0)})
    alloc.join("A")
    joined = alloc.join("B")  # A lowered to 2, but counted at 4 until it confirms
    assert sent(joined) == [("A", K, 2), ("B", K, 0)]
    raised = alloc.set_capacity(K, 5, 0)
    # A's target is 3 (within what it may still use: free); B's is 2, but one slot is free
    assert sent(raised) == [("A", K, 3), ("B", K, 1)]
    assert sum(alloc.held(e, K) for e in "AB") == 5
    assert sent(confirm(alloc, "A", raised)) == [("B", K, 2)]


def test_a_first_waiter_takes_an_idle_slot_after_its_holder_confirms() -> None:
    alloc = Allocator({K: (1, 0)})
    alloc.join("A")
    joined = alloc.join("B")
    assert joined == [Grant("B", K, 0, 0, 2)]  # one slot, A keeps it
    lowered = alloc.report("B", K, waiting=1, in_use=0, serial=2)
    assert lowered == [Grant("A", K, 0, 0, 3)]  # A is lowered at once ...
    assert alloc.held("A", K) == 1  # ... but may still be using its slot
    assert alloc.granted("B", K) == 0
    # A's run.request, admitted before A saw the lowering, is not refused
    assert alloc.run_started("A", K)
    assert alloc.report("A", K, waiting=0, in_use=1, serial=3) == []  # A confirms, busy
    assert alloc.run_ended("A", K) == []
    assert alloc.report("A", K, waiting=0, in_use=0, serial=3) == [Grant("B", K, 1, 0, 4)]
    assert alloc.held("A", K) == 0


def test_a_busy_edge_gives_up_a_slot_at_its_first_run_end() -> None:
    alloc = Allocator({K: (2, 0)})
    alloc.join("A")
    assert alloc.report("A", K, waiting=3, in_use=2, serial=1) == []
    assert alloc.run_started("A", K)
    assert alloc.run_started("A", K)
    assert alloc.join("B") == [Grant("B", K, 0, 0, 2)]
    # B waits; A uses both slots: its grant is never cut below its runs
    assert alloc.report("B", K, waiting=1, in_use=0, serial=2) == []
    assert alloc.granted("A", K) == 2
    assert alloc.starving(K) == ("B",)
    # A's first run ends: A is lowered at once (sent before A hears of the end)
    assert alloc.run_ended("A", K) == [Grant("A", K, 1, 0, 3)]
    # A applied it but had not heard the end yet: it still uses 2, B waits
    assert alloc.report("A", K, waiting=3, in_use=2, serial=3) == []
    assert alloc.granted("A", K) == 1  # and A's grant is not raised again
    # A heard the end: the slot is B's
    assert alloc.report("A", K, waiting=3, in_use=1, serial=3) == [Grant("B", K, 1, 0, 4)]
    assert [alloc.held(e, K) for e in "AB"] == [1, 1]
    assert alloc.starving(K) == ("B",)  # until it uses its slot
    assert alloc.report("B", K, waiting=0, in_use=1, serial=4) == []
    assert alloc.starving(K) == ()


def test_with_one_slot_the_edges_take_turns_longest_starved_first() -> None:
    alloc = Allocator({K: (1, 0)})
    for edge in "ABC":
        alloc.join(edge)
    serial = {"A": 1, "B": 2, "C": 3}
    # A has the slot and runs; then B, then C start waiting
    assert alloc.run_started("A", K)
    alloc.report("A", K, waiting=5, in_use=1, serial=serial["A"])
    alloc.report("B", K, waiting=5, in_use=0, serial=serial["B"])
    alloc.report("C", K, waiting=5, in_use=0, serial=serial["C"])
    assert alloc.starving(K) == ("B", "C")
    holder, turns = "A", []
    for _ in range(5):
        [lowered] = alloc.run_ended(holder, K)
        assert (lowered.edge, lowered.slots) == (holder, 0)
        [raised] = alloc.report(holder, K, waiting=5, in_use=0, serial=lowered.serial)
        assert raised.slots == 1
        holder = raised.edge
        turns.append(holder)
        assert alloc.run_started(holder, K)
        alloc.report(holder, K, waiting=4, in_use=1, serial=raised.serial)
    assert turns == ["B", "C", "A", "B", "C"]


def test_leave_frees_at_once_and_ignores_the_gone_edge_later() -> None:
    alloc = Allocator({K: (2, 0)})
    alloc.join("A")
    joined = alloc.join("B")
    confirm(alloc, "A", joined, in_use=1)
    assert alloc.run_started("A", K)
    assert sent(alloc.leave("A")) == [("B", K, 2)]  # no confirmation to wait for
    assert alloc.edges() == frozenset({"B"})
    assert alloc.leave("A") == []
    assert alloc.report("A", K, waiting=1, in_use=0, serial=9) == []
    assert not alloc.run_started("A", K)
    assert alloc.run_ended("A", K) == []
    assert (alloc.granted("A", K), alloc.held("A", K), alloc.runs("A", K)) == (0, 0, 0)


def test_lowered_slots_shrink_the_idle_grants_and_nothing_grows_until_they_fit() -> None:
    alloc = Allocator({K: (4, 0)})
    alloc.join("A")
    joined = alloc.join("B")
    # A uses two, so the two nobody uses are spread: one each
    assert sent(confirm(alloc, "A", joined, in_use=2)) == [("A", K, 3), ("B", K, 1)]
    assert alloc.run_started("A", K)
    assert alloc.run_started("A", K)
    # down to 1 slot: A keeps its two runs, B's idle grant goes
    lowered = alloc.set_capacity(K, 1, 0)
    assert sent(lowered) == [("A", K, 2), ("B", K, 0)]
    assert alloc.report("B", K, waiting=1, in_use=0, serial=lowered[1].serial) == []
    assert confirm(alloc, "A", lowered, waiting=0, in_use=2) == []
    assert sum(alloc.held(e, K) for e in "AB") == 2  # over the 1 slot, until A's runs end
    ended = alloc.run_ended("A", K)
    assert sent(ended) == [("A", K, 1)]
    assert confirm(alloc, "A", ended, in_use=1) == []  # 1 held, 1 slot: B does not grow
    ended = alloc.run_ended("A", K)
    assert sent(ended) == [("A", K, 0)]
    assert sent(confirm(alloc, "A", ended)) == [("B", K, 1)]


def test_raised_slots_and_a_new_key_are_granted_at_once() -> None:
    alloc = Allocator({K: (2, 0)})
    alloc.join("A")
    joined = alloc.join("B")
    confirm(alloc, "A", joined)
    assert [alloc.granted(e, K) for e in "AB"] == [1, 1]
    raised = alloc.set_capacity(K, 4, 2)
    assert sorted((g.edge, g.slots, g.long_context_slots) for g in raised) == [
        ("A", 2, 1),
        ("B", 2, 1),
    ]
    added = alloc.set_capacity(K2, 3, 0)  # a grant of the new key for each edge
    assert sorted(sent(added)) == [("A", K2, 2), ("B", K2, 1)]
    # only the long-context part changed: sent again, in proportion
    more_long = alloc.set_capacity(K2, 3, 3)
    assert sorted((g.edge, g.slots, g.long_context_slots) for g in more_long) == [
        ("A", 2, 2),
        ("B", 1, 1),
    ]


def test_a_refused_run_counts_nothing() -> None:
    alloc = Allocator({K: (1, 0)})
    alloc.join("A")
    alloc.join("B")
    assert not alloc.run_started("B", K)  # B holds no slot
    assert alloc.runs("B", K) == 0
    assert alloc.run_started("A", K)
    assert not alloc.run_started("A", K)  # beyond A's one slot
    assert alloc.runs("A", K) == 1
    assert not alloc.run_started("A", K2)  # a key the node does not have


def test_a_report_on_another_key_does_not_confirm_this_one() -> None:
    alloc = Allocator({K: (2, 0), K2: (2, 0)})
    alloc.join("A")
    joined = alloc.join("B")
    latest = max(g.serial for g in joined)
    alloc.report("A", K2, waiting=0, in_use=0, serial=latest)
    assert alloc.held("A", K) == 2  # A's report on K2 says nothing of what it uses of K
    alloc.report("A", K, waiting=0, in_use=0, serial=latest)
    assert alloc.held("A", K) == 1


def test_a_report_never_raises_what_the_node_counts() -> None:
    alloc = Allocator({K: (2, 0)})
    alloc.join("A")
    joined = alloc.join("B")
    confirm(alloc, "A", joined)
    assert alloc.report("B", K, waiting=-3, in_use=9, serial=4) == []
    assert alloc.held("B", K) == 1


def test_a_name_joined_twice_and_negative_slots_are_refused() -> None:
    alloc = Allocator({K: (1, 0)})
    alloc.join("A")
    with pytest.raises(ValueError, match="already joined"):
        alloc.join("A")
    with pytest.raises(ValueError, match="0 or more"):
        alloc.set_capacity(K, -1, 0)
    with pytest.raises(ValueError, match="0 or more"):
        Allocator({K: (1, -1)})


def test_a_session_back_under_the_same_name_is_not_confirmed_by_old_serials() -> None:
    alloc = Allocator({K: (2, 0)})
    alloc.join("A")
    alloc.join("B")
    alloc.leave("A")
    [again] = [g for g in alloc.join("A") if g.edge == "A"]
    assert again.serial > 3  # serials never repeat
    alloc.report("A", K, waiting=0, in_use=0, serial=1)  # a late report of the old session
    assert alloc.held("A", K) == again.slots


# --------------------------------------------------------------------------- water_fill


def test_water_fill() -> None:
    assert water_fill(4, []) == []
    assert water_fill(4, [(0, 0)]) == [4]  # one edge gets every slot
    assert water_fill(4, [(0, 0), (0, 0)]) == [2, 2]
    assert water_fill(4, [(0, 3), (0, 0)]) == [3, 1]  # the slot left goes to the one with least
    assert water_fill(6, [(0, 1), (0, 9), (0, 9)]) == [1, 3, 2]  # the first favoured
    assert water_fill(2, [(0, 1), (0, 1), (0, 1)]) == [1, 1, 0]
    assert water_fill(2, [(2, 5), (0, 1)]) == [2, 0]  # a run is never taken back
    assert water_fill(1, [(2, 5), (0, 1)]) == [2, 0]  # floors over the slots: floors


@given(
    slots=st.integers(0, 20),
    wants=st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 12)).map(lambda w: (w[0], max(w))),
        max_size=6,
    ),
)
def test_water_fill_is_max_min_fair_above_the_floors(
    slots: int, wants: list[tuple[int, int]]
) -> None:
    shares = water_fill(slots, wants)
    assert len(shares) == len(wants)
    if not wants:
        return
    floors = [f for f, _ in wants]
    assert all(s >= f for s, f in zip(shares, floors, strict=True))
    if sum(floors) >= slots:
        assert shares == floors
        return
    assert sum(shares) == slots
    demands = [d for _, d in wants]
    if sum(demands) <= slots:
        assert all(s >= d for s, d in zip(shares, demands, strict=True))
        assert (
            max(s - d for s, d in zip(shares, demands, strict=True))
            - min(s - d for s, d in zip(shares, demands, strict=True))
            <= 1
        )
        return
    assert all(s <= max(f, d) for s, (f, d) in zip(shares, wants, strict=True))
    for i, (share, demand) in enumerate(zip(shares, demands, strict=True)):
        if share < demand:  # short: nobody above its floor has more than one slot more
            for j, other in enumerate(shares):
                assert other <= share + 1 or other == floors[j], (i, j)
                if other == share + 1 and other > floors[j]:
                    assert j < i  # the extra slot went to the more favoured
