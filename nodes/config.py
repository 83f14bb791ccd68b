"""A node's configuration: who it is, where the edge is, which providers and models it serves.

Build a :class:`NodeConfig` in Python, take :func:`default_node_config` (one built-in ``echo``
model), or load a TOML file with :func:`load_node_config`. Loading validates everything and
reports the first problem as a :class:`NodeConfigError` naming the file, the key and the
reason, for example ``node.toml: providers[1].models[0].slots: expected a positive integer,
got 'x'``. Unknown keys are errors too (a typo must not silently fall back to a default).

Secrets never live in a provider's configuration: ``api_key_env`` names an environment
variable that the adapter reads when it runs. The node's own ``token`` (how the edge
authenticates the node) may be given inline or, better, through ``token_env``.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import socket
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Literal, NoReturn, TypeAlias, get_args

import attrs

from dispatcher import wire

AdapterType: TypeAlias = Literal["echo", "ollama", "openai", "cli"]
ADAPTER_TYPES: Final[tuple[str, ...]] = get_args(AdapterType)
EXECUTION_PATHS: Final[tuple[str, ...]] = get_args(wire.ExecutionPath)

NODE_CONNECT_PATH: Final = "/v1/nodes/connect"
"""The edge's websocket endpoint for nodes; an edge URL's path ends with it (a reverse proxy
may put a prefix before it)."""
DEFAULT_EDGE_URL: Final = "ws://127.0.0.1:8700" + NODE_CONNECT_PATH

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class NodeConfigError(Exception):
    """An invalid node configuration. ``str()`` is ``"<file>: <key>: <reason>"``."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        super().__init__(f"{source}: {key}: {reason}" if key else f"{source}: {reason}")
        self.source = source
        self.key = key
        self.reason = reason


class OptionsError(Exception):
    """An adapter's ``options`` table is invalid; ``key`` is relative to that table."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


@attrs.frozen(kw_only=True)
class ModelConfig:
    """One model a provider serves. ``name`` is what clients ask for; ``served_name`` what the
    provider calls it (defaults to ``name``)."""

    name: str
    served_name: str = attrs.field(default=attrs.Factory(lambda self: self.name, takes_self=True))
    slots: int = 1
    long_context_slots: int = 0
    context_window: int | None = None
    capabilities: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class ProviderConfig:
    """One engine or upstream the node drives, through the adapter named by ``type``.

    ``options`` holds adapter knobs (for ``echo`` see :class:`nodes.adapters.echo.EchoOptions`).
    ``api_key_env`` is the *name* of an environment variable holding the upstream's key,
    never the key itself.
    """

    id: str
    type: AdapterType
    path: wire.ExecutionPath = "normalized"
    base_url: str | None = None
    command: tuple[str, ...] | None = None
    api_key_env: str | None = None
    options: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    models: tuple[ModelConfig, ...] = ()


@attrs.frozen(kw_only=True)
class NodeConfig:
    """Everything a node needs. Times are seconds."""

    node_id: str
    label: str = ""
    edge_url: str = DEFAULT_EDGE_URL
    token: str | None = attrs.field(default=None, repr=False)
    providers: tuple[ProviderConfig, ...] = ()
    heartbeat_timeout_factor: float = 3.0
    """The session ends when the edge is silent for this many heartbeat intervals."""
    handshake_timeout: float = 10.0
    """How long to wait for ``welcome`` after sending ``hello``."""
    reconnect_min_backoff: float = 0.5
    reconnect_max_backoff: float = 30.0
    reconnect_reset_after: float = 30.0
    """A session that lasted longer than this resets the backoff to its minimum."""
    drain_grace: float = 30.0
    """On SIGTERM / Ctrl-C (or :class:`nodes.agent.Drain`), how long the node's in-flight runs
    and tunnels get to finish after it told the edge ``node.draining``, before it leaves."""


def check_edge_url(url: str) -> str | None:
    """Why ``url`` is not an edge's node endpoint (``ws[s]://HOST[:PORT][/PREFIX]/v1/nodes/
    connect``), with the likely fix; None when it is one."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  # raises ValueError for a port that is not a number
    except ValueError as exc:
        return f"expected a ws:// or wss:// URL, got {url!r} ({exc})"
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        fixed = ("ws" if scheme == "http" else "wss") + url[len(scheme) :]
        if not parts.path.endswith(NODE_CONNECT_PATH):
            fixed = fixed.rstrip("/") + NODE_CONNECT_PATH
        return f"expected a ws:// or wss:// URL, got {url!r} (try {fixed})"
    if scheme not in ("ws", "wss") or not parts.hostname:
        return f"expected a ws:// or wss:// URL, got {url!r}"
    if not parts.path.endswith(NODE_CONNECT_PATH):
        fixed = urllib.parse.urlunsplit(
            (parts.scheme, parts.netloc, parts.path.rstrip("/") + NODE_CONNECT_PATH, "", "")
        )
        return f"expected a URL ending in {NODE_CONNECT_PATH}, got {url!r} (try {fixed})"
    return None


def default_node_config(node_id: str | None = None) -> NodeConfig:
    """A node serving the built-in ``echo`` model (provider ``echo``, 8 slots, no capabilities:
    echo honours no tools, JSON mode or images, so it announces none)."""
    return NodeConfig(
        node_id=node_id or socket.gethostname(),
        providers=(
            ProviderConfig(
                id="echo",
                type="echo",
                models=(ModelConfig(name="echo", slots=8),),
            ),
        ),
    )


def hello_from_config(config: NodeConfig) -> wire.Hello:
    """The ``hello`` announcing this node: everything but provider credentials (which never
    leave the node). ``adapter`` is the provider's ``type``."""
    return wire.Hello(
        protocol=wire.PROTOCOL_VERSION,
        node_id=config.node_id,
        label=config.label,
        token=config.token,
        providers=tuple(
            wire.ProviderInfo(
                id=provider.id,
                type=provider.type,
                adapter=provider.type,
                path=provider.path,
                models=tuple(
                    wire.ModelInfo(
                        name=model.name,
                        served_name=model.served_name,
                        slots=model.slots,
                        long_context_slots=model.long_context_slots,
                        context_window=model.context_window,
                        capabilities=model.capabilities,
                    )
                    for model in provider.models
                ),
            )
            for provider in config.providers
        ),
    )


# --------------------------------------------------------------------------- loading TOML


def load_node_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> NodeConfig:
    """Load and validate a node configuration file; see ``docs/node.md`` for the format.

    ``environ`` (default ``os.environ``) resolves ``node.token_env``.
    Raises :class:`NodeConfigError`.
    """
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise NodeConfigError(source, "", f"cannot read the file: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise NodeConfigError(source, "", "the file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise NodeConfigError(source, "", f"invalid TOML: {exc}") from None
    return _parse(source, data, os.environ if environ is None else environ)


def _parse(source: str, data: dict[str, Any], environ: Mapping[str, str]) -> NodeConfig:
    # Imported here: the adapter registry imports this module for ProviderConfig.
    from nodes.adapters import validate_options

    top = _Table(source, "", data)
    node = top.table("node", required=False)
    providers_raw = top.array_of_tables("providers")
    top.finish()

    node_id = node.optional_string("id") or socket.gethostname()
    label = node.optional_string("label") or ""
    edge_url = node.optional_string("edge_url") or DEFAULT_EDGE_URL
    bad_url = check_edge_url(edge_url)
    if bad_url is not None:
        node.fail("edge_url", bad_url)
    token = node.optional_string("token")
    token_env = node.env_name("token_env")
    if token is not None and token_env is not None:
        node.fail("token_env", "give either token or token_env, not both")
    if token_env is not None:
        token = environ.get(token_env)
        if not token:
            node.fail("token_env", f"environment variable {token_env} is not set")
    factor = node.number("heartbeat_timeout_factor", minimum=1.0, default=3.0)
    handshake_timeout = node.number("handshake_timeout", minimum=0.0, default=10.0, strict=True)
    min_backoff = node.number("reconnect_min_backoff", minimum=0.0, default=0.5, strict=True)
    max_backoff = node.number("reconnect_max_backoff", minimum=0.0, default=30.0, strict=True)
    if max_backoff < min_backoff:
        node.fail(
            "reconnect_max_backoff",
            f"must be at least reconnect_min_backoff ({min_backoff}), got {max_backoff}",
        )
    reset_after = node.number("reconnect_reset_after", minimum=0.0, default=30.0)
    drain_grace = node.number("drain_grace", minimum=0.0, default=30.0)
    node.finish()

    if not providers_raw:
        top.fail("providers", "expected at least one [[providers]] table")
    providers: list[ProviderConfig] = []
    for provider_table in providers_raw:
        provider = _parse_provider(provider_table, validate_options)
        if any(p.id == provider.id for p in providers):
            provider_table.fail("id", f"duplicate provider id {provider.id!r}")
        providers.append(provider)

    return NodeConfig(
        node_id=node_id,
        label=label,
        edge_url=edge_url,
        token=token,
        providers=tuple(providers),
        heartbeat_timeout_factor=factor,
        handshake_timeout=handshake_timeout,
        reconnect_min_backoff=min_backoff,
        reconnect_max_backoff=max_backoff,
        reconnect_reset_after=reset_after,
        drain_grace=drain_grace,
    )


def _parse_provider(
    table: _Table, validate_options: Callable[[str, Mapping[str, Any]], None]
) -> ProviderConfig:
    provider_id = table.string("id")
    kind = table.choice("type", ADAPTER_TYPES)
    path = table.optional_choice("path", EXECUTION_PATHS) or "normalized"
    if path == "tunnel" and kind in ("echo", "cli"):
        table.fail("path", f"a {kind!r} provider can only run normalized, not tunnel")
    base_url = table.optional_string("base_url")
    if base_url is not None and not base_url.startswith(("http://", "https://")):
        table.fail("base_url", f"expected an http:// or https:// URL, got {base_url!r}")
    command = table.command("command")
    api_key_env = table.env_name("api_key_env")
    options = table.table("options", required=False)
    try:
        validate_options(kind, options.data)
    except OptionsError as exc:
        options.fail(exc.key, exc.reason)
    models_raw = table.array_of_tables("models")
    table.finish()
    if not models_raw:
        table.fail("models", "expected at least one [[providers.models]] table")
    models: list[ModelConfig] = []
    for model_table in models_raw:
        model = _parse_model(model_table)
        if any(m.name == model.name for m in models):
            model_table.fail("name", f"duplicate model name {model.name!r}")
        models.append(model)
    return ProviderConfig(
        id=provider_id,
        type=kind,  # type: ignore[arg-type]  # checked by choice() against ADAPTER_TYPES
        path=path,  # type: ignore[arg-type]  # checked by choice() against EXECUTION_PATHS
        base_url=base_url,
        command=command,
        api_key_env=api_key_env,
        options=dict(options.data),
        models=tuple(models),
    )


def _parse_model(table: _Table) -> ModelConfig:
    name = table.string("name")
    served_name = table.optional_string("served_name") or name
    slots = table.integer("slots", minimum=1, default=1)
    long_context_slots = table.integer("long_context_slots", minimum=0, default=0)
    if long_context_slots > slots:
        table.fail(
            "long_context_slots", f"must not exceed slots ({slots}), got {long_context_slots}"
        )
    context_window = table.optional_integer("context_window", minimum=1)
    capabilities = table.string_list("capabilities")
    table.finish()
    return ModelConfig(
        name=name,
        served_name=served_name,
        slots=slots,
        long_context_slots=long_context_slots,
        context_window=context_window,
        capabilities=capabilities,
    )


@attrs.define
class _Table:
    """A TOML table being validated: typed getters that remember which keys were read, and
    errors that name the file and the full key path."""

    source: str
    prefix: str
    data: Mapping[str, Any]
    seen: set[str] = attrs.field(factory=set)

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def fail(self, name: str, reason: str) -> NoReturn:
        raise NodeConfigError(self.source, self.key(name), reason)

    def _get(self, name: str) -> Any:
        self.seen.add(name)
        return self.data.get(name)

    def finish(self) -> None:
        for name in self.data:
            if name not in self.seen:
                self.fail(name, "unknown key")

    def table(self, name: str, *, required: bool) -> _Table:
        value = self._get(name)
        if value is None:
            if required:
                self.fail(name, "missing")
            value = {}
        if not isinstance(value, dict):
            self.fail(name, f"expected a table, got {_show(value)}")
        return _Table(self.source, self.key(name), value)

    def array_of_tables(self, name: str) -> list[_Table]:
        value = self._get(name)
        if value is None:
            return []
        if not isinstance(value, list):
            self.fail(name, f"expected an array of tables, got {_show(value)}")
        tables = []
        for index, item in enumerate(value):
            key = f"{self.key(name)}[{index}]"
            if not isinstance(item, dict):
                raise NodeConfigError(self.source, key, f"expected a table, got {_show(item)}")
            tables.append(_Table(self.source, key, item))
        return tables

    def string(self, name: str) -> str:
        value = self.optional_string(name)
        if value is None:
            self.fail(name, "missing")
        return value

    def optional_string(self, name: str) -> str | None:
        value = self._get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            self.fail(name, f"expected a non-empty string, got {_show(value)}")
        return value

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        value = self.optional_choice(name, choices)
        if value is None:
            self.fail(name, "missing")
        return value

    def optional_choice(self, name: str, choices: tuple[str, ...]) -> str | None:
        value = self.optional_string(name)
        if value is not None and value not in choices:
            self.fail(name, f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def env_name(self, name: str) -> str | None:
        value = self.optional_string(name)
        if value is not None and not _ENV_NAME.match(value):
            self.fail(name, f"expected the name of an environment variable, got {value!r}")
        return value

    def command(self, name: str) -> tuple[str, ...] | None:
        value = self._get(name)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                argv = shlex.split(value)
            except ValueError as exc:
                self.fail(name, f"cannot split the command line: {exc}")
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            argv = list(value)
        else:
            self.fail(name, f"expected a string or an array of strings, got {_show(value)}")
        if not argv:
            self.fail(name, "expected a non-empty command")
        return tuple(argv)

    def integer(self, name: str, *, minimum: int, default: int) -> int:
        value = self.optional_integer(name, minimum=minimum)
        return default if value is None else value

    def optional_integer(self, name: str, *, minimum: int) -> int | None:
        value = self._get(name)
        if value is None:
            return None
        if type(value) is not int or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            self.fail(name, f"expected {kind}, got {_show(value)}")
        return int(value)

    def number(self, name: str, *, minimum: float, default: float, strict: bool = False) -> float:
        value = self._get(name)
        if value is None:
            return default
        ok = type(value) in (int, float) and math.isfinite(value)
        ok = ok and (value > minimum if strict else value >= minimum)
        if not ok:
            bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
            self.fail(name, f"expected a number {bound}, got {_show(value)}")
        return float(value)

    def string_list(self, name: str) -> tuple[str, ...]:
        value = self._get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(name, f"expected an array of non-empty strings, got {_show(value)}")
        if len(set(value)) != len(value):
            self.fail(name, "duplicate entries")
        return tuple(value)


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return repr(value)
