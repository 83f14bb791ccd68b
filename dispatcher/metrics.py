"""Prometheus metrics for ``GET /metrics`` (every series: ``docs/metrics.md``).

Gauges and counters that admission already keeps (queue depth, slots, candidate health,
admissions by reason, rejections by cause, ejections) are read from
``Admission.statistics()`` at scrape time, so nothing is counted twice and a departed
candidate or dropped group has no series left; only what has no other home -- the queue-wait
histogram and request outcomes -- is recorded as it happens, and those series of a model
admission no longer knows (no node serves it, no config names it) are removed (see
:meth:`Metrics.prune`). Each dispatcher has its own registry (no process-global state), so
several dispatchers in one process, as in the tests, do not mix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .admission import ADMIT_REASONS, HEALTH_STATES, REJECT_CAUSES, Admission

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

OUTCOMES = (
    "completed",  # the client got a complete answer
    "failed",  # the run or its node failed (502 or an SSE error event)
    "client_gone",  # the client left before the end
    "rejected",  # admission said no: 404, 400 no capable candidate, 429, 503
    "bad_request",  # the request itself was invalid
    "shutting_down",  # refused or cut off by the edge's drain
)

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
    """What the in-flight gauges read at scrape time (the dispatcher provides it)."""

    def inflight_runs(self) -> int: ...
    def inflight_tunnels(self) -> int: ...


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


class Metrics:
    """The dispatcher's metrics registry.

    The ``model`` label of the recorded series (queue wait, requests) is bounded: a series
    is removed once admission no longer knows its model (``Admission.knows_model``: no
    candidate, no waiter, no config), at each scrape and whenever a new model label
    appears, so the series held at any time are those of models known now plus the few that
    went away since then. A model that comes back starts its series again from 0 (a counter
    reset, which ``rate()`` and ``increase()`` handle)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._wait_labels: dict[str, set[str]] = {}
        """model -> the classes it has queue-wait series for."""
        self._request_labels: dict[str, set[str]] = {}
        """model -> the outcomes it has request series for."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_AdmissionCollector(admission))
        self.inflight_requests = 0
        """Requests inside a route's counted block now (``api.common.counted_request``)."""
        self.inflight_source: InFlightSource | None = None
        self.registry.register(_InFlightCollector(self))
        self.queue_wait = Histogram(
            "dispatcher_queue_wait_seconds",
            "Time admitted requests waited for their slot, per model group and class.",
            ["model", "class"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "dispatcher_requests",
            "Client requests by model and outcome.",
            ["model", "outcome"],
            registry=self.registry,
        )

    def observe_admission(self, model: str, request_class: str, queue_wait: float) -> None:
        self._track(self._wait_labels, model, request_class)
        self.queue_wait.labels(model, request_class).observe(queue_wait)

    def count_request(self, model: str, outcome: str) -> None:
        self._track(self._request_labels, model, outcome)
        self.requests.labels(model, outcome).inc()

    def prune(self) -> None:
        """Remove the queue-wait and request series of every model admission does not know
        any more (O(models with series))."""
        for tracked, metric in (
            (self._wait_labels, self.queue_wait),
            (self._request_labels, self.requests),
        ):
            for model in [m for m in tracked if not self._known(m)]:
                for value in tracked.pop(model):
                    metric.remove(model, value)

    def render(self) -> bytes:
        self.prune()
        return generate_latest(self.registry)

    def _known(self, model: str) -> bool:
        return model == UNKNOWN_MODEL or self._admission.knows_model(model)

    def _track(self, tracked: dict[str, set[str]], model: str, value: str) -> None:
        values = tracked.get(model)
        if values is None:  # a new model label: first let go of those that went away
            self.prune()
            values = tracked[model] = set()
        values.add(value)
