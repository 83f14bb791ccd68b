"""The thin driver of the tenant limits: the clocks, the errors, the ledger.

* :meth:`Tenants.admitted` is the one check of a client request, before the gate: a context
  manager that raises the refusal (429, or 404 for a model the key may not use) or holds the
  request's :class:`~dispatcher.tenants.Ticket` until it is left, however it is left.
* :meth:`Tenants.price` is the gate's pricing hook: each usage row gets its cost as it is
  built, and a billable row bills its request's ticket (:meth:`Tenants.recorder`: the same
  in front of a sink of rows built unpriced).
* :meth:`Tenants.seed` reads this month's billable spend from the ledger at start-up (a
  restart does not reset a budget); :meth:`Tenants.swap` is a reload's part.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import attrs
import trio

from ..admission import UnknownModel
from ..errors import QuotaExceeded, RateLimited, TokenRateLimited
from ..shared.tokens import estimate_prompt_tokens
from ..store.ledger import (
    BillableTo,
    GroupBy,
    UsageGroup,
    UsageRow,
)
from ._core import (
    Refusal,
    TenantLimiter,
    Ticket,
    month_start,
    periods,
)
from ._policy import KeyDirectory, Tenant, TenantPolicy

__all__ = ["SpendSource", "Tenants", "expected_output_tokens", "request_estimate"]

log = logging.getLogger("dispatcher.tenants")

_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def expected_output_tokens(body: dict[str, Any]) -> int:
    """The output a request declares it may produce (OpenAI's ``max_completion_tokens`` or
    ``max_tokens``, the Responses API's ``max_output_tokens``); 0 when it declares none."""
    for field in _OUTPUT_FIELDS:
        value = body.get(field)
        if type(value) is int and value > 0:
            return value
    return 0


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


class SpendSource(Protocol):
    """What seeding reads of the ledger."""

    async def query_groups(
        self,
        *,
        group_by: Sequence[GroupBy] = ...,
        since: float | None = None,
        until: float | None = None,
        attribution: str | None = None,
        model: str | None = None,
        billable: bool = False,
    ) -> list[UsageGroup]: ...


@attrs.define(eq=False)
class Tenants:
    """The tenant policy in force and every tenant's counters."""

    policy: TenantPolicy = attrs.Factory(TenantPolicy)
    limiter: TenantLimiter = attrs.Factory(TenantLimiter)
    clock: Callable[[], float] = trio.current_time
    wall: Callable[[], float] = time.time

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
    ) -> AbstractContextManager[Ticket | None]:
        """Check and hold one client request (``tenant`` None: client auth is off, nothing
        is limited). Raises :class:`~dispatcher.admission.UnknownModel` for a model the
        tenant may not use (as if it did not exist), the 429s for a refusal."""
        if tenant is None:
            return nullcontext()  # nothing to hold: no generator per request
        return self._admitted(request_id, tenant, model, body)

    @contextmanager
    def _admitted(
        self, request_id: str, tenant: Tenant, model: str, body: dict[str, Any]
    ) -> Iterator[Ticket]:
        policy = self.policy  # one snapshot: the tenant and the prices of the same config
        tenant = policy.current(tenant)
        if not tenant.allows(model):
            raise UnknownModel(f"model {model!r} does not exist")
        decision = self.limiter.admit(
            request_id,
            tenant,
            policy.prices,
            model,
            request_estimate(body),
            now=self.clock(),
            wall=self.wall(),
        )
        if isinstance(decision, Refusal):
            raise refusal_error(decision)
        try:
            yield decision
        finally:
            self.limiter.release(decision, now=self.clock(), wall=self.wall())

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
            row.model_group,
            row.attribution,
            row.billable_to,
            row.prompt_tokens,
            row.completion_tokens,
        )
        return attrs.evolve(row, cost_usd=cost)

    def price(
        self,
        request_id: str,
        model_group: str,
        attribution: str | None,
        billable_to: BillableTo,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> float | None:
        """A usage row's cost (at the prices its request was admitted under), billed to its
        tenant when it is billable to the client: the gate's pricing hook
        (:data:`~dispatcher.gate.accounting.UsagePricing`). Never raises into the gate's exit
        path (None: the row is recorded unpriced)."""
        try:
            names: tuple[str, ...] = (model_group,)
            ticket = self.limiter.ticket(request_id)
            if ticket is not None:
                names = (model_group, ticket.model)
            if billable_to != "client":
                prices = ticket.prices if ticket is not None else self.policy.prices
                return prices.cost(names, prompt_tokens, completion_tokens)
            if ticket is not None:
                return self.limiter.bill(
                    ticket,
                    prompt_tokens,
                    completion_tokens,
                    names,
                    now=self.clock(),
                    wall=self.wall(),
                )
            cost = self.policy.prices.cost(names, prompt_tokens, completion_tokens)
            if attribution is not None:
                tokens = prompt_tokens + completion_tokens
                self.limiter.spend(attribution, tokens, cost, now=self.clock(), wall=self.wall())
            return cost
        except Exception:  # the accounting must never break a request's exit path
            log.exception("tenant accounting failed for request %s", request_id)
            return None

    async def seed(self, ledger: SpendSource) -> None:
        """This month's billable spend per tenant (and today's), from the ledger: what was
        spent before a restart still counts against the budgets."""
        wall = self.wall()
        day, month = periods(wall)
        since = month_start(wall)
        groups = await ledger.query_groups(group_by=("key", "day"), since=since, billable=True)
        for group in groups:
            if group.key is None or group.day is None or not group.day.startswith(month):
                continue
            tokens = group.prompt_tokens + group.completion_tokens
            # Spend of an earlier day counts in the month only.
            at = wall if group.day == day else since
            self.limiter.spend(group.key, tokens, group.cost_usd, now=self.clock(), wall=at)
