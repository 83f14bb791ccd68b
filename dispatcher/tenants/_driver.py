"""The tenants' driver: the policy in force, the tickets, the errors, the ledger, over a
:class:`~dispatcher.store.seam.LimitStore` (in one process,
:class:`~dispatcher.store.limits.MemoryLimits`).

* :meth:`Tenants.admitted` is the one check of a client request, before the gate: an async
  context manager that raises the refusal (429, or 404 for a model the key may not use) or
  holds the request's :class:`Ticket` (its reservation in the store) until it is left,
  however it is left.
* :meth:`Tenants.price` is the gate's pricing hook: each usage row gets its cost as it is
  built, and a billable row settles its request's reservation, keyed by request and attempt
  (:meth:`Tenants.recorder`: the same in front of a sink of rows built unpriced). A ticket
  whose billable row may still come after its request ended (a cancelled stream's waits for
  the node's confirmation) is remembered until then, at most :data:`TICKET_MEMORY` seconds.
* :meth:`Tenants.seed` has the store seed its budgets from the ledger at start-up (a restart
  does not reset a budget); :meth:`Tenants.swap` is a reload's part.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, Final

import attrs
import trio

from ..admission import UnknownModel
from ..config import Limits
from ..errors import QuotaExceeded, RateLimited, StoreUnavailable, TokenRateLimited
from ..shared.tokens import estimate_prompt_tokens
from ..store.seam import (
    Hold,
    LimitStore,
    RateHeaders,
    Refusal,
    Reservation,
    UsageLedger,
)
from ..store.usage import BillableTo, UsageRow
from ._policy import KeyDirectory, PriceTable, Tenant, TenantPolicy

__all__ = [
    "TICKET_MEMORY",
    "Tenants",
    "Ticket",
    "expected_output_tokens",
    "refusal_error",
    "request_estimate",
]

log = logging.getLogger("dispatcher.tenants")

SEED_RETRY: Final = 5.0
"""Seconds between tries of seeding the budgets while the ledger cannot be read."""
TICKET_MEMORY: Final = 120.0
"""Seconds a released request's ticket waits for its billable usage row (the gate's
accounting waits at most ``SETTLE_TIMEOUT``, 10 s, for an abandoned run's)."""

_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def expected_output_tokens(body: dict[str, Any]) -> int:
    """The output a request declares it may produce (OpenAI's ``max_completion_tokens`` or
    ``max_tokens``, the Responses API's ``max_output_tokens``); 0 when it declares none."""
    for field in _OUTPUT_FIELDS:
        value = body.get(field)
        if type(value) is int and value > 0:
            return value
    return 0


def _limits_tokens(limits: Limits) -> bool:
    """Whether ``limits`` counts a request's tokens (a tokens-per-minute limit or a token
    budget): only then is its estimate reserved."""
    return (
        limits.tpm is not None
        or limits.budget_tokens_day is not None
        or limits.budget_tokens_month is not None
    )


def request_estimate(body: dict[str, Any]) -> int:
    """A request's tokens before any usage is known: the prompt's estimate (the one
    estimator) plus the declared output."""
    return estimate_prompt_tokens(body) + expected_output_tokens(body)


def refusal_error(refusal: Refusal) -> RateLimited:
    """The error tree's 429 for a refusal: ``insufficient_quota`` for a budget, OpenAI's
    ``requests`` / ``tokens`` rate limit errors otherwise."""
    kind: type[RateLimited]
    if refusal.quota:
        kind = QuotaExceeded
    elif refusal.limit == "tpm":
        kind = TokenRateLimited
    else:
        kind = RateLimited
    return kind(refusal.message, retry_after=refusal.retry_after, headers=refusal.headers)


@attrs.define(eq=False, slots=True)
class Ticket:
    """An admitted request: the tenant and prices it was admitted under, and its
    reservation in the limit store."""

    request_id: str
    tenant: Tenant
    """The tenant as the request was admitted: its limits for this request's life."""
    prices: PriceTable
    """The prices in force at admission: what its usage costs."""
    model: str
    reservation: Reservation
    answered: bool = False
    """Set when the answer started: from then on a billable row is expected."""
    billed: bool = False
    released: bool = False

    @property
    def headers(self) -> RateHeaders:
        """The ``x-ratelimit-*`` headers of its answer (empty when no rate limit is set)."""
        return self.reservation.headers

    @property
    def estimate(self) -> int:
        return self.reservation.hold.tokens


@attrs.define(eq=False)
class Tenants:
    """The tenant policy in force and the tickets of the requests it admitted."""

    policy: TenantPolicy
    limits: LimitStore[Any]
    """Where the windows and budgets are kept (the storage seam; the edge's
    :func:`~dispatcher.store.backends.open_stores` chooses it)."""
    clock: Callable[[], float] = trio.current_time
    """When a remembered ticket is forgotten (monotonic)."""
    _tickets: dict[str, Ticket] = attrs.field(factory=dict, init=False)
    _forget: collections.deque[tuple[float, str]] = attrs.field(
        factory=collections.deque, init=False
    )

    @property
    def keys(self) -> KeyDirectory:
        """Who the keys are, now (a reload swaps it)."""
        return self.policy.keys

    def swap(self, policy: TenantPolicy) -> None:
        """The new keys and prices, at once; requests in flight keep what they were
        admitted under (their tickets hold it)."""
        self.policy = policy

    def admitted(
        self, request_id: str, tenant: Tenant | None, model: str, body: dict[str, Any]
    ) -> AbstractAsyncContextManager[Ticket | None]:
        """Check and hold one client request (``tenant`` None: client auth is off, nothing
        is limited). Raises :class:`~dispatcher.admission.UnknownModel` for a model the
        tenant may not use (as if it did not exist), the 429s for a refusal."""
        if tenant is None:
            return nullcontext()  # nothing to hold: no generator per request
        return self._admitted(request_id, tenant, model, body)

    @asynccontextmanager
    async def _admitted(
        self, request_id: str, tenant: Tenant, model: str, body: dict[str, Any]
    ) -> AsyncIterator[Ticket]:
        policy = self.policy  # one snapshot: the tenant and the prices of the same config
        tenant = policy.current(tenant)
        if not tenant.allows(model):
            raise UnknownModel(f"model {model!r} does not exist")
        limits = tenant.limits
        # Nothing computed for a limit the key does not have: the estimate counts only
        # against a token limit or budget, its price only against a USD budget.
        tokens = _limits_tokens(limits)
        dollars = limits.budget_usd_day is not None or limits.budget_usd_month is not None
        estimate = request_estimate(body) if tokens or dollars else 0
        usd = policy.prices.cost((model,), estimate, 0) if dollars else 0.0
        hold = Hold(request_id, tenant.id, limits, estimate if tokens else 0, usd)
        decision = await self.limits.admit(hold)
        if isinstance(decision, Refusal):
            raise refusal_error(decision)
        ticket = Ticket(request_id, tenant, policy.prices, model, decision)
        self._tickets[request_id] = ticket
        try:
            yield ticket
        finally:
            self._release(ticket)

    def _release(self, ticket: Ticket) -> None:
        ticket.released = True
        self.limits.release(ticket.reservation, answered=ticket.answered)
        if ticket.billed or not ticket.answered:
            # Billed, or nothing committed: no row is to come for it (a row that comes all
            # the same is spent without a ticket, at the prices in force).
            self._tickets.pop(ticket.request_id, None)
        else:
            self._forget.append((self.clock() + TICKET_MEMORY, ticket.request_id))

    def ticket(self, request_id: str) -> Ticket | None:
        """The ticket of a request in flight, or ended with its billable row still to come."""
        now = self.clock()
        forget = self._forget
        while forget and forget[0][0] <= now:
            _, forgotten = forget.popleft()
            ticket = self._tickets.get(forgotten)
            if ticket is not None and ticket.released:
                del self._tickets[forgotten]
        return self._tickets.get(request_id)

    def tickets(self) -> int:
        """Tickets remembered (in flight, or waiting for their row)."""
        return len(self._tickets)

    def recorder(self, record: Callable[[UsageRow], None]) -> Callable[[UsageRow], None]:
        """A usage sink in front of ``record``: the row with its cost (:meth:`price`, which
        bills it). The gate does not need one: it prices each row as it builds it."""

        def recorded(row: UsageRow) -> None:
            record(self.observe(row))

        return recorded

    def observe(self, row: UsageRow) -> UsageRow:
        """``row`` with its cost (:meth:`price`)."""
        cost = self.price(
            row.request_id,
            row.attempt,
            row.model_group,
            row.attribution,
            row.billable_to,
            row.prompt_tokens,
            row.completion_tokens,
            cached_tokens=row.cached_tokens,
            cache_write_tokens=row.cache_write_tokens,
        )
        return attrs.evolve(row, cost_usd=cost)

    def price(
        self,
        request_id: str,
        attempt: int,
        model_group: str,
        attribution: str | None,
        billable_to: BillableTo,
        prompt_tokens: int,
        completion_tokens: int,
        /,
        *,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float | None:
        """A usage row's cost (at the prices its request was admitted under, its cached and
        cache-written prompt tokens at their own prices); a row billable
        to the client settles its request's reservation (once per attempt): the gate's
        pricing hook (:data:`~dispatcher.gate.accounting.UsagePricing`). Never raises into
        the gate's exit path (None: the row is recorded unpriced)."""
        try:
            names: tuple[str, ...] = (model_group,)
            ticket = self.ticket(request_id)
            if ticket is not None:
                names = (model_group, ticket.model)
            parts = {"cached_tokens": cached_tokens, "cache_write_tokens": cache_write_tokens}
            if billable_to != "client":
                prices = ticket.prices if ticket is not None else self.policy.prices
                return prices.cost(names, prompt_tokens, completion_tokens, **parts)
            tokens = prompt_tokens + completion_tokens
            if ticket is not None:
                cost = ticket.prices.cost(names, prompt_tokens, completion_tokens, **parts)
                self.limits.settle(ticket.reservation, attempt, tokens, cost)
                ticket.billed = True
                if ticket.released:
                    self._tickets.pop(request_id, None)
                return cost
            cost = self.policy.prices.cost(names, prompt_tokens, completion_tokens, **parts)
            if attribution is not None:
                self.limits.spend(attribution, tokens, cost)
            return cost
        except Exception:  # the accounting must never break a request's exit path
            log.exception("tenant accounting failed for request %s", request_id)
            return None

    async def seed(self, ledger: UsageLedger) -> None:
        """What was spent before a restart still counts against the budgets: the store
        seeds them from the ledger (:meth:`~dispatcher.store.seam.LimitStore.seed`)."""
        await self.limits.seed(ledger)

    async def seed_when_readable(
        self,
        ledger: UsageLedger,
        *,
        retry_every: float = SEED_RETRY,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """:meth:`seed` (started once the first try is over: ``nursery.start``), tried again
        every ``retry_every`` seconds while the ledger cannot be read (a shared ledger's
        database is down at start-up): the budgets count what is spent from now until then,
        and what was spent before once it can be read. Seeding adds to the counters, so it
        may come after requests were admitted."""
        warned = False
        while True:
            try:
                await self.seed(ledger)
            except StoreUnavailable as exc:
                if not warned:
                    log.warning(
                        "budgets not seeded from the usage ledger yet (%s): until it can be "
                        "read, they count only what is spent from now; trying every %g s",
                        exc,
                        retry_every,
                    )
                    warned = True
                    task_status.started()
                await trio.sleep(retry_every)
                continue
            if warned:
                log.info("budgets seeded from the usage ledger")
            else:
                task_status.started()
            return
