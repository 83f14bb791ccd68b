"""The tenant limits, sans-IO: windows and counters as plain state, every input carrying the
time, every answer a decision.

* ``now`` is the monotonic clock (``trio.current_time()`` in the driver, virtual in the
  tests): the per-minute windows. ``wall`` is Unix time: the UTC day and month of budgets.
* :meth:`TenantLimiter.admit` answers a :class:`Ticket` (the request may go; it holds a
  concurrency place, its token estimate in the minute window and in the budgets' reservation,
  and the tenant *as it was admitted*, limits and prices included) or a :class:`Refusal`
  (which limit, when to retry, the ``x-ratelimit-*`` header values).
* :meth:`TenantLimiter.bill` is the usage row of the request's committed attempt: the
  estimate in the window becomes the tokens used, the spend is added to the budgets.
* :meth:`TenantLimiter.release` ends the request: its concurrency place and its reservation
  go; if it never answered and no row billed it, its estimate leaves the window (a request
  that failed before its answer costs its tenant nothing). An answered request's billable
  row may still come (a cancelled stream's row waits for the node's confirmation): its
  ticket is remembered until then, at most :data:`TICKET_MEMORY` seconds
  (:meth:`TenantLimiter.ticket` finds it); any other ticket is forgotten when released.

Windows are sliding logs over :data:`WINDOW` seconds: one timestamp per request, one
:class:`_Charge` per request's tokens (corrected in place when its row comes). Counters are
keyed by tenant id, so they survive a reload that changes the tenant's limits.
"""

from __future__ import annotations

import collections
import datetime
import functools
from typing import Final, Literal

import attrs

from ._policy import Limits, PriceTable, Tenant

__all__ = [
    "CONCURRENCY_RETRY_AFTER",
    "TICKET_MEMORY",
    "WINDOW",
    "Headers",
    "LimitName",
    "Refusal",
    "TenantLimiter",
    "Ticket",
    "format_reset",
    "month_start",
    "periods",
    "seconds_to_next",
]

WINDOW: Final = 60.0
"""Seconds of the requests-per-minute and tokens-per-minute windows."""
CONCURRENCY_RETRY_AFTER: Final = 1.0
"""``Retry-After`` of a refusal for concurrency (when a place frees is not known)."""
TICKET_MEMORY: Final = 120.0
"""Seconds a released request's ticket waits for its billable usage row (the gate's
accounting waits at most ``SETTLE_TIMEOUT``, 10 s, for an abandoned run's)."""

LimitName = Literal[
    "rpm",
    "tpm",
    "max_concurrent",
    "budget_tokens_day",
    "budget_tokens_month",
    "budget_usd_day",
    "budget_usd_month",
]
Headers = tuple[tuple[bytes, bytes], ...]


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: ``250ms``, ``1s``, ``6m0s``,
    ``1h2m3s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes:
        return f"{int(minutes)}m{text}"
    return text


def periods(wall: float) -> tuple[str, str]:
    """The UTC day (``2026-12-01``) and month (``2026-12``) of a Unix time."""
    return _periods_of_day(int(wall // 86400))


@functools.lru_cache(maxsize=8)
def _periods_of_day(day: int) -> tuple[str, str]:
    moment = datetime.datetime.fromtimestamp(day * 86400, datetime.UTC)
    return moment.strftime("%Y-%m-%d"), moment.strftime("%Y-%m")


def month_start(wall: float) -> float:
    """The Unix time the UTC month of ``wall`` began."""
    moment = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    return moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()


def seconds_to_next(wall: float, *, month: bool) -> float:
    """Seconds from ``wall`` to the next UTC midnight (or first of the month)."""
    moment = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if month:
        start = start.replace(day=1)
        following = (start + datetime.timedelta(days=32)).replace(day=1)
    else:
        following = start + datetime.timedelta(days=1)
    return max(0.0, following.timestamp() - wall)


@attrs.define(eq=False, slots=True)
class _Charge:
    """One request's tokens in its tenant's minute window."""

    at: float
    tokens: int
    live: bool = True
    """Still in the window (an expired charge is corrected without effect)."""


@attrs.define(slots=True)
class _Spend:
    """What was spent in one budget period."""

    period: str = ""
    tokens: int = 0
    usd: float = 0.0

    def roll(self, period: str) -> None:
        if period > self.period:
            self.period, self.tokens, self.usd = period, 0, 0.0

    def add(self, period: str, tokens: int, usd: float) -> None:
        self.roll(period)
        if period == self.period:  # spend of an earlier period counts in it no more
            self.tokens += tokens
            self.usd += usd


@attrs.define(eq=False, slots=True)
class _Counters:
    """One tenant's state."""

    requests: collections.deque[float] = attrs.field(factory=collections.deque)
    charges: collections.deque[_Charge] = attrs.field(factory=collections.deque)
    charged: int = 0
    """The sum of the live charges' tokens."""
    in_flight: int = 0
    reserved_tokens: int = 0
    reserved_usd: float = 0.0
    day: _Spend = attrs.Factory(_Spend)
    month: _Spend = attrs.Factory(_Spend)

    def advance(self, now: float, wall: float) -> None:
        cutoff = now - WINDOW
        while self.requests and self.requests[0] <= cutoff:
            self.requests.popleft()
        while self.charges and self.charges[0].at <= cutoff:
            charge = self.charges.popleft()
            charge.live = False
            self.charged -= charge.tokens
        day, month = periods(wall)
        self.day.roll(day)
        self.month.roll(month)

    def recharge(self, charge: _Charge, tokens: int) -> None:
        if charge.live:
            self.charged += tokens - charge.tokens
        charge.tokens = tokens


@attrs.define(eq=False, slots=True)
class Ticket:
    """An admitted request (see the module docstring)."""

    request_id: str
    tenant: Tenant
    """The tenant as the request was admitted: its limits for this request's life."""
    prices: PriceTable
    """The prices in force at admission: what its usage costs."""
    model: str
    estimate: int
    cost_estimate: float
    headers: Headers
    """The ``x-ratelimit-*`` headers of its answer (empty when no rate limit is set)."""
    charge: _Charge = attrs.field(repr=False)
    answered: bool = False
    """Set by the driver when the answer started: from then on a billable row is expected."""
    billed: bool = False
    reserved: bool = True
    released: bool = False


@attrs.frozen
class Refusal:
    """A request refused before admission."""

    limit: LimitName
    message: str
    retry_after: float
    headers: Headers

    @property
    def quota(self) -> bool:
        """A budget is spent (429 ``insufficient_quota``), not a rate."""
        return self.limit.startswith("budget_")


class TenantLimiter:
    """Every tenant's counters and the tickets in flight (see the module docstring)."""

    def __init__(self) -> None:
        self._counters: dict[str, _Counters] = {}
        self._tickets: dict[str, Ticket] = {}
        self._forget: collections.deque[tuple[float, str]] = collections.deque()

    def _of(self, tenant_id: str, now: float, wall: float) -> _Counters:
        counters = self._counters.get(tenant_id)
        if counters is None:
            counters = self._counters[tenant_id] = _Counters()
        counters.advance(now, wall)
        while self._forget and self._forget[0][0] <= now:
            _, request_id = self._forget.popleft()
            ticket = self._tickets.get(request_id)
            if ticket is not None and ticket.released:
                del self._tickets[request_id]
        return counters

    # -- decisions ---------------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        tenant: Tenant,
        prices: PriceTable,
        model: str,
        estimate: int,
        *,
        now: float,
        wall: float,
    ) -> Ticket | Refusal:
        """Admit one client request of ``estimate`` tokens (input + expected output)."""
        counters = self._of(tenant.id, now, wall)
        limits = tenant.limits
        cost_estimate = prices.cost((model,), estimate, 0)
        refusal = (
            _over_budget(counters, limits, wall)
            or _over_concurrency(counters, limits)
            or _over_rpm(counters, limits, now)
            or _over_tpm(counters, limits, estimate, now)
        )
        if refusal is not None:
            limit, message, retry_after = refusal
            return Refusal(limit, message, retry_after, _headers(counters, limits, now))
        counters.requests.append(now)
        charge = _Charge(now, estimate)
        counters.charges.append(charge)
        counters.charged += estimate
        counters.in_flight += 1
        counters.reserved_tokens += estimate
        counters.reserved_usd += cost_estimate
        ticket = Ticket(
            request_id,
            tenant,
            prices,
            model,
            estimate,
            cost_estimate,
            _headers(counters, limits, now),
            charge,
        )
        self._tickets[request_id] = ticket
        return ticket

    def bill(
        self,
        ticket: Ticket,
        prompt_tokens: int,
        completion_tokens: int,
        names: tuple[str, ...],
        *,
        now: float,
        wall: float,
    ) -> float:
        """The request's billable usage row: its tokens replace the estimate in the window
        (a second billable row adds to them), its cost (at the ticket's prices, the first of
        ``names`` priced) is spent. Returns the cost."""
        counters = self._of(ticket.tenant.id, now, wall)
        tokens = prompt_tokens + completion_tokens
        counters.recharge(ticket.charge, tokens + (ticket.charge.tokens if ticket.billed else 0))
        ticket.billed = True
        self._unreserve(counters, ticket)
        if ticket.released:
            self._tickets.pop(ticket.request_id, None)
        cost = ticket.prices.cost(names, prompt_tokens, completion_tokens)
        self._spend(counters, tokens, cost, wall)
        return cost

    def release(self, ticket: Ticket, *, now: float, wall: float) -> None:
        """The request ended (however it ended); idempotent."""
        if ticket.released:
            return
        ticket.released = True
        counters = self._of(ticket.tenant.id, now, wall)
        counters.in_flight -= 1
        self._unreserve(counters, ticket)
        if ticket.billed or not ticket.answered:
            # Billed, or nothing committed: no row is to come for it (a row that comes all
            # the same is spent without a ticket, at the prices in force).
            if not ticket.billed:
                counters.recharge(ticket.charge, 0)
            self._tickets.pop(ticket.request_id, None)
        else:
            self._forget.append((now + TICKET_MEMORY, ticket.request_id))

    def spend(self, tenant_id: str, tokens: int, usd: float, *, now: float, wall: float) -> None:
        """Spend without a ticket: rows recorded before a restart (seeding the budgets from
        the ledger), or a row whose request's ticket is forgotten."""
        self._spend(self._of(tenant_id, now, wall), tokens, usd, wall)

    def ticket(self, request_id: str) -> Ticket | None:
        """The ticket of a request in flight or recently ended."""
        return self._tickets.get(request_id)

    def in_flight(self, tenant_id: str) -> int:
        counters = self._counters.get(tenant_id)
        return 0 if counters is None else counters.in_flight

    def spent(self, tenant_id: str, *, now: float, wall: float) -> tuple[int, float, int, float]:
        """Tokens and USD spent today, then this month (UTC)."""
        counters = self._of(tenant_id, now, wall)
        return counters.day.tokens, counters.day.usd, counters.month.tokens, counters.month.usd

    def tickets(self) -> int:
        """Tickets remembered (in flight, or waiting for their row)."""
        return len(self._tickets)

    # -- internals ---------------------------------------------------------------------

    @staticmethod
    def _unreserve(counters: _Counters, ticket: Ticket) -> None:
        if ticket.reserved:
            ticket.reserved = False
            counters.reserved_tokens -= ticket.estimate
            counters.reserved_usd -= ticket.cost_estimate

    @staticmethod
    def _spend(counters: _Counters, tokens: int, usd: float, wall: float) -> None:
        day, month = periods(wall)
        counters.day.add(day, tokens, usd)
        counters.month.add(month, tokens, usd)


_Over = tuple[LimitName, str, float] | None


def _over_budget(counters: _Counters, limits: Limits, wall: float) -> _Over:
    """A budget counts what was spent and what requests in flight are expected to spend: it
    is exhausted when that reaches it."""
    tokens_day = counters.day.tokens + counters.reserved_tokens
    tokens_month = counters.month.tokens + counters.reserved_tokens
    usd_day = counters.day.usd + counters.reserved_usd
    usd_month = counters.month.usd + counters.reserved_usd
    budgets: tuple[tuple[LimitName, float | None, float, str, bool], ...] = (
        ("budget_tokens_day", limits.budget_tokens_day, tokens_day, "tokens today", False),
        ("budget_usd_day", limits.budget_usd_day, usd_day, "USD today", False),
        ("budget_tokens_month", limits.budget_tokens_month, tokens_month, "tokens", True),
        ("budget_usd_month", limits.budget_usd_month, usd_month, "USD", True),
    )
    for name, budget, spent, unit, month in budgets:
        if budget is not None and spent >= budget:
            period = "this month (UTC)" if month else "(UTC)"
            return (
                name,
                f"You exceeded your current quota: {spent:g} of {budget:g} {unit} {period}.",
                seconds_to_next(wall, month=month),
            )
    return None


def _over_concurrency(counters: _Counters, limits: Limits) -> _Over:
    limit = limits.max_concurrent
    if limit is None or counters.in_flight < limit:
        return None
    return (
        "max_concurrent",
        f"Too many requests in flight: limit {limit}. Retry when one has ended.",
        CONCURRENCY_RETRY_AFTER,
    )


def _over_rpm(counters: _Counters, limits: Limits, now: float) -> _Over:
    limit = limits.rpm
    requests = counters.requests
    if limit is None or len(requests) < limit:
        return None
    # The oldest requests must leave the window until one place is free.
    frees_at = requests[len(requests) - limit] + WINDOW
    return (
        "rpm",
        f"Rate limit reached on requests per min (RPM): Limit {limit}, Used {len(requests)}, "
        "Requested 1.",
        max(0.0, frees_at - now),
    )


def _over_tpm(counters: _Counters, limits: Limits, estimate: int, now: float) -> _Over:
    """Refused when the estimate does not fit what the window has left; a request larger
    than the whole limit goes when the window is empty (else it never could)."""
    limit = limits.tpm
    used = counters.charged
    if limit is None or used + estimate <= limit or used <= 0:
        return None
    left = used
    frees_at = now
    for charge in counters.charges:
        left -= charge.tokens
        frees_at = charge.at + WINDOW
        if left + estimate <= limit or left <= 0:
            break
    return (
        "tpm",
        f"Rate limit reached on tokens per min (TPM): Limit {limit}, Used {used}, "
        f"Requested {estimate}.",
        max(0.0, frees_at - now),
    )


def _headers(counters: _Counters, limits: Limits, now: float) -> Headers:
    """OpenAI's ``x-ratelimit-*`` headers for the limits set: the limit, what is left, and
    when the oldest request (or tokens) in the window leave it."""
    headers: list[tuple[bytes, bytes]] = []
    if limits.rpm is not None:
        requests = counters.requests
        reset = requests[0] + WINDOW - now if requests else 0.0
        headers += _header_set(b"requests", limits.rpm, limits.rpm - len(requests), reset)
    if limits.tpm is not None:
        charges = counters.charges
        reset = charges[0].at + WINDOW - now if charges else 0.0
        headers += _header_set(b"tokens", limits.tpm, limits.tpm - counters.charged, reset)
    return tuple(headers)


def _header_set(kind: bytes, limit: int, remaining: int, reset: float) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-ratelimit-limit-" + kind, str(limit).encode()),
        (b"x-ratelimit-remaining-" + kind, str(max(0, remaining)).encode()),
        (b"x-ratelimit-reset-" + kind, format_reset(reset).encode()),
    ]
