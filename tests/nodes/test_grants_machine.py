"""A Hypothesis state machine over the node's slot allocator (``nodes.grants``), with the
wire's delays modelled.

A node with two keys and up to three edge sessions at a time. Per edge, a FIFO of what the
node sent it (grants, "your run ended") and a FIFO of what it sent the node (reports, run
starts, run stops); one rule delivers the next message of one FIFO, so every interleaving
the wire allows is tried. A well-behaved edge keeps to the last grant it received (it admits
a waiter only while its in-use count is below that grant), reports each change of its
waiting or in-use counts and each grant it applies, echoing the last serial it applied.
Requests arrive and leave; an admitted request is sent to the node at once or later, or its
client leaves before it is sent (the edge's in-use count drops, the node never sees a run);
a run ends on the node (the node first sends the grants that returns, then "ended"), or the
edge stops it (its in-use count drops at once, the node hears after). Edges join and leave
(their late messages still arrive, and must be ignored); the operator changes a key's
slots. Some edges are hostile: they report what they like and start runs regardless.

Invariants, after every step:

* safety: for each key, the sum of what the node counts the edges as holding is at most its
  slots (after a lowering of the slots below that, it never grows until it fits again), and
  so is the sum of runs; each edge's runs are at most what it holds; a call that raises a
  grant leaves the key's held slots within its slots;
* the node never under-counts a well-behaved edge: what it holds is at least what the edge
  really uses (admitted, sent or not, not yet told ended) -- so it is never refused, which
  every run start asserts;
* no grant to an edge that left; serials increase per edge; the allocator's views agree
  with what was sent and what the node runs;
* the starving edges are listed in the order they started starving.

When nothing is in flight (and no hostile edge is connected), also: the node's view is the
edges' (held = max(grant, in use), runs = in use); every slot of a key is granted (held
adds up to exactly its slots) unless the runs alone exceed them; work conservation (free
slots and a waiting edge: some waiting edge may admit); each edge's long-context part is in
proportion to its grant; the starving edges are exactly the ones with waiters and no slot in
use. Fairness: from such a quiet state, with an edge starving on a key, a run of that key ends
anywhere and everything is delivered with the edges admitting as soon as they may: the
longest-starved edge has a slot.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

import attrs
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nodes.grants import Allocator, EdgeId, Grant, Key

KEYS: tuple[Key, ...] = (("p", "a"), ("p", "b"))
MAX_EDGES = 3
MAX_WAITING = 5
SETTLE_ROUNDS = 50
"""Rounds of delivering everything in flight after which the grants must have settled."""


@attrs.frozen
class Ended:
    """Node -> edge: a run ended on the node."""

    key: Key
    run: int


@attrs.frozen
class Report:
    key: Key
    waiting: int
    in_use: int
    serial: int


@attrs.frozen
class Start:
    key: Key
    run: int


@attrs.frozen
class Stop:
    """Edge -> node: the edge stopped a run (it no longer counts it)."""

    key: Key
    run: int


@attrs.define(eq=False)
class MEdge:
    id: EdgeId
    hostile: bool
    to_edge: collections.deque[Grant | Ended] = attrs.Factory(collections.deque)
    to_node: collections.deque[Report | Start | Stop] = attrs.Factory(collections.deque)
    applied: int = 0
    grant: dict[Key, int] = attrs.Factory(lambda: dict.fromkeys(KEYS, 0))
    long_context: dict[Key, int] = attrs.Factory(lambda: dict.fromkeys(KEYS, 0))
    waiting: dict[Key, int] = attrs.Factory(lambda: dict.fromkeys(KEYS, 0))
    in_use: dict[Key, int] = attrs.Factory(lambda: dict.fromkeys(KEYS, 0))
    unsent: dict[Key, list[int]] = attrs.Factory(lambda: {key: [] for key in KEYS})
    live: dict[Key, set[int]] = attrs.Factory(lambda: {key: set() for key in KEYS})
    """Runs sent to the node that the edge has not heard (or decided) the end of."""

    def report(self, key: Key) -> None:
        self.to_node.append(Report(key, self.waiting[key], self.in_use[key], self.applied))


class GrantsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = Allocator({})
        self.slots: dict[Key, int] = {}
        self.long_context: dict[Key, int] = {}
        self.edges: dict[EdgeId, MEdge] = {}
        self.gone: dict[EdgeId, MEdge] = {}
        self.names = itertools.count()
        self.run_ids = itertools.count()
        self.node_runs: dict[int, tuple[EdgeId, Key]] = {}
        self.sent: dict[tuple[EdgeId, Key], int] = {}
        self.last_serial: dict[EdgeId, int] = {}
        self.over: dict[Key, bool] = {}
        self.calls = itertools.count()
        self.starving_since: dict[tuple[EdgeId, Key], int] = {}

    @initialize(slots=st.tuples(st.integers(0, 4), st.integers(0, 4)), edges=st.integers(1, 3))
    def start(self, slots: tuple[int, int], edges: int) -> None:
        self.slots = dict(zip(KEYS, slots, strict=True))
        self.long_context = {key: n // 2 for key, n in self.slots.items()}
        self.alloc = Allocator({key: (n, n // 2) for key, n in self.slots.items()})
        self.over = dict.fromkeys(KEYS, False)
        for _ in range(edges):
            self.join(hostile=False)

    # ------------------------------------------------------------------ the node

    def held(self, key: Key) -> int:
        return sum(self.alloc.held(edge, key) for edge in self.edges)

    def decide(self, call: Callable[[], list[Grant]]) -> list[Grant]:
        """One allocator event, its grants checked and put on the wire."""
        before = {key: self.held(key) for key in KEYS}
        granted = {
            (edge, key): self.alloc.granted(edge, key) for edge in self.edges for key in KEYS
        }
        grants = call()
        for key in KEYS:
            after = self.held(key)
            assert after <= max(self.slots[key], before[key]), (key, before[key], after)
        for grant in grants:
            assert grant.edge in self.edges, f"a grant for {grant.edge}, which left"
            assert grant.serial > self.last_serial.get(grant.edge, 0)
            self.last_serial[grant.edge] = grant.serial
            if grant.slots > granted.get((grant.edge, grant.key), 0):
                assert self.held(grant.key) <= self.slots[grant.key], grant
            slots, long_context = self.slots[grant.key], self.long_context[grant.key]
            assert grant.long_context_slots == (
                0 if slots == 0 else min(grant.slots, long_context * grant.slots // slots)
            )
            self.sent[grant.edge, grant.key] = grant.slots
            edge = self.edges[grant.edge]
            if not edge.hostile:
                edge.to_edge.append(grant)
        self.observe_starving()
        return grants

    def observe_starving(self) -> None:
        now = next(self.calls)
        for key in KEYS:
            starving = self.alloc.starving(key)
            for edge in self.edges:
                if edge in starving:
                    self.starving_since.setdefault((edge, key), now)
                else:
                    self.starving_since.pop((edge, key), None)
            since = [self.starving_since[edge, key] for edge in starving]
            assert since == sorted(since), (key, starving, since)

    def end_on_node(self, run: int) -> None:
        edge_id, key = self.node_runs.pop(run)
        self.decide(lambda: self.alloc.run_ended(edge_id, key))
        self.edges[edge_id].to_edge.append(Ended(key, run))

    def deliver_to_node(self, edge: MEdge) -> None:
        message = edge.to_node.popleft()
        if edge.id not in self.edges:  # late: the session is gone
            if isinstance(message, Report):
                assert (
                    self.alloc.report(
                        edge.id,
                        message.key,
                        waiting=message.waiting,
                        in_use=message.in_use,
                        serial=message.serial,
                    )
                    == []
                )
            elif isinstance(message, Start):
                assert not self.alloc.run_started(edge.id, message.key)
            else:
                assert self.alloc.run_ended(edge.id, message.key) == []
            return
        match message:
            case Report(key, waiting, in_use, serial):
                self.decide(
                    lambda: self.alloc.report(
                        edge.id, key, waiting=waiting, in_use=in_use, serial=serial
                    )
                )
            case Start(key, run):
                assert self.alloc.run_started(edge.id, key), (
                    f"{edge.id} refused on {key}: held {self.alloc.held(edge.id, key)}, "
                    f"runs {self.alloc.runs(edge.id, key)}"
                )
                self.node_runs[run] = (edge.id, key)
            case Stop(key, run):
                if run in self.node_runs:  # else the node had ended it already
                    del self.node_runs[run]
                    self.decide(lambda: self.alloc.run_ended(edge.id, key))

    # ------------------------------------------------------------------ an edge

    def deliver_to_edge(self, edge: MEdge, *, greedy: bool = False) -> None:
        message = edge.to_edge.popleft()
        match message:
            case Grant(_, key, slots, long_context, serial):
                edge.grant[key] = slots
                edge.long_context[key] = long_context
                edge.applied = serial
                edge.report(key)
            case Ended(key, run):
                if run not in edge.live[key]:  # it stopped the run itself
                    return
                edge.live[key].remove(run)
                edge.in_use[key] -= 1
                edge.report(key)
        if greedy:
            while edge.waiting[key] > 0 and edge.in_use[key] < edge.grant[key]:
                self.admit_one(edge, key, send=True)

    def admit_one(self, edge: MEdge, key: Key, *, send: bool) -> None:
        edge.waiting[key] -= 1
        edge.in_use[key] += 1
        run = next(self.run_ids)
        if send:
            edge.live[key].add(run)
            edge.to_node.append(Start(key, run))
        else:
            edge.unsent[key].append(run)
        edge.report(key)

    def deliver_everything(self, *, greedy: bool) -> None:
        for _ in range(SETTLE_ROUNDS):
            if not any(edge.to_node or edge.to_edge for edge in self.edges.values()):
                return
            for edge in list(self.edges.values()):
                while edge.to_node:
                    self.deliver_to_node(edge)
                if edge.id in self.edges:
                    while edge.to_edge:
                        self.deliver_to_edge(edge, greedy=greedy)
        raise AssertionError(f"the grants do not settle in {SETTLE_ROUNDS} rounds")

    def good_edges(self) -> list[MEdge]:
        return [edge for edge in self.edges.values() if not edge.hostile]

    def quiet(self) -> bool:
        return not any(edge.hostile for edge in self.edges.values()) and not any(
            edge.to_edge or edge.to_node or any(edge.unsent.values())
            for edge in self.edges.values()
        )

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.edges) < MAX_EDGES)
    @rule(hostile=st.sampled_from([False, False, False, True]))
    def join(self, hostile: bool) -> None:
        edge = MEdge(f"e{next(self.names)}", hostile)
        self.edges[edge.id] = edge
        granted = self.decide(lambda: self.alloc.join(edge.id))
        assert sorted(g.key for g in granted if g.edge == edge.id) == sorted(KEYS)

    @precondition(lambda self: self.edges)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        edge = self.edges.pop(data.draw(st.sampled_from(sorted(self.edges))))
        self.node_runs = {r: (e, k) for r, (e, k) in self.node_runs.items() if e != edge.id}
        edge.to_edge.clear()
        self.gone[edge.id] = edge
        self.decide(lambda: self.alloc.leave(edge.id))
        assert self.alloc.leave(edge.id) == []

    def in_flight(self) -> list[tuple[str, MEdge]]:
        """Every FIFO with a message in it: to the node, to an edge, or late (its edge left)."""
        return [
            *(("node", e) for e in self.edges.values() if e.to_node),
            *(("edge", e) for e in self.edges.values() if e.to_edge),
            *(("late", e) for e in self.gone.values() if e.to_node),
        ]

    @precondition(lambda self: self.in_flight())
    @rule(data=st.data())
    def one_message_arrives(self, data: st.DataObject) -> None:
        way, edge = data.draw(st.sampled_from(self.in_flight()))
        if way == "edge":
            self.deliver_to_edge(edge)
        else:
            self.deliver_to_node(edge)

    def send_everything(self) -> None:
        for edge in self.good_edges():
            for key in KEYS:
                while edge.unsent[key]:
                    self.send_one(edge, key)

    @precondition(lambda self: self.edges)
    @rule()
    def everything_in_flight_arrives(self) -> None:
        self.send_everything()
        self.deliver_everything(greedy=False)

    @precondition(lambda self: self.good_edges())
    @rule(data=st.data(), key=st.sampled_from(KEYS), arrives=st.booleans())
    def a_request_arrives_or_leaves(self, data: st.DataObject, key: Key, arrives: bool) -> None:
        edge = data.draw(st.sampled_from(self.good_edges()))
        if arrives and edge.waiting[key] < MAX_WAITING:
            edge.waiting[key] += 1
            edge.report(key)
        elif not arrives and edge.waiting[key] > 0:
            edge.waiting[key] -= 1
            edge.report(key)

    def admissible(self) -> list[tuple[MEdge, Key]]:
        """Where a well-behaved edge may admit: a waiter, and fewer in use than its grant."""
        return [
            (e, k)
            for e in self.good_edges()
            for k in KEYS
            if e.waiting[k] and e.in_use[k] < e.grant[k]
        ]

    @precondition(lambda self: self.admissible())
    @rule(data=st.data(), send=st.booleans())
    def the_edge_admits_a_waiter(self, data: st.DataObject, send: bool) -> None:
        edge, key = data.draw(st.sampled_from(self.admissible()))
        self.admit_one(edge, key, send=send)

    def send_one(self, edge: MEdge, key: Key) -> None:
        run = edge.unsent[key].pop(0)
        edge.live[key].add(run)
        edge.to_node.append(Start(key, run))

    def unsent(self) -> list[tuple[MEdge, Key]]:
        return [(e, k) for e in self.good_edges() for k in KEYS if e.unsent[k]]

    @precondition(lambda self: self.unsent())
    @rule(data=st.data(), client_left=st.booleans())
    def an_admitted_request_is_sent_or_its_client_leaves(
        self, data: st.DataObject, client_left: bool
    ) -> None:
        edge, key = data.draw(st.sampled_from(self.unsent()))
        if client_left:  # the node never sees this run
            edge.unsent[key].pop(0)
            edge.in_use[key] -= 1
            edge.report(key)
        else:
            self.send_one(edge, key)

    def runs_to_end(self) -> list[tuple[str, MEdge | None, Key | None, int]]:
        return [
            *(("node", None, None, run) for run in sorted(self.node_runs)),
            *(
                ("edge", e, k, r)
                for e in self.good_edges()
                for k in KEYS
                for r in sorted(e.live[k])
            ),
        ]

    @precondition(lambda self: self.runs_to_end())
    @rule(data=st.data())
    def a_run_ends(self, data: st.DataObject) -> None:
        """On the node (it sends the grants, then "ended"), or the edge stops it (it stops
        counting it at once; the node hears later)."""
        where, edge, key, run = data.draw(st.sampled_from(self.runs_to_end()))
        if where == "node":
            self.end_on_node(run)
            return
        assert edge is not None
        assert key is not None
        edge.live[key].remove(run)
        edge.in_use[key] -= 1
        edge.to_node.append(Stop(key, run))
        edge.report(key)

    @rule(key=st.sampled_from(KEYS), slots=st.integers(0, 5), long_context=st.integers(0, 6))
    def the_operator_changes_the_slots(self, key: Key, slots: int, long_context: int) -> None:
        self.slots[key] = slots
        self.long_context[key] = long_context
        self.decide(lambda: self.alloc.set_capacity(key, slots, long_context))
        self.over[key] = self.held(key) > slots
        if self.over[key]:
            event("slots lowered below what is held")

    @precondition(lambda self: any(e.hostile for e in self.edges.values()))
    @rule(
        data=st.data(),
        key=st.sampled_from(KEYS),
        start=st.booleans(),
        waiting=st.integers(-1, 9),
        in_use=st.integers(-1, 9),
        serial_ahead=st.integers(-3, 3),
    )
    def a_hostile_edge_reports_or_starts_a_run(
        self,
        data: st.DataObject,
        key: Key,
        start: bool,
        waiting: int,
        in_use: int,
        serial_ahead: int,
    ) -> None:
        edge = data.draw(st.sampled_from([e for e in self.edges.values() if e.hostile]))
        if start:
            if self.alloc.run_started(edge.id, key):
                self.node_runs[next(self.run_ids)] = (edge.id, key)
            else:
                event("a hostile edge's run refused")
            return
        serial = self.last_serial.get(edge.id, 0) + serial_ahead
        self.decide(
            lambda: self.alloc.report(edge.id, key, waiting=waiting, in_use=in_use, serial=serial)
        )

    def fairness_case(self) -> list[Key]:
        """The keys with an edge starving, a run, and no more runs than slots."""
        return [
            key
            for key in KEYS
            if self.alloc.starving(key)
            and 0 < sum(k == key for _, k in self.node_runs.values()) <= self.slots[key]
        ]

    def admit_all_they_may(self) -> None:
        for edge, key in self.admissible():
            while edge.waiting[key] > 0 and edge.in_use[key] < edge.grant[key]:
                self.admit_one(edge, key, send=True)

    @precondition(lambda self: self.edges and not any(e.hostile for e in self.edges.values()))
    @rule(data=st.data(), crowd=st.sampled_from([None, *KEYS]))
    def a_run_ends_and_the_longest_starved_gets_its_slot(
        self, data: st.DataObject, crowd: Key | None
    ) -> None:
        """Fairness: all quiet, the edges admitting as soon as they may; a run of a key with
        an edge starving ends; once everything is delivered, the longest-starved edge runs.
        (``crowd``: first, requests arrive at every edge for that key.)"""
        if crowd is not None:
            for edge in self.edges.values():
                edge.waiting[crowd] = MAX_WAITING
                edge.report(crowd)
        self.send_everything()
        self.admit_all_they_may()
        self.deliver_everything(greedy=True)
        assert self.quiet()
        if not self.fairness_case():
            event("fairness: no run to end")
            return
        key = data.draw(st.sampled_from(self.fairness_case()))
        longest = self.alloc.starving(key)[0]
        runs = sorted(r for r, (_, k) in self.node_runs.items() if k == key)
        self.end_on_node(data.draw(st.sampled_from(runs)))
        self.deliver_everything(greedy=True)
        assert self.edges[longest].in_use[key] >= 1, (longest, key)
        event("fairness: the longest-starved edge got the freed slot")

    # ------------------------------------------------------------------ invariants

    @invariant()
    def safety(self) -> None:
        assert self.alloc.edges() == frozenset(self.edges)
        for key in KEYS:
            held = self.held(key)
            if held <= self.slots[key]:
                self.over[key] = False
            assert held <= self.slots[key] or self.over[key], (key, held, self.slots[key])
            runs = sum(self.alloc.runs(edge, key) for edge in self.edges)
            assert runs <= self.slots[key] or self.over[key], (key, runs)
            for edge in self.edges.values():
                node_runs = [r for r, (e, k) in self.node_runs.items() if (e, k) == (edge.id, key)]
                assert self.alloc.runs(edge.id, key) == len(node_runs)
                assert self.alloc.runs(edge.id, key) <= self.alloc.held(edge.id, key)
                assert self.alloc.granted(edge.id, key) == self.sent.get((edge.id, key), 0)
                if not edge.hostile:
                    assert self.alloc.held(edge.id, key) >= edge.in_use[key], (
                        f"{edge.id} may use {edge.in_use[key]} of {key}, "
                        f"the node counts {self.alloc.held(edge.id, key)}"
                    )

    @invariant()
    def when_quiet(self) -> None:
        if not self.quiet():
            return
        event("quiet")
        for key in KEYS:
            slots = self.slots[key]
            runs = 0
            for edge in self.edges.values():
                granted = self.alloc.granted(edge.id, key)
                assert edge.grant[key] == granted
                assert edge.long_context[key] == (
                    0 if slots == 0 else min(granted, self.long_context[key] * granted // slots)
                )
                assert edge.in_use[key] == self.alloc.runs(edge.id, key)
                assert self.alloc.held(edge.id, key) == max(granted, edge.in_use[key])
                runs += edge.in_use[key]
            if self.edges and runs <= slots:
                assert self.held(key) == slots, (key, self.held(key), slots)
            waiting = [e for e in self.edges.values() if e.waiting[key]]
            if runs < slots and waiting:
                assert any(e.grant[key] > e.in_use[key] for e in waiting), key
            starving = {e.id for e in waiting if e.in_use[key] == 0}
            assert set(self.alloc.starving(key)) == starving
            if starving:
                event("quiet, with an edge starving")


TestGrants = GrantsMachine.TestCase
TestGrants.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
