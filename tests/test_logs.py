"""The two log formats (``dispatcher.logs``): what a client or a node sent is escaped, so a
line is always one line, and the JSON format parses with stable keys."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from dispatcher.observe.logs import (
    FIELDS,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    escape_text,
    format_value,
)

FORGED = 'node "a"\r\n2026-01-01 00:00:00,000 INFO    dispatcher.access: forged=1\u2028\x1b[31m'


def record(
    message: str = "%s done",
    *args: object,
    fields: dict[str, object] | None = None,
    exc_info: bool = False,
) -> logging.LogRecord:
    info = sys.exc_info() if exc_info else None
    made = logging.LogRecord("dispatcher.access", logging.INFO, __file__, 1, message, args, info)
    if fields is not None:
        setattr(made, FIELDS, fields)
    return made


@pytest.mark.parametrize(
    ("value", "written"),
    [
        (None, "-"),
        (True, "true"),
        (200, "200"),
        (12.5, "12.5"),
        ("req-0a1b", "req-0a1b"),
        ("/v1/responses/{id}", "/v1/responses/{id}"),
        ("two words", '"two words"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("a=b", '"a=b"'),
        ("back\\slash", '"back\\\\slash"'),
        ("cr\rlf\n", '"cr\\rlf\\n"'),
        ("nel\x85ls\u2028esc\x1b", '"nel\\x85ls\\u2028esc\\x1b"'),
        ("héllo wörld", '"héllo wörld"'),
    ],
)
def test_format_value(value: object, written: str) -> None:
    assert format_value(value) == written


def test_escape_text_leaves_printable_text() -> None:
    assert escape_text("plain text, é and 漢字") == "plain text, é and 漢字"
    assert escape_text("a\r\nb\tc\x00") == "a\\r\\nb\\tc\\x00"


def test_text_line_escapes_fields_and_message() -> None:
    line = TextFormatter().format(
        record("node %s said", FORGED, fields={"node_label": FORGED, "status": 200})
    )
    assert "\n" not in line
    assert "\r" not in line
    assert "\u2028" not in line
    assert "\x1b" not in line
    assert line.count("dispatcher.access:") == 3  # the real one; the forged ones escaped
    assert line.endswith(
        ' node_label="node \\"a\\"\\r\\n2026-01-01 00:00:00,000 INFO    '
        'dispatcher.access: forged=1\\u2028\\x1b[31m" status=200'
    )
    assert ' INFO    dispatcher.access: node node "a"\\r\\n2026' in line


def raised(error: Exception) -> logging.LogRecord:
    """A record logged while handling ``error`` (its traceback attached)."""
    try:
        raise error
    except type(error):
        return record("failed", exc_info=True)


def test_text_traceback_still_follows_on_its_own_lines() -> None:
    text = TextFormatter().format(raised(ValueError("boom")))
    first, *rest = text.splitlines()
    assert first.endswith("dispatcher.access: failed")
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ValueError: boom"


def test_json_line_is_one_object_with_stable_keys() -> None:
    fields = {"node_label": FORGED, "status": 502, "message": "a field", "ttft_ms": None}
    line = JsonFormatter().format(record("%s done", "POST /v1/x", fields=fields))
    assert "\n" not in line
    assert "\r" not in line
    assert line.isascii()  # U+2028 and every non-ASCII character escaped too
    document = json.loads(line)
    assert list(document)[:4] == ["ts", "level", "logger", "message"]
    assert document["level"] == "info"
    assert document["logger"] == "dispatcher.access"
    assert document["message"] == "POST /v1/x done"
    assert document["node_label"] == FORGED  # escaped on the wire, the same text parsed
    assert document["status"] == 502
    assert document["field_message"] == "a field"  # cannot replace the fixed key
    assert document["ttft_ms"] is None
    assert document["ts"].endswith("Z")
    assert len(document["ts"]) == len("2026-01-01T00:00:00.000Z")


def test_json_exception() -> None:
    line = JsonFormatter().format(raised(ValueError("boom\r\nforged")))
    assert "\n" not in line
    document = json.loads(line)
    assert document["exception"].startswith("Traceback (most recent call last):")
    assert document["exception"].endswith("ValueError: boom\r\nforged")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_configure_logging(log_format: str) -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        handler = configure_logging("INFO", log_format, stream)  # type: ignore[arg-type]
        assert root.handlers == [handler]
        logging.getLogger("dispatcher.test").debug("hidden")
        logging.getLogger("dispatcher.test").info("line\none", extra={FIELDS: {"k": "v w"}})
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    if log_format == "json":
        document = json.loads(lines[0])
        assert (document["message"], document["k"]) == ("line\none", "v w")
    else:
        assert lines[0].endswith('dispatcher.test: line\\none k="v w"')


def test_the_store_clients_retries_are_not_logged() -> None:
    """A Redis or PostgreSQL that is down makes coredis (INFO) and psycopg's pool (WARNING)
    log every retry, several a second: the edge's own WARNING says it once."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "text", stream)
        logging.getLogger("coredis").info("Retry attempt 1 due to error")
        logging.getLogger("coredis").warning("a real problem")
        logging.getLogger("psycopg.pool").warning("error connecting in 'dispatcher ...'")
        logging.getLogger("psycopg.pool").error("a real pool problem")
        logging.getLogger("dispatcher").info("ours")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    text = stream.getvalue()
    assert "Retry attempt" not in text
    assert "a real problem" in text
    assert "error connecting" not in text
    assert "a real pool problem" in text
    assert "ours" in text
