"""The node's slots shared between the edges it serves, driven: :class:`EdgeGrants` holds the
sans-IO :class:`~nodes.grants.Allocator` for every session of the node and carries its
decisions to the sessions.

* A session joins before its ``hello``: the hello announces this edge's first grant of each
  model (not the node's whole capacity), so an edge never believes it owns more than it was
  given, not even between the welcome and the first ``capacity``. It leaves when it ends,
  however it ends: what it held is free for the others at once.
* What the allocator decides for an edge goes to that edge's **outbox**, and the session's
  own task (:meth:`EdgeGrants.send_grants`) writes it as ``capacity`` messages through the
  session's one writer: no session writes to another's connection.
* The session tells :meth:`EdgeGrants.report` each ``demand`` the edge sends,
  :meth:`EdgeGrants.run_started` each ``run.request`` and ``tunnel.request`` (False: beyond
  what the edge holds, refused without running), :meth:`EdgeGrants.run_ended` each end, and
  writes the grants it answers before the end itself.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Iterable, Mapping

import attrs
import trio

from dispatcher import wire
from nodes.config import NodeConfig
from nodes.grants import Allocator, EdgeId, Grant, Key

__all__ = ["EdgeGrants", "hello_with_grants"]


@attrs.define(eq=False)
class _Outbox:
    grants: collections.deque[Grant] = attrs.field(factory=collections.deque)
    ready: trio.Event = attrs.field(factory=trio.Event)


class EdgeGrants:
    """The node's slots over its edge sessions (see the module docstring)."""

    def __init__(self, config: NodeConfig) -> None:
        capacity = {
            (provider.id, model.name): (model.slots, model.long_context_slots)
            for provider in config.providers
            for model in provider.models
        }
        self.allocator = Allocator(capacity)
        self._outboxes: dict[EdgeId, _Outbox] = {}

    def join(self, edge: EdgeId) -> dict[Key, Grant]:
        """A session to ``edge`` is about to say hello: its first grants, by key (the
        others' shrunk grants go to their outboxes)."""
        self._outboxes[edge] = _Outbox()
        grants = self.allocator.join(edge)
        self._deliver(grant for grant in grants if grant.edge != edge)
        return {grant.key: grant for grant in grants if grant.edge == edge}

    def leave(self, edge: EdgeId) -> None:
        """The session to ``edge`` ended: what it held goes to the others."""
        outbox = self._outboxes.pop(edge, None)
        if outbox is not None:
            outbox.ready.set()  # its sender, if still there, sees it is gone
        self._deliver(self.allocator.leave(edge))

    def report(self, edge: EdgeId, demand: wire.Demand) -> None:
        self._deliver(
            self.allocator.report(
                edge,
                (demand.provider_id, demand.model),
                waiting=demand.waiting,
                in_use=demand.in_use,
                serial=demand.serial,
            )
        )

    def run_started(self, edge: EdgeId, key: Key) -> bool:
        """A run or tunnel from ``edge`` on ``key``: False if it is beyond what the edge
        holds (the caller refuses it; nothing is counted)."""
        return self.allocator.run_started(edge, key)

    def run_ended(self, edge: EdgeId, key: Key) -> list[wire.Capacity]:
        """A run or tunnel of ``edge`` on ``key`` ended: the grants for ``edge`` waiting to
        be sent, to write *before* the end itself (so an edge whose grant was lowered learns
        it before it sees the slot free, and does not fill it once more); the others'
        go to their outboxes."""
        self._deliver(self.allocator.run_ended(edge, key))
        outbox = self._outboxes.get(edge)
        if outbox is None or not outbox.grants:
            return []
        grants, outbox.grants = list(outbox.grants), collections.deque()
        return [_capacity(grant) for grant in grants]

    async def send_grants(
        self, edge: EdgeId, send: Callable[[wire.Capacity], Awaitable[None]]
    ) -> None:
        """The session's task: write its edge's new grants as ``capacity``, in order, until
        cancelled (or the edge left)."""
        while True:
            outbox = self._outboxes.get(edge)
            if outbox is None:
                return
            if not outbox.grants:
                outbox.ready = trio.Event()
                await outbox.ready.wait()
                continue
            # A grant taken by run_ended meanwhile may overtake this one: the edge applies
            # only the newest serial it has seen.
            await send(_capacity(outbox.grants.popleft()))

    def _deliver(self, grants: Iterable[Grant]) -> None:
        for grant in grants:
            outbox = self._outboxes.get(grant.edge)
            if outbox is not None:
                outbox.grants.append(grant)
                outbox.ready.set()


def _capacity(grant: Grant) -> wire.Capacity:
    return wire.Capacity(
        provider_id=grant.key[0],
        model=grant.key[1],
        slots=grant.slots,
        long_context_slots=grant.long_context_slots,
        serial=grant.serial,
    )


def hello_with_grants(hello: wire.Hello, grants: Mapping[Key, Grant]) -> wire.Hello:
    """``hello`` announcing this edge's grants as each model's slots."""

    def model(provider_id: str, info: wire.ModelInfo) -> wire.ModelInfo:
        grant = grants.get((provider_id, info.name))
        if grant is None:
            return info
        return attrs.evolve(info, slots=grant.slots, long_context_slots=grant.long_context_slots)

    return attrs.evolve(
        hello,
        providers=tuple(
            attrs.evolve(
                provider, models=tuple(model(provider.id, info) for info in provider.models)
            )
            for provider in hello.providers
        ),
    )
