"""Prometheus metrics for ``GET /metrics``.

Gauges and counters that admission already keeps (queue depth, slots, admissions by reason,
rejections by cause) are read from ``Admission.statistics()`` at scrape time, so nothing is
counted twice; only what has no other home -- the queue-wait histogram and request outcomes --
is recorded as it happens. Each dispatcher has its own registry (no process-global state), so
several dispatchers in one process, as in the tests, do not mix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .admission import Admission
from .admission._core import ADMIT_REASONS, REJECT_CAUSES

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
        for key, candidate in sorted(stats.candidates.items()):
            values = [key.node_id, key.provider_id, key.model]
            total.add_metric(values, candidate.total)
            in_use.add_metric(values, candidate.in_use)
            draining.add_metric(values, candidate.draining)
        yield total
        yield in_use
        yield draining

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
    def __init__(self, admission: Admission) -> None:
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
        self.queue_wait.labels(model, request_class).observe(queue_wait)

    def count_request(self, model: str, outcome: str) -> None:
        self.requests.labels(model, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
