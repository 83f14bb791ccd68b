"""The tenants' limits in one process: :class:`MemoryLimits`, the embedded
:class:`~dispatcher.store.seam.LimitStore`, over :class:`LimitCounters`, its sans-IO core:
windows and counters as plain state, every input carrying the time, every answer a decision.

* ``now`` is the monotonic clock (``trio.current_time()`` in :class:`MemoryLimits`, virtual in
  the tests): the per-minute windows. ``wall`` is Unix time: the UTC day and month of budgets.
* :meth:`LimitCounters.admit` answers a :class:`Held` reservation (the request may go; it
  holds a concurrency place, its token estimate in the minute window and in the budgets'
  reservation) or a :class:`~dispatcher.store.seam.Refusal` (which limit, when to retry, the
  ``x-ratelimit-*`` header values).
* :meth:`LimitCounters.settle` is the usage row of one billable attempt: the estimate in the
  window becomes the tokens used (a second attempt's row adds to them), the spend is added to
  the budgets. A ``(request, attempt)`` settled once is not settled again.
* :meth:`LimitCounters.release` ends the request: its concurrency place and its reservation
  go; if it never answered and nothing settled it, its estimate leaves the window (a request
  that failed before its answer costs its tenant nothing).

Windows are sliding logs over :data:`WINDOW` seconds: one timestamp per request, one
:class:`_Charge` per request's tokens (corrected in place when its row comes). Counters are
keyed by tenant id, so they survive a reload that changes the tenant's limits.
"""

from __future__ import annotations

import collections
import datetime
import functools
import time
from collections.abc import Callable
from typing import Final

import attrs
import trio

from ..config import Limits
from .seam import Hold, LimitName, RateHeaders, Refusal, Spent, UsageLedger

__all__ = [
    "CONCURRENCY_RETRY_AFTER",
    "WINDOW",
    "Held",
    "LimitCounters",
    "MemoryLimits",
    "format_reset",
    "month_start",
    "periods",
    "rate_headers",
    "refusal_message",
    "seconds_to_next",
]

WINDOW: Final = 60.0
"""Seconds of the requests-per-minute and tokens-per-minute windows."""
CONCURRENCY_RETRY_AFTER: Final = 1.0
"""``Retry-After`` of a refusal for concurrency (when a place frees is not known)."""


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
class Held:
    """An admitted request's reservation (a :class:`~dispatcher.store.seam.Reservation`)."""

    hold: Hold
    headers: RateHeaders
    """The ``x-ratelimit-*`` headers of its answer (empty when no rate limit is set)."""
    charge: _Charge = attrs.field(repr=False)
    settled: set[int] = attrs.field(factory=set, repr=False)
    """The attempts whose rows settled it."""
    reserved: bool = True
    released: bool = False


class LimitCounters:
    """Every tenant's counters (see the module docstring)."""

    def __init__(self) -> None:
        self._counters: dict[str, _Counters] = {}

    def _of(self, tenant_id: str, now: float, wall: float) -> _Counters:
        counters = self._counters.get(tenant_id)
        if counters is None:
            counters = self._counters[tenant_id] = _Counters()
        counters.advance(now, wall)
        return counters

    # -- decisions ---------------------------------------------------------------------

    def admit(self, hold: Hold, *, now: float, wall: float) -> Held | Refusal:
        """Admit one client request of ``hold.tokens`` tokens (input + expected output)."""
        counters = self._of(hold.tenant_id, now, wall)
        limits = hold.limits
        refusal = (
            _over_budget(counters, limits, wall)
            or _over_concurrency(counters, limits)
            or _over_rpm(counters, limits, now)
            or _over_tpm(counters, limits, hold.tokens, now)
        )
        if refusal is not None:
            limit, message, retry_after = refusal
            return Refusal(limit, message, retry_after, _headers(counters, limits, now))
        counters.requests.append(now)
        charge = _Charge(now, hold.tokens)
        counters.charges.append(charge)
        counters.charged += hold.tokens
        counters.in_flight += 1
        counters.reserved_tokens += hold.tokens
        counters.reserved_usd += hold.usd
        return Held(hold, _headers(counters, limits, now), charge)

    def settle(
        self, held: Held, attempt: int, tokens: int, usd: float, *, now: float, wall: float
    ) -> bool:
        """The billable usage row of ``attempt``: its tokens replace the estimate in the
        window (another attempt's add to them), ``usd`` is spent. False, and nothing
        changes, if this attempt settled it before."""
        if attempt in held.settled:
            return False
        counters = self._of(held.hold.tenant_id, now, wall)
        counters.recharge(held.charge, tokens + (held.charge.tokens if held.settled else 0))
        held.settled.add(attempt)
        self._unreserve(counters, held)
        self._spend(counters, tokens, usd, wall)
        return True

    def release(self, held: Held, *, answered: bool, now: float, wall: float) -> None:
        """The request ended (however it ended); idempotent."""
        if held.released:
            return
        held.released = True
        counters = self._of(held.hold.tenant_id, now, wall)
        counters.in_flight -= 1
        self._unreserve(counters, held)
        if not held.settled and not answered:
            counters.recharge(held.charge, 0)  # nothing committed: it costs nothing

    def spend(self, tenant_id: str, tokens: int, usd: float, *, now: float, wall: float) -> None:
        """Spend without a reservation: rows recorded before a restart (seeding the budgets
        from the ledger), or a row whose request is long gone."""
        self._spend(self._of(tenant_id, now, wall), tokens, usd, wall)

    def in_flight(self, tenant_id: str) -> int:
        counters = self._counters.get(tenant_id)
        return 0 if counters is None else counters.in_flight

    def spent(self, tenant_id: str, *, now: float, wall: float) -> Spent:
        """Tokens and USD spent today, then this month (UTC)."""
        counters = self._of(tenant_id, now, wall)
        return Spent(
            counters.day.tokens, counters.day.usd, counters.month.tokens, counters.month.usd
        )

    # -- internals ---------------------------------------------------------------------

    @staticmethod
    def _unreserve(counters: _Counters, held: Held) -> None:
        if held.reserved:
            held.reserved = False
            counters.reserved_tokens -= held.hold.tokens
            counters.reserved_usd -= held.hold.usd

    @staticmethod
    def _spend(counters: _Counters, tokens: int, usd: float, wall: float) -> None:
        day, month = periods(wall)
        counters.day.add(day, tokens, usd)
        counters.month.add(month, tokens, usd)


@attrs.define(eq=False)
class MemoryLimits:
    """The embedded :class:`~dispatcher.store.seam.LimitStore`: :class:`LimitCounters` on
    this process's clocks. Nothing is shared; nothing blocks."""

    clock: Callable[[], float] = trio.current_time
    wall: Callable[[], float] = time.time
    counters: LimitCounters = attrs.Factory(LimitCounters)

    async def admit(self, hold: Hold) -> Held | Refusal:
        """Decided in memory: no I/O and no checkpoint (the request's path has its own)."""
        return self.counters.admit(hold, now=self.clock(), wall=self.wall())

    def settle(self, reservation: Held, attempt: int, tokens: int, usd: float) -> None:
        self.counters.settle(reservation, attempt, tokens, usd, now=self.clock(), wall=self.wall())

    def release(self, reservation: Held, *, answered: bool) -> None:
        self.counters.release(reservation, answered=answered, now=self.clock(), wall=self.wall())

    def spend(self, tenant_id: str, tokens: int, usd: float) -> None:
        self.counters.spend(tenant_id, tokens, usd, now=self.clock(), wall=self.wall())

    def spent(self, tenant_id: str) -> Spent:
        return self.counters.spent(tenant_id, now=self.clock(), wall=self.wall())

    def in_flight(self, tenant_id: str) -> int:
        return self.counters.in_flight(tenant_id)

    async def seed(self, ledger: UsageLedger) -> None:
        """This month's billable spend per tenant (and today's), from the ledger: what was
        spent before a restart still counts against the budgets."""
        wall = self.wall()
        day, month = periods(wall)
        since = month_start(wall)
        for group in await ledger.billable_spend(since):
            if group.key is None or group.day is None or not group.day.startswith(month):
                continue
            tokens = group.prompt_tokens + group.completion_tokens
            # Spend of an earlier day counts in the month only.
            at = wall if group.day == day else since
            self.counters.spend(group.key, tokens, group.cost_usd, now=self.clock(), wall=at)


_Over = tuple[LimitName, str, float] | None


def _over_budget(counters: _Counters, limits: Limits, wall: float) -> _Over:
    """A budget counts what was spent and what requests in flight are expected to spend: it
    is exhausted when that reaches it."""
    tokens_day = counters.day.tokens + counters.reserved_tokens
    tokens_month = counters.month.tokens + counters.reserved_tokens
    usd_day = counters.day.usd + counters.reserved_usd
    usd_month = counters.month.usd + counters.reserved_usd
    budgets: tuple[tuple[LimitName, float | None, float], ...] = (
        ("budget_tokens_day", limits.budget_tokens_day, tokens_day),
        ("budget_usd_day", limits.budget_usd_day, usd_day),
        ("budget_tokens_month", limits.budget_tokens_month, tokens_month),
        ("budget_usd_month", limits.budget_usd_month, usd_month),
    )
    for name, budget, spent in budgets:
        if budget is not None and spent >= budget:
            month = name.endswith("_month")
            return name, refusal_message(limits, name, spent, 0), seconds_to_next(wall, month=month)
    return None


def _over_concurrency(counters: _Counters, limits: Limits) -> _Over:
    limit = limits.max_concurrent
    if limit is None or counters.in_flight < limit:
        return None
    return (
        "max_concurrent",
        refusal_message(limits, "max_concurrent", counters.in_flight, 0),
        CONCURRENCY_RETRY_AFTER,
    )


def _over_rpm(counters: _Counters, limits: Limits, now: float) -> _Over:
    limit = limits.rpm
    requests = counters.requests
    if limit is None or len(requests) < limit:
        return None
    # The oldest requests must leave the window until one place is free.
    frees_at = requests[len(requests) - limit] + WINDOW
    return "rpm", refusal_message(limits, "rpm", len(requests), 1), max(0.0, frees_at - now)


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
    return "tpm", refusal_message(limits, "tpm", used, estimate), max(0.0, frees_at - now)


def _headers(counters: _Counters, limits: Limits, now: float) -> RateHeaders:
    requests, charges = counters.requests, counters.charges
    return rate_headers(
        limits,
        now,
        len(requests),
        requests[0] if requests else None,
        counters.charged,
        charges[0].at if charges else None,
    )


# -- what every limit store answers the same way -------------------------------------------


def refusal_message(limits: Limits, limit: LimitName, used: float, requested: int) -> str:
    """How a refusal of ``limit`` is worded, by every limit store: ``used`` is what counts
    against it (spent and reserved for a budget), ``requested`` what the request asked."""
    if limit.startswith("budget_"):
        month = limit.endswith("_month")
        unit = ("tokens" if "tokens" in limit else "USD") + ("" if month else " today")
        period = "this month (UTC)" if month else "(UTC)"
        budget = getattr(limits, limit)
        return f"You exceeded your current quota: {used:g} of {budget:g} {unit} {period}."
    if limit == "max_concurrent":
        return (
            f"Too many requests in flight: limit {limits.max_concurrent}. Retry when one has ended."
        )
    if limit == "rpm":
        return (
            f"Rate limit reached on requests per min (RPM): Limit {limits.rpm}, "
            f"Used {int(used)}, Requested 1."
        )
    return (
        f"Rate limit reached on tokens per min (TPM): Limit {limits.tpm}, Used {int(used)}, "
        f"Requested {requested}."
    )


def rate_headers(
    limits: Limits,
    now: float,
    requests: int,
    oldest_request: float | None,
    charged: int,
    oldest_charge: float | None,
) -> RateHeaders:
    """OpenAI's ``x-ratelimit-*`` headers for the limits set, by every limit store: the
    limit, what is left of it (``requests`` in the minute window, ``charged`` tokens), and
    when the oldest request (or tokens) leave the window."""
    headers: list[tuple[bytes, bytes]] = []
    if limits.rpm is not None:
        reset = oldest_request + WINDOW - now if oldest_request is not None else 0.0
        headers += _header_set(b"requests", limits.rpm, limits.rpm - requests, reset)
    if limits.tpm is not None:
        reset = oldest_charge + WINDOW - now if oldest_charge is not None else 0.0
        headers += _header_set(b"tokens", limits.tpm, limits.tpm - charged, reset)
    return tuple(headers)


def _header_set(kind: bytes, limit: int, remaining: int, reset: float) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-ratelimit-limit-" + kind, str(limit).encode()),
        (b"x-ratelimit-remaining-" + kind, str(max(0, remaining)).encode()),
        (b"x-ratelimit-reset-" + kind, format_reset(reset).encode()),
    ]
