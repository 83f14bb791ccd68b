"""What a loaded config would serve, as the lines ``dispatcher check-config`` prints.

Pure functions of a validated config (:class:`~dispatcher.config.EdgeConfig`,
:class:`~nodes.config.NodeConfig`): no file is opened, nothing is started. Secrets are never
shown -- not the client or admin keys, not the node tokens, not a password or query in a URL
-- only how many there are and which variable a provider's key comes from.

Which kind of file a TOML document is (:func:`config_kind`): a node's has a ``[node]`` table,
or ``[[providers]]`` and nothing else; anything else is read as an edge's (an empty file is a
working edge; an edge's file may hold ``[[providers]]`` too, for its in-process node).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

from nodes.config import ModelConfig, NodeConfig, ProviderConfig

from . import BUILT_IN_ECHO, EdgeConfig, QueuePolicySettings

__all__ = [
    "KINDS",
    "ConfigKind",
    "config_kind",
    "describe_edge",
    "describe_node",
    "describe_stores",
]

ConfigKind = Literal["edge", "node"]
KINDS: Final[tuple[ConfigKind, ...]] = ("edge", "node")


def config_kind(document: Mapping[str, Any]) -> ConfigKind:
    """``"node"`` for a document with a ``[node]`` table, or with ``[[providers]]`` and no
    other key (a node's file may be only that); else ``"edge"``."""
    keys = document.keys()
    return "node" if "node" in keys or keys == {"providers"} else "edge"


def public_url(url: str) -> str:
    """``url`` without what may be a secret: its user and password, its query."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = "..." if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _seconds(value: float) -> str:
    return f"{value:g} s"


# --------------------------------------------------------------------------- the edge


def describe_edge(config: EdgeConfig, *, auth: Sequence[str], usage_db: str) -> list[str]:
    """The edge's listen address, TLS, auth (``auth``: the start-up banner's lines), the
    metrics listener, files, the in-process node, the per-model policies and aliases, and
    the prices."""
    http = config.http
    tls = http.tls_certificate is not None
    host = f"[{config.host}]" if ":" in config.host else config.host or "0.0.0.0"
    where = f"{host}:{config.port}"
    lines = [
        f"listen: {'https' if tls else 'http'}://{where}/v1 "
        f"(nodes dial {'wss' if tls else 'ws'}://{where}/v1/nodes/connect)",
        (
            f"TLS: on (certificate {http.tls_certificate}, key {http.tls_private_key})"
            if tls
            else "TLS: off (plain HTTP; put a TLS-terminating proxy in front off loopback)"
        ),
        *auth,
        _metrics_listener(config),
        f"data dir: {config.default_data_dir()}",
        *describe_stores(config, usage_db),
        *_in_process_node(config),
        f"drain: in-flight requests get {_seconds(http.shutdown_grace)} (http.shutdown_grace)",
        f"node heartbeat: every {_seconds(config.nodes.heartbeat_interval)}, "
        f"lost after {_seconds(config.nodes.heartbeat_timeout)}",
        f"admission defaults: {_policy(config.admission) or 'built-in'}",
    ]
    if not config.models:
        lines.append("models: whatever the nodes announce, each with the defaults")
    for name, settings in sorted(config.models.items()):
        policy = _policy(settings) or "the defaults"
        aliases = f"; aliases {', '.join(settings.aliases)}" if settings.aliases else ""
        fallbacks = f"; fallbacks {', '.join(settings.fallbacks)}" if settings.fallbacks else ""
        lines.append(f"model {name}: {policy}{aliases}{fallbacks}")
    lines.extend(_prices(config))
    return lines


def _prices(config: EdgeConfig) -> list[str]:
    """A line per ``[prices."MODEL"]``: USD per million tokens of each kind, a cache price
    left out shown as the input's it is."""
    lines = []
    for name, price in sorted(config.prices.items()):
        cached, written = price.cached_input_per_mtok, price.cache_write_per_mtok
        defaulted = [
            kind for kind, value in (("cached input", cached), ("cache write", written))
            if value is None
        ]  # fmt: skip
        note = ""
        if len(defaulted) == 2:
            note = " (cache prices: the input's)"
        elif defaulted:
            note = f" ({defaulted[0]}: the input's)"
        lines.append(
            f"price {name}: input {price.input_per_mtok:g}, "
            f"cached input {price.input_per_mtok if cached is None else cached:g}, "
            f"cache write {price.input_per_mtok if written is None else written:g}, "
            f"output {price.output_per_mtok:g} USD/Mtok{note}"
        )
    return lines


def _in_process_node(config: EdgeConfig) -> list[str]:
    """The in-process node: the built-in echo model while ``local_node`` is on, and the
    file's ``[[providers]]`` (their keys' variables named, never read out)."""
    served = [f"model {BUILT_IN_ECHO}"] if config.local_node else []
    served += [f"provider {provider.id}" for provider in config.providers]
    if not served:
        return ["in-process node: off"]
    lines = [f"in-process node: on ({', '.join(served)})"]
    for provider in config.providers:
        lines.append(f"provider {provider.id}: {_provider(provider)}")
        lines.extend(f"  model {_model(model)}" for model in provider.models)
    return lines


def describe_stores(config: EdgeConfig, usage_db: str | None) -> list[str]:
    """Which backend each stored part uses (``[store]``, ``docs/cluster.md``)."""
    store = config.store
    if store.redis_url is None:
        limits = "limits and budgets: in memory (this edge only)"
    else:
        mode = (
            "refuse (503)"
            if store.on_store_error == "refuse"
            else f"local (limits / {store.edge_count} per edge)"
        )
        limits = (
            f"limits and budgets: Redis {public_url(store.redis_url)} (shared; "
            f"decided within {_seconds(store.timeout_s)}, else {mode}; a dead edge's "
            f"holds return within {_seconds(store.hold_lease_s)})"
        )
    if store.database_url is None:
        ledger = usage_db or ":memory:"
        kept = [f"usage ledger: {ledger}", "stored responses: SQLite, beside the ledger"]
    else:
        database = public_url(store.database_url)
        kept = [
            f"usage ledger: PostgreSQL {database} (shared; outbox {config.outbox_path()})",
            f"stored responses: PostgreSQL {database} (shared)",
        ]
    lines = [limits, *kept]
    if store.redis_url is not None:
        lines.append(
            f"cluster: this edge is {config.edge_id()}, heartbeat every "
            f"{_seconds(store.heartbeat_s)}"
        )
    return lines


def _metrics_listener(config: EdgeConfig) -> str:
    address = config.metrics.listen_address()
    if address is None:
        return "metrics listener: off (/metrics on the main listener only)"
    host, port = address
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"metrics listener: http://{where}/metrics and /healthz, no auth (metrics.listen)"


def _policy(settings: QueuePolicySettings) -> str:
    """The set fields, as the file names them (``affinity_wait_ms`` in milliseconds)."""
    fields = {**settings.overrides(), **settings.gate_overrides()}
    if settings.affinity_wait_ms is not None:
        del fields["affinity_wait_s"]
        fields["affinity_wait_ms"] = settings.affinity_wait_ms
    return ", ".join(f"{name} = {_value(value)}" for name, value in sorted(fields.items()))


def _value(value: float) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}"


# --------------------------------------------------------------------------- a node


def describe_node(config: NodeConfig) -> list[str]:
    """The node's id, the edges it dials (and how it trusts them), and each provider with its
    models and slots."""
    label = f" ({config.label})" if config.label else ""
    lines = [
        f"node id: {config.node_id}{label}",
        *(f"edge: {public_url(url)}{_edge_trust(config, url)}" for url in config.edge_urls),
        *(
            ["slots: shared between the edges (each is granted a share)"]
            if len(config.edge_urls) > 1
            else []
        ),
        "token: " + ("set (not shown)" if config.token else "none"),
        f"drain: in-flight runs and tunnels get {_seconds(config.drain_grace)} (drain_grace)",
    ]
    for provider in config.providers:
        lines.append(f"provider {provider.id}: {_provider(provider)}")
        lines.extend(f"  model {_model(model)}" for model in provider.models)
    return lines


def _edge_trust(config: NodeConfig, url: str) -> str:
    if not url.lower().startswith("wss:"):
        return ""
    parts = [f"CA file {Path(config.edge_ca_file)}" if config.edge_ca_file else "system CAs"]
    if config.edge_tls_server_name:
        parts.append(f"certificate name {config.edge_tls_server_name}")
    return f" (TLS: {', '.join(parts)})"


def _provider(provider: ProviderConfig) -> str:
    parts = [f"type {provider.type}", provider.path]
    if provider.base_url is not None:
        parts.append(public_url(provider.base_url))
    if provider.command is not None:
        parts.append(f"command {provider.command[0]}")
    if provider.api_key_env is not None:
        parts.append(f"key from ${provider.api_key_env}")
    return ", ".join(parts)


def _model(model: ModelConfig) -> str:
    served = f" (served as {model.served_name})" if model.served_name != model.name else ""
    parts = [f"{model.slots} slot{'' if model.slots == 1 else 's'}"]
    if model.long_context_slots:
        parts.append(f"{model.long_context_slots} long-context")
    if model.context_window is not None:
        parts.append(f"context window {model.context_window}")
    if model.capabilities:
        parts.append(f"capabilities {', '.join(model.capabilities)}")
    return f"{model.name}{served}: {', '.join(parts)}"
