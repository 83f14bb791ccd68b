"""The recorded metric families (``dispatcher.series``) render what prometheus_client's own
``Histogram`` and ``Counter`` render for the same observations, and ``Metrics``' cache of an
ended request's series follows what ``prune`` removes."""

from __future__ import annotations

import math
import random
import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from dispatcher.admission import Admission, PolicySnapshot
from dispatcher.observe import series
from dispatcher.observe.metrics import (
    REQUEST_DURATION_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    Metrics,
)

from .admission.helpers import cand


def _created_masked(text: bytes) -> bytes:
    """The exposition with each ``_created`` value (a creation time) replaced."""
    return re.sub(rb"(_created\{[^}]*\}) \S+", rb"\1 T", text)


def test_families_render_as_prometheus_clients_own() -> None:
    theirs, ours = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    labels = ["model", "route"]
    duration = Histogram("d_seconds", "Durations.", labels, buckets=REQUEST_DURATION_BUCKETS,
                         registry=theirs)  # fmt: skip
    our_duration = series.histogram("d_seconds", "Durations.", labels, REQUEST_DURATION_BUCKETS)
    tokens = Histogram("tokens", "Tokens.", ["model"], buckets=TOKEN_BUCKETS, registry=theirs)
    our_tokens = series.histogram("tokens", "Tokens.", ["model"], TOKEN_BUCKETS)
    requests = Counter("requests", "Requests.", ["model", "outcome"], registry=theirs)
    our_requests = series.counter("requests", "Requests.", ["model", "outcome"])
    for family in (our_duration, our_tokens, our_requests):
        ours.register(family)
    rnd = random.Random(7)
    for _ in range(3000):
        model = rnd.choice(["a", "b", "c"])
        # bounds exactly, between them, past the last, zero
        amount = rnd.choice([0, 0.01, 0.02, 81.92, 100.0, rnd.random() * 3, rnd.expovariate(4)])
        duration.labels(model, "/x").observe(amount)
        our_duration.labels(model, "/x").observe(amount)
        count = rnd.choice([0, 1, 4, 5, 16, 10**9, rnd.randrange(10**6)])
        tokens.labels(model).observe(count)
        our_tokens.labels(model).observe(count)
        outcome, step = rnd.choice(["completed", "failed"]), rnd.choice([1, 2, 3])
        requests.labels(model, outcome).inc(step)
        our_requests.labels(model, outcome).inc(step)
    duration.remove("b", "/x")
    our_duration.remove("b", "/x")
    expected = _created_masked(generate_latest(theirs))
    assert _created_masked(generate_latest(ours)) == expected
    assert b'd_seconds_bucket{le="0.02",model="a",route="/x"}' in expected
    assert b"_created" in expected
    assert b'model="b",route' not in expected


def test_a_nan_goes_into_the_sum_only_as_prometheus_clients() -> None:
    theirs, ours = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    histogram = Histogram("t_seconds", "T.", ["model"], buckets=TTFT_BUCKETS, registry=theirs)
    our_histogram = series.histogram("t_seconds", "T.", ["model"], TTFT_BUCKETS)
    ours.register(our_histogram)
    for amount in (0.5, math.nan, 2.0):
        histogram.labels("m").observe(amount)
        our_histogram.labels("m").observe(amount)
    text = _created_masked(generate_latest(ours))
    assert text == _created_masked(generate_latest(theirs))
    assert b't_seconds_count{model="m"} 2.0' in text
    assert b"NaN" in text


def _request_series(metrics: Metrics, model: str) -> list[str]:
    text = generate_latest(metrics.registry).decode()
    return sorted(
        line.split("{")[0]
        for line in text.splitlines()
        if line.startswith("gen_ai_") and f'gen_ai_request_model="{model}"' in line
    )


async def test_request_series_are_made_when_first_needed_and_again_after_a_prune() -> None:
    admission = Admission(PolicySnapshot(groups={}))
    metrics = Metrics(admission)
    admission.node_joined([cand(model="m")])
    route = "/v1/chat/completions"
    metrics.observe_request(route=route, model="m", outcome="failed", duration=0.1, ttft=None,
                            tokens=None, attempts=0)  # fmt: skip
    # no first output, no tokens, no attempt: only the duration's series
    assert set(_request_series(metrics, "m")) == {
        "gen_ai_server_request_duration_seconds_bucket",
        "gen_ai_server_request_duration_seconds_count",
        "gen_ai_server_request_duration_seconds_created",
        "gen_ai_server_request_duration_seconds_sum",
    }
    metrics.observe_request(route=route, model="m", outcome="failed", duration=0.1, ttft=0.05,
                            tokens=(3, 4), attempts=2)  # fmt: skip
    text = generate_latest(metrics.registry).decode()
    assert 'gen_ai_server_time_to_first_token_seconds_count{gen_ai_operation_name="chat"' in text
    assert 'dispatcher_recoveries_total{model="m"} 1.0' in text
    assert 'dispatcher_attempts_total{model="m"} 2.0' in text

    admission.node_left("node-a", 1)
    metrics.prune()
    assert _request_series(metrics, "m") == []
    admission.node_joined([cand("node-b", model="m")])  # the model comes back
    metrics.observe_request(route=route, model="m", outcome="failed", duration=0.2, ttft=None,
                            tokens=None, attempts=1)  # fmt: skip
    text = generate_latest(metrics.registry).decode()
    # counted again from 0 in series the registry holds (not in the pruned ones)
    assert 'gen_ai_server_request_duration_seconds_count{gen_ai_operation_name="chat"' in text
    assert 'dispatcher_attempts_total{model="m"} 1.0' in text
    assert 'dispatcher_recoveries_total{model="m"} 0.0' in text
