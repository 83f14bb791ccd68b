"""A node's slots shared between the edges it dials: who may use how many, sans-IO.

A node that dials several edges owns each provider model's slots once, not once per edge. It
arbitrates them itself: every edge session gets, per key (``provider_id``, ``model``), a
**grant** -- a ``capacity`` message telling that edge how many of the key's slots it may fill
-- and the grants of a key never promise more than the key has. The :class:`Allocator` decides
the grants; the node's sessions carry them (nothing here sends, waits or reads a clock: each
method takes one event and returns the :class:`Grant`\\ s to send now, in order). A grant's
``long_context_slots`` are the key's in proportion (a soft split; the slots are the bound).

**Demand.** Each edge tells the node, per key, how many requests wait for it there
(``waiting``) and how many slots it uses (``in_use``: admitted, whether or not the node has
seen the run yet), echoing the ``serial`` of the last grant it applied
(:meth:`Allocator.report`). The node shares a key's slots out by demand (what the edge uses
plus what waits), max-min fair: no edge gets more than it asks while another gets less than it
asks, and a grant is never lowered below what its edge uses (a run is never taken back). Slots
nobody asks for are granted too, spread evenly over the edges, so a node with one edge grants
it everything (as before there were grants) and an idle edge can start its first request
without asking first. When there are fewer slots than edges that want one, the edge that has
waited longest with no slot in use gets the next one that frees, and the one that got its slot
longest ago gives it up first: the edges take turns, none starves. A slot granted and not yet
filled is not taken back for an edge that started waiting later.

**A grant that grows counts at once; one that shrinks counts only once the edge confirms
it.** Messages cross on the wire: when the node lowers an edge's grant, the edge may already
have admitted requests under the old one whose ``run.request`` is still on its way. So the
node keeps counting that edge as possibly using what the old grant allowed
(:meth:`Allocator.held`) until a report of the edge's on that key echoes the lowering grant's
serial (or a later one); from then on it counts the largest of the latest grant, what the
edge's last report says it uses and the runs the node sees. Only slots nobody may be holding
are granted to another edge: what the node counts for the edges of a key never adds up to more
than its slots (except after the operator lowers a key's slots below what is in use: then no
grant grows until enough runs end). A run the node receives beyond what it counts for that edge
is refused (:meth:`Allocator.run_started` says False): an edge that keeps to the grants it
received and reports honestly never is, whatever the delays; one that does not cannot take
another edge's slots (nor can its reports: one never raises what the node counts for it).

**What the node's sessions must do.** Send each edge its grants in the order returned (their
serials increase, over all keys, and never repeat: they come from one counter, so a session
that returns under the same name never confirms with an old serial). Send the grants
:meth:`Allocator.run_ended` returns before telling the edge the run ended, so an edge whose
grant was lowered learns it before it sees the slot free (else it may refill the slot once
more before giving it up: safe, only later). The edge reports a key each time its waiting or
in-use count changes and after applying each capacity message for that key: a lowered grant
is freed for the other edges by that report alone. Events of an edge that has left (or of a
key the node does not have) are ignored, so the sessions may race with :meth:`Allocator.leave`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

Key = tuple[str, str]
"""One provider model: (``provider_id``, ``model``)."""
EdgeId = str
"""The node's name for one edge session (e.g. the edge's URL)."""


@attrs.frozen
class Grant:
    """One ``capacity`` message to send to ``edge``: it may use ``slots`` of ``key``'s slots,
    ``long_context_slots`` of them for long prompts."""

    edge: EdgeId
    key: Key
    slots: int
    long_context_slots: int
    serial: int
    """Increasing per edge, over all keys: the edge echoes the last one it applied."""


def water_fill(slots: int, wants: Sequence[tuple[int, int]]) -> list[int]:
    """``slots`` shared out over ``wants``, each (floor, demand), most favoured first.

    Max-min fair by demand, never below a floor: each gets ``max(floor, min(demand, level))``
    for the highest level that fits, and the slots left at that level go one each to the most
    favoured of those that want more. When the demands fit, each gets its demand and what is
    left is spread evenly (one more each to the ones with least, the most favoured first).
    When the floors alone fill the slots (or more), each gets its floor."""
    count = len(wants)
    if count == 0:
        return []
    floors = [floor for floor, _ in wants]
    demands = [max(floor, demand) for floor, demand in wants]
    if sum(floors) >= slots:
        return floors
    if sum(demands) <= slots:
        each, rest = divmod(slots - sum(demands), count)
        shares = [demand + each for demand in demands]
        for index in sorted(range(count), key=lambda i: (shares[i], i))[:rest]:
            shares[index] += 1
        return shares

    def filled(level: int) -> int:
        return sum(max(f, min(d, level)) for f, d in zip(floors, demands, strict=True))

    low, high = 0, max(demands)  # filled(low) < slots < filled(high)
    while high - low > 1:
        middle = (low + high) // 2
        if filled(middle) <= slots:
            low = middle
        else:
            high = middle
    shares = [max(f, min(d, low)) for f, d in zip(floors, demands, strict=True)]
    rest = slots - sum(shares)
    for index in range(count):
        if rest == 0:
            break
        if floors[index] <= low < demands[index]:
            shares[index] += 1
            rest -= 1
    return shares


@attrs.define(eq=False)
class _Sent:
    """A grant sent to one edge for one key, while it may still be in force there."""

    serial: int
    slots: int
    superseded: int | None = None
    """The serial of the next grant sent for the key (None: this is the latest)."""


@attrs.define(eq=False)
class _Share:
    """One edge's part of one key's slots, as the node knows it."""

    order: int
    """When the edge joined: the last tie-break."""
    since: int
    """When the edge last started or stopped starving (its join at first)."""
    granted: int = 0
    long_context: int = 0
    announced: bool = False
    sent: list[_Sent] = attrs.Factory(list)
    """The grants the edge may be applying: the one in force at its last report on the key
    and every later one -- only those that were larger than all sent after them (the max is
    what counts), so at most one per grant size."""
    reported: int = 0
    """``in_use`` from the edge's last report on the key (never more than the node counted
    for it then)."""
    in_use: int = 0
    """``reported``, less the runs that ended since: the node's guess of what the edge uses."""
    waiting: int = 0
    runs: int = 0
    starving: bool = False

    @property
    def held(self) -> int:
        return max(self.sent[0].slots if self.sent else 0, self.reported, self.runs)

    @property
    def floor(self) -> int:
        """What a grant is never lowered below: the runs the node sees, what the edge uses."""
        return max(self.runs, self.in_use)

    @property
    def demand(self) -> int:
        return self.floor + self.waiting

    def send(self, serial: int, slots: int, long_context: int) -> None:
        if self.sent:
            self.sent[-1].superseded = serial
        while self.sent and self.sent[-1].slots <= slots:
            self.sent.pop()
        self.sent.append(_Sent(serial, slots))
        self.granted = slots
        self.long_context = long_context
        self.announced = True

    def applied(self, serial: int) -> None:
        """The edge applied the grants up to ``serial``: the ones superseded by then are
        no longer in force."""
        while self.sent and self.sent[0].superseded is not None:
            if self.sent[0].superseded > serial:
                break
            del self.sent[0]

    def priority(self) -> tuple[int, int, int, int]:
        """Most favoured first: the longest starving; then the one granted most now (a
        settled split stays put); then the one that got its slot most recently (the longest
        served gives way first); then the one that joined first."""
        if self.starving:
            return (0, 0, self.since, self.order)
        return (1, -self.granted, -self.since, self.order)


class Allocator:
    """The grants of one node's slots to its edge sessions (the module docstring is the
    protocol). Each event method returns the grants to send now: only the ones that
    changed, and all of a new edge's (one per key, even 0). An edge the allocator does not
    know (it left, or never joined) is ignored: its report and run events return ``[]`` /
    ``False``, so the caller may race with :meth:`leave`; so is a key it does not have."""

    def __init__(self, capacity: Mapping[Key, tuple[int, int]]) -> None:
        for key, (slots, long_context_slots) in capacity.items():
            _check_capacity(key, slots, long_context_slots)
        self._capacity: dict[Key, tuple[int, int]] = dict(capacity)
        self._edges: dict[EdgeId, dict[Key, _Share]] = {}
        self._order: dict[EdgeId, int] = {}
        """When each edge joined: the last tie-break."""
        self._serial = 0
        self._clock = 0
        self._joined = 0

    # ------------------------------------------------------------------ events

    def join(self, edge: EdgeId) -> list[Grant]:
        """A new edge session: its first grants, one per key (even 0), and the others'
        grants that make room for it. A name already joined is the caller's mistake."""
        if edge in self._edges:
            raise ValueError(
                f"edge {edge!r} has already joined the node's allocator: leave it before a "
                "new session joins under the same name"
            )
        self._clock += 1
        self._joined += 1
        self._order[edge] = self._joined
        self._edges[edge] = {key: self._new_share(edge) for key in self._capacity}
        out: list[Grant] = []
        for key in self._capacity:
            self._settle(key, out)
        return out

    def leave(self, edge: EdgeId) -> list[Grant]:
        """The edge's session is gone: what it held is free at once, and it is granted
        nothing more; the grants to the others that grow from it."""
        if self._edges.pop(edge, None) is None:
            return []
        del self._order[edge]
        self._clock += 1
        out: list[Grant] = []
        for key in self._capacity:
            self._settle(key, out)
        return out

    def report(
        self, edge: EdgeId, key: Key, *, waiting: int, in_use: int, serial: int
    ) -> list[Grant]:
        """The edge's demand on ``key``: ``waiting`` requests queued for it, ``in_use`` slots
        it holds (admitted, whether or not the node has seen the run yet), as of the grants
        it applied up to ``serial``. Negative counts are taken as 0; an ``in_use`` beyond
        what the node counts for the edge is taken as that."""
        share = self._share(edge, key)
        if share is None:
            return []
        self._clock += 1
        before = share.held
        share.applied(serial)
        share.reported = share.in_use = min(max(in_use, 0), before)
        share.waiting = max(waiting, 0)
        out: list[Grant] = []
        self._settle(key, out)
        return out

    def run_started(self, edge: EdgeId, key: Key) -> bool:
        """A ``run.request`` arrived. False: it is beyond what the node counts the edge as
        holding (the caller refuses it, a protocol error) and nothing is counted."""
        share = self._share(edge, key)
        if share is None or share.runs + 1 > share.held:
            return False
        share.runs += 1
        return True

    def run_ended(self, edge: EdgeId, key: Key) -> list[Grant]:
        """A run the node counted ended. Send what this returns before telling the edge."""
        share = self._share(edge, key)
        if share is None or share.runs == 0:
            return []
        self._clock += 1
        share.runs -= 1
        share.in_use = max(share.in_use - 1, 0)
        out: list[Grant] = []
        self._settle(key, out)
        return out

    def set_capacity(self, key: Key, slots: int, long_context_slots: int) -> list[Grant]:
        """The operator changed ``key``'s slots. A key the node did not have is added for
        every edge (each gets a grant for it, even 0). Below what is held, the grants shrink
        as runs end; none grows until the held slots fit again."""
        _check_capacity(key, slots, long_context_slots)
        self._clock += 1
        if key not in self._capacity:
            for edge, shares in self._edges.items():
                shares[key] = self._new_share(edge)
        self._capacity[key] = (slots, long_context_slots)
        out: list[Grant] = []
        self._settle(key, out)
        return out

    # ------------------------------------------------------------------ views

    def granted(self, edge: EdgeId, key: Key) -> int:
        """The latest grant sent to ``edge`` for ``key`` (0 for an unknown one)."""
        share = self._share(edge, key)
        return 0 if share is None else share.granted

    def held(self, edge: EdgeId, key: Key) -> int:
        """What the node counts ``edge`` as possibly using of ``key``: its latest grant, or
        a larger one it has not confirmed giving up; what it last reported using; its runs."""
        share = self._share(edge, key)
        return 0 if share is None else share.held

    def runs(self, edge: EdgeId, key: Key) -> int:
        share = self._share(edge, key)
        return 0 if share is None else share.runs

    def edges(self) -> frozenset[EdgeId]:
        return frozenset(self._edges)

    def starving(self, key: Key) -> tuple[EdgeId, ...]:
        """The edges with requests waiting for ``key`` and no slot of it in use, the longest
        starving first: the order in which they get the next slots. (One that was granted a
        slot stays on the list until it uses it: a slot granted and not yet filled is not
        taken back for an edge that started waiting later.)"""
        found = [
            (share.since, share.order, edge)
            for edge, shares in self._edges.items()
            if (share := shares.get(key)) is not None and share.starving
        ]
        return tuple(edge for _, _, edge in sorted(found))

    # ------------------------------------------------------------------ the decision

    def _share(self, edge: EdgeId, key: Key) -> _Share | None:
        shares = self._edges.get(edge)
        return None if shares is None else shares.get(key)

    def _new_share(self, edge: EdgeId) -> _Share:
        return _Share(order=self._order[edge], since=self._clock)

    def _settle(self, key: Key, out: list[Grant]) -> None:
        """Recompute ``key``'s targets and move the grants towards them safely: lower the
        ones above target (never below what the edge uses), then raise the ones below
        target, the most favoured first, with what the held slots leave free."""
        slots, _ = self._capacity[key]
        shares = [(edge, by_key[key]) for edge, by_key in self._edges.items()]
        self._mark(shares)
        ranked = sorted(shares, key=lambda pair: pair[1].priority())
        targets = water_fill(slots, [(share.floor, share.demand) for _, share in ranked])
        for (edge, share), target in zip(ranked, targets, strict=True):
            if share.granted > target:  # never below its floor: no target is
                self._send(edge, key, share, target, out)
        free = slots - sum(share.held for _, share in shares)
        for (edge, share), target in zip(ranked, targets, strict=True):
            if free <= 0:
                break
            if share.granted < target:
                held = share.held
                raised = min(target, held + free)
                free -= max(raised - held, 0)
                self._send(edge, key, share, raised, out)
        for edge, share in shares:
            if not share.announced or share.long_context != self._long_context(key, share.granted):
                self._send(edge, key, share, share.granted, out)

    def _mark(self, shares: list[tuple[EdgeId, _Share]]) -> None:
        """Which edges starve (requests waiting, no slot in use), and since when."""
        for _, share in shares:
            starving = share.waiting > 0 and share.floor == 0
            if starving != share.starving:
                share.starving = starving
                share.since = self._clock

    def _send(self, edge: EdgeId, key: Key, share: _Share, slots: int, out: list[Grant]) -> None:
        self._serial += 1
        long_context = self._long_context(key, slots)
        share.send(self._serial, slots, long_context)
        out.append(Grant(edge, key, slots, long_context, self._serial))

    def _long_context(self, key: Key, granted: int) -> int:
        """The grant's part of the key's long-context slots, in proportion (a soft
        partition: the hard bound is the slots)."""
        slots, long_context_slots = self._capacity[key]
        return 0 if slots == 0 else min(granted, long_context_slots * granted // slots)


def _check_capacity(key: Key, slots: int, long_context_slots: int) -> None:
    if slots < 0 or long_context_slots < 0:
        raise ValueError(
            f"{key[0]}/{key[1]}: slots ({slots}) and long_context_slots "
            f"({long_context_slots}) must be 0 or more"
        )
