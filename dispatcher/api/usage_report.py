"""``GET /v1/usage`` on the HTTP side: its query string parsed into the ledger's query
(:func:`parse_usage_query`) and the report rendered as the response body
(:func:`usage_report_json`). The ledger itself (rows, SQLite, queries) is
:mod:`dispatcher.usage`."""

from __future__ import annotations

import datetime
import math
import urllib.parse
from typing import Final

import attrs
import orjson

from ..usage import MAX_QUERY_LIMIT, TokenTotals, UsageQuery, UsageReport

__all__ = ["parse_usage_query", "usage_report_json"]

_QUERY_PARAMETERS: Final = (
    "since",
    "until",
    "attribution",
    "model",
    "client_request_id",
    "limit",
)


def _parse_time(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        try:
            moment = datetime.datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(
                f"{name}: expected unix seconds or an ISO-8601 time, got {value!r}"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.UTC)
        return moment.timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"{name}: expected a finite number of unix seconds, got {value!r}")
    return seconds


def parse_usage_query(query_string: str) -> UsageQuery:
    """The keyword arguments for :meth:`UsageLedger.query` from ``GET /v1/usage``'s query
    string: ``since`` and ``until`` (unix seconds, or ISO-8601; without a zone it is UTC),
    ``attribution``, ``model``, ``limit``. A ValueError names the bad parameter; unknown and
    repeated parameters are errors too (a misspelt filter must not widen the totals)."""
    query: UsageQuery = {}
    seen: set[str] = set()
    for name, value in urllib.parse.parse_qsl(query_string.removeprefix("?"), True):
        if name not in _QUERY_PARAMETERS:
            raise ValueError(f"{name}: unknown parameter (known: {', '.join(_QUERY_PARAMETERS)})")
        if name in seen:
            raise ValueError(f"{name}: given more than once")
        seen.add(name)
        if not value:
            raise ValueError(f"{name}: empty value")
        if name == "since":
            query["since"] = _parse_time(name, value)
        elif name == "until":
            query["until"] = _parse_time(name, value)
        elif name == "attribution":
            query["attribution"] = value
        elif name == "model":
            query["model"] = value
        elif name == "client_request_id":
            query["client_request_id"] = value
        else:
            if not value.isdigit() or not value.isascii():
                raise ValueError(f"limit: expected a whole number, got {value!r}")
            limit = int(value)
            if limit > MAX_QUERY_LIMIT:
                raise ValueError(f"limit: at most {MAX_QUERY_LIMIT}, got {limit}")
            query["limit"] = limit
    if "since" in query and "until" in query and query["since"] > query["until"]:
        raise ValueError("until: before since")
    return query


def _tokens_json(tokens: TokenTotals) -> dict[str, int]:
    return {
        "prompt_tokens": tokens.prompt_tokens,
        "completion_tokens": tokens.completion_tokens,
        "total_tokens": tokens.total_tokens,
    }


def usage_report_json(report: UsageReport) -> bytes:
    """The body of ``GET /v1/usage``."""
    totals = report.totals
    return orjson.dumps(
        {
            "object": "usage.report",
            "query": {
                "since": report.since,
                "until": report.until,
                "attribution": report.attribution,
                "model": report.model,
                "client_request_id": report.client_request_id,
                "limit": report.limit,
            },
            "totals": {
                "requests": totals.requests,
                "attempts": totals.attempts,
                "prompt_tokens": totals.prompt_tokens,
                "completion_tokens": totals.completion_tokens,
                "total_tokens": totals.prompt_tokens + totals.completion_tokens,
                "billable": {
                    "client": _tokens_json(totals.client),
                    "operator": _tokens_json(totals.operator),
                },
                "estimated": _tokens_json(totals.estimated),
                "outcomes": dict(totals.outcomes),
            },
            "truncated": report.truncated,
            "rows": [attrs.asdict(row, recurse=False) for row in report.rows],
        }
    )
