"""The cluster soak's checks and its summary. Each check is a pure function of a finished
:class:`~tests.cluster_chaos.soak.SoakRun` returning a :class:`~tests.chaos.checks.Check` (a name,
a figure, and when it fails the evidence: request ids, rows, log lines).

What a fault may excuse, and nothing else: a request in flight on the edge when it was
SIGKILLed may break, and its attempts then in progress may have no ledger row (no process
was left to write it); a request whose attempt ran on a node when it was SIGKILLed may end in
an error (after its commit: before, the edge recovers it); a request of the limited key may
be refused 503 ``limit_store_unavailable`` while Redis restarts. The limits are checked
within each of Redis's two lives (a restart empties it, as documented), on the requests that
lived within one.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from dispatcher.tenants import request_estimate
from tests.chaos.checks import Check
from tests.chaos.processes import tracebacks

from .soak import (
    EDGES,
    FLAKY,
    GAUGES,
    LIMITED,
    MAX_ATTEMPTS,
    NODES,
    Event,
    Seen,
    SoakRun,
    configured_slots,
    engine_name,
    nodes_in,
    slot_sums,
    total,
)

Row = dict[str, Any]

FAILED_BEFORE_COMMIT = re.compile(r"request (\S+) attempt (\d+) failed before commit: (.*)$")
NOT_SENT = re.compile(r"request (\S+) attempt (\d+) was not sent: (.*)$")
ACCESS = re.compile(r"dispatcher\.access: .* request_id=(\S+) client_request_id=(\S+) ")

SLACK = 1.0
"""Seconds around a fault within which a request's edges of time may fall (clocks of two
processes read at slightly different moments)."""


# ------------------------------------------------------------------------------ helpers


def events(run: SoakRun, kind: str) -> list[Event]:
    return [event for event in run.events if event.kind == kind]


def rows_by_client(run: SoakRun) -> dict[str, list[Row]]:
    by: dict[str, list[Row]] = {}
    for row in run.rows:
        by.setdefault(str(row.get("client_request_id")), []).append(row)
    for rows in by.values():
        rows.sort(key=lambda r: int(r["attempt"]))
    return by


def row_start(row: Row) -> float:
    return float(row["ended_at"]) - float(row["duration_s"])


def _row(row: Row) -> str:
    keys = ("attempt", "node_id", "provider_id", "outcome", "billable_to", "usage_source")
    return "{" + ", ".join(f"{k}={row.get(k)}" for k in keys) + "}"


def cut_by_edge_kill(run: SoakRun, seen: Seen) -> bool:
    """In flight on the edge when it was SIGKILLed."""
    return any(
        seen.edge == event.target and seen.started <= event.started <= seen.ended + SLACK
        for event in events(run, "edge")
    )


def hit_by_node_kill(run: SoakRun, seen: Seen, rows: list[Row]) -> str | None:
    """The node kill one of the request's attempts was running through, if any."""
    for event in events(run, "node"):
        for row in rows:
            if row["node_id"] == event.target and (
                row_start(row) - SLACK <= event.started <= float(row["ended_at"]) + SLACK
            ):
                return f"{event.target} SIGKILLed at #{event.at} during attempt {row['attempt']}"
    return None


def in_redis_outage(run: SoakRun, seen: Seen) -> bool:
    return any(
        seen.started <= event.back + SLACK and seen.ended >= event.started - SLACK
        for event in events(run, "redis")
    )


def edge_logs(run: SoakRun) -> dict[str, str]:
    return {name: text for name, text in run.logs.items() if name.split(".")[0] in EDGES}


# ------------------------------------------------------------------------------ checks


def check_no_silent_truncation(run: SoakRun) -> Check:
    bad = [seen for seen in run.seen if seen.view == "truncated"]
    return Check(
        "0 silent truncations",
        not bad,
        f"{len(bad)} of {len(run.seen)} answers ended without their finish and usage chunks "
        "and without an error, or with another text",
        [seen.describe() for seen in bad],
    )


def check_engines_within_slots(run: SoakRun) -> Check:
    evidence = []
    figures = []
    for node, providers in NODES.items():
        for provider, spec in providers.items():
            name = engine_name(node, provider)
            status = run.engines.get(name)
            if status is None:
                evidence.append(f"{name}: its status could not be read")
                continue
            figures.append(f"{name} {status['most_active']}/{spec.slots}")
            for violation in status["violations"]:
                evidence.append(
                    f"{name}: {violation['running']} requests at once, {spec.slots} slots, "
                    f"at {violation['at']:.3f}: {violation['users']}"
                )
    return Check(
        "no engine ever ran more requests than its node's slots",
        not evidence,
        "most at once / slots: " + ", ".join(figures),
        evidence,
    )


def check_edges_within_slots(run: SoakRun) -> Check:
    """Under load, what both edges are granted of a node's slots, and what they hold (in use
    or draining), never add up to more than the node has -- in consistent cuts taken with
    the node frozen (:func:`~tests.cluster_chaos.soak.take_cuts`). The engines alone cannot show
    this: a node has as many connections to its engine as slots, so work beyond them would
    wait in the node, unseen by the engine."""
    slots = configured_slots()
    evidence = list(run.beyond)
    if run.cuts < len(NODES):
        evidence.append(f"{run.cuts} cuts taken ({run.unstable_cuts} unstable): too few")
    most = ", ".join(
        f"{n}/{p} {run.granted_most.get((n, p), 0):g}|{run.held_most.get((n, p), 0):g} of {count}"
        for (n, p), count in sorted(slots.items())
    )
    return Check(
        "the edges together never granted or held more than a node's slots",
        not evidence,
        f"{run.cuts} cuts ({run.unstable_cuts} unstable); most granted|held: {most}",
        evidence,
    )


def check_failures_explained(run: SoakRun) -> Check:
    """Every answer that is neither complete nor a planned leave is one a fault explains: a
    429 of the limited key; its 503 ``limit_store_unavailable`` during Redis's restart; a
    broken connection, an error event or a 5xx of a request in flight on the killed edge or
    whose attempt ran on a killed node. Nothing hangs."""
    by = rows_by_client(run)
    evidence = []
    causes: Counter[str] = Counter()
    for seen in run.seen:
        view = seen.view
        if view in ("complete", "left", "truncated"):
            continue
        limited = seen.plan.key is LIMITED
        if view == "http_429" and limited and seen.code == "rate_limit_exceeded":
            causes["limited key over its limits (429)"] += 1
            continue
        if (
            view == "http_503"
            and limited
            and seen.code == "limit_store_unavailable"
            and in_redis_outage(run, seen)
        ):
            causes["limited key during Redis's restart (503)"] += 1
            continue
        if view in ("broken", "error_event") or view.startswith("http_5"):
            if cut_by_edge_kill(run, seen):
                causes[f"{view}: in flight on the killed edge"] += 1
                continue
            if hit_by_node_kill(run, seen, by.get(seen.request_id, [])) is not None:
                causes[f"{view}: its attempt on a killed node"] += 1
                continue
        evidence.append(
            f"{seen.describe()}; rows: {[_row(r) for r in by.get(seen.request_id, [])]}"
        )
    figure = ", ".join(f"{k} {v}" for k, v in sorted(causes.items())) or "none"
    return Check(
        "every failure explained by a fault (kills, Redis, the limited key's limits)",
        not evidence,
        f"{len(evidence)} unexplained; explained: {figure}",
        evidence,
    )


def check_surviving_edge(run: SoakRun) -> Check:
    """While the other edge is dead (from its SIGKILL until it serves again with every
    node), what the surviving edge answers is what it answers without a fault: complete, the
    client's own leave, or the limited key's 429. Recovery may hide what the death did. (A
    request whose attempt ran on a node SIGKILLed later, once the edge was back, is that
    kill's: counted apart.)"""
    by = rows_by_client(run)
    evidence = []
    during: list[Seen] = []
    node_kills = 0
    for event in events(run, "edge"):
        if not event.recovered:
            evidence.append(f"{event.describe()}: the window never closed")
            continue
        survivors = [name for name in EDGES if name != event.target]
        for seen in run.seen:
            if seen.edge not in survivors or not (
                seen.started <= event.back and seen.ended >= event.started
            ):
                continue
            during.append(seen)
            if seen.view in ("complete", "left") or (
                seen.view == "http_429" and seen.plan.key is LIMITED
            ):
                continue
            if hit_by_node_kill(run, seen, by.get(seen.request_id, [])) is not None:
                node_kills += 1
                continue
            evidence.append(seen.describe())
    if run.events and not during and not evidence:
        evidence.append("no request ran on the surviving edge while the other was dead")
    views = Counter(seen.view for seen in during)
    return Check(
        "the surviving edge's requests unaffected by the other's death",
        not evidence,
        f"{len(during)} requests on the surviving edge meanwhile: {_counts(views)}"
        + (f" ({node_kills} hit by a node kill after it)" if node_kills else ""),
        evidence,
    )


def check_one_row_per_attempt(run: SoakRun) -> Check:
    """Every dispatched attempt has exactly one PostgreSQL row: each attempt an engine saw
    has its row on that node and provider; each attempt an edge logged as failed before its
    commit has its row, and one it logged as not sent (its node lost before the request went
    out) has none; an answer's attempt (``x-dispatcher-attempts``) has its row, on the
    node and provider that answered, and no row comes after it; a request's rows share one
    ledger key, attempts 1..max_attempts, each once; no row belongs to no client. The
    attempts in progress on the killed edge when it died are excused (listed in the
    figure)."""
    by = rows_by_client(run)
    known = {seen.request_id: seen for seen in run.seen}
    excused = {seen.request_id for seen in run.seen if cut_by_edge_kill(run, seen)}
    evidence = []
    for client in sorted(set(by) - set(known)):
        evidence.append(f"rows of a request no client sent ({client}): {by[client]}")
    # the edges' ids -> the clients' (access log lines and rows)
    to_client = {str(r["request_id"]): str(r["client_request_id"]) for r in run.rows}
    failed: list[tuple[str, str, int, str]] = []
    not_sent: list[tuple[str, str, int, str]] = []
    for name, text in edge_logs(run).items():
        for line in text.splitlines():
            if (m := ACCESS.search(line)) and m.group(2) != "-":
                to_client.setdefault(m.group(1), m.group(2))
            elif m := FAILED_BEFORE_COMMIT.search(line):
                failed.append((name, m.group(1), int(m.group(2)), line.strip()))
            elif m := NOT_SENT.search(line):
                not_sent.append((name, m.group(1), int(m.group(2)), line.strip()))
    for name, edge_id, attempt, line in failed:
        owner = to_client.get(edge_id)
        if owner is None:
            if name not in run.killed:
                evidence.append(f"{name}: a failed attempt of a request with no row: {line}")
            continue
        if owner in excused:
            continue
        if attempt not in {int(r["attempt"]) for r in by.get(owner, [])}:
            evidence.append(f"{owner}: no row for attempt {attempt}, which {name} logged: {line}")
    for name, edge_id, attempt, line in not_sent:
        owner = to_client.get(edge_id)
        if owner is not None and attempt in {int(r["attempt"]) for r in by.get(owner, [])}:
            evidence.append(
                f"{owner}: a row for attempt {attempt}, which {name} never sent: {line}"
            )
    for seen in run.seen:
        rid = seen.request_id
        rows = by.get(rid, [])
        attempts = [int(r["attempt"]) for r in rows]
        where = f"{rid} (saw {seen.view}, on {seen.edge})"
        if len({r["request_id"] for r in rows}) > 1:
            evidence.append(f"{where}: rows under several ledger keys: {[_row(r) for r in rows]}")
        if len(set(attempts)) != len(attempts) or any(not 1 <= a <= MAX_ATTEMPTS for a in attempts):
            evidence.append(f"{where}: attempts {attempts}")
        answered = seen.attempts
        if answered is not None:
            later = [a for a in attempts if a > answered]
            if later:
                evidence.append(f"{where}: rows after the answering attempt {answered}: {later}")
            if rid not in excused:
                row = next((r for r in rows if int(r["attempt"]) == answered), None)
                served = (
                    seen.headers.get("x-dispatcher-node"),
                    seen.headers.get("x-dispatcher-provider"),
                )
                if row is None:
                    evidence.append(
                        f"{where}: answered by attempt {answered} but no row for it; "
                        f"rows: {[_row(r) for r in rows]}"
                    )
                elif (row["node_id"], row["provider_id"]) != served:
                    evidence.append(f"{where}: answered by {served}, its row says {_row(row)}")
                elif seen.view == "complete" and row["outcome"] != "completed":
                    evidence.append(f"{where}: a complete answer, its row says {_row(row)}")
    seen_by_engine: Counter[tuple[str, str, str]] = Counter()
    for node, providers in NODES.items():
        for provider in providers:
            status = run.engines.get(engine_name(node, provider), {})
            for call in status.get("calls", []):
                seen_by_engine[(str(call["user"]), node, provider)] += 1
    for (rid, node, provider), count in sorted(seen_by_engine.items()):
        if rid in excused:
            continue
        on = [r for r in by.get(rid, []) if (r["node_id"], r["provider_id"]) == (node, provider)]
        if len(on) < count:
            evidence.append(
                f"{rid}: {engine_name(node, provider)} answered {count} attempts of it, the "
                f"ledger has {len(on)} rows there: {[_row(r) for r in by.get(rid, [])]}"
            )
    return Check(
        "exactly one PostgreSQL row per dispatched attempt",
        not evidence,
        f"{len(run.rows)} rows for {len(by)} requests; {sum(seen_by_engine.values())} engine "
        f"requests, {len(failed)} attempts logged as failed before the commit, "
        f"{len(not_sent)} as not sent; "
        f"{len(excused)} requests in flight on the killed edge excused",
        evidence,
    )


def _epoch(run: SoakRun, seen: Seen) -> int | None:
    """Which life of Redis the request lived in: 0 before its restart, 1 after, None when
    it lived through the restart."""
    restarts = events(run, "redis")
    if not restarts:
        return 0
    event = restarts[0]
    if seen.ended < event.started:
        return 0
    if event.resumed and seen.started > event.resumed:
        return 1
    return None


@attrs.frozen
class Span:
    """A request of the limited key as its limits see it: admitted between ``sent`` and
    ``first`` (its first attempt's submission to admission), in flight at least from
    ``first`` to ``held_until`` (see :func:`held_until`); ``tokens`` billed, ``estimate``
    reserved at admission."""

    request_id: str
    sent: float
    first: float
    held_until: float
    tokens: int
    estimate: int
    view: str


def held_until(seen: Seen, rows: list[Row]) -> float:
    """A moment the request surely still held its place in flight (released when the
    request ends at the edge): the end of each attempt whose row was written as it ended.
    A cancelled attempt's row (its client left) waits for the node's confirmation, after the
    request ended: only the moment the client left counts (the edge saw it leave later), or
    failing that the attempt's start."""
    until = 0.0
    for row in rows:
        if row["outcome"] != "cancelled":
            until = max(until, float(row["ended_at"]))
        elif seen.left_at is not None:
            until = max(until, min(float(row["ended_at"]), seen.left_at))
        else:
            until = max(until, row_start(row))
    return until


def _peak(spans: list[Span]) -> tuple[list[Span], float]:
    """The most spans in flight at one instant (an end before a start at the same one: a
    span that ends where it starts, or before, is never in flight)."""
    spans = [s for s in spans if s.held_until > s.first]
    marks = sorted(
        [(s.first, 1, s) for s in spans] + [(s.held_until, -1, s) for s in spans],
        key=lambda mark: (mark[0], mark[1]),
    )
    running: list[Span] = []
    best: list[Span] = []
    at = 0.0
    for instant, step, span in marks:
        if step > 0:
            running.append(span)
            if len(running) > len(best):
                best, at = list(running), instant
        else:
            running.remove(span)
    return best, at


def limit_figures(run: SoakRun) -> tuple[dict[str, int], list[str]]:
    """The limited key's measured peaks per Redis life -- requests per minute, requests at
    once, tokens per minute -- and the evidence of any over its limit. Bounds a correct edge
    never exceeds: only the requests whose admission surely falls in a 60 s window count for
    it; the tokens of a window may exceed ``tpm`` by what its requests billed beyond their
    reservations (settled after a later admission: ``docs/cluster.md``)."""
    by = rows_by_client(run)
    limits = LIMITED.limits
    peaks = {"rpm": 0, "max_concurrent": 0, "tpm": 0}
    evidence = []
    lives: dict[int, list[Span]] = {}
    for seen in run.seen:
        rows = by.get(seen.request_id, [])
        life = _epoch(run, seen)
        if seen.plan.key is not LIMITED or not rows or life is None:
            continue
        tokens = sum(
            int(r["prompt_tokens"]) + int(r["completion_tokens"])
            for r in rows
            if r["billable_to"] == "client"
        )
        span = Span(
            seen.request_id,
            seen.started,
            min(row_start(r) for r in rows),
            held_until(seen, rows),
            tokens,
            request_estimate(seen.plan.body()),
            seen.view,
        )
        lives.setdefault(life, []).append(span)
    for life, spans in sorted(lives.items()):
        for lo in (span.sent for span in spans):
            window = [s for s in spans if s.sent >= lo and s.first < lo + 60.0]
            count, tokens = len(window), sum(s.tokens for s in window)
            beyond = sum(max(0, s.tokens - s.estimate) for s in window)
            peaks["rpm"] = max(peaks["rpm"], count)
            peaks["tpm"] = max(peaks["tpm"], tokens)
            if count > limits["rpm"]:
                evidence.append(
                    f"Redis life {life}: {count} requests admitted within 60 s from {lo:.3f}, "
                    f"rpm {limits['rpm']:g}: {[s.request_id for s in window]}"
                )
            if tokens > limits["tpm"] + beyond:
                evidence.append(
                    f"Redis life {life}: {tokens} tokens admitted within 60 s from {lo:.3f}, "
                    f"tpm {limits['tpm']:g} + {beyond} billed beyond the reservations"
                )
        peak, at_peak = _peak(spans)
        peaks["max_concurrent"] = max(peaks["max_concurrent"], len(peak))
        if len(peak) > limits["max_concurrent"]:
            evidence.append(
                f"Redis life {life}: {len(peak)} requests of the key at once at {at_peak:.3f}, "
                f"max_concurrent {limits['max_concurrent']:g}: "
                + "; ".join(
                    f"{span.request_id} ({span.view}) sent {span.sent:.3f}, in flight "
                    f"{span.first:.3f}..{span.held_until:.3f}"
                    for span in peak
                )
            )
    return peaks, evidence


def check_limits(run: SoakRun) -> Check:
    peaks, evidence = limit_figures(run)
    refused = Counter((seen.plan.key.id, seen.code) for seen in run.seen if seen.view == "http_429")
    for (key, code), count in refused.items():
        if key != LIMITED.id:
            evidence.append(f"{count} requests of {key}, a key without limits, refused {code}")
    if not refused[(LIMITED.id, "rate_limit_exceeded")]:
        evidence.append("the limited key was never refused: its limits were not exercised")
    limits = LIMITED.limits
    return Check(
        "the limited key's limits held across both edges",
        not evidence,
        f"peaks rpm {peaks['rpm']}/{limits['rpm']:g}, at once "
        f"{peaks['max_concurrent']}/{limits['max_concurrent']:g}, tpm {peaks['tpm']}/"
        f"{limits['tpm']:g}; {refused[(LIMITED.id, 'rate_limit_exceeded')]} refused 429",
        evidence,
    )


def check_at_rest(run: SoakRun) -> Check:
    """After the load: each edge's slots in use, draining, queues, requests in flight and
    outbox at 0; each node's slots, summed over the two edges' grants, equal to its own."""
    evidence = []
    if not run.settled:
        evidence.append(f"not at rest after {run.settle_s:.1f} s")
    for edge, metrics in sorted(run.metrics.items()):
        for gauge in GAUGES:
            for labels, value in metrics.get(gauge, []):
                if value:
                    evidence.append(f"{edge}: {gauge}{labels} = {value:g}")
        if nodes_in(metrics) != set(NODES):
            evidence.append(f"{edge} has the nodes {sorted(nodes_in(metrics))}")
    sums = slot_sums(run.metrics)
    if sums != configured_slots():
        evidence.append(f"slots summed over the edges {sums}, the nodes have {configured_slots()}")
    per_edge = {
        edge: {
            f"{labels['node']}/{labels['provider']}": int(value)
            for labels, value in metrics.get("dispatcher_slots_total", [])
        }
        for edge, metrics in sorted(run.metrics.items())
    }
    return Check(
        "slots, grants and queues back to full and empty",
        not evidence,
        f"slots per edge {per_edge}; settled in {run.settle_s:.1f} s",
        evidence,
    )


def check_no_tracebacks(run: SoakRun) -> Check:
    evidence = []
    for name, text in sorted(run.logs.items()):
        for trace in tracebacks(text):
            evidence.append(f"{name}.err:\n" + "\n".join("      " + x for x in trace.splitlines()))
    return Check(
        "no traceback in any log",
        not evidence,
        f"{len(evidence)} tracebacks in {len(run.logs)} process logs",
        evidence,
    )


BEYOND_GRANT = ("beyond_grant", "beyond the slots this node granted")
"""How a run refused beyond an edge's grant shows in a log: its code (an edge's access log,
a failure's cause), or the node's WARNING, which names it in words."""


def check_no_beyond_grant(run: SoakRun) -> Check:
    evidence = [
        f"{name}.err: {line.strip()}"
        for name, text in sorted(run.logs.items())
        for line in text.splitlines()
        if any(mark in line for mark in BEYOND_GRANT)
    ]
    return Check(
        "no run refused beyond an edge's grant (beyond_grant) in any node's or edge's log",
        not evidence,
        f"{len(evidence)} lines",
        evidence,
    )


def check_processes(run: SoakRun) -> Check:
    evidence = [f"{name} exited with status {code}" for name, code in sorted(run.exited.items())]
    if run.readback_error is not None:
        evidence.append(f"/metrics or an engine's status could not be read: {run.readback_error}")
    for event in run.events:
        if not event.recovered:
            evidence.append(f"{event.describe()}")
    return Check(
        "every fault recovered from, every process alive but the killed ones",
        not evidence,
        f"{len(run.logs)} processes, {len(run.killed)} killed, {len(run.exited)} exited",
        evidence,
    )


def check_coverage(run: SoakRun) -> Check:
    """The soak did what it claims: every request ran, ≥ 20% of the clients left, ~60% were
    streams, both edges served, requests were recovered after the flaky engine's faults,
    requests were sent during every fault."""
    count = len(run.seen)
    evidence = []
    if count != run.count:
        evidence.append(f"{count} of {run.count} requests ran")
    left = sum(1 for seen in run.seen if seen.view == "left")
    if left < 0.2 * count:
        evidence.append(f"only {left} of {count} clients left")
    streamed = sum(1 for plan in run.plans if plan.stream)
    if not 0.5 * run.count <= streamed <= 0.7 * run.count:
        evidence.append(f"{streamed} of {run.count} streamed")
    served = Counter(seen.edge for seen in run.seen if seen.view == "complete")
    if set(served) != set(EDGES):
        evidence.append(f"complete answers came from {dict(served)}")
    recovered = sum(1 for seen in run.seen if seen.view == "complete" and (seen.attempts or 1) > 1)
    if not recovered:
        evidence.append("no request was recovered")
    faults = sum(
        1
        for call in run.engines.get(engine_name(*FLAKY), {}).get("calls", [])
        if call["fault"] != "ok"
    )
    if not faults:
        evidence.append("the flaky engine injected no fault")
    for event in run.events:
        if not any(event.started <= seen.started <= event.back for seen in run.seen):
            evidence.append(f"{event.describe()}: no request was sent meanwhile")
    kinds = Counter(event.kind for event in run.events)
    return Check(
        "coverage: leaves, streams, both edges, recoveries, faults",
        not evidence,
        f"{left} left ({left / max(1, count):.0%}), {streamed} streamed, "
        f"{recovered} recovered, {faults} injected engine faults, events {dict(kinds)}",
        evidence,
    )


CHECKS: tuple[Callable[[SoakRun], Check], ...] = (
    check_no_silent_truncation,
    check_engines_within_slots,
    check_edges_within_slots,
    check_failures_explained,
    check_surviving_edge,
    check_one_row_per_attempt,
    check_limits,
    check_at_rest,
    check_no_tracebacks,
    check_no_beyond_grant,
    check_processes,
    check_coverage,
)


def run_checks(run: SoakRun) -> list[Check]:
    return [check(run) for check in CHECKS]


# ------------------------------------------------------------------------------ summary


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1])) or "-"


def _table(rows: Iterable[tuple[str, str]]) -> str:
    rows = list(rows)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def summary(run: SoakRun, checks: list[Check]) -> str:
    views = Counter(seen.view for seen in run.seen)
    by_edge = Counter(seen.edge for seen in run.seen)
    attempts = Counter(str(seen.attempts) for seen in run.seen if seen.attempts is not None)
    served = Counter(
        f"{seen.headers.get('x-dispatcher-node')}/{seen.headers.get('x-dispatcher-provider')}"
        for seen in run.seen
        if seen.headers.get("x-dispatcher-node")
    )
    outcomes = Counter(str(row["outcome"]) for row in run.rows)
    leaves = Counter(str(seen.plan.leave) for seen in run.seen if seen.view == "left")
    engines = ", ".join(
        f"{name} {len(status.get('calls', []))}" for name, status in sorted(run.engines.items())
    )
    figures = [
        ("seed", f"{run.seed} (CLUSTER_CHAOS_SEED={run.seed} reproduces the plan)"),
        ("requests", f"{len(run.seen)} of {run.count}, {run.concurrency} clients"),
        ("streamed", f"{sum(1 for p in run.plans if p.stream)}"),
        ("by edge", _counts(by_edge)),
        ("load", f"{run.load_s:.1f} s ({len(run.seen) / max(run.load_s, 1e-9):.1f} req/s)"),
        ("machine load", f"{os.getloadavg()[0]:.1f} (1-min), {os.cpu_count()} CPUs"),
        ("clients saw", _counts(views)),
        ("clients left", _counts(leaves)),
        ("x-dispatcher-attempts", _counts(attempts)),
        ("answered by", _counts(served)),
        ("engine requests", engines),
        ("faults", "; ".join(event.describe() for event in run.events)),
        ("ledger rows", f"{len(run.rows)}: {_counts(outcomes)}"),
        ("settle", f"{run.settle_s:.1f} s ({'settled' if run.settled else 'NOT settled'})"),
        (
            "slots at rest",
            ", ".join(
                f"{edge} {total(metrics, 'dispatcher_slots_total'):g}"
                for edge, metrics in sorted(run.metrics.items())
            ),
        ),
    ]
    result = [(("ok    " if c.ok else "FAIL  ") + c.name, c.figure) for c in checks]
    return f"cluster soak: {len(run.seen)} requests\n{_table(figures)}\nchecks:\n{_table(result)}"
