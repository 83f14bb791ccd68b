"""The :class:`Service` and :func:`open_service`: the dispatcher without its HTTP front ends.

``open_service`` owns the root nursery: the admission driver and the node sessions attached
in memory live in it, so leaving the ``async with`` stops everything::

    async with open_service(EdgeConfig()) as service:
        await service.attach_local_node()          # the built-in echo model, no sockets
        async with service.open_run(RunSpec(model="echo", body=body)) as run:
            async for event in run:
                ...

Draining (:meth:`Service.drain`, what ``dispatcher serve`` does on SIGTERM): admit nothing
new (new requests get 503 ``shutting_down``, ``/readyz`` answers 503), tell every node session
``edge.draining``, let in-flight requests, runs and tunnels finish within the grace, then end
what is left: a stream with a final ``shutting_down`` event, an unanswered request with 503.

This module knows nothing of HTTP: it imports neither ``dispatcher.api`` nor
``dispatcher.http``. Serving the HTTP front ends is :mod:`dispatcher.edge`, whose
``Dispatcher`` (a subclass of :class:`Service` with a ``serve`` method) is what
``dispatcher.open_dispatcher``, the embedding entry point, yields (built here by
:func:`open_service_of`); :func:`open_service` yields a service without one, for embedders
that bring their own front end.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from types import TracebackType
from typing import Final, TypeVar

import attrs
import trio

from nodes.agent import serve_node_session
from nodes.config import NodeConfig, default_node_config

from . import wire
from .admission import Admission, Candidate, CandidateKey, PolicySnapshot
from .config import ConfigError, EdgeConfig, NodeToken
from .errors import ShuttingDown
from .gate.attempts import Gate
from .gate.catalog import candidates_for_session, gate_policies, policy_snapshot_from_config
from .gate.pool import Dispatch, DispatchRequest, Pool
from .link.registry import NodeSession, Registry
from .link.session import (
    LOCAL_CREDENTIAL,
    NodeCredential,
    NodeLinkSettings,
    serve_node_connection,
)
from .observe.metrics import Metrics
from .observe.status import EdgeStatus, edge_status
from .observe.traffic import Traffic
from .paths.runs import Run, Runs, RunSpec
from .paths.tunnel import Tunnels
from .shared.forwarding import Forwarded
from .shared.transport import Connection, memory_connection_pair
from .store.backends import open_stores
from .store.cluster import LocalCluster, edge_identity
from .store.limits import MemoryLimits
from .store.seam import Cluster, EdgeReport, ResponseStore, UsageLedger
from .tenants import TenantPolicy, Tenants, tenant_policy_from_config

log = logging.getLogger("dispatcher")

LOCAL_NODE_ID: Final = "local"
"""The in-process node's id."""

RESTART_ONLY: Final = (
    "host",
    "port",
    "local_node",
    "providers",
    "data_dir",
    "usage_db",
    "expose_node_ids",
    "http",
    "nodes",
    "responses",
    "metrics.listen",
    "store",
)
"""Settings a reload does not change (the listening sockets and their TLS, the server limits,
the files, the node link, the in-process node and its providers, whose keys are read from the
environment at start): a restart applies them. A dotted name is a
setting inside a table whose other settings a reload does apply (``metrics.token``)."""


def _setting(config: EdgeConfig, name: str) -> object:
    """The setting ``name`` (dotted: inside a table) of ``config``."""
    return functools.reduce(getattr, name.split("."), config)


def _keeping(config: EdgeConfig, old: EdgeConfig, name: str) -> EdgeConfig:
    """``config`` with the setting ``name`` (dotted: inside a table) as ``old`` has it."""
    table, _, field = name.rpartition(".")
    if not table:
        return attrs.evolve(config, **{field: getattr(old, field)})
    inner = attrs.evolve(getattr(config, table), **{field: _setting(old, name)})
    return attrs.evolve(config, **{table: inner})


ConfigSource = Callable[[], EdgeConfig]
"""Reads the edge's config again (its file, with the command line's overrides)."""


@attrs.define(eq=False)
class Work:
    """One request being served (see :meth:`Service.track_work`)."""

    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    answered: bool = False
    """The response has started: from here only a stream's own scope can end it cleanly."""


class _WorkBlock:
    """The block of :meth:`Service.track_work` (a small class rather than a generator: one
    per request)."""

    __slots__ = ("_service", "_work")

    def __init__(self, service: Service) -> None:
        self._service = service
        self._work: Work | None = None

    def __enter__(self) -> Work:
        service = self._service
        if service.draining:
            raise ShuttingDown("the dispatcher is shutting down; retry the request")
        work = self._work = Work()
        service._work.add(work)
        if service._idle.is_set():
            service._idle = trio.Event()
        work.scope.__enter__()
        if service.shutting_down:
            work.scope.cancel(reason="dispatcher shut down")
        return work

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        work = self._work
        assert work is not None
        service = self._service
        try:
            return work.scope.__exit__(exc_type, exc, tb)
        finally:
            service._work.discard(work)
            if not service._work:
                service._idle.set()


@attrs.define(eq=False)
class Service:
    """The edge without its HTTP front ends. Create it with :func:`open_service` (or, with
    the front ends, ``dispatcher.open_dispatcher``)."""

    config: EdgeConfig
    registry: Registry
    admission: Admission
    pool: Pool
    tunnels: Tunnels
    gate: Gate
    ledger: UsageLedger
    response_store: ResponseStore
    """The Responses API's stored responses, beside the ledger (``dispatcher.store.responses``)."""
    metrics: Metrics
    traffic: Traffic
    """The requests in flight and what ended ones left (``dispatcher.observe.traffic``)."""
    nodelink_settings: NodeLinkSettings
    _nursery: trio.Nursery
    tenants: Tenants = attrs.Factory(lambda: Tenants(TenantPolicy(), MemoryLimits()))
    """The client keys as tenants: their limits, budgets and prices (``dispatcher.tenants``)."""
    config_source: ConfigSource | None = None
    """Where :meth:`reload_config` reads the config again (``dispatcher serve``: its file);
    None: this dispatcher cannot reload by itself (:meth:`reload` still applies a config)."""
    cluster: Cluster = attrs.Factory(lambda: LocalCluster(edge_identity(EdgeConfig())))
    """The edges sharing this edge's stores: their heartbeats, reloads told to all
    (``dispatcher.store.cluster``; this edge alone without ``store.redis_url``)."""
    started_at: float = attrs.field(factory=time.time)
    _reloaded: tuple[float, str | None] | None = None
    """When the config file was last read again, and why it was refused (None: applied)."""
    _stream_scopes: set[trio.CancelScope] = attrs.field(factory=set)
    _work: set[Work] = attrs.field(factory=set)
    _idle: trio.Event = attrs.field(factory=trio.Event)
    _drain_deadline: float | None = None
    _peers: tuple[wire.EdgePeer, ...] = ()
    _demand_keys: dict[NodeSession, DemandKeys] = attrs.field(factory=dict)
    """Each live session's candidate keys, as its ``hello`` announced them (fixed for the
    session): made once at its join, not again on every admission change."""
    _affinity_anywhere: tuple[PolicySnapshot, bool] | None = None
    """Whether the admission policy in force (the snapshot) turns affinity on anywhere."""
    shutting_down: bool = False
    """Set when what the drain left is ended (streams get their final event at once)."""

    runs = Forwarded[Runs]("pool.runs")
    """The pool's: the normalized runs (:meth:`open_run` opens one outside the pool)."""

    def __attrs_post_init__(self) -> None:
        self._idle.set()

    @property
    def draining(self) -> bool:
        """True once :meth:`drain` (or :meth:`start_draining`) was called: nothing new is
        admitted."""
        return self._drain_deadline is not None

    @asynccontextmanager
    async def open_run(self, spec: RunSpec) -> AsyncIterator[Run]:
        """Queue, take a slot, subscribe, send; see :mod:`dispatcher.paths.runs`. Raises
        :class:`ShuttingDown` once the dispatcher is draining, and out of the block when a
        drain's grace ran out before it was left."""
        with self.track_work() as work:
            async with self.runs.open_run(spec) as run:
                yield run
        _raise_if_cut_off(work)

    @asynccontextmanager
    async def open_dispatch(self, request: DispatchRequest) -> AsyncIterator[Dispatch]:
        """One admission over the model's provider pool, then the winning candidate's path
        (see :mod:`dispatcher.gate.pool`). Raises :class:`ShuttingDown` like :meth:`open_run`."""
        with self.track_work() as work:
            async with self.pool.open(request) as dispatch:
                yield dispatch
        _raise_if_cut_off(work)

    # -- nodes ------------------------------------------------------------------------

    async def attach_node(self, conn: Connection, *, peer: str = "in-memory") -> None:
        """Serve a node connection (for instance one end of ``memory_connection_pair``) in
        the dispatcher's nursery until it closes."""
        self._nursery.start_soon(self.serve_node_connection, conn, peer)
        await trio.lowlevel.checkpoint()

    async def serve_node_connection(self, conn: Connection, peer: str = "in-memory") -> None:
        await serve_node_connection(
            conn,
            self.registry,
            self.nodelink_settings,
            on_capacity=self.on_capacity,
            on_draining=self.on_draining,
            peer=peer,
            edge_id=self.cluster.edge_id,
            peers=self.peers,
        )

    async def attach_local_node(self, node_config: NodeConfig | None = None) -> str:
        """Run an in-process node over an in-memory connection, in the dispatcher's nursery
        (default: :func:`local_node_config` of the config -- the built-in ``echo`` model, and
        the config's ``[[providers]]`` --, or ``echo`` alone when that is None). Returns
        once it has registered.

        The in-process node is trusted: it needs no node token (whatever ``nodes.tokens``
        says), and its session has its own credential (``nodelink.LOCAL_CREDENTIAL``), so no
        connection can take over its id while it runs. Raises ``RuntimeError`` if it ended
        without registering (its id is held by another node's live session, say)."""
        config = (
            node_config
            or local_node_config(self.config)
            or default_node_config(node_id=LOCAL_NODE_ID)
        )
        edge_end, node_end = memory_connection_pair()
        node_ended = trio.Event()

        async def run_node() -> None:
            try:
                await serve_node_session(node_end, config)
            finally:
                node_ended.set()
                with trio.move_on_after(1, shield=True):
                    await node_end.aclose()

        self._nursery.start_soon(
            functools.partial(
                serve_node_connection,
                edge_end,
                self.registry,
                self.nodelink_settings,
                on_capacity=self.on_capacity,
                on_draining=self.on_draining,
                peer="in-process",
                authenticated_as=LOCAL_CREDENTIAL,
            )
        )
        self._nursery.start_soon(run_node)

        def registered() -> bool:
            session = self.registry.sessions.get(config.node_id)
            return session is not None and session.credential == LOCAL_CREDENTIAL

        while not registered():
            if node_ended.is_set():
                raise RuntimeError(
                    f"the in-process node {config.node_id!r} ended before it registered "
                    "(see the log)"
                )
            async with trio.open_nursery() as waiting:

                async def wait_for(event: Callable[[], Awaitable[object]]) -> None:
                    await event()
                    waiting.cancel_scope.cancel()

                waiting.start_soon(wait_for, self.registry.wait_changed)
                waiting.start_soon(wait_for, node_ended.wait)
        return config.node_id

    def on_capacity(self, session: NodeSession, change: wire.Capacity) -> None:
        """A new grant of the node's: admission takes it as the candidate's slots, and the
        node hears it was applied (a ``demand`` with its serial: a smaller grant is trusted
        by the node only then)."""
        if change.serial and change.serial < session.grant_serial:
            return  # overtaken on the wire by a newer grant: that one stands
        session.grant_serial = max(session.grant_serial, change.serial)
        if session.draining:
            return  # a draining node takes nothing new, whatever it announces
        for candidate in candidates_for_session(session):
            if candidate.provider_id == change.provider_id and candidate.model == change.model:
                self.admission.capacity_changed(
                    candidate.key, change.slots, change.long_context_slots
                )
        report_demand(self.admission, session, self._keys_of(session))

    def peers(self) -> tuple[wire.EdgePeer, ...]:
        """The other live edges, as last read (:meth:`watch_peers`): what a node's welcome
        lists."""
        return self._peers

    async def watch_peers(
        self, every: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Read the live edges every ``every`` seconds (a store that does not answer leaves
        the last list read)."""
        task_status.started()
        while True:
            listed = await self.cluster.edges()
            self._peers = tuple(
                wire.EdgePeer(id=record.id, node_url=record.node_url)
                for record in listed.edges
                if record.id != self.cluster.edge_id and record.node_url
            )
            await trio.sleep(every)

    async def report_demands(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Tells each node what this edge wants of it (``demand``) whenever that may have
        changed (:meth:`Admission.wait_changed`: not for a slot taken or freed within its
        grant): one pass per change, however many came together."""
        task_status.started()
        while True:
            await self.admission.wait_changed()
            for session in list(self.registry.sessions.values()):
                report_demand(self.admission, session, self._keys_of(session))

    def on_draining(self, session: NodeSession) -> None:
        """The node said ``node.draining``: admit nothing more onto its candidates (their
        slots drop to 0; the runs and tunnels they hold finish and release as usual)."""
        for candidate in candidates_for_session(session):
            # long_context_slots unchanged: a queued long request must not be rejected as
            # incapable because this node is leaving; with 0 slots it just admits nobody.
            self.admission.capacity_changed(candidate.key, 0, candidate.long_context_slots)

    def _node_joined(self, session: NodeSession) -> None:
        candidates = candidates_for_session(session)
        self._demand_keys[session] = demand_keys(candidates)
        self.admission.node_joined(candidates)

    def _node_left(self, session: NodeSession) -> None:
        self._demand_keys.pop(session, None)
        self.admission.node_left(session.node_id, session.generation)

    def _keys_of(self, session: NodeSession) -> DemandKeys:
        """``session``'s candidate keys (made at its join; a session that left or has not
        joined gets them made afresh, and not kept)."""
        keys = self._demand_keys.get(session)
        if keys is None:
            keys = demand_keys(candidates_for_session(session))
        return keys

    def model_aliases(self) -> Mapping[str, str]:
        """The aliases the admission policy in force names (public name -> model group)."""
        return self.admission.policy.aliases

    def affinity_wanted(self, model: str) -> bool:
        """Whether a request for ``model`` may be routed by its affinity key: its group's
        policy, or a fallback's, turns affinity on. While no policy in force does (the
        default), False at once: no key is made per request."""
        snapshot = self.admission.policy
        anywhere = self._affinity_anywhere
        if anywhere is None or anywhere[0] is not snapshot:
            anywhere = self._affinity_anywhere = (
                snapshot,
                snapshot.default.affinity
                or any(policy.affinity for policy in snapshot.groups.values()),
            )
        if not anywhere[1]:
            return False
        groups = (model, *self.gate.policy_for(model).fallbacks)
        return any(snapshot.policy_for(snapshot.resolve(group)).affinity for group in groups)

    def metric_model_label(self, model: str) -> str:
        """``model`` if it names a served or configured group, else "unknown" (clients must not
        be able to create metric series at will)."""
        policy = self.admission.policy
        group = policy.resolve(model)
        if policy.knows(group) or group in self.registry.models():
            return group
        return "unknown"

    def inflight_runs(self) -> int:
        return self.runs.stats.open_runs

    def inflight_tunnels(self) -> int:
        return self.tunnels.statistics().open_tunnels

    def connected_nodes(self) -> int:
        return len(self.registry.sessions)

    def edge_report(self) -> EdgeReport:
        """What this edge tells the others at each heartbeat (see :attr:`cluster`)."""
        reloaded_at, reload_error = self._reloaded or (None, None)
        return EdgeReport(
            started_at=self.started_at,
            in_flight=self.in_flight(),
            reloaded_at=reloaded_at,
            reload_error=reload_error,
        )

    async def status(self) -> EdgeStatus:
        """The edge at a glance (``GET /admin/status``; see ``dispatcher.observe.status``),
        with the live edges of its cluster (read from the store now)."""
        edges = await self.cluster.edges()
        return edge_status(
            sessions=self.registry.sessions.values(),
            stats=self.admission.statistics(),
            traffic=self.traffic,
            now=trio.current_time(),
            wall=time.time(),
            started_at=self.started_at,
            draining=self.draining,
            edge_id=self.cluster.edge_id,
            edges=edges,
        )

    def candidates(self) -> list[Candidate]:
        return [c for s in self.registry.sessions.values() for c in candidates_for_session(s)]

    # -- draining ---------------------------------------------------------------------

    def track_work(self) -> _WorkBlock:
        """Count one request as in flight: :meth:`drain` waits for it. Raises
        :class:`ShuttingDown` when draining. When the grace is over, a request that has not
        started its answer (``work.answered`` still False) has ``work.scope`` cancelled."""
        return _WorkBlock(self)

    def in_flight(self) -> int:
        """Requests being served now (those :meth:`drain` waits for)."""
        return len(self._work)

    def start_draining(self, grace: float | None = None) -> None:
        """Begin draining without waiting (idempotent): admit nothing new and tell every
        node session ``edge.draining``. ``grace`` defaults to ``http.shutdown_grace``."""
        if self._drain_deadline is not None:
            return
        if grace is None:
            grace = self.config.http.shutdown_grace
        self._drain_deadline = trio.current_time() + grace
        log.info(
            "draining: admitting nothing new; %d request(s) in flight get %.1f s",
            len(self._work),
            grace,
        )
        for session in list(self.registry.sessions.values()):
            session.post(wire.EdgeDraining(grace=grace))

    async def drain(self, grace: float | None = None) -> bool:
        """Drain: :meth:`start_draining`, wait until no request is in flight or the grace
        is over, then end what is left (as :meth:`begin_shutdown`; also when this is
        cancelled). Returns True when nothing was left. Calling it again waits with the
        first call's deadline."""
        self.start_draining(grace)
        assert self._drain_deadline is not None
        try:
            with trio.move_on_at(self._drain_deadline):
                await self._idle.wait()
        finally:
            left = len(self._work)
            if left:
                log.warning("drain grace is over: ending %d request(s) still in flight", left)
            else:
                log.info("drained: no request in flight")
            self._cut_off()
        await trio.lowlevel.checkpoint()
        return not left

    @contextmanager
    def stream_scope(self) -> Iterator[trio.CancelScope]:
        """A scope for one streamed response; when the drain's grace is over it is
        cancelled so the handler sends its final event."""
        with trio.CancelScope() as scope:
            self._stream_scopes.add(scope)
            try:
                if self.shutting_down:
                    scope.cancel(reason="dispatcher shut down")
                yield scope
            finally:
                self._stream_scopes.discard(scope)

    async def begin_shutdown(self) -> None:
        """End what is in flight now (idempotent): each open stream sends a final error event
        (``shutting_down``); a request not yet answered is cancelled (the HTTP API answers
        503). Nothing new is admitted from here on."""
        self._cut_off()
        await trio.lowlevel.checkpoint()

    def _cut_off(self) -> None:
        self.start_draining(0)
        self.shutting_down = self.registry.closing = True
        for scope in list(self._stream_scopes):
            scope.cancel(reason="dispatcher shutting down")
        for work in list(self._work):
            if not work.answered:
                work.scope.cancel(reason="dispatcher shutting down")

    def set_policy(self, snapshot: PolicySnapshot) -> None:
        self.admission.set_policy(snapshot)

    # -- reloading --------------------------------------------------------------------

    def reload(self, config: EdgeConfig) -> tuple[str, ...]:
        """Apply ``config``'s keys, limits, prices and per-model policy (admission and gate)
        at once: everything is built first (a :class:`ConfigError` changes nothing), then
        swapped without a checkpoint between. Requests in flight keep the limits and the
        policy they were admitted under. Returns the :data:`RESTART_ONLY` settings that
        differ, which are not applied."""
        admission = policy_snapshot_from_config(config)
        gate = gate_policies(config, admission)
        tenants = tenant_policy_from_config(config)
        kept = tuple(
            name for name in RESTART_ONLY if _setting(config, name) != _setting(self.config, name)
        )
        self.admission.set_policy(admission)
        self.gate.policy_for = gate
        self.tenants.swap(tenants)
        self.config = functools.reduce(
            lambda new, name: _keeping(new, self.config, name), kept, config
        )
        return kept

    async def reload_config(self) -> tuple[str, ...]:
        """Read the config again from :attr:`config_source` and :meth:`reload` it; logged
        either way. Raises :class:`ConfigError` (the old config keeps serving) for a file
        that cannot be used, ``LookupError`` when there is no source."""
        source = self.config_source
        if source is None:
            raise LookupError("this edge was not started from a config file: nothing to reload")
        refused: ConfigError | None = None
        try:
            config = await trio.to_thread.run_sync(source)
            kept = self.reload(config)
        except ConfigError as exc:
            refused = exc
        self._reloaded = (time.time(), None if refused is None else str(refused))
        self.cluster.changed()
        if refused is not None:
            # One line, no traceback: the message names the file, the key and the reason.
            log.error("reload refused, the old config keeps serving: %s", refused)
            raise refused
        log.info(
            "reloaded the config: %d tenant key(s), %d price(s), %d model polic(ies)",
            len(self.tenants.keys.clients),
            len(config.prices),
            len(config.models),
        )
        if kept:
            log.warning("reload: %s changed but need a restart: not applied", ", ".join(kept))
        return kept

    async def reload_cluster(self) -> tuple[tuple[str, ...], int]:
        """:meth:`reload_config` here, then ask every other edge of the cluster to reload
        its own file (``POST /admin/reload?scope=cluster``). Returns what this edge did not
        apply and how many other edges were told. Raises as :meth:`reload_config` does
        (nothing is published then: fix this edge's file first), ``RuntimeError`` when the
        cluster's store cannot be reached (this edge has reloaded)."""
        kept = await self.reload_config()
        told = await self.cluster.publish_reload()
        log.info("reload: told %d other edge(s) of the cluster to reload", told)
        return kept, told

    async def _reload_asked(self) -> None:
        """Another edge asked every edge to reload: this edge's own file, refused (and
        logged) here when it is broken; the old config keeps serving."""
        try:
            await self.reload_config()
        except ConfigError:
            pass  # logged by reload_config; the heartbeat carries the refusal
        except LookupError as exc:
            log.warning("reload asked by another edge: %s", exc)


def local_node_config(config: EdgeConfig) -> NodeConfig | None:
    """The in-process node of ``config``: the built-in ``echo`` model while ``local_node``
    is on, then the file's ``[[providers]]``; None when it has neither (no in-process
    node)."""
    echo = default_node_config(node_id=LOCAL_NODE_ID)
    providers = (*(echo.providers if config.local_node else ()), *config.providers)
    if not providers:
        return None
    return attrs.evolve(echo, providers=providers)


def _raise_if_cut_off(work: Work) -> None:
    if work.scope.cancelled_caught:
        raise ShuttingDown("the dispatcher shut down before this finished")


def _credential(token: str | NodeToken) -> str | NodeCredential:
    if isinstance(token, str):
        return token
    if token.value is None:  # node_tokens() resolves value_env; this is a bug
        raise ValueError("a node token without a value")
    return NodeCredential(token.value, token.ids)


ServiceT = TypeVar("ServiceT", bound=Service)


@asynccontextmanager
async def open_service(config: EdgeConfig | None = None) -> AsyncIterator[Service]:
    """A running service without a front end, stopped when the block exits (with the
    HTTP front ends: ``dispatcher.open_dispatcher``, from :mod:`dispatcher.edge`)."""
    async with open_service_of(Service, config) as service:
        yield service


@asynccontextmanager
async def open_service_of(
    kind: type[ServiceT], config: EdgeConfig | None = None
) -> AsyncIterator[ServiceT]:
    """:func:`open_service`, yielding a ``kind`` (a subclass that adds a front end, such as
    ``dispatcher.edge.Dispatcher``)."""
    config = config or EdgeConfig()
    registry = Registry()
    snapshot = policy_snapshot_from_config(config)
    admission = Admission(snapshot)
    settings = NodeLinkSettings(
        node_tokens=tuple(_credential(token) for token in config.node_tokens()),
        hello_timeout=config.nodes.hello_timeout,
        heartbeat_interval=config.nodes.heartbeat_interval,
        heartbeat_timeout=config.nodes.heartbeat_timeout,
    )
    runs = Runs(registry, admission)
    metrics = Metrics(admission)
    tunnels = Tunnels(registry, admission)
    pool = Pool(
        runs, admission, open_tunnel=tunnels.open_tunnel, on_admitted=metrics.observe_admission
    )
    async with open_stores(config) as stores, trio.open_nursery() as nursery:
        ledger = stores.ledger
        tenants = Tenants(tenant_policy_from_config(config), stores.limits)
        dispatcher = kind(
            config=config,
            registry=registry,
            admission=admission,
            pool=pool,
            tunnels=tunnels,
            gate=Gate(
                pool,
                gate_policies(config, snapshot),
                record_usage=ledger.record,
                nursery=nursery,
                price_usage=tenants.price,
            ),
            ledger=ledger,
            response_store=stores.responses,
            metrics=metrics,
            traffic=Traffic(metrics),
            nodelink_settings=settings,
            nursery=nursery,
            tenants=tenants,
            cluster=stores.cluster,
        )
        stores.cluster.bind(dispatcher.edge_report, dispatcher._reload_asked)
        metrics.inflight_source = dispatcher
        registry.on_join(dispatcher._node_joined)
        registry.on_leave(dispatcher._node_left)
        await nursery.start(admission.run)
        await nursery.start(dispatcher.report_demands)
        await nursery.start(dispatcher.watch_peers, config.store.heartbeat_s)
        await nursery.start(tenants.seed_when_readable, ledger)
        try:
            yield dispatcher
        finally:
            registry.closing = True  # the node sessions end as the edge's, not as lost nodes
            nursery.cancel_scope.cancel(reason="dispatcher closed")


DemandKeys = tuple[tuple[CandidateKey, tuple[str, str]], ...]
"""A session's candidates as :func:`report_demand` reads them: each key, and the (provider,
model) its ``demand`` names."""


def demand_keys(candidates: Iterable[Candidate]) -> DemandKeys:
    return tuple(
        (candidate.key, (candidate.provider_id, candidate.model)) for candidate in candidates
    )


def report_demand(admission: Admission, session: NodeSession, keys: DemandKeys) -> None:
    """Post ``demand`` to the node for each of its candidates (``keys``: the session's,
    :func:`demand_keys`) whose report changed: the requests waiting, or the grant applied
    (the node waits for it to trust a smaller one), or the slots held when they are beyond
    the grant or come back to it (within its grant the node counts this edge's runs itself:
    no report per request)."""
    if session.closed_reason is not None or session.draining:
        return
    serial = session.grant_serial
    for key, where in keys:
        now = admission.demand(key)
        if now is None:
            continue
        waiting, held, slots = now
        # Nothing said yet is "nothing waits, nothing beyond the hello's grant".
        was_waiting, was_held, was_serial = session.demand_sent.get(where, (0, 0, 0))
        if (
            waiting == was_waiting
            and serial == was_serial
            and (held == was_held or (held <= slots and was_held <= slots))
        ):
            continue
        session.demand_sent[where] = (waiting, held, serial)
        session.post(
            wire.Demand(
                provider_id=where[0],
                model=where[1],
                waiting=waiting,
                in_use=held,
                serial=serial,
            )
        )


__all__ = [
    "Service",
    "ShuttingDown",
    "Work",
    "local_node_config",
    "open_service",
    "open_service_of",
]
