"""Edge configuration: TOML, validated into frozen attrs classes.

A config error names the file, the key and the reason, e.g.
``edge.toml: $.http.max_body_size: expected int, got str``, and the daemon refuses to start.
Every key has a default, so an empty file (or no file) is a working edge.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.preconf.tomllib import make_converter


class ConfigError(Exception):
    """A configuration file that cannot be used; ``str()`` says where and why."""


@attrs.frozen(kw_only=True)
class HTTPSettings:
    max_header_size: int = 16 * 1024
    max_body_size: int = 8 * 1024 * 1024
    header_timeout: float = 10.0
    keepalive_timeout: float = 30.0
    write_timeout: float = 30.0
    max_connections: int = 10_000
    shutdown_grace: float = 10.0
    tls_certificate: str | None = None
    tls_private_key: str | None = None


@attrs.frozen(kw_only=True)
class NodeSettings:
    tokens: tuple[str, ...] = attrs.field(default=(), repr=False)
    """Node tokens accepted in ``hello``. Empty: any node may join (fine on loopback only)."""
    tokens_env: str | None = None
    """Name of an environment variable holding comma-separated node tokens."""
    hello_timeout: float = 10.0
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 15.0


_GATE_FIELDS = frozenset(
    {"max_attempts", "request_timeout_s", "first_token_timeout_s", "stall_timeout_s"}
)


@attrs.frozen(kw_only=True)
class QueuePolicySettings:
    """A model group's policy: admission (queue, slots) and the stream gate (attempts,
    timeouts). ``[admission]`` sets the defaults, ``[models.NAME]`` overrides them."""

    max_queue: int | None = None
    queue_timeout_s: float | None = None
    per_candidate_cap: int | None = None
    long_context_tokens: int | None = None
    drain_timeout_s: float | None = None
    max_attempts: int | None = None
    """Attempts per request (the first plus recoveries before anything was streamed)."""
    request_timeout_s: float | None = None
    """One deadline for all attempts of a request until its answer starts, queue waits
    included."""
    first_token_timeout_s: float | None = None
    """An attempt that produced no content this long after dispatch is aborted."""
    stall_timeout_s: float | None = None
    """A run that goes this long between two events is aborted."""
    aliases: tuple[str, ...] = ()

    def overrides(self) -> dict[str, Any]:
        """The admission policy fields that are set."""
        return {
            name: value
            for name, value in attrs.asdict(self).items()
            if value is not None and name != "aliases" and name not in _GATE_FIELDS
        }

    def gate_overrides(self) -> dict[str, Any]:
        """The stream gate fields that are set."""
        return {
            name: value
            for name, value in attrs.asdict(self).items()
            if value is not None and name in _GATE_FIELDS
        }


@attrs.frozen(kw_only=True)
class EdgeConfig:
    host: str = "127.0.0.1"
    port: int = 8700
    local_node: bool = True
    """Run an in-process node serving the built-in ``echo`` model."""
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    """Client API keys (``Authorization: Bearer ...``). Empty: no key needed."""
    api_keys_env: str | None = None
    admin_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    """Keys for the admin routes (``GET /v1/usage``). Empty: admin routes are open only when
    no client API key is configured either."""
    admin_keys_env: str | None = None
    data_dir: str | None = None
    """Where the edge keeps its files; default ``$XDG_DATA_HOME/trio-dispatcher`` (or
    ``~/.local/share/trio-dispatcher``)."""
    usage_db: str | None = None
    """The usage ledger's SQLite file. ``dispatcher serve`` defaults it to
    ``DATA_DIR/usage.sqlite3``; embedded dispatchers default to ``:memory:``."""
    expose_node_ids: bool = False
    """Name the answering node and provider in ``x-dispatcher-node`` / ``-provider`` response
    headers. Off by default: node ids are the operator's business, not every client's."""
    http: HTTPSettings = HTTPSettings()
    nodes: NodeSettings = NodeSettings()
    admission: QueuePolicySettings = QueuePolicySettings()
    models: dict[str, QueuePolicySettings] = attrs.field(factory=dict)

    def node_tokens(self) -> tuple[str, ...]:
        return self.nodes.tokens + _env_list(self.nodes.tokens_env)

    def client_api_keys(self) -> tuple[str, ...]:
        return self.api_keys + _env_list(self.api_keys_env)

    def admin_api_keys(self) -> tuple[str, ...]:
        return self.admin_keys + _env_list(self.admin_keys_env)

    def default_data_dir(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(base) / "trio-dispatcher"


def _env_list(name: str | None) -> tuple[str, ...]:
    if not name:
        return ()
    return tuple(item.strip() for item in os.environ.get(name, "").split(",") if item.strip())


_converter = make_converter(forbid_extra_keys=True)


def _strict(kind: type[Any]) -> Any:
    def structure(value: Any, _: Any) -> Any:
        ok = type(value) is kind or (kind is float and type(value) is int)
        if not ok:
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return value

    return structure


for _kind in (str, int, float, bool):
    _converter.register_structure_hook(_kind, _strict(_kind))


def parse_edge_config(raw: dict[str, Any], *, source: str = "<config>") -> EdgeConfig:
    try:
        config = _converter.structure(raw, EdgeConfig)
    except cattrs.BaseValidationError as exc:
        reasons = "; ".join(cattrs.transform_error(exc, path="$"))
        raise ConfigError(f"{source}: {reasons}") from None
    _validate(config, source)
    return config


def _validate(config: EdgeConfig, source: str) -> None:
    def check(ok: bool, key: str, reason: str) -> None:
        if not ok:
            raise ConfigError(f"{source}: $.{key}: {reason}")

    check(0 <= config.port <= 65535, "port", f"{config.port} is not a TCP port")
    check(config.nodes.heartbeat_interval > 0, "nodes.heartbeat_interval", "must be > 0")
    check(
        config.nodes.heartbeat_timeout > config.nodes.heartbeat_interval,
        "nodes.heartbeat_timeout",
        "must be longer than nodes.heartbeat_interval",
    )
    check(config.http.max_body_size > 0, "http.max_body_size", "must be > 0")
    check(
        (config.http.tls_certificate is None) == (config.http.tls_private_key is None),
        "http.tls_certificate",
        "tls_certificate and tls_private_key go together",
    )
    for name, policy in {
        "admission": config.admission,
        **{f"models.{k}": v for k, v in config.models.items()},
    }.items():
        if policy.max_queue is not None:
            check(policy.max_queue >= 0, f"{name}.max_queue", "must be >= 0")
        if policy.queue_timeout_s is not None:
            check(policy.queue_timeout_s > 0, f"{name}.queue_timeout_s", "must be > 0")


def load_edge_config(path: str | os.PathLike[str] | None) -> EdgeConfig:
    """Read and validate an edge config file; no path means all defaults."""
    if path is None:
        return EdgeConfig()
    file = Path(path)
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: not valid TOML: {exc}") from None
    return parse_edge_config(raw, source=str(file))
