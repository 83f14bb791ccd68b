"""Tenants: client keys with limits, budgets and prices (``docs/tenants.md``).

A key is a :class:`Tenant` (an id, a name, the models it may use, a priority band and a
weight for the admission queue, its :class:`Limits`). The limit logic is sans-IO
(:class:`TenantLimiter`: windows and counters as plain state, ``now`` passed in, decisions
returned); :class:`Tenants` is its thin driver (the clocks, the errors, the ledger), owned by
the :class:`~dispatcher.service.Dispatcher`, which swaps its :class:`TenantPolicy` on a
reload.
"""

from ._core import CONCURRENCY_RETRY_AFTER as CONCURRENCY_RETRY_AFTER
from ._core import TICKET_MEMORY as TICKET_MEMORY
from ._core import WINDOW as WINDOW
from ._core import LimitName as LimitName
from ._core import Refusal as Refusal
from ._core import TenantLimiter as TenantLimiter
from ._core import Ticket as Ticket
from ._core import format_reset as format_reset
from ._driver import Tenants as Tenants
from ._driver import expected_output_tokens as expected_output_tokens
from ._driver import refusal_error as refusal_error
from ._driver import request_estimate as request_estimate
from ._policy import UNLIMITED as UNLIMITED
from ._policy import KeyDirectory as KeyDirectory
from ._policy import Limits as Limits
from ._policy import Price as Price
from ._policy import PriceTable as PriceTable
from ._policy import Tenant as Tenant
from ._policy import TenantPolicy as TenantPolicy
from ._policy import legacy_key_id as legacy_key_id
from ._policy import tenant_policy_from_config as tenant_policy_from_config

__all__ = [
    "CONCURRENCY_RETRY_AFTER",
    "TICKET_MEMORY",
    "UNLIMITED",
    "WINDOW",
    "KeyDirectory",
    "LimitName",
    "Limits",
    "Price",
    "PriceTable",
    "Refusal",
    "TenantLimiter",
    "TenantPolicy",
    "Tenants",
    "Ticket",
    "expected_output_tokens",
    "format_reset",
    "legacy_key_id",
    "refusal_error",
    "request_estimate",
    "tenant_policy_from_config",
]
