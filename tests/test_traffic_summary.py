"""A request's summary as the access log takes it: :meth:`RequestSummary.fields` is what
``attrs.asdict`` gives (it replaced it on the per-request path), key order included."""

from __future__ import annotations

import attrs

from dispatcher.observe.traffic import RequestRecord, RequestSummary


def test_fields_are_asdict_in_order() -> None:
    summary = RequestSummary(
        request_id="req-1",
        client_request_id="client-1",
        method="POST",
        path="/v1/chat/completions",
        route="/v1/chat/completions",
        model="echo",
        key_id="key-1",
        stream=True,
        state="answering",
        node="node-a",
        provider="echo",
        status=200,
        outcome="completed",
        error_code=None,
        error=None,
        attempts=2,
        queue_wait_s=0.001,
        ttft_s=0.002,
        duration_s=0.5,
        input_tokens=10,
        output_tokens=20,
        tokens_source="reported",
        dropped_tools="web_search",
        started_at=1_700_000_000.123,
    )
    assert list(summary.fields().items()) == list(attrs.asdict(summary).items())


def test_a_records_summary_copies_it_and_rounds_its_times() -> None:
    record = RequestRecord(
        request_id="req-2",
        client_request_id=None,
        method="GET",
        path="/x" * 400,
        started_at=10.0,
        started_wall=1_700_000_000.12345,
        route="/healthz",
        key_id="key-2",
        status=503,
        outcome="failed",
    )
    record.failed("busy", "try later")
    fields = record.summary(10.123456).fields()
    assert list(fields) == [field.name for field in attrs.fields(RequestSummary)]
    assert fields == {
        **fields,
        "request_id": "req-2",
        "client_request_id": None,
        "method": "GET",
        "route": "/healthz",
        "key_id": "key-2",
        "status": 503,
        "outcome": "failed",
        "error_code": "busy",
        "error": "try later",
        "state": "received",
        "model": None,
        "stream": None,
        "node": None,
        "attempts": 0,
        "queue_wait_s": None,
        "ttft_s": None,
        "input_tokens": None,
        "tokens_source": None,
        "dropped_tools": None,
        "duration_s": 0.1235,
        "started_at": 1_700_000_000.123,
    }
    assert fields["path"] == ("/x" * 400)[:297] + "..."
