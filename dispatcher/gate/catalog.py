"""From node sessions and the edge config to what admission works with: candidates and the
policy snapshot."""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs

from ..admission import (
    MODEL_LINGER_S,
    Candidate,
    Policy,
    PolicySnapshot,
)
from ..config import EdgeConfig, QueuePolicySettings, fallback_chain
from ..link.registry import NodeSession
from .rules import GatePolicy


def candidates_for_session(session: NodeSession) -> list[Candidate]:
    """Every (provider, model) the session's ``hello`` announced, as candidates of its
    generation."""
    return [
        Candidate.from_info(
            node_id=session.node_id,
            generation=session.generation,
            provider=provider,
            model=model,
            node_label=session.label,
        )
        for provider in session.hello.providers
        for model in provider.models
    ]


def _policy(base: Policy, settings: QueuePolicySettings) -> Policy:
    return attrs.evolve(base, **settings.overrides())


def policy_snapshot_from_config(config: EdgeConfig) -> PolicySnapshot:
    """The admission policy in force for ``config``: ``[admission]`` is the default,
    ``[models.NAME]`` overrides it per group and may name aliases of the group. A model a
    key's ``models`` names exactly (not by a pattern) is one that key expects: while no node
    serves it, that key's requests for it are unavailable (503), not unknown (404)."""
    default = _policy(Policy(), config.admission)
    groups = {name: _policy(default, settings) for name, settings in config.models.items()}
    aliases = {
        alias: name for name, settings in config.models.items() for alias in settings.aliases
    }
    linger = config.admission.model_linger_s
    return PolicySnapshot(
        default=default,
        groups=groups,
        aliases=aliases,
        tenant_models={
            key.id: frozenset(name for name in key.models if not _GLOB.search(name))
            for key in config.keys
        },
        model_linger_s=MODEL_LINGER_S if linger is None else linger,
    )


_GLOB = re.compile(r"[*?\[]")
"""What makes a name an ``fnmatch`` pattern rather than one model's name."""


def gate_policies(config: EdgeConfig, snapshot: PolicySnapshot) -> Callable[[str], GatePolicy]:
    """The gate policy of a model (or alias): ``[admission]`` gate fields as defaults,
    ``[models.NAME]`` overriding them, with the group's fallbacks in the order they are
    tried (:func:`~dispatcher.config.fallback_chain`). An alias is resolved by ``snapshot``
    (the admission policy of the same config): one alias map, one resolver, for admission,
    the gate and the metrics' model label."""
    default = attrs.evolve(GatePolicy(), **config.admission.gate_overrides())
    groups = {
        name: attrs.evolve(
            default, **settings.gate_overrides(), fallbacks=fallback_chain(config, name)
        )
        for name, settings in config.models.items()
    }
    resolve = snapshot.resolve

    def policy_for(model: str) -> GatePolicy:
        return groups.get(resolve(model), default)

    return policy_for
