"""What the usage ledger keeps and answers, as plain data: a :class:`UsageRow` per attempt
of a request (keyed by ``(request_id, attempt)``), the filters and groupings a query takes, and
what it answers (:class:`UsageReport`, :class:`UsageGroup`). Every ledger backend
(:class:`~dispatcher.store.seam.UsageLedger`) speaks these types."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, TypedDict, get_args

import attrs

from ..wire import ExecutionPath

__all__ = [
    "BILLABLE_TO",
    "DEFAULT_QUERY_LIMIT",
    "EVERY_ROW",
    "GROUP_BY",
    "MAX_QUERY_LIMIT",
    "OUTCOMES",
    "BillableTo",
    "DuplicateUsageRow",
    "ExecutionPath",
    "FilterFields",
    "GroupBy",
    "Outcome",
    "TokenTotals",
    "UsageFilter",
    "UsageGroup",
    "UsageLedgerStatistics",
    "UsageQuery",
    "UsageReport",
    "UsageRow",
    "UsageSource",
    "UsageTotals",
]

MAX_QUERY_LIMIT: Final = 10_000
"""The most rows one query returns (totals always cover every matching row)."""
DEFAULT_QUERY_LIMIT: Final = 1000
"""The rows a query returns when it does not say."""

UsageSource = Literal["reported", "estimated"]
Outcome = Literal["completed", "failed", "aborted", "cancelled"]
"""How the attempt ended; ``cancelled`` is the client going away."""
BillableTo = Literal["client", "operator"]

OUTCOMES: Final[tuple[Outcome, ...]] = get_args(Outcome)
BILLABLE_TO: Final[tuple[BillableTo, ...]] = get_args(BillableTo)


class DuplicateUsageRow(ValueError):
    """``record`` was given a ``(request_id, attempt)`` this ledger already has."""

    def __init__(self, request_id: str, attempt: int) -> None:
        super().__init__(f"usage of request {request_id!r} attempt {attempt} was already recorded")
        self.request_id = request_id
        self.attempt = attempt


def _at_least(minimum: int) -> Any:
    return attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(minimum))


def _check_parts(row: UsageRow, _: attrs.Attribute[int], __: int) -> None:
    """The parts of the counts (one check for the three, run once their fields are set):
    ints, at least 0, ``cached_tokens + cache_write_tokens <= prompt_tokens`` and
    ``reasoning_tokens <= completion_tokens``."""
    cached, written, reasoning = row.cached_tokens, row.cache_write_tokens, row.reasoning_tokens
    for name, value in (
        ("cached_tokens", cached),
        ("cache_write_tokens", written),
        ("reasoning_tokens", reasoning),
    ):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if cached > row.prompt_tokens:
        raise ValueError(
            f"cached_tokens ({cached}) must not exceed prompt_tokens ({row.prompt_tokens})"
        )
    if cached + written > row.prompt_tokens:
        raise ValueError(
            f"cache_write_tokens + cached_tokens ({cached + written}) must not exceed "
            f"prompt_tokens ({row.prompt_tokens})"
        )
    if reasoning > row.completion_tokens:
        raise ValueError(
            f"reasoning_tokens ({reasoning}) must not exceed completion_tokens "
            f"({row.completion_tokens})"
        )


@attrs.frozen(kw_only=True)
class UsageRow:
    """One attempt of one request, as it ended."""

    request_id: str
    attempt: int = attrs.field(validator=_at_least(1))
    """1-based: the first try is 1, each recovery on another candidate adds one."""
    model_group: str
    """The public model name the client asked for."""
    served_model: str
    """The model name the provider served it under."""
    provider_id: str
    node_id: str
    path: ExecutionPath = attrs.field(validator=attrs.validators.in_(get_args(ExecutionPath)))
    attribution: str | None
    """Whom the usage is for: the client's API key id, or what the embedder passes."""
    prompt_tokens: int = attrs.field(validator=_at_least(0))
    completion_tokens: int = attrs.field(validator=_at_least(0))
    usage_source: UsageSource = attrs.field(validator=attrs.validators.in_(get_args(UsageSource)))
    """``reported`` by the upstream, or ``estimated`` by the edge."""
    outcome: Outcome = attrs.field(validator=attrs.validators.in_(OUTCOMES))
    billable_to: BillableTo = attrs.field(validator=attrs.validators.in_(BILLABLE_TO))
    """``client`` for the committed attempt, ``operator`` for attempts the client never saw."""
    queue_wait_s: float
    ttft_s: float | None
    """Time to first token; None if the attempt produced none."""
    duration_s: float
    ended_at: float
    """Unix time the attempt ended."""
    client_request_id: str | None = None
    """The client's own ``x-request-id``, if it sent one: searchable, never the key (the
    edge generates ``request_id``, so reusing an id cannot hide a request from the ledger)."""
    route: str | None = None
    """The API route the request came in on (``/v1/chat/completions``, ...)."""
    cost_usd: float | None = None
    """What its tokens cost at the price table its request was admitted under
    (``dispatcher.tenants``); None when nothing priced it (rows of older versions)."""
    cached_tokens: int = 0
    """Of ``prompt_tokens``, those read from the engine's or provider's prompt cache
    (OpenAI's convention: ``prompt_tokens`` counts them)."""
    cache_write_tokens: int = 0
    """Of ``prompt_tokens``, those written to the provider's cache (Anthropic's
    ``cache_creation_input_tokens``)."""
    reasoning_tokens: int = attrs.field(default=0, validator=_check_parts)
    """Of ``completion_tokens``, those spent reasoning. (Its validator checks the three
    parts.)"""

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.attempt)


@attrs.frozen
class TokenTotals:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: TokenTotals) -> TokenTotals:
        return TokenTotals(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
        )


@attrs.frozen(kw_only=True)
class UsageTotals:
    """Sums over every row matching a query (not only the rows returned)."""

    requests: int
    """Distinct request ids."""
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    client: TokenTotals
    """Tokens of attempts billable to the client (the committed ones)."""
    operator: TokenTotals
    """Tokens of attempts the client never saw."""
    estimated: TokenTotals
    """Tokens, of either kind, the edge estimated because the upstream reported none."""
    outcomes: Mapping[Outcome, int]
    """Attempts by outcome; every outcome is present."""
    cost_usd: float = 0.0
    """The cost of the tokens billable to the client."""
    cached_tokens: int = 0
    """Of :attr:`prompt_tokens`, read from a prompt cache."""
    cache_write_tokens: int = 0
    """Of :attr:`prompt_tokens`, written to a provider's cache."""
    reasoning_tokens: int = 0
    """Of :attr:`completion_tokens`, spent reasoning."""


GroupBy = Literal["key", "model", "route", "day"]
GROUP_BY: Final[tuple[GroupBy, ...]] = get_args(GroupBy)


@attrs.frozen(kw_only=True)
class UsageGroup:
    """Sums over the rows of one group of :meth:`UsageLedger.query_groups`: the group's
    values for the dimensions grouped by (the others None), then the sums."""

    key: str | None = None
    """The attribution (the tenant's id)."""
    model: str | None = None
    route: str | None = None
    day: str | None = None
    """The UTC day the attempts ended, ``YYYY-MM-DD``."""
    requests: int
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    client: TokenTotals
    """Tokens billable to the client."""
    cost_usd: float
    """The cost of the tokens billable to the client."""
    cached_tokens: int = 0
    """Of :attr:`prompt_tokens`, read from a prompt cache."""
    cache_write_tokens: int = 0
    """Of :attr:`prompt_tokens`, written to a provider's cache."""
    reasoning_tokens: int = 0
    """Of :attr:`completion_tokens`, spent reasoning."""


def _not_before_since(
    instance: UsageFilter, _: attrs.Attribute[float | None], until: float | None
) -> None:
    if until is not None and instance.since is not None and until < instance.since:
        raise ValueError(f"until: before since ({until} < {instance.since})")


@attrs.frozen(kw_only=True)
class UsageFilter:
    """Which rows a query covers: attempts that ended in ``[since, until)`` (unix seconds),
    for one ``attribution``, one model group ``model`` (``model_group``, the name clients
    use) and the client's own request id ``client_request_id``; a filter left None matches
    every row."""

    since: float | None = None
    until: float | None = attrs.field(default=None, validator=_not_before_since)
    attribution: str | None = None
    model: str | None = None
    client_request_id: str | None = None


EVERY_ROW: Final = UsageFilter()
"""The filter that matches every row."""


class FilterFields(TypedDict, total=False):
    """:class:`UsageFilter`'s fields as keyword arguments of the ledger's queries
    (``query(since=t0, model="llama")``), so that mypy checks their names and types."""

    since: float | None
    until: float | None
    attribution: str | None
    model: str | None
    client_request_id: str | None


@attrs.frozen(kw_only=True)
class UsageQuery:
    """A question to the ledger, as ``GET /v1/usage`` asks it
    (``dispatcher.api.usage_report.parse_usage_query``): the rows ``filter`` covers, at most
    ``limit`` of them (:meth:`UsageLedger.query`), and their sums grouped by ``group_by``
    (:meth:`UsageLedger.query_groups`)."""

    filter: UsageFilter = EVERY_ROW
    limit: int = DEFAULT_QUERY_LIMIT
    group_by: tuple[GroupBy, ...] = GROUP_BY


@attrs.frozen(kw_only=True)
class UsageReport:
    """What :meth:`UsageLedger.query` found: the filter and limit it was asked, the totals
    over every matching row, and the rows (newest first), as ``GET /v1/usage`` shows them."""

    filter: UsageFilter
    limit: int
    totals: UsageTotals
    rows: tuple[UsageRow, ...]

    @property
    def truncated(self) -> bool:
        """More rows matched than ``limit``; the totals still cover all of them."""
        return self.totals.attempts > len(self.rows)


@attrs.frozen(kw_only=True)
class UsageLedgerStatistics:
    rows_recorded: int
    """Rows ``record`` accepted."""
    rows_written: int
    """Rows now in the database."""
    rows_pending: int
    """Rows accepted and not yet written (nor given up)."""
    rows_lost: int
    """Rows never written: beyond ``max_pending``, given up after failed retries, or still
    pending when the closing flush ran out of time."""
    batches: int
    """Committed transactions."""
    duplicates_refused: int
    """``record`` calls that raised :class:`DuplicateUsageRow`."""
    duplicates_dropped: int
    """Rows that met an existing row's primary key at write time and were dropped."""
    write_errors: int
    """Failed transactions (each retry counts) and rows the database refused."""
    rows_in_outbox: int = 0
    """Rows kept in the ledger's durable local outbox, waiting for its shared database
    (:mod:`dispatcher.store.outbox`; counted in ``rows_pending`` too). Always 0 without one."""
