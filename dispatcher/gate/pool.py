"""Provider-pool dispatch: one admission over every candidate of a model group, then the path
the winning candidate needs -- a normalized run, or a tunnel.

::

    async with pool.open(DispatchRequest(model="llama", body=body)) as dispatch:
        dispatch.result      # what was chosen: node, provider, served model, path, queue wait
        dispatch.run         # a Run (normalized path), or
        dispatch.tunnel      # a Tunnel (tunnel path), opened by the ``open_tunnel`` hook

Optional hooks run after selection and before anything is sent: ``prepare_run`` may rewrite
the run's spec for the chosen candidate (credentials, headers, model-specific options),
``prepare_tunnel`` the same for a tunnel. An error in a hook leaves the block, which releases
the slot like any other exit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs

from ..admission import (
    DEFAULT_SHARE,
    Admission,
    Candidate,
    CandidateKey,
    Predicate,
    Share,
    Slot,
    needs_from_body,
)
from ..admission._candidates import RequestClass
from ..errors import TunnelUnavailable
from ..paths.runs import Run, Runs, RunSpec
from ..paths.tunnel import Tunnel
from ..shared.forwarding import Forwarded
from ..wire import ExecutionPath, RouteName


@attrs.frozen(kw_only=True)
class DispatchRequest:
    """One request to place: the public model name and the OpenAI body, plus what the caller
    knows about it."""

    model: str
    body: dict[str, Any]
    route: str = "/v1/chat/completions"
    """The OpenAI route the client called (the tunnel path relays it as is)."""
    run_route: RouteName = "chat"
    """What ``body`` is to a normalized run (``wire.RunRequest.route``): a chat body, or an
    embeddings body."""
    session_id: str | None = None
    """Prefer the node that served this session last, when it has a free slot."""
    affinity_key: str | None = None
    """The request's affinity key (``Needs.affinity_key``), or None."""
    predicate: Predicate | None = attrs.field(default=None, eq=False)
    """An embedder's extra test of each candidate: a rejection reason, or None."""
    exclude: frozenset[CandidateKey] = frozenset()
    """Candidates not to use (they already failed for this request)."""
    requeue: bool = False
    """A recovery of a request that held a slot before: queued ahead of new arrivals and
    admitted with reason ``requeued``."""
    share: Share = DEFAULT_SHARE
    """Whose request it is (tenant, priority band, weight), for admission's fair queueing;
    a retry keeps it."""


@attrs.frozen(kw_only=True)
class DispatchResult:
    """What the pool actually chose: the candidate (whose facts it shows under the names
    below) and how admission placed the request on it."""

    chosen: Candidate
    run_id: str | None
    session_id: str | None
    context_class: RequestClass
    queue_reason: str
    queue_wait: float

    node_id = Forwarded[str]("chosen.node_id")
    model_group = Forwarded[str]("chosen.model")
    adapter = Forwarded[str]("chosen.adapter")
    served_model = Forwarded[str]("chosen.served_model")
    provider_id = Forwarded[str]("chosen.provider_id")
    provider_type = Forwarded[str]("chosen.provider_type")
    path = Forwarded[ExecutionPath]("chosen.path")
    node_label = Forwarded[str]("chosen.node_name")
    candidate = Forwarded[CandidateKey]("chosen.key")


@attrs.frozen
class Dispatch:
    """What :meth:`Pool.open` yields: the choice, and the handle of exactly one path."""

    result: DispatchResult
    run: Run | None = None
    tunnel: Tunnel | None = None

    def __attrs_post_init__(self) -> None:
        if (self.run is None) == (self.tunnel is None):
            raise ValueError("a dispatch holds exactly one of a run and a tunnel")


PrepareRun = Callable[[Candidate, RunSpec], Awaitable[RunSpec]]
PrepareTunnel = Callable[[Candidate, DispatchRequest], Awaitable[DispatchRequest]]
OpenTunnel = Callable[[Slot], AbstractAsyncContextManager[Tunnel]]
"""Opens a tunnel on the slot's candidate (``dispatcher.paths.tunnel.Tunnels.open_tunnel``)."""


@attrs.define(eq=False)
class Pool:
    runs: Runs
    admission: Admission
    prepare_run: PrepareRun | None = None
    prepare_tunnel: PrepareTunnel | None = None
    open_tunnel: OpenTunnel | None = None
    """The tunnel transport (``dispatcher.paths.tunnel``); None until one is installed."""
    on_admitted: Callable[[str, str, float], None] | None = None
    """Told (model group, request class, queue wait) of every admission, for metrics."""

    @asynccontextmanager
    async def open(
        self, request: DispatchRequest, *, prepare_run: PrepareRun | None = None
    ) -> AsyncIterator[Dispatch]:
        """Admit ``request`` and open the chosen candidate's path. ``prepare_run`` (this
        request's own hook) replaces the pool's."""
        needs = needs_from_body(
            request.body,
            session_id=request.session_id,
            affinity_key=request.affinity_key,
            predicate=request.predicate,
            exclude=request.exclude,
        )
        async with self.admission.open_slot(
            request.model, needs, requeue=request.requeue, share=request.share
        ) as slot:
            candidate = slot.candidate
            if self.on_admitted is not None:
                self.on_admitted(candidate.model, slot.request_class, slot.queue_wait)
            if candidate.path == "tunnel":
                # the tunnel's path in this block (no generator of its own per request)
                if self.open_tunnel is None:
                    raise TunnelUnavailable(
                        f"{candidate.label} serves {request.model!r} through a tunnel, "
                        "which this edge cannot open yet"
                    )
                if self.prepare_tunnel is not None:
                    request = await self.prepare_tunnel(candidate, request)
                async with self.open_tunnel(slot) as tunnel:
                    yield Dispatch(self._result(request, slot, None), tunnel=tunnel)
                return
            spec = RunSpec(
                model=candidate.model, body=request.body, needs=needs, route=request.run_route
            )
            prepare = prepare_run or self.prepare_run
            if prepare is not None:
                spec = await prepare(candidate, spec)
            async with self.runs.open_on_slot(spec, slot) as run:
                yield Dispatch(self._result(request, slot, run.run_id), run=run)

    @staticmethod
    def _result(request: DispatchRequest, slot: Slot, run_id: str | None) -> DispatchResult:
        return DispatchResult(
            chosen=slot.candidate,
            run_id=run_id,
            session_id=request.session_id,
            context_class=slot.request_class,
            queue_reason=slot.queue_reason,
            queue_wait=slot.queue_wait,
        )
