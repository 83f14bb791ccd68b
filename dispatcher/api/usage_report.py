"""``GET /v1/usage`` on the HTTP side: its query string parsed into the ledger's query and
grouping (:func:`parse_usage_query`) and the report rendered as the response body
(:func:`usage_report_json`). The ledger itself (rows, SQLite, queries) is
:mod:`dispatcher.store.ledger`."""

from __future__ import annotations

import datetime
import math
import urllib.parse
from collections.abc import Sequence
from typing import Any, Final, cast

import attrs
import orjson

from ..store.usage import (
    DEFAULT_QUERY_LIMIT,
    GROUP_BY,
    MAX_QUERY_LIMIT,
    GroupBy,
    TokenTotals,
    UsageFilter,
    UsageGroup,
    UsageQuery,
    UsageReport,
    UsageTotals,
)

__all__ = ["parse_usage_query", "usage_report_json"]

_FILTERS: Final = tuple(field.name for field in attrs.fields(UsageFilter))
_QUERY_PARAMETERS: Final = (*_FILTERS, "limit", "group_by")


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


def _group_by(value: str) -> tuple[GroupBy, ...]:
    names = tuple(name.strip() for name in value.split(","))
    if any(name not in GROUP_BY for name in names) or len(set(names)) != len(names):
        raise ValueError(
            f"group_by: expected distinct names of {', '.join(GROUP_BY)}, comma-separated, "
            f"got {value!r}"
        )
    return cast(tuple[GroupBy, ...], names)


def _limit(value: str) -> int:
    if not value.isdigit() or not value.isascii():
        raise ValueError(f"limit: expected a whole number, got {value!r}")
    limit = int(value)
    if limit > MAX_QUERY_LIMIT:
        raise ValueError(f"limit: at most {MAX_QUERY_LIMIT}, got {limit}")
    return limit


def parse_usage_query(query_string: str) -> UsageQuery:
    """``GET /v1/usage``'s query string: the filter's ``since`` and ``until`` (unix seconds,
    or ISO-8601; without a zone it is UTC), ``attribution``, ``model`` and
    ``client_request_id``; ``limit``; ``group_by``, the dimensions of the report's groups
    (comma-separated ``key``, ``model``, ``route``, ``day``; default all four). A ValueError
    names the bad parameter; unknown and repeated parameters are errors too (a misspelt
    filter must not widen the totals)."""
    filters: dict[str, Any] = {}
    limit = DEFAULT_QUERY_LIMIT
    group_by = GROUP_BY
    seen: set[str] = set()
    for name, value in urllib.parse.parse_qsl(query_string.removeprefix("?"), True):
        if name not in _QUERY_PARAMETERS:
            raise ValueError(f"{name}: unknown parameter (known: {', '.join(_QUERY_PARAMETERS)})")
        if name in seen:
            raise ValueError(f"{name}: given more than once")
        seen.add(name)
        if not value:
            raise ValueError(f"{name}: empty value")
        if name in ("since", "until"):
            filters[name] = _parse_time(name, value)
        elif name == "group_by":
            group_by = _group_by(value)
        elif name == "limit":
            limit = _limit(value)
        else:
            filters[name] = value
    return UsageQuery(filter=UsageFilter(**filters), limit=limit, group_by=group_by)


def _tokens_json(tokens: TokenTotals) -> dict[str, int]:
    return {
        "prompt_tokens": tokens.prompt_tokens,
        "completion_tokens": tokens.completion_tokens,
        "total_tokens": tokens.total_tokens,
    }


def _parts_json(sums: UsageGroup | UsageTotals) -> dict[str, int]:
    """The parts of the prompt (cached, cache-written) and the completion (reasoning)."""
    return {
        "cached_tokens": sums.cached_tokens,
        "cache_write_tokens": sums.cache_write_tokens,
        "reasoning_tokens": sums.reasoning_tokens,
    }


def _group_json(group: UsageGroup, group_by: Sequence[GroupBy]) -> dict[str, object]:
    return {
        **{name: getattr(group, name) for name in group_by},
        "requests": group.requests,
        "attempts": group.attempts,
        "prompt_tokens": group.prompt_tokens,
        "completion_tokens": group.completion_tokens,
        "total_tokens": group.prompt_tokens + group.completion_tokens,
        **_parts_json(group),
        "billable": _tokens_json(group.client),
        "cost_usd": group.cost_usd,
    }


def usage_report_json(
    report: UsageReport,
    groups: Sequence[UsageGroup] | None = None,
    group_by: Sequence[GroupBy] = GROUP_BY,
) -> bytes:
    """The body of ``GET /v1/usage``: the query, the totals, the cost of the usage billable
    to the client, the groups (when given) and the rows."""
    totals = report.totals
    grouped = {}
    if groups is not None:
        grouped = {
            "group_by": list(group_by),
            "groups": [_group_json(group, group_by) for group in groups],
        }
    return orjson.dumps(
        {
            "object": "usage.report",
            "query": {**attrs.asdict(report.filter), "limit": report.limit},
            "totals": {
                "requests": totals.requests,
                "attempts": totals.attempts,
                "prompt_tokens": totals.prompt_tokens,
                "completion_tokens": totals.completion_tokens,
                "total_tokens": totals.prompt_tokens + totals.completion_tokens,
                **_parts_json(totals),
                "billable": {
                    "client": _tokens_json(totals.client),
                    "operator": _tokens_json(totals.operator),
                },
                "estimated": _tokens_json(totals.estimated),
                "outcomes": dict(totals.outcomes),
            },
            "cost_usd": totals.cost_usd,
            **grouped,
            "truncated": report.truncated,
            "rows": [attrs.asdict(row, recurse=False) for row in report.rows],
        }
    )
