"""The recorded metric families (histograms and counters): each series kept in plain numbers,
rendered at scrape time as the very samples ``prometheus_client``'s own ``Histogram`` and
``Counter`` give (``_bucket`` with ``le``, ``_count``, ``_sum``, ``_created``; ``_total``,
``_created``), in the same order.

Why not those classes: a request observes several series, and their ``observe`` takes a lock
per number and walks the buckets in Python, several times a request's own work in the metrics
(the edge observes and renders on its one Trio thread, so no lock is needed). Here an
observation is one ``bisect`` and two additions.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

_go_float: Callable[[float], str] = floatToGoString
"""A bound as its ``le`` label (prometheus_client's, which its stubs leave untyped)."""

_USE_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in (
    "true",
    "1",
    "t",
)
"""Whether ``_created`` samples are rendered: prometheus_client's own switch, read the same way."""


class HistogramSeries:
    """One histogram series: a count per bucket (not cumulative), the sum, the creation time."""

    __slots__ = ("_bounds", "counts", "created", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count ``amount`` in the first bucket whose bound is >= it (the last is +Inf)."""
        self.total += amount
        if amount == amount:  # a NaN goes into the sum only, as prometheus_client's does
            self.counts[bisect_left(self._bounds, amount)] += 1


class CounterSeries:
    """One counter series: its value and creation time."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


S = TypeVar("S", HistogramSeries, CounterSeries)


class Family(Collector, Generic[S]):
    """A labelled family: its series by label values, created on first use
    (:meth:`labels`), removed by :meth:`remove`. Registered on a registry as any collector."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        kind: str,
        new_series: Callable[[], S],
        render: Callable[[Metric, str, dict[str, str], S], None],
    ) -> None:
        self.name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._kind = kind
        self._new_series: Callable[[], S] = new_series
        self._render: Callable[[Metric, str, dict[str, str], S], None] = render
        self._series: dict[tuple[str, ...], S] = {}

    def labels(self, *values: str) -> S:
        """The series of these label values (one per label name, in order), created if new."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self.name}: {len(self._labelnames)} label values expected")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = self._new_series()
        return series

    def remove(self, *values: str) -> None:
        self._series.pop(values, None)

    def describe(self) -> Iterator[Metric]:
        yield Metric(self.name, self._documentation, self._kind)

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self.name, self._documentation, self._kind)
        names = self._labelnames
        for values, series in self._series.items():
            self._render(metric, self.name, dict(zip(names, values, strict=True)), series)
        yield metric


def histogram(
    name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
) -> Family[HistogramSeries]:
    """A histogram family over ``buckets`` (sorted; +Inf is added when missing)."""
    bounds = [float(bound) for bound in buckets]
    if bounds != sorted(bounds) or len(bounds) < 1:
        raise ValueError("buckets must be sorted, at least one")
    if bounds[-1] != INF:
        bounds.append(INF)
    bound_labels = [_go_float(bound) for bound in bounds]

    def render(metric: Metric, name: str, labels: dict[str, str], series: HistogramSeries) -> None:
        cumulative = 0.0
        for le, count in zip(bound_labels, series.counts, strict=True):
            cumulative += count
            metric.add_sample(f"{name}_bucket", {**labels, "le": le}, cumulative)
        metric.add_sample(f"{name}_count", labels, cumulative)
        if bounds[0] >= 0:
            metric.add_sample(f"{name}_sum", labels, series.total)
        if _USE_CREATED:
            metric.add_sample(f"{name}_created", labels, series.created)

    return Family(
        name, documentation, labelnames, "histogram", lambda: HistogramSeries(bounds), render
    )


def counter(name: str, documentation: str, labelnames: Sequence[str]) -> Family[CounterSeries]:
    """A counter family (``name`` without ``_total``: its samples add it)."""

    def render(metric: Metric, name: str, labels: dict[str, str], series: CounterSeries) -> None:
        metric.add_sample(f"{name}_total", labels, series.value)
        if _USE_CREATED:
            metric.add_sample(f"{name}_created", labels, series.created)

    return Family(name, documentation, labelnames, "counter", CounterSeries, render)
