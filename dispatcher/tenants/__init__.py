"""Tenants: client keys with limits, budgets and prices (``docs/tenants.md``).

A key is a :class:`Tenant` (an id, a name, the models it may use, a priority band and a
weight for the admission queue, its :class:`Limits`). Its windows and budgets are kept by a
:class:`~dispatcher.store.seam.LimitStore` (the storage seam; in one process,
:class:`~dispatcher.store.limits.MemoryLimits` over the sans-IO
:class:`~dispatcher.store.limits.LimitCounters`); :class:`Tenants` is the driver (the
policy in force, the tickets, the errors, the ledger), owned by the
:class:`~dispatcher.service.Service`, which swaps its :class:`TenantPolicy` on a reload.
"""

from ._driver import SEED_RETRY as SEED_RETRY
from ._driver import TICKET_MEMORY as TICKET_MEMORY
from ._driver import Tenants as Tenants
from ._driver import Ticket as Ticket
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
    "SEED_RETRY",
    "TICKET_MEMORY",
    "UNLIMITED",
    "KeyDirectory",
    "Limits",
    "Price",
    "PriceTable",
    "Tenant",
    "TenantPolicy",
    "Tenants",
    "Ticket",
    "expected_output_tokens",
    "legacy_key_id",
    "refusal_error",
    "request_estimate",
    "tenant_policy_from_config",
]
