"""The soak's checks and its summary table. Each check is a pure function of a finished
:class:`~tests.chaos.soak.SoakRun` and returns a :class:`Check`: a name, a figure, and when it
fails, the evidence (request ids, rows, log lines), so a failure says exactly what broke."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from .processes import tracebacks
from .soak import (
    FAULTY_PROVIDER,
    GAUGES,
    MAX_ATTEMPTS,
    MID_STREAM_MARGIN,
    NODES,
    TOTAL_SLOTS,
    EdgeLog,
    Seen,
    SoakRun,
    client_id_of,
    gauge_total,
)

EVIDENCE_LIMIT = 15
"""Items of evidence shown per failed check (the count is always given in full)."""

GAUGES_ZERO_LIMIT = 4.5
"""The gauges must read 0 within this long of the last client's end: a cancel confirmation
takes milliseconds (under 2 s on a loaded 2-core machine); the drain timeout that would
cover a lost one is 5 s."""

ROW_LATENESS_LIMIT = 4.5
"""A row may be written at most this long after its client saw the end of its request
(milliseconds normally; the wait for a cancel confirmation that never comes is 10 s)."""


@attrs.define
class Check:
    name: str
    ok: bool
    figure: str
    evidence: list[str] = attrs.field(factory=list)

    def report(self) -> str:
        lines = [f"FAILED {self.name}: {self.figure}"]
        lines += [f"    {item}" for item in self.evidence[:EVIDENCE_LIMIT]]
        if len(self.evidence) > EVIDENCE_LIMIT:
            lines.append(f"    ... and {len(self.evidence) - EVIDENCE_LIMIT} more")
        return "\n".join(lines)


def _row(row: dict[str, Any]) -> str:
    keys = (
        "attempt",
        "node_id",
        "provider_id",
        "outcome",
        "billable_to",
        "usage_source",
        "prompt_tokens",
        "completion_tokens",
        "ttft_s",
    )
    return "{" + ", ".join(f"{k}={row.get(k)}" for k in keys) + "}"


def rows_by_request(run: SoakRun) -> dict[str, list[dict[str, Any]]]:
    """Rows by the client's request id, by attempt (see :class:`~tests.chaos.soak.RowIndex`)."""
    return run.index.by_client


def _client_of(run: SoakRun, row: dict[str, Any]) -> str:
    return client_id_of(row, {s.request_id for s in run.seen})


def _log(run: SoakRun) -> EdgeLog:
    assert run.edge_log is not None
    return run.edge_log


# ------------------------------------------------------------------------------ checks


def check_no_silent_truncation(run: SoakRun) -> Check:
    bad = [s for s in run.seen if s.view in ("truncated", "wrong_content")]
    return Check(
        "0 silent truncations",
        not bad,
        f"{len(bad)} of {len(run.seen)} answers ended without [DONE] or an error event, "
        "or were cut, unparseable or wrong",
        [s.describe() for s in bad],
    )


def check_every_client_answered(run: SoakRun) -> Check:
    bad = [s for s in run.seen if s.view in ("transport_error", "hung")]
    missing = len(run.plans) - len(run.seen)
    evidence = [s.describe() for s in bad]
    if missing:
        evidence.insert(0, f"{missing} planned requests never ran")
    return Check(
        "every client got an answer (no connection dropped before it, no hang)",
        not bad and not missing,
        f"{len(bad)} without any HTTP answer or hung (> bound), {missing} not run",
        evidence,
    )


_NODE_SESSION_END = (
    "connection to the edge lost",
    "ending session",
    "dropping the connection",
    "reconnecting to",
)
"""What a node logs when its session ends (``nodes/agent.py``)."""


def check_node_sessions(run: SoakRun) -> Check:
    log = _log(run)
    killed = Counter((k.node_id, k.generation) for k in run.kills)
    ended = Counter((node, generation) for node, generation, _, _ in log.left)
    evidence = []
    for node, generation, _reason, line in log.left:
        if (node, generation) not in killed:
            evidence.append(f"unexpected session end: {line.strip()}")
    for key, count in ended.items():
        if count > 1:
            evidence.append(f"node {key[0]} generation {key[1]} ended {count} times")
    for kill in run.kills:
        if (kill.node_id, kill.generation) not in ended:
            evidence.append(
                f"killed {kill.node_id} generation {kill.generation} at request "
                f"{kill.at_request}: the edge logged no session end for it"
            )
        if kill.rejoined_generation is None:
            evidence.append(f"killed {kill.node_id} at request {kill.at_request}: never rejoined")
    for name, text in sorted(run.logs.items()):
        if not name.startswith("node-"):
            continue
        for line in text.splitlines():
            if any(marker in line for marker in _NODE_SESSION_END):
                evidence.append(f"{name}.err: {line.strip()}")
    unexpected = sum(1 for n, g, _, _ in log.left if (n, g) not in killed)
    return Check(
        "0 node sessions ended other than the killed ones",
        not evidence,
        f"{len(log.left)} sessions ended, {len(run.kills)} nodes killed, "
        f"{unexpected} unexpected ends",
        evidence,
    )


def check_gauges(run: SoakRun) -> Check:
    evidence = []
    for name in GAUGES:
        samples = run.metrics.get(name)
        if samples is None:
            evidence.append(f"{name}: not in /metrics")
            continue
        for labels, value in samples:
            if value != 0:
                evidence.append(f"{name}{json.dumps(labels, sort_keys=True)} = {value:g}")
    zero = run.gauges_zero_s
    if zero is None:
        evidence.append(f"the gauges never all read 0 in {run.settle_s:.1f} s")
    elif zero > GAUGES_ZERO_LIMIT:
        evidence.append(
            f"the gauges first all read 0 {zero:.1f} s after the last client's end "
            f"(limit {GAUGES_ZERO_LIMIT:g} s)"
        )
    figure = ", ".join(
        f"{g.removeprefix('dispatcher_')}={gauge_total(run.metrics, g):g}" for g in GAUGES
    )
    when = "never" if zero is None else f"{zero:.1f} s"
    return Check(
        f"slots, queue and in-flight gauges back to 0 (within {GAUGES_ZERO_LIMIT:g} s)",
        not evidence,
        f"{figure} (all 0 after {when})",
        evidence,
    )


def check_nodes_back(run: SoakRun) -> Check:
    total = gauge_total(run.metrics, "dispatcher_slots_total")
    nodes = {labels.get("node") for labels, _ in run.metrics.get("dispatcher_slots_total", [])}
    evidence = []
    if nodes != set(NODES):
        evidence.append(f"candidates at the end are on nodes {sorted(map(str, nodes))}")
    if total != TOTAL_SLOTS:
        evidence.append(f"dispatcher_slots_total = {total:g}, configured {TOTAL_SLOTS}")
    return Check(
        "every node back with all its slots",
        not evidence,
        f"slots_total={total:g} of {TOTAL_SLOTS} on {len(nodes)} nodes",
        evidence,
    )


def check_one_row_per_attempt(run: SoakRun) -> Check:
    """One row per dispatched attempt: attempt numbers within bounds; an answered request
    has a row for the attempt that answered (``x-dispatcher-attempts``) and none after it;
    every attempt the edge logged as failed before the commit has its row, one it logged as
    not sent (its node lost before the request went out) has none; no other row
    but one final (cancelled) row of a client that left; each request the fake upstream
    saw has at least as many rows on that provider; no row for a request nobody sent."""
    by = rows_by_request(run)
    log = _log(run)
    known = {s.request_id: s for s in run.seen}
    evidence = []
    for rid in sorted(set(by) - set(known)):
        evidence.append(f"{rid}: rows for a request no client sent: {by[rid]}")
    for seen in run.seen:
        rid = seen.request_id
        rows = by.get(rid, [])
        attempts = [r["attempt"] for r in rows]
        failed = run.index.failed.get(rid, {})
        where = f"{rid} (saw {seen.view}, {'stream' if seen.plan.stream else 'non-stream'})"
        keys = sorted({r["request_id"] for r in rows})
        if len(keys) > 1:
            evidence.append(f"{where}: its rows have {len(keys)} ledger keys: {keys}")
        echoed = seen.headers.get("x-request-id")
        if seen.status is not None and echoed not in {rid, *keys}:
            evidence.append(
                f"{where}: the edge answered x-request-id {echoed!r}, neither the client's id "
                f"nor the ledger key of its rows {keys}"
            )
        if len(set(attempts)) != len(attempts):
            evidence.append(f"{where}: duplicate attempt numbers {attempts}")
        if any(not 1 <= a <= MAX_ATTEMPTS for a in attempts):
            evidence.append(f"{where}: attempt numbers out of 1..{MAX_ATTEMPTS}: {attempts}")
        for attempt, line in sorted(failed.items()):
            if attempt not in attempts:
                evidence.append(
                    f"{where}: no row for attempt {attempt}, which the edge logged: {line.strip()}"
                )
        answered = seen.attempts
        if answered is not None:
            if answered not in attempts:
                evidence.append(
                    f"{where}: answered by attempt {answered} (x-dispatcher-attempts) but no "
                    f"row for it; rows: {[_row(r) for r in rows]}"
                )
            later = [a for a in attempts if a > answered]
            if later:
                evidence.append(f"{where}: rows after the answering attempt {answered}: {later}")
        others = [r for r in rows if r["attempt"] not in failed and r["attempt"] != answered]
        if seen.view == "left" and answered is None:
            # the attempt in progress when the client left: dispatched (one row) or not
            if len(others) > 1:
                evidence.append(
                    f"{where}: {len(others)} rows neither logged as failed nor final: "
                    f"{[_row(r) for r in others]}"
                )
        elif others:
            evidence.append(
                f"{where}: rows for attempts the edge never logged as failed nor answered "
                f"with: {[_row(r) for r in others]}"
            )
    upstream = Counter(str(r.get("user")) for r in run.upstream_requests)
    for user, count in sorted(upstream.items()):
        on_faulty = [r for r in by.get(user, []) if r["provider_id"] == FAULTY_PROVIDER]
        if len(on_faulty) < count:
            evidence.append(
                f"{user}: the faulty upstream got {count} requests for it but the ledger has "
                f"{len(on_faulty)} rows on {FAULTY_PROVIDER}"
            )
    for line in run.index.unmapped:
        evidence.append(f"the edge logged a failed attempt of a request with no row: {line}")
    for key, unsent in sorted(log.not_sent.items()):
        owner = run.index.edge_ids.get(key) or (key if key in known else None)
        had = {r["attempt"] for r in by.get(owner, [])} if owner is not None else set()
        for attempt in sorted(set(unsent) & had):
            evidence.append(
                f"{owner}: a row for attempt {attempt}, which the edge logged as never sent: "
                f"{unsent[attempt].strip()}"
            )
    if run.usage_truncated:
        evidence.insert(0, "GET /v1/usage was truncated: not every row was read")
    for line in log.text.splitlines():
        if "dispatcher.usage" in line and ("ERROR" in line or "duplicate" in line.lower()):
            evidence.append(f"ledger: {line.strip()}")
    return Check(
        "exactly one ledger row per dispatched attempt",
        not evidence,
        f"{len(run.rows)} rows for {len(by)} requests; "
        f"{sum(len(v) for v in log.failed_before_commit.values())} attempts logged as failed "
        f"before the commit, {sum(len(v) for v in log.not_sent.values())} as not sent"
        + (", rows keyed by the edge's own ids" if _edge_keyed(run) else ""),
        evidence,
    )


def _edge_keyed(run: SoakRun) -> bool:
    return any(r["request_id"] != _client_of(run, r) for r in run.rows)


def check_completed_usage(run: SoakRun) -> Check:
    """Every ``completed`` row carries the node's reported usage, and it is what the client
    was told (and what echo / the fake upstream report: words in, words out)."""
    known = {s.request_id: s for s in run.seen}
    evidence = []
    completed = [r for r in run.rows if r["outcome"] == "completed"]
    for row in completed:
        rid = _client_of(run, row)
        seen = known.get(rid)
        problems = []
        if row["usage_source"] != "reported":
            problems.append(f"usage_source={row['usage_source']}")
        tokens = (row["prompt_tokens"], row["completion_tokens"])
        if seen is not None:
            words = (seen.plan.prompt_words, len(seen.plan.words))
            if tokens != words:
                problems.append(
                    f"tokens {tokens} but the request is {words[0]} words in, {words[1]} out"
                )
        if seen is not None and seen.usage is not None and tuple(seen.usage) != tokens:
            problems.append(f"the client was told usage {seen.usage}")
        if problems:
            evidence.append(f"{rid}: completed row {_row(row)}: {'; '.join(problems)}")
    return Check(
        "every completed row carries the node's reported usage",
        not evidence,
        f"{len(completed)} completed rows, {len(evidence)} without the reported usage",
        evidence,
    )


def check_echo_usage_reported(run: SoakRun) -> Check:
    """Every row of an ``echo`` attempt carries the node's reported usage, whatever its
    outcome -- echo reports usage from its start, and the node sends it with the run's end
    or its cancel confirmation -- unless the node was killed while the attempt ran (then the
    edge can only estimate). (The ``openai`` adapter learns usage only from the upstream's
    last chunk, so its unfinished attempts are estimated by the node, rightly.)"""
    evidence = []
    echo_rows = [r for r in run.rows if r["provider_id"] == "echo"]
    for row in echo_rows:
        if row["usage_source"] == "reported":
            continue
        start = row["ended_at"] - (row["duration_s"] or 0.0)
        killed = [
            k
            for k in run.kills
            if k.node_id == row["node_id"] and start - 0.5 <= k.at_wall <= row["ended_at"] + 0.5
        ]
        if not killed:
            evidence.append(
                f"{_client_of(run, row)}: {_row(row)} is estimated, and {row['node_id']} was "
                "not killed while it ran"
            )
    return Check(
        "every echo row carries the node's reported usage (unless its node was killed)",
        not evidence,
        f"{len(echo_rows)} echo rows, "
        f"{sum(1 for r in echo_rows if r['usage_source'] != 'reported')} estimated, "
        f"{len(evidence)} of them on a live node",
        evidence,
    )


RACE_WORDS = MID_STREAM_MARGIN
"""A client that left after ``n`` words may find its row ``failed`` when the upstream failed
the run after ``n``..``n + RACE_WORDS`` words: the failure was on its way, unread (a client
on a loaded machine lags behind the edge)."""
RACE_SECONDS = 0.5
"""... or when its node was SIGKILLed within this long of the client leaving."""


def raced_failure(run: SoakRun, seen: Seen, row: dict[str, Any]) -> str | None:
    """Why a client that left mid-stream and a ``failed`` row are both right, if they are:
    the run failed at the edge at the moment the client left, before the client read the
    error event (a race no one can order from outside). None otherwise."""
    if seen.view != "left" or row["outcome"] != "failed":
        return None
    got = seen.words_received
    if row["provider_id"] == FAULTY_PROVIDER:
        for entry in run.upstream_requests:
            after = entry.get("after")
            if (
                entry.get("user") == seen.request_id
                and entry.get("fault") in ("error_mid_stream", "reset_mid_stream")
                and isinstance(after, int)
                and got <= after <= got + RACE_WORDS
            ):
                return f"the upstream failed it after {after} words, the client left after {got}"
    for kill in run.kills:
        if kill.node_id == row["node_id"] and abs(kill.at_wall - seen.ended_at) <= RACE_SECONDS:
            return (
                f"{kill.node_id} was killed {kill.at_wall - seen.ended_at:+.2f} s from the "
                "client leaving"
            )
    return None


def _final_expectation(seen: Seen) -> tuple[set[str], str | None, bool]:
    """(allowed final outcomes, required billable_to or None, must a final row exist)."""
    view = seen.view
    if view == "complete":
        return {"completed"}, "client", True
    if view == "error_event":
        return {"failed"}, "client", True
    if view == "left":
        if seen.left_after_headers:
            return {"cancelled"}, "client", True
        return {"cancelled"}, None, False
    return set(), None, False  # an HTTP error: no final row, every row aborted


def check_outcomes_match_clients(run: SoakRun) -> Check:
    """The final row of each request says what its client saw: ``completed`` iff a full
    answer, ``cancelled`` iff the client left, ``failed`` iff an error after the stream
    began; every other row (and every row of a 502) is ``aborted``, billed to the
    operator."""
    by = rows_by_request(run)
    evidence = []
    raced: list[str] = []
    mismatches: Counter[str] = Counter()
    for seen in run.seen:
        if seen.view in ("truncated", "wrong_content", "transport_error", "hung"):
            continue  # reported by their own checks
        rows = by.get(seen.request_id, [])
        allowed, billable, required = _final_expectation(seen)
        final = [r for r in rows if r["outcome"] != "aborted"]
        aborted = [r for r in rows if r["outcome"] == "aborted"]
        problems = []
        if len(final) > 1:
            problems.append(f"{len(final)} rows not aborted")
        if final:
            row = final[-1]
            race = raced_failure(run, seen, row)
            if race is not None:
                raced.append(f"{seen.request_id}: {race}")
            elif row["outcome"] not in allowed:
                problems.append(f"final row says {row['outcome']}")
                mismatches[f"{seen.view} -> {row['outcome']}"] += 1
            elif billable is not None and row["billable_to"] != billable:
                problems.append(f"final row billable_to={row['billable_to']}, not {billable}")
                mismatches[f"{seen.view} -> billable {row['billable_to']}"] += 1
            if rows and row["attempt"] != max(r["attempt"] for r in rows):
                problems.append("the final row is not the last attempt")
        elif required:
            problems.append("no final row")
            mismatches[f"{seen.view} -> no row"] += 1
        for row in aborted:
            if row["billable_to"] != "operator":
                problems.append(f"aborted attempt {row['attempt']} billed to {row['billable_to']}")
        if problems:
            evidence.append(
                f"{seen.describe()}: {'; '.join(problems)}; rows: {[_row(r) for r in rows]}"
            )
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(mismatches.items())) or "none"
    if evidence and raced:
        evidence += [f"(accepted, a failure raced the leave) {item}" for item in raced]
    return Check(
        "every row's outcome equals what its client saw",
        not evidence,
        f"{len(evidence) - (len(raced) if evidence else 0)} requests whose rows disagree with "
        f"their client (by kind: {summary}); {len(raced)} left as their run failed "
        "(failed rows accepted)",
        evidence,
    )


_VIEW_METRIC = {"complete": "completed", "left": "client_gone", "error_event": "failed"}
_ROW_METRIC = {
    "completed": "completed",
    "cancelled": "client_gone",
    "failed": "failed",
    "aborted": "failed",
}


def _metric_for_view(view: str) -> str | None:
    if view.startswith("http_5"):
        return "failed"
    return _VIEW_METRIC.get(view)


def check_request_metrics(run: SoakRun) -> Check:
    """``dispatcher_requests_total`` by outcome equals the clients' view
    (completed = full answers, client_gone = clients that left, failed = SSE error events
    and 5xx answers)."""
    counted: Counter[str] = Counter()
    labels_seen: Counter[str] = Counter()
    for labels, value in run.metrics.get("dispatcher_requests_total", []):
        # every model label: a request whose body the edge never read counts as "unknown"
        counted[labels.get("outcome") or "?"] += int(value)
        if value:
            labels_seen[f"{labels.get('model')}/{labels.get('outcome')}"] += int(value)
    expected: Counter[str] = Counter()
    by = rows_by_request(run)
    races = 0
    for seen in run.seen:
        rows = by.get(seen.request_id)
        if rows and raced_failure(run, seen, rows[-1]) is not None:
            races += 1  # client_gone or failed: either is right
            continue
        outcome = _metric_for_view(seen.view)
        if outcome is not None:
            expected[outcome] += 1
    evidence = []
    if counted["completed"] != expected["completed"]:
        evidence.append(
            f"outcome=completed: the edge counted {counted['completed']}, "
            f"the clients saw {expected['completed']}"
        )
    for outcome in ("client_gone", "failed"):
        low, high = expected[outcome], expected[outcome] + races
        if not low <= counted[outcome] <= high:
            want = str(low) if low == high else f"{low}..{high}"
            evidence.append(
                f"outcome={outcome}: the edge counted {counted[outcome]}, the clients saw {want}"
            )
    together = expected["client_gone"] + expected["failed"] + races
    if not evidence and counted["client_gone"] + counted["failed"] != together:
        evidence.append(
            f"client_gone + failed: the edge counted "
            f"{counted['client_gone'] + counted['failed']}, the clients saw {together}"
        )
    if evidence:
        # The metric is one number per outcome; name the requests whose last row (which
        # the edge may count by) disagrees with what their client saw.
        for seen in run.seen:
            rows = by.get(seen.request_id)
            wanted = _metric_for_view(seen.view)
            if not rows or wanted is None:
                continue
            by_row = _ROW_METRIC[rows[-1]["outcome"]]
            if by_row != wanted:
                evidence.append(
                    f"suspect {seen.describe()}: its last row is {rows[-1]['outcome']} "
                    f"(-> {by_row}), the client saw {seen.view} (-> {wanted}); "
                    f"rows: {[_row(r) for r in rows]}"
                )
    if evidence:
        evidence.insert(0, f"dispatcher_requests_total by model/outcome: {_counts(labels_seen)}")
    return Check(
        "request-outcome metrics equal what the clients saw",
        not evidence,
        ", ".join(f"{k}={counted[k]}" for k in sorted(counted) if counted[k])
        + " (clients: "
        + ", ".join(f"{k}={expected[k]}" for k in sorted(expected))
        + (f", {races} either client_gone or failed" if races else "")
        + ")",
        evidence,
    )


def check_recovery_excludes_failed(run: SoakRun) -> Check:
    """A recovery never re-chooses a candidate (node, provider) that already failed for the
    request, whatever its generation."""
    evidence = []
    for rid, rows in sorted(rows_by_request(run).items()):
        failed: set[tuple[str, str]] = set()
        for row in rows:
            key = (row["node_id"], row["provider_id"])
            if key in failed:
                evidence.append(
                    f"{rid}: attempt {row['attempt']} went to {key[0]}/{key[1]} again after it "
                    f"failed for this request; rows: {[_row(r) for r in rows]}"
                )
            if row["outcome"] == "aborted":
                failed.add(key)
    return Check(
        "a recovery never re-chooses a candidate that failed for the request",
        not evidence,
        f"{len(evidence)} re-chosen candidates",
        evidence,
    )


def check_rows_prompt(run: SoakRun) -> Check:
    """No row waits: each is written within :data:`ROW_LATENESS_LIMIT` of its client's end."""
    known = {s.request_id: s for s in run.seen}
    late = []
    worst = 0.0
    for row in run.rows:
        seen = known.get(_client_of(run, row))
        if seen is None:
            continue
        lateness = row["ended_at"] - seen.ended_at
        worst = max(worst, lateness)
        if lateness > ROW_LATENESS_LIMIT:
            late.append((lateness, row, seen))
    late.sort(key=lambda item: -item[0])
    return Check(
        f"rows written within {ROW_LATENESS_LIMIT:g} s of their client's end",
        not late,
        f"{len(late)} late rows, worst {worst:.2f} s",
        [
            f"{s.request_id}: row {_row(r)} written {t:.2f} s after the client saw {s.view}"
            for t, r, s in late
        ],
    )


def check_processes_alive(run: SoakRun) -> Check:
    """Every process but the SIGKILLed ones still runs, and the edge answered at the end."""
    evidence = [f"{name} exited with status {code}" for name, code in sorted(run.exited.items())]
    if run.readback_error is not None:
        evidence.append(f"/metrics or GET /v1/usage could not be read: {run.readback_error}")
    return Check(
        "every process alive (but the killed ones), the edge answering",
        not evidence,
        f"{len(run.logs)} processes, {len(run.exited)} exited on their own",
        evidence,
    )


def check_no_tracebacks(run: SoakRun) -> Check:
    evidence = []
    for name, text in sorted(run.logs.items()):
        for trace in tracebacks(text):
            evidence.append(
                f"{name}.err:\n" + "\n".join("      " + line for line in trace.splitlines())
            )
    return Check(
        "no traceback in any process's log",
        not evidence,
        f"{len(evidence)} tracebacks in {len(run.logs)} process logs",
        evidence,
    )


def check_coverage(run: SoakRun) -> Check:
    """The soak did what it claims: ≥ 20% of clients left, at each kind of point; the nodes
    were killed; the faulty provider injected faults."""
    count = len(run.seen)
    left = [s for s in run.seen if s.view == "left"]
    by = rows_by_request(run)
    kinds = leave_kinds(run, by)
    evidence = []
    if count and len(left) < 0.2 * count:
        evidence.append(f"only {len(left)} of {count} clients left ({len(left) / count:.0%})")
    for kind, n in kinds.items():
        if n == 0:
            evidence.append(f"no client left {kind}")
    planned_kills = sum(
        1 for i in range(1, run.count) if run.kill_every and i % run.kill_every == 0
    )
    if len(run.kills) != planned_kills:
        evidence.append(f"{len(run.kills)} nodes killed, {planned_kills} planned")
    faults = Counter(r["fault"] for r in run.upstream_requests)
    if sum(v for k, v in faults.items() if k != "ok") == 0:
        evidence.append("the faulty provider injected no fault")
    return Check(
        "coverage: ≥ 20% of clients left (queued, before the first token, mid-stream), "
        "kills and faults happened",
        not evidence,
        f"{len(left)} left ({len(left) / max(1, count):.0%}): "
        + ", ".join(f"{k} {v}" for k, v in kinds.items()),
        evidence,
    )


def leave_kinds(run: SoakRun, by: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    """Where the clients that left were, as measured: no row for the attempt in progress
    (still queued, or not yet sent), a row without a first token, or mid-stream."""
    kinds = {"while queued": 0, "after dispatch, before the first token": 0, "mid-stream": 0}
    for seen in run.seen:
        if seen.view != "left":
            continue
        if seen.left_after_headers:
            kinds["mid-stream"] += 1
            continue
        failed = run.index.failed.get(seen.request_id, {})
        last = [r for r in by.get(seen.request_id, []) if r["attempt"] not in failed]
        if not last:
            kinds["while queued"] += 1
        elif last[-1].get("ttft_s") is None:
            kinds["after dispatch, before the first token"] += 1
        else:
            kinds["mid-stream"] += 1  # committed at the edge, headers not yet read
    return kinds


CHECKS: tuple[Callable[[SoakRun], Check], ...] = (
    check_no_silent_truncation,
    check_every_client_answered,
    check_node_sessions,
    check_gauges,
    check_nodes_back,
    check_one_row_per_attempt,
    check_completed_usage,
    check_echo_usage_reported,
    check_outcomes_match_clients,
    check_request_metrics,
    check_recovery_excludes_failed,
    check_rows_prompt,
    check_processes_alive,
    check_no_tracebacks,
    check_coverage,
)


def run_checks(run: SoakRun) -> list[Check]:
    return [check(run) for check in CHECKS]


# ------------------------------------------------------------------------------ summary


def _table(rows: Iterable[tuple[str, str]]) -> str:
    rows = list(rows)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1])) or "-"


def summary(run: SoakRun, checks: list[Check]) -> str:
    by = rows_by_request(run)
    views = Counter(s.view for s in run.seen)
    stream = sum(1 for p in run.plans if p.stream)
    planned_leave = Counter(p.leave for p in run.plans)
    attempts = Counter(str(s.attempts) for s in run.seen if s.attempts is not None)
    served = Counter(
        f"{s.headers.get('x-dispatcher-node')}/{s.headers.get('x-dispatcher-provider')}"
        for s in run.seen
        if s.headers.get("x-dispatcher-node")
    )
    outcomes = Counter(r["outcome"] for r in run.rows)
    sources = Counter(f"{r['outcome']}:{r['usage_source']}" for r in run.rows)
    providers = Counter(f"{r['node_id']}/{r['provider_id']}" for r in run.rows)
    faults = Counter(r["fault"] for r in run.upstream_requests)
    log = _log(run)
    kills = "; ".join(
        f"#{k.at_request} {k.node_id} gen {k.generation}->{k.rejoined_generation}"
        + (f" ({k.rejoin_s:.2f} s)" if k.rejoin_s is not None else "")
        for k in run.kills
    )
    rss = (
        f"{(run.rss_before_kib or 0) / 1024:.1f} MiB -> {(run.rss_after_kib or 0) / 1024:.1f} MiB "
        f"(peak {(run.rss_peak_kib or 0) / 1024:.1f} MiB)"
    )
    figures = [
        ("seed", f"{run.seed} (CHAOS_SEED={run.seed} reproduces the plan)"),
        (
            "requests",
            f"{len(run.seen)} of {run.count} ({stream} streamed, {run.count - stream} not)",
        ),
        ("concurrency", f"{run.concurrency} clients, {TOTAL_SLOTS} slots on {len(NODES)} nodes"),
        (
            "machine load",
            "-"
            if run.load_average is None
            else f"{run.load_average[0]:.1f} -> {run.load_average[1]:.1f} (1-min load average, "
            f"{os.cpu_count()} CPUs)",
        ),
        ("load time", f"{run.load_s:.1f} s ({len(run.seen) / max(run.load_s, 1e-9):.1f} req/s)"),
        ("planned leaves", _counts(Counter({k: v for k, v in planned_leave.items() if k != "no"}))),
        ("clients saw", _counts(views)),
        ("clients left at", ", ".join(f"{k} {v}" for k, v in leave_kinds(run, by).items())),
        ("x-dispatcher-attempts", _counts(attempts)),
        ("answered by", _counts(served)),
        ("upstream requests", f"{len(run.upstream_requests)}: {_counts(faults)}"),
        ("node kills", f"{len(run.kills)}: {kills or '-'}"),
        ("node sessions ended", f"{len(log.left)} (joined {len(log.joined)})"),
        ("ledger rows", f"{len(run.rows)} for {len(by)} requests: {_counts(outcomes)}"),
        ("rows by usage source", _counts(sources)),
        ("rows by provider", _counts(providers)),
        ("failed-before-commit", str(sum(len(v) for v in log.failed_before_commit.values()))),
        (
            "gauges",
            ", ".join(
                f"{g.removeprefix('dispatcher_')} {gauge_total(run.metrics, g):g}" for g in GAUGES
            ),
        ),
        (
            "settle",
            f"{run.settle_s:.1f} s ({'settled' if run.settled else 'NOT settled'}; gauges 0 "
            f"after {'never' if run.gauges_zero_s is None else f'{run.gauges_zero_s:.1f} s'})",
        ),
        ("edge RSS", rss),
    ]
    result = [(("ok    " if c.ok else "FAIL  ") + c.name, c.figure) for c in checks]
    return f"chaos soak: {len(run.seen)} requests\n{_table(figures)}\nchecks:\n{_table(result)}"
