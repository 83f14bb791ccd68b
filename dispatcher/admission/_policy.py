"""Admission policy: per model group limits, and the snapshot the core works from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Final

import attrs


def _non_negative(_: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def _load_factor(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (1.0 <= value < float("inf")):
        raise ValueError(f"{attribute.name} must be a finite number >= 1, got {value!r}")


def _positive(_: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class Policy:
    """How one model group admits requests. Times are in seconds.

    ``max_queue``: waiters at most (both classes) before new ones get ``queue_full``.
    ``queue_timeout_s``: longest wait for a slot before ``timeout``.
    ``per_candidate_cap``: lowers every candidate's announced ``slots`` to at most this.
    ``long_context_tokens``: requests of at least this many estimated tokens are class
    ``"long"``; ``None`` means one class for all.
    ``drain_timeout_s``: how long a cancelled run's slot stays occupied waiting for the node to
    confirm the cancel. ``retry_after_s``: the Retry-After of ``queue_full`` and ``timeout``.

    Failure-aware selection (see ``docs/admission.md``): ``eject_after_failures``
    consecutive retryable failures of a candidate eject it (0: never); the first cool-down
    is ``eject_base_s``, each further ejection without a success in between doubles it, up
    to ``eject_max_s``.

    Affinity (cache-aware routing, see "Affinity" in ``docs/admission.md``): with
    ``affinity`` on, a request with an affinity key prefers the candidate its key ranks
    first (rendezvous hashing); it spills to the next in its ranking when that one is above
    ``affinity_load_factor`` x the group's average load, or has no free slot within
    ``affinity_wait_s`` of the request's arrival.
    """

    max_queue: int = attrs.field(default=256, validator=_non_negative)
    queue_timeout_s: float = attrs.field(default=30.0, validator=_non_negative)
    per_candidate_cap: int | None = attrs.field(default=None, validator=_positive)
    long_context_tokens: int | None = attrs.field(default=None, validator=_positive)
    drain_timeout_s: float = attrs.field(default=5.0, validator=_non_negative)
    retry_after_s: float = attrs.field(default=1.0, validator=_non_negative)
    eject_after_failures: int = attrs.field(default=2, validator=_non_negative)
    eject_base_s: float = attrs.field(default=5.0, validator=_non_negative)
    eject_max_s: float = attrs.field(default=300.0, validator=_non_negative)
    affinity: bool = False
    affinity_wait_s: float = attrs.field(default=0.05, validator=_non_negative)
    affinity_load_factor: float = attrs.field(default=1.25, validator=_load_factor)

    def cool_down(self, ejections: int) -> float:
        """The cool-down of the ``ejections``-th ejection in a row (1 for the first)."""
        if ejections <= 1:
            return min(self.eject_base_s, self.eject_max_s)
        # min() before the power would overflow: 2**60 * base is past any sane max
        return min(self.eject_max_s, self.eject_base_s * 2.0 ** min(ejections - 1, 60))


def _frozen_tenant_models(value: Mapping[str, Iterable[str]]) -> Mapping[str, frozenset[str]]:
    return MappingProxyType({tenant: frozenset(names) for tenant, names in value.items()})


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


MODEL_LINGER_S: Final = 60.0
"""How long a model stays *unavailable* (503, retry) rather than *unknown* (404) after the
last node that served it left: long enough for its node to restart."""
UNAVAILABLE_RETRY_AFTER_S: Final = 2.0
"""The ``Retry-After`` of ``model_unavailable``: the SDKs' default two retries then cover
about 4 s of a node's restart."""


@attrs.frozen(kw_only=True)
class PolicySnapshot:
    """The whole admission configuration at one moment: a default policy, per-group
    overrides, and aliases (public name -> group). Replaced as a unit.

    ``model_linger_s`` and ``tenant_models`` say what a request for a model that no group
    holds gets: *unavailable* (503 with ``Retry-After``: a node may come back) if a node
    served it less than ``model_linger_s`` ago or the requesting tenant's own allowed models
    name it exactly (``tenant_models``, by ``Share.tenant``: another tenant's list never
    changes the answer, so a key learns nothing of the others'), else *unknown* (404)."""

    default: Policy = Policy()
    groups: Mapping[str, Policy] = attrs.field(factory=dict, converter=_frozen_mapping, hash=False)
    aliases: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_mapping, hash=False)
    model_linger_s: float = attrs.field(default=MODEL_LINGER_S, validator=_non_negative)
    tenant_models: Mapping[str, frozenset[str]] = attrs.field(
        factory=dict, converter=_frozen_tenant_models, hash=False
    )
    unavailable_retry_after_s: float = attrs.field(
        default=UNAVAILABLE_RETRY_AFTER_S, validator=_non_negative
    )

    def policy_for(self, group: str) -> Policy:
        return self.groups.get(group, self.default)

    def resolve(self, model: str) -> str:
        """The group a public model name means (itself unless it is an alias)."""
        return self.aliases.get(model, model)

    def knows(self, group: str) -> bool:
        """True when the configuration names ``group`` (an override or an alias target)."""
        return group in self.groups or group in self.aliases.values()
