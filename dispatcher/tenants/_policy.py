"""What a tenant is and what the config says of tenants: keys, limits, prices. Pure data,
built from an :class:`~dispatcher.config.EdgeConfig` by :func:`tenant_policy_from_config`;
a reload swaps the whole :class:`TenantPolicy` at once."""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
from collections.abc import Mapping

import attrs

from ..admission import Share
from ..config import (
    EdgeConfig,
    KeySettings,
    Limits,
    key_digest,
    tenant_digest,
)

__all__ = [
    "UNLIMITED",
    "KeyDirectory",
    "Limits",
    "Price",
    "PriceTable",
    "Tenant",
    "TenantPolicy",
    "legacy_key_id",
    "tenant_policy_from_config",
]


def legacy_key_id(key: bytes) -> str:
    """The id of an ``api_keys`` entry: ``key-`` and 12 hex digits of its SHA-256 (what the
    usage ledger has always recorded for it)."""
    return "key-" + hashlib.sha256(key).hexdigest()[:12]


UNLIMITED = Limits()


@attrs.frozen(kw_only=True)
class Tenant:
    """Who a request is for: a ``[[keys]]`` entry, or an ``api_keys`` entry (unlimited,
    named by its key id)."""

    id: str
    name: str
    models: tuple[str, ...] = ("*",)
    """Glob patterns of the model names it may ask for."""
    priority: int = 0
    weight: float = 1.0
    limits: Limits = UNLIMITED
    own_usage: bool = True
    """It may read its own rows in ``GET /v1/usage`` (``api_keys`` entries may not: their
    behaviour is unchanged)."""

    def allows(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    @property
    def share(self) -> Share:
        """Its place in admission's fair queueing: its own flow, its band and weight."""
        return Share(tenant=self.id, priority=self.priority, weight=self.weight)


@attrs.frozen
class Price:
    """USD per million tokens: of input (the prompt), of input read from a prompt cache
    (``cached_input_per_mtok``) and written to one (``cache_write_per_mtok``), of output.
    A cache price left None is the input price."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0
    cached_input_per_mtok: float | None = None
    cache_write_per_mtok: float | None = None

    def cost(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float:
        """``(prompt - cached - cache_write) * input + cached * cached_input + cache_write *
        cache_write + completion * output``, per million. Tokens of a cache without a price
        of its own count at the input price, as part of the input's term: without cache
        prices the cost is exactly ``prompt * input + completion * output``."""
        input_tokens = prompt_tokens
        spent = 0.0
        if self.cached_input_per_mtok is not None:
            input_tokens -= cached_tokens
            spent += cached_tokens * self.cached_input_per_mtok
        if self.cache_write_per_mtok is not None:
            input_tokens -= cache_write_tokens
            spent += cache_write_tokens * self.cache_write_per_mtok
        spent += input_tokens * self.input_per_mtok + completion_tokens * self.output_per_mtok
        return spent / 1e6


@attrs.frozen
class PriceTable:
    """Prices by model name: an exact name first, else the first glob pattern (in the
    file's order) that matches; a model without a price costs nothing."""

    exact: Mapping[str, Price] = attrs.field(factory=dict)
    patterns: tuple[tuple[str, Price], ...] = ()

    def price(self, *names: str) -> Price | None:
        """The price of the first of ``names`` that has one (the served group, then the
        name asked for)."""
        for name in names:
            if name in self.exact:
                return self.exact[name]
        for name in names:
            for pattern, price in self.patterns:
                if fnmatch.fnmatchcase(name, pattern):
                    return price
        return None

    def cost(
        self,
        names: tuple[str, ...],
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float:
        price = self.price(*names)
        if price is None:
            return 0.0
        return price.cost(
            prompt_tokens,
            completion_tokens,
            cached_tokens=cached_tokens,
            cache_write_tokens=cache_write_tokens,
        )


@attrs.frozen
class KeyDirectory:
    """Who a presented key is. Keys are compared by their SHA-256 (a dict lookup: what it
    could leak by timing is a prefix of a hash, which does not help find a key)."""

    clients: Mapping[str, Tenant] = attrs.field(factory=dict, repr=False)
    """Client key digests (hex) -> tenant."""
    admins: frozenset[str] = attrs.field(default=frozenset(), repr=False)
    """Admin key digests (hex)."""
    scrapers: frozenset[str] = attrs.field(default=frozenset(), repr=False)
    """Metrics token digests (hex): keys for ``/metrics`` and nothing else."""
    tenants: Mapping[str, Tenant] = attrs.field(init=False, repr=False)
    """The tenants by id."""

    @tenants.default
    def _by_id(self) -> Mapping[str, Tenant]:
        return {tenant.id: tenant for tenant in self.clients.values()}

    def client(self, key: bytes) -> Tenant | None:
        return self.clients.get(key_digest(key))

    def admin(self, key: bytes) -> bool:
        return _among(self.admins, key)

    def scraper(self, key: bytes) -> bool:
        """``key`` is the metrics token."""
        return _among(self.scrapers, key)


def _among(digests: frozenset[str], key: bytes) -> bool:
    digest = key_digest(key)
    found = False
    for known in digests:  # few: compared in constant time, no early exit
        found |= hmac.compare_digest(digest, known)
    return found


@attrs.frozen
class TenantPolicy:
    """Everything of tenants a reload swaps at once."""

    keys: KeyDirectory = KeyDirectory()
    prices: PriceTable = PriceTable()

    def current(self, tenant: Tenant) -> Tenant:
        """The tenant as this policy has it: a request authenticated before a reload and
        admitted after it is admitted as the reload made it, with the reload's prices (a
        tenant the reload removed keeps what it was)."""
        return self.keys.tenants.get(tenant.id, tenant)


def _tenant(settings: KeySettings) -> Tenant:
    return Tenant(
        id=settings.id,
        name=settings.name or settings.id,
        models=settings.models,
        priority=settings.priority,
        weight=settings.weight,
        limits=settings.limits(),
    )


def tenant_policy_from_config(config: EdgeConfig) -> TenantPolicy:
    """The tenants ``config`` defines (its secrets resolved: ``EdgeConfig.client_api_keys``
    resolves them when the config was built in Python)."""
    clients: dict[str, Tenant] = {}
    for key in config.client_api_keys():
        encoded = key.encode()
        name = legacy_key_id(encoded)
        clients[key_digest(encoded)] = Tenant(id=name, name=name, own_usage=False)
    for settings in config.resolved_keys():
        clients[tenant_digest(settings)] = _tenant(settings)
    admins = frozenset(key_digest(key) for key in config.admin_api_keys())
    token = config.metrics_token()
    scrapers = frozenset(() if token is None else (key_digest(token),))
    exact = {}
    patterns = []
    for name, priced in config.prices.items():
        price = Price(
            priced.input_per_mtok,
            priced.output_per_mtok,
            priced.cached_input_per_mtok,
            priced.cache_write_per_mtok,
        )
        if any(char in name for char in "*?["):
            patterns.append((name, price))
        else:
            exact[name] = price
    keys = KeyDirectory(clients, admins, scrapers)
    return TenantPolicy(keys, PriceTable(exact, tuple(patterns)))
