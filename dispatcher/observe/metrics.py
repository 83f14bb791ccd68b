"""Prometheus metrics for ``GET /metrics`` (every series: ``docs/metrics.md``).

Gauges and counters that admission already keeps (queue depth, slots, candidate health,
admissions by reason, rejections by cause, ejections) are read from
``Admission.statistics()`` at scrape time, so nothing is counted twice and a departed
candidate or dropped group has no series left; only what has no other home -- the queue-wait
histogram, request outcomes, and each ended request's duration, time to first token, tokens
and attempts (observed by its record, :mod:`dispatcher.observe.traffic`) -- is recorded as it
happens, and those series of a model admission no longer knows (no node serves it, no config
names it) are removed (see :meth:`Metrics.prune`). Each dispatcher has its own registry (no
process-global state), so several dispatchers in one process, as in the tests, do not mix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final, Protocol

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..admission import (
    ADMIT_REASONS,
    AFFINITY_RESULTS,
    HEALTH_STATES,
    REJECT_CAUSES,
    Admission,
)
from ..store.limits_guard import GuardedLimits, LimitGuardStatistics
from ..store.seam import UsageLedger
from ..tenants import Tenants
from . import series
from .series import (
    CounterSeries,
    Family,
    HistogramSeries,
    S,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUEST_OUTCOMES = (
    "completed",  # the client got a complete answer
    "failed",  # the run or its node failed (502 or an SSE error event)
    "client_gone",  # the client left before the end
    "rejected",  # admission said no: 404, 400 no capable candidate, 429, 503
    "bad_request",  # the request itself was invalid
    "shutting_down",  # refused or cut off by the edge's drain
)

REQUEST_DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
"""The OpenTelemetry GenAI semantic conventions' boundaries for ``gen_ai.server.request
.duration``."""
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
"""The conventions' boundaries for ``gen_ai.server.time_to_first_token``."""
TOKEN_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
"""The conventions' boundaries for ``gen_ai.client.token.usage``."""

OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}
"""``gen_ai_operation_name`` of each model route (the conventions' well-known values); another
route's is ``chat``."""

UNKNOWN_MODEL = "unknown"
"""The ``model`` label of a request for a model nobody serves or configures
(``Dispatcher.metric_model_label``): never removed."""


class _AdmissionCollector(Collector):
    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        stats = self._admission.statistics()
        depth = GaugeMetricFamily(
            "dispatcher_queue_depth",
            "Requests waiting for a slot, per model group and request class.",
            labels=["model", "class"],
        )
        for model, group in sorted(stats.groups.items()):
            depth.add_metric([model, "short"], group.short)
            depth.add_metric([model, "long"], group.long)
        yield depth

        affinity = CounterMetricFamily(
            "dispatcher_affinity",
            "Admissions of a model group with affinity on, by result: hit (onto the candidate "
            "the request's affinity key ranks first), a spill by reason (over_load, busy, "
            "ineligible, ejected), or unkeyed (no key).",
            labels=["model", "result"],
        )
        for model, group in sorted(stats.groups.items()):
            if group.affinity_on or any(group.affinity.values()):
                for result in AFFINITY_RESULTS:
                    affinity.add_metric([model, result], group.affinity.get(result, 0))
        yield affinity

        labels = ["node", "provider", "model"]
        total = GaugeMetricFamily(
            "dispatcher_slots_total", "Slots a candidate offers (after caps).", labels=labels
        )
        in_use = GaugeMetricFamily(
            "dispatcher_slots_in_use", "Slots held by running requests.", labels=labels
        )
        draining = GaugeMetricFamily(
            "dispatcher_slots_draining",
            "Slots of cancelled runs, held until the node confirms the cancel.",
            labels=labels,
        )
        health = GaugeMetricFamily(
            "dispatcher_candidate_health",
            "A candidate's health for failure-aware selection: 1 for its state "
            "(healthy, ejected or probing), 0 for the others.",
            labels=[*labels, "state"],
        )
        failures = GaugeMetricFamily(
            "dispatcher_candidate_consecutive_failures",
            "Candidate-caused failures since the candidate's last success.",
            labels=labels,
        )
        ejections = CounterMetricFamily(
            "dispatcher_candidate_ejections",
            "Times the candidate was ejected (each cool-down once); starts again from 0 "
            "when its node comes back after leaving with nothing to remember.",
            labels=labels,
        )
        for key, candidate in sorted(stats.candidates.items()):
            values = [key.node_id, key.provider_id, key.model]
            total.add_metric(values, candidate.total)
            in_use.add_metric(values, candidate.in_use)
            draining.add_metric(values, candidate.draining)
            for state in HEALTH_STATES:
                health.add_metric([*values, state], 1 if candidate.health == state else 0)
            failures.add_metric(values, candidate.consecutive_failures)
            ejections.add_metric(values, candidate.ejections_total)
        yield total
        yield in_use
        yield draining
        yield health
        yield failures
        yield ejections

        admissions = CounterMetricFamily(
            "dispatcher_admissions", "Requests given a slot, by queue reason.", labels=["reason"]
        )
        for reason in ADMIT_REASONS:
            admissions.add_metric([reason], stats.admissions.get(reason, 0))
        yield admissions
        rejections = CounterMetricFamily(
            "dispatcher_rejections", "Requests refused by admission, by cause.", labels=["cause"]
        )
        for cause in REJECT_CAUSES:
            rejections.add_metric([cause], stats.rejections.get(cause, 0))
        yield rejections
        yield CounterMetricFamily(
            "dispatcher_ejections",
            "Candidate ejections (each cool-down once), every candidate, since the start.",
            value=stats.ejections,
        )


class InFlightSource(Protocol):
    """What the in-flight gauges (and the limit store's series) read at scrape time (the
    dispatcher provides it)."""

    def inflight_runs(self) -> int: ...
    def inflight_tunnels(self) -> int: ...
    def connected_nodes(self) -> int: ...
    @property
    def tenants(self) -> Tenants:
        """Its tenants, whose limit store the ``dispatcher_limit_store_*`` series describe."""
        ...

    @property
    def ledger(self) -> UsageLedger:
        """Its usage ledger, which the ``dispatcher_usage_rows_*`` series describe."""
        ...


class _InFlightCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        source = self._metrics.inflight_source
        yield GaugeMetricFamily(
            "dispatcher_inflight_requests",
            "Client requests being served now (admitted or waiting), on every route.",
            value=self._metrics.inflight_requests,
        )
        yield GaugeMetricFamily(
            "dispatcher_inflight_runs",
            "Normalized runs whose owning block is open now.",
            value=source.inflight_runs() if source is not None else 0,
        )
        yield GaugeMetricFamily(
            "dispatcher_inflight_tunnels",
            "Tunnels whose owning block is open now.",
            value=source.inflight_tunnels() if source is not None else 0,
        )
        yield GaugeMetricFamily(
            "dispatcher_connected_nodes",
            "Node sessions connected now (the in-process node included).",
            value=source.connected_nodes() if source is not None else 0,
        )


_ALWAYS_UP: Final = LimitGuardStatistics(
    store="memory", mode="refuse", up=True, outages=0, refused=0, local=0, pending=0, parked=0,
    lost=0,
)  # fmt: skip
"""What the embedded limits (in memory, they cannot fail) report."""


class _LedgerCollector(Collector):
    """The usage ledger's writer: rows waiting (in memory or in the outbox in front of a
    shared database) and rows lost."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        source = self._metrics.inflight_source
        if source is None:
            return
        stats = source.ledger.statistics()
        yield GaugeMetricFamily(
            "dispatcher_usage_rows_pending",
            "Usage rows recorded and not yet in the ledger's database (the outbox's included).",
            value=stats.rows_pending,
        )
        yield GaugeMetricFamily(
            "dispatcher_usage_rows_in_outbox",
            "Usage rows kept in this edge's durable outbox until PostgreSQL has them "
            "([store] database_url; 0 without one). Growing: PostgreSQL is down or slow.",
            value=stats.rows_in_outbox,
        )
        yield CounterMetricFamily(
            "dispatcher_usage_rows_lost",
            "Usage rows never written (beyond the writer's bound, refused by the database, "
            "or pending when a closing flush ran out of time).",
            value=stats.rows_lost,
        )


class _LimitStoreCollector(Collector):
    """The limit store's health: the shared one's (``[store] redis_url``,
    :class:`~dispatcher.store.limits_guard.GuardedLimits`), else always up."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        source = self._metrics.inflight_source
        limits = source.tenants.limits if source is not None else None
        stats = limits.statistics() if isinstance(limits, GuardedLimits) else _ALWAYS_UP
        yield GaugeMetricFamily(
            "dispatcher_limit_store_up",
            "1 while the limit store answers this edge's admissions (always, for the embedded "
            "one), 0 during an outage of the shared one ([store] on_store_error decides them).",
            value=1 if stats.up else 0,
        )
        errors = CounterMetricFamily(
            "dispatcher_limit_store_errors",
            "Client requests whose limits the shared limit store did not decide: refused "
            "with 503 (mode refuse) or decided on this edge (mode local, and any key without "
            "limits).",
            labels=["mode"],
        )
        errors.add_metric(["refuse"], stats.refused)
        errors.add_metric(["local"], stats.local)
        yield errors
        yield CounterMetricFamily(
            "dispatcher_limit_store_outages",
            "Times the shared limit store stopped answering this edge.",
            value=stats.outages,
        )
        yield GaugeMetricFamily(
            "dispatcher_limit_store_writes_pending",
            "Settles, releases and spends posted to the shared limit store and not yet "
            "written (those held back during an outage included).",
            value=stats.pending + stats.parked,
        )
        yield CounterMetricFamily(
            "dispatcher_limit_store_writes_lost",
            "Writes to the shared limit store given up (after their tries, or held back "
            "beyond the bound of an outage): spend its budgets do not count.",
            value=stats.lost,
        )


@attrs.define(eq=False)
class _RequestSeries:
    """The series the ended requests of one (model, route, outcome) observe, each made when
    first needed (a request without a first output makes no time-to-first-token series)."""

    where: tuple[str, str, str]
    """The labels the gen_ai families share: model, operation, route."""
    duration: HistogramSeries
    ttft: HistogramSeries | None = None
    tokens: tuple[HistogramSeries, HistogramSeries] | None = None
    """Input and output."""
    cached: CounterSeries | None = None
    """Input read from a prompt cache."""
    attempts: tuple[CounterSeries, CounterSeries] | None = None
    """Attempts and recoveries."""


class Metrics:
    """The dispatcher's metrics registry.

    The ``model`` label of the recorded series (queue wait, requests, durations, tokens,
    attempts) is bounded: a series is removed once admission no longer knows its model
    (``Admission.knows_model``: no candidate, no waiter, no config), at each scrape and
    whenever a new model label appears, so the series held at any time are those of models
    known now plus the few that went away since then. A model that comes back starts its
    series again from 0 (a counter reset, which ``rate()`` and ``increase()`` handle)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._tracked: dict[Family[Any], dict[str, dict[tuple[str, ...], Any]]] = {}
        """Per recorded family, per model label: its series by their other labels (for
        :meth:`prune`)."""
        self._request_groups: dict[tuple[str, str, str], _RequestSeries] = {}
        """An ended request's series by (model, route, outcome), the series
        :meth:`observe_request` observes (emptied whenever :meth:`prune` removes a series)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_AdmissionCollector(admission))
        self.inflight_requests = 0
        """Requests inside a route's counted block now (``api.common.CountedRequest``)."""
        self.inflight_source: InFlightSource | None = None
        self.registry.register(_InFlightCollector(self))
        self.registry.register(_LimitStoreCollector(self))
        self.registry.register(_LedgerCollector(self))
        self.queue_wait = self._histogram(
            "dispatcher_queue_wait_seconds",
            "Time admitted requests waited for their slot, per model group and class.",
            ["model", "class"],
            QUEUE_WAIT_BUCKETS,
        )
        self.requests = self._counter(
            "dispatcher_requests", "Client requests by model and outcome.", ["model", "outcome"]
        )
        genai = ["gen_ai_request_model", "gen_ai_operation_name", "route"]
        self.request_duration = self._histogram(
            "gen_ai_server_request_duration_seconds",
            "Model-route requests from their start to their end, by model, operation, route "
            "and outcome.",
            [*genai, "outcome"],
            REQUEST_DURATION_BUCKETS,
        )
        self.time_to_first_token = self._histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "From a model-route request's start (queue wait included) to its answer's first "
            "output.",
            genai,
            TTFT_BUCKETS,
        )
        self.token_usage = self._histogram(
            "gen_ai_client_token_usage",
            "Tokens per model-route request, input and output (as reported by the node or "
            "provider, else the edge's estimate).",
            [*genai, "gen_ai_token_type"],
            TOKEN_BUCKETS,
        )
        self.cached_tokens = self._counter(
            "dispatcher_cached_tokens",
            "Input tokens of model-route requests read from a prompt cache (a part of "
            "gen_ai_client_token_usage's input), as the node or provider reported them.",
            ["model"],
        )
        self.attempts = self._counter(
            "dispatcher_attempts",
            "Attempts admitted for model-route requests (the first and every recovery).",
            ["model"],
        )
        self.recoveries = self._counter(
            "dispatcher_recoveries",
            "Attempts after a request's first: each a recovery from a failed attempt.",
            ["model"],
        )

    def _histogram(
        self, name: str, documentation: str, labels: list[str], buckets: tuple[float, ...]
    ) -> Family[HistogramSeries]:
        """A recorded histogram (its first label is ``model``'s, pruned by :meth:`prune`)."""
        return self._track(series.histogram(name, documentation, labels, buckets))

    def _counter(self, name: str, documentation: str, labels: list[str]) -> Family[CounterSeries]:
        """A recorded counter (as :meth:`_histogram`)."""
        return self._track(series.counter(name, documentation, labels))

    def _track(self, family: Family[S]) -> Family[S]:
        self.registry.register(family)
        self._tracked[family] = {}
        return family

    def observe_admission(self, model: str, request_class: str, queue_wait: float) -> None:
        self._series(self.queue_wait, model, request_class).observe(queue_wait)

    def count_request(self, model: str, outcome: str) -> None:
        self._series(self.requests, model, outcome).inc()

    def observe_request(
        self,
        model: str,
        route: str,
        outcome: str,
        duration: float,
        *,
        ttft: float | None,
        tokens: tuple[int, int] | None,
        attempts: int,
        cached: int = 0,
    ) -> None:
        """An ended model-route request (``model``: a bounded label, ``metric_model_label``):
        its duration, time to first output (None: there was none), input and output tokens,
        attempts admitted, and input tokens read from a prompt cache."""
        key = (model, route, outcome)
        group = self._request_groups.get(key)
        if group is None:
            where = (model, OPERATIONS.get(route, "chat"), route)
            group = _RequestSeries(where, self._series(self.request_duration, *where, outcome))
            self._request_groups[key] = group
        group.duration.observe(duration)
        if ttft is not None:
            if group.ttft is None:
                group.ttft = self._series(self.time_to_first_token, *group.where)
            group.ttft.observe(ttft)
        if tokens is not None:
            if group.tokens is None:
                group.tokens = (
                    self._series(self.token_usage, *group.where, "input"),
                    self._series(self.token_usage, *group.where, "output"),
                )
            group.tokens[0].observe(tokens[0])
            group.tokens[1].observe(tokens[1])
            if group.cached is None:
                group.cached = self._series(self.cached_tokens, model)  # 0 from the first
            if cached:
                group.cached.inc(cached)
        if attempts:
            if group.attempts is None:
                group.attempts = (
                    self._series(self.attempts, model),
                    self._series(self.recoveries, model),  # its series exists from the first
                )
            group.attempts[0].inc(attempts)
            if attempts > 1:  # (an inc of 0 changes nothing: skipped)
                group.attempts[1].inc(attempts - 1)

    def prune(self) -> None:
        """Remove the recorded series of every model admission does not know any more
        (O(models with series))."""
        for metric, tracked in self._tracked.items():
            for model in [m for m in tracked if not self._known(m)]:
                for values in tracked.pop(model):
                    metric.remove(model, *values)
                self._request_groups = {}  # they may hold a removed series

    def render(self) -> bytes:
        self.prune()
        return generate_latest(self.registry)

    def _known(self, model: str) -> bool:
        return model == UNKNOWN_MODEL or self._admission.knows_model(model)

    def _series(self, metric: Family[S], model: str, *values: str) -> S:
        """``metric``'s series for ``model`` and ``values``, tracked for :meth:`prune`."""
        tracked = self._tracked[metric]
        known = tracked.get(model)
        if known is None:  # a new model label: first let go of those that went away
            self.prune()
            known = tracked[model] = {}
        child: S | None = known.get(values)
        if child is None:
            child = known[values] = metric.labels(model, *values)
        return child
