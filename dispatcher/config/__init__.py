"""Edge configuration: TOML, validated into frozen attrs classes.

A config error names the file, the key path and the reason, in the same style as the node's
(``nodes.config``)::

    edge.toml: http.max_body_size: expected an integer, got 'big'
    edge.toml: api_keys: expected an array of strings, got a string
    edge.toml: nodes.lable: unknown key

and the daemon refuses to start. A :class:`ConfigError` holds every problem of the file
(``problems``), not just the first: the values' (types, unknown keys), then what the checks
across values and the secrets find in the rest
(:func:`~dispatcher.shared.config_errors.structure_all`). Every key has a default, so an
empty file (or no file) is a working edge.

**Secrets.** Client keys, admin keys and node tokens are arrays of strings (a bare string is
an error: it would otherwise be read as one key per character) and may come from environment
variables; the metrics token (``[metrics]``) is one string, or a variable holding it.
:func:`load_edge_config` and :func:`parse_edge_config` -- the daemon's path -- resolve them
once, when the file is loaded:

* ``api_keys_env`` / ``admin_keys_env`` / ``nodes.tokens_env`` name a variable of
  comma-separated values. When the file does not name one, the daemon reads
  ``DISPATCHER_API_KEYS`` / ``DISPATCHER_ADMIN_KEYS`` / ``DISPATCHER_NODE_TOKENS`` if set.
* A variable the file names that is unset or empty is an error; so is a default variable
  that is set but empty (most often a template that failed to fill it in): either would
  silently turn authentication off.

The loaded config holds the values (the ``*_env`` fields are None afterwards). An
:class:`EdgeConfig` built in Python reads only the variables it names, when its keys are
asked for (:meth:`EdgeConfig.client_api_keys` and friends), with the same strictness.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
from cattrs.gen import make_dict_structure_fn
from cattrs.preconf.tomllib import make_converter

from nodes import provider_startup_problems
from nodes.adapters import ADAPTERS
from nodes.config import ProviderConfig, check_providers, structure_providers

from ..shared.config_errors import (
    ConfigFileError,
    Invalid,
    Problem,
    render,
    show,
    structure_all,
    structure_each,
    structure_named,
)
from ..shared.config_errors import key as toml_key

DEFAULT_API_KEYS_ENV: Final = "DISPATCHER_API_KEYS"
DEFAULT_ADMIN_KEYS_ENV: Final = "DISPATCHER_ADMIN_KEYS"
DEFAULT_NODE_TOKENS_ENV: Final = "DISPATCHER_NODE_TOKENS"

ENVIRONMENT: Final = "environment"
"""The ``source`` of an error in a default environment variable (not in any file)."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ID_PATTERN = re.compile(r"[A-Za-z0-9._:*?\[\]!-]+\Z")
"""A node id glob: node id characters (see ``nodelink``) plus ``* ? [ ] !``."""


class ConfigError(ConfigFileError):
    """A configuration that cannot be used; ``str()`` is ``"<file>: <key>: <reason>"``."""


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
class NodeToken:
    """A node token bound to the node ids it may claim: a table in ``nodes.tokens``.

    ``ids`` are glob patterns (``fnmatch``, case-sensitive: ``*``, ``?``, ``[...]``), e.g.
    ``["gpu-*"]``; ``["*"]`` allows any id. The token is ``value`` or, better, the
    environment variable ``value_env`` (the whole value is one token) -- exactly one of
    them."""

    value: str | None = attrs.field(default=None, repr=False)
    value_env: str | None = None
    ids: tuple[str, ...]


@attrs.frozen(kw_only=True)
class NodeSettings:
    tokens: tuple[str | NodeToken, ...] = attrs.field(default=(), repr=False)
    """Node tokens accepted in ``hello``: a string may claim any node id, a
    :class:`NodeToken` only the ids it lists. Empty (and no token in ``tokens_env``): any
    node may join, under any id (fine on loopback only)."""
    tokens_env: str | None = None
    """Name of an environment variable holding comma-separated node tokens (any id). The
    daemon reads ``DISPATCHER_NODE_TOKENS`` when this is not set."""
    hello_timeout: float = 10.0
    heartbeat_interval: float = 5.0
    heartbeat_timeout: float = 15.0


def _one_of(*allowed: str) -> Callable[[object, attrs.Attribute[Any], str], None]:
    """A field's validator: its value is one of ``allowed``."""

    def check(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in allowed:
            wanted = " or ".join(f'"{each}"' for each in allowed)
            raise Invalid(f"must be {wanted}, got {value!r}", at=attribute.name)

    return check


_LISTEN = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^\s:\[\]]+)):(?P<port>[0-9]{1,5})\Z")


def parse_listen(text: str) -> tuple[str, int] | None:
    """``"host:port"`` (``"[::1]:9700"`` for an IPv6 address) as ``(host, port)``; None when
    it is not one."""
    found = _LISTEN.match(text)
    if found is None or int(found["port"]) > 65535:
        return None
    return found["v6"] or found["host"], int(found["port"])


@attrs.frozen(kw_only=True)
class MetricsSettings:
    """``GET /metrics`` for a Prometheus scraper (``docs/metrics.md``), without the admin
    key: a token of its own, a listener of its own, or both."""

    token: str | None = attrs.field(default=None, repr=False)
    """A bearer token ``/metrics`` accepts (besides what it accepts without one: an admin
    key, see ``api.app``); it opens no other route. Better ``token_env``."""
    token_env: str | None = None
    """An environment variable holding the token (its whole value)."""
    listen: str | None = None
    """``"host:port"`` of a second, plain-HTTP listener that serves only ``/metrics`` and
    ``/healthz``, with no auth (``dispatcher serve``; embedders: ``Dispatcher.serve_metrics``).
    Keep it on loopback or a network only the scraper reaches."""

    def listen_address(self) -> tuple[str, int] | None:
        """``listen`` as ``(host, port)`` (None: no listener). Raises ``ValueError`` for an
        address the loader would have refused."""
        if self.listen is None:
            return None
        address = parse_listen(self.listen)
        if address is None:
            raise ValueError(f"metrics.listen: not a host:port: {self.listen!r}")
        return address


@attrs.frozen(kw_only=True)
class ResponsesSettings:
    """The Responses API's stored responses (``docs/responses.md``): kept in SQLite beside
    the usage ledger (in memory when the ledger is), oldest first out past a bound."""

    max_stored: int = 10_000
    """The most responses kept."""
    max_stored_bytes: int = 64 * 1024 * 1024
    """The most bytes of their JSON kept (each with its conversation)."""
    max_age_s: float = 24 * 3600.0
    """A response older than this is forgotten."""
    built_in_tools: str = attrs.field(default="drop", validator=_one_of("drop", "refuse"))
    """A request offering the API's built-in tools (``web_search``, ``file_search`` ...),
    which no backend of the edge runs: ``drop`` them (the answer's
    ``x-dispatcher-dropped-tools`` header names them), or ``refuse`` it with a 400."""


@attrs.frozen(kw_only=True)
class StoreSettings:
    """Where the edge keeps what several edges share (``docs/cluster.md``). Without a URL
    each part is embedded: the limits in memory, the ledger and the stored responses in
    SQLite (``usage_db``) -- one process, nothing to run."""

    redis_url: str | None = attrs.field(default=None, repr=False)
    """The tenants' limits and budgets, and the edges' heartbeats, on this Redis (>= 7) or
    Valkey: ``redis://[[user]:password@]host:port/db`` or ``unix://[:password@]/path?db=N``
    (no TLS: keep Redis on a private network)."""
    redis_url_env: str | None = None
    """An environment variable holding ``redis_url`` (the URL may hold a password)."""
    database_url: str | None = attrs.field(default=None, repr=False)
    """The usage ledger and the stored responses on this PostgreSQL:
    ``postgresql://user[:password]@host:port/database``."""
    database_url_env: str | None = None
    """An environment variable holding ``database_url``."""
    on_store_error: str = attrs.field(default="refuse", validator=_one_of("refuse", "local"))
    """When Redis is unreachable or answers past ``timeout_s``: ``refuse`` a request that a
    key's limits apply to (503, retryable), or enforce each key's limits ``local``ly, divided
    by ``edge_count``, until Redis answers again."""
    edge_count: int = 1
    """How many edges share the load (``on_store_error = "local"`` divides by it)."""
    timeout_s: float = 0.5
    """Seconds a request's limit decision may take on Redis before the store counts as
    failing."""
    hold_lease_s: float = 60.0
    """Seconds a request's place in flight survives its edge: the ``max_concurrent`` holds
    of an edge that died come back within this."""
    outbox: str | None = None
    """The ledger's outbox with ``database_url``: a SQLite file on this edge's disk keeping
    rows until PostgreSQL has them. ``dispatcher serve`` defaults it to
    ``DATA_DIR/outbox.sqlite3``; embedded dispatchers to ``:memory:`` (not durable)."""
    edge_id: str | None = None
    """This edge's name in the cluster (default: host name and port)."""
    node_url: str | None = None
    """Where nodes dial this edge (its node endpoint, ``ws://`` or ``wss://`` ending in
    ``/v1/nodes/connect``), told to every node that joins another edge, so that it joins this
    one too (default: the edge's address, ``ws://`` or ``wss://`` with TLS)."""
    heartbeat_s: float = 5.0
    """Seconds between this edge's heartbeats in Redis; it is forgotten after three missed."""

    def shared(self) -> bool:
        """Whether any part is on a shared server."""
        return bool(
            self.redis_url or self.redis_url_env or self.database_url or self.database_url_env
        )


def _positive(_: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 0:
        raise Invalid("must be > 0 (leave it out for no limit)", at=attribute.name)


def _limit() -> Any:
    """A limit's field: None (no limit) or > 0."""
    return attrs.field(default=None, validator=_positive)


@attrs.frozen(kw_only=True)
class Limits:
    """A tenant's limits (``docs/tenants.md``); None is no limit, else each is > 0."""

    rpm: int | None = _limit()
    """Requests per minute (a sliding 60 s window)."""
    tpm: int | None = _limit()
    """Tokens per minute, input + output (estimated at admission, corrected from usage)."""
    max_concurrent: int | None = _limit()
    """Requests in flight at once."""
    budget_tokens_day: int | None = _limit()
    """Tokens billed to the tenant per UTC day (what its requests in flight are expected to
    use counts too)."""
    budget_tokens_month: int | None = _limit()
    """Tokens billed per UTC month."""
    budget_usd_day: float | None = _limit()
    """USD billed per UTC day, at the ``[prices]`` its requests were admitted under."""
    budget_usd_month: float | None = _limit()
    """USD billed per UTC month."""


@attrs.frozen(kw_only=True)
class KeySettings(Limits):
    """A client key as a tenant: one ``[[keys]]`` table (``docs/tenants.md``), with its
    :class:`Limits` beside the fields below.

    The secret is exactly one of ``key_env`` (an environment variable holding the key),
    ``key_sha256`` (the key's SHA-256, 64 hex digits: the file then holds no secret) or
    ``key`` (the key itself: discouraged)."""

    id: str
    """The tenant's id: what the usage ledger attributes its requests to."""
    name: str | None = None
    """A human name (default: the id)."""
    key: str | None = attrs.field(default=None, repr=False)
    key_env: str | None = None
    key_sha256: str | None = attrs.field(default=None, repr=False)
    models: tuple[str, ...] = ("*",)
    """The model names (glob patterns, as the client asks for them) the key may use."""
    priority: int = 0
    """The priority band of its requests in the admission queue (higher first)."""
    weight: float = 1.0
    """Its weight among the tenants of one band (fair queueing)."""

    def limits(self) -> Limits:
        """Its limits alone."""
        return Limits(**{field.name: getattr(self, field.name) for field in _LIMIT_FIELDS})


_LIMIT_FIELDS: Final = attrs.fields(Limits)


@attrs.frozen(kw_only=True)
class PriceSettings:
    """A model's price: one ``[prices."MODEL"]`` table (USD per million tokens; the name may
    be a glob pattern)."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0
    cached_input_per_mtok: float | None = None
    """Input read from a prompt cache; left out: ``input_per_mtok``."""
    cache_write_per_mtok: float | None = None
    """Input written to a provider's prompt cache; left out: ``input_per_mtok``."""


_GATE_FIELDS = frozenset(
    {"max_attempts", "request_timeout_s", "first_token_timeout_s", "stall_timeout_s"}
)
_NOT_POLICY_FIELDS = _GATE_FIELDS | {"aliases", "model_linger_s", "fallbacks"}
"""What a model group's admission ``Policy`` does not take (``model_linger_s`` is the
whole snapshot's: a dropped group has no policy of its own)."""


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
    affinity: bool | None = None
    """Cache-aware routing (``docs/admission.md``, "Affinity"): a request with an affinity
    key prefers the candidate its key ranks first. Off by default."""
    affinity_wait_ms: float | None = None
    """How long a request may wait for its preferred candidate while another has a free
    slot (milliseconds; default 50)."""
    affinity_load_factor: float | None = None
    """A preferred candidate above this many times the group's average load is passed over
    for the next in the ranking (>= 1; default 1.25)."""
    model_linger_s: float | None = None
    """``[admission]`` only: after the last node serving a model left, requests for it get
    503 ``model_unavailable`` (retry) for this long, then 404 (default 60)."""
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    """``[models.NAME]`` only: the model groups (or aliases) tried, in order, when every
    candidate of this group failed before the answer started or none was available within
    the queue timeout (``docs/gate.md``, "Fallbacks"); each group's own fallbacks follow
    it. Checked at load: a known group, not this one, no cycle."""

    def overrides(self) -> dict[str, Any]:
        """The admission policy fields that are set (``affinity_wait_ms`` as the policy's
        ``affinity_wait_s``)."""
        fields = {
            name: value
            for name, value in attrs.asdict(self).items()
            if value is not None and name not in _NOT_POLICY_FIELDS
        }
        if "affinity_wait_ms" in fields:
            fields["affinity_wait_s"] = fields.pop("affinity_wait_ms") / 1000.0
        return fields

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
    """Run an in-process node serving the built-in ``echo`` model. It is trusted: it needs no
    node token, and no other connection can take over its id."""
    providers: tuple[ProviderConfig, ...] = ()
    """The edge's own ``[[providers]]``, exactly a node's (``docs/node.md``), served by the
    in-process node (beside ``echo`` while :attr:`local_node` is on): one process, one file.
    Their keys stay in the environment (``api_key_env``)."""
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    """Client API keys (``Authorization: Bearer ...``). Empty: no key needed."""
    api_keys_env: str | None = None
    """Name of an environment variable of comma-separated client keys, added to
    ``api_keys``. The daemon reads ``DISPATCHER_API_KEYS`` when this is not set."""
    admin_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    """Keys for the admin routes (``GET /v1/usage``). Empty: admin routes are open only when
    no client API key is configured either."""
    admin_keys_env: str | None = None
    """As ``api_keys_env``, for admin keys (default ``DISPATCHER_ADMIN_KEYS``)."""
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
    responses: ResponsesSettings = ResponsesSettings()
    store: StoreSettings = StoreSettings()
    """Shared backends for several edges (``docs/cluster.md``); embedded without."""
    metrics: MetricsSettings = MetricsSettings()
    """How a scraper reads ``/metrics`` without the admin key (``docs/metrics.md``)."""
    admission: QueuePolicySettings = QueuePolicySettings()
    models: dict[str, QueuePolicySettings] = attrs.field(factory=dict)
    keys: tuple[KeySettings, ...] = attrs.field(default=(), repr=False)
    """Client keys as tenants, with limits and budgets (``docs/tenants.md``)."""
    prices: dict[str, PriceSettings] = attrs.field(factory=dict)
    """Per-model prices (USD per million tokens): the cost in ``GET /v1/usage`` and the
    money budgets."""

    def node_tokens(self) -> tuple[str | NodeToken, ...]:
        """The accepted node tokens, with every ``*_env`` resolved (each
        :class:`NodeToken` has its ``value``). Raises :class:`ConfigError` for a named
        variable that is unset or empty."""
        return resolve_secrets(self).nodes.tokens

    def client_api_keys(self) -> tuple[str, ...]:
        """The client API keys, ``api_keys_env`` resolved (see :meth:`node_tokens`)."""
        return resolve_secrets(self).api_keys

    def admin_api_keys(self) -> tuple[str, ...]:
        """The admin keys, ``admin_keys_env`` resolved (see :meth:`node_tokens`)."""
        return resolve_secrets(self).admin_keys

    def metrics_token(self) -> str | None:
        """The metrics token, ``metrics.token_env`` resolved (see :meth:`node_tokens`)."""
        return resolve_secrets(self).metrics.token

    def resolved_keys(self) -> tuple[KeySettings, ...]:
        """The ``[[keys]]`` tenants, each ``key_env`` resolved into ``key`` (see
        :meth:`node_tokens`)."""
        return resolve_secrets(self).keys

    def default_data_dir(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(base) / "trio-dispatcher"

    def outbox_path(self) -> str:
        """The ledger's outbox with ``[store] database_url``: ``store.outbox``, else
        ``DATA_DIR/outbox.sqlite3`` (what ``dispatcher serve`` uses)."""
        return self.store.outbox or str(self.default_data_dir() / "outbox.sqlite3")

    def edge_id(self, hostname: str | None = None) -> str:
        """This edge's name in the cluster: ``store.edge_id``, else ``HOSTNAME:PORT``."""
        return self.store.edge_id or f"{hostname or socket.gethostname()}:{self.port}"


# --------------------------------------------------------------------------- secrets


def resolve_secrets(
    config: EdgeConfig,
    *,
    environ: Mapping[str, str] | None = None,
    default_env: bool = False,
    source: str = "<config>",
) -> EdgeConfig:
    """``config`` with the secrets of every ``*_env`` variable moved into the values
    (``api_keys``, ``admin_keys``, ``nodes.tokens``, ``metrics.token``) and the ``*_env``
    fields cleared.

    ``environ`` defaults to ``os.environ``. With ``default_env`` (the daemon), a field that
    names no variable reads its ``DISPATCHER_*`` default when that is set. Raises
    :class:`ConfigError` for a named variable that is unset or empty, and for a default
    variable that is set but empty (every such variable, in one error)."""
    env = os.environ if environ is None else environ
    resolved, failed = _resolve_secrets(config, env, default_env=default_env, source=source)
    if failed:
        raise ConfigError.of(failed)
    return resolved


def _resolve_secrets(
    config: EdgeConfig, env: Mapping[str, str], *, default_env: bool, source: str
) -> tuple[EdgeConfig, list[Problem]]:
    """:func:`resolve_secrets`' work: ``config`` with what resolved (a table whose variable
    did not keeps its ``*_env``), and a problem for each variable that did not."""
    failed: list[Problem] = []

    def read(name: str, *, source: str, key: str, explicit: bool, split: bool) -> tuple[str, ...]:
        try:
            return _env_values(env, name, source=source, key=key, explicit=explicit, split=split)
        except ConfigError as exc:
            failed.extend(exc.problems)
            return ()

    def values(field: str, named: str | None, default: str) -> tuple[str, ...]:
        if named is not None:
            return read(named, source=source, key=field, explicit=True, split=True)
        if default_env:
            return read(default, source=ENVIRONMENT, key=default, explicit=False, split=True)
        return ()

    tokens: list[str | NodeToken] = []
    for index, token in enumerate(config.nodes.tokens):
        if isinstance(token, NodeToken) and token.value_env is not None:
            key = f"nodes.tokens[{index}].value_env"
            for value in read(token.value_env, source=source, key=key, explicit=True, split=False):
                token = attrs.evolve(token, value=value, value_env=None)
        tokens.append(token)
    tokens.extend(values("nodes.tokens_env", config.nodes.tokens_env, DEFAULT_NODE_TOKENS_ENV))
    keys: list[KeySettings] = []
    for index, tenant in enumerate(config.keys):
        if tenant.key_env is not None:
            at = f"keys[{index}].key_env"
            for value in read(tenant.key_env, source=source, key=at, explicit=True, split=False):
                tenant = attrs.evolve(tenant, key=value, key_env=None)
        keys.append(tenant)
    metrics = config.metrics
    if metrics.token_env is not None:
        at = "metrics.token_env"
        for value in read(metrics.token_env, source=source, key=at, explicit=True, split=False):
            metrics = attrs.evolve(metrics, token=value, token_env=None)
    store = config.store
    for field in ("redis_url", "database_url"):
        named = getattr(store, f"{field}_env")
        if named is None:
            continue
        at = f"store.{field}_env"
        for value in read(named, source=source, key=at, explicit=True, split=False):
            changes: dict[str, Any] = {field: value, f"{field}_env": None}
            store = attrs.evolve(store, **changes)
    resolved = attrs.evolve(
        config,
        store=store,
        keys=tuple(keys),
        metrics=metrics,
        api_keys=config.api_keys
        + values("api_keys_env", config.api_keys_env, DEFAULT_API_KEYS_ENV),
        api_keys_env=None,
        admin_keys=config.admin_keys
        + values("admin_keys_env", config.admin_keys_env, DEFAULT_ADMIN_KEYS_ENV),
        admin_keys_env=None,
        nodes=attrs.evolve(config.nodes, tokens=tuple(tokens), tokens_env=None),
    )
    return resolved, failed


def _env_values(
    environ: Mapping[str, str],
    name: str,
    *,
    source: str,
    key: str,
    explicit: bool = True,
    split: bool = True,
) -> tuple[str, ...]:
    raw = environ.get(name)
    if raw is None:
        if explicit:
            raise ConfigError(source, key, f"environment variable {name} is not set")
        return ()
    if split:
        items = tuple(item.strip() for item in raw.split(",") if item.strip())
    else:
        items = (raw.strip(),) if raw.strip() else ()
    if not items:
        if explicit:
            raise ConfigError(source, key, f"environment variable {name} is empty")
        raise ConfigError(
            source, key, "is set but empty: unset it to run without, or give the values"
        )
    return items


# --------------------------------------------------------------------------- structuring


_TOML_KINDS: Final = (
    (bool, "a boolean"),  # before int: a bool is an int in Python, not in TOML
    (str, "a string"),
    (int, "an integer"),
    (float, "a float"),
    (dict, "a table"),
    (list, "an array"),
)


def _kind(value: Any) -> str:
    """A value's TOML type, never the value (for secrets)."""
    return next((name for kind, name in _TOML_KINDS if isinstance(value, kind)), "a date or time")


_converter = make_converter(forbid_extra_keys=True)

_EXPECTED = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _strict(kind: type[Any]) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _: Any) -> Any:
        ok = type(value) is kind or (kind is float and type(value) is int)
        if not ok:
            raise Invalid(f"expected {_EXPECTED[kind]}, got {show(value)}")
        return float(value) if kind is float else value

    return structure


for _kind_type in (str, int, float, bool):
    _converter.register_structure_hook(_kind_type, _strict(_kind_type))


def _string(value: Any) -> str:
    # Never the value itself: these arrays hold secrets.
    if not isinstance(value, str):
        raise Invalid(f"expected a string, got {_kind(value)}")
    if not value.strip():
        raise Invalid("expected a non-empty string")
    return value


def _array(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise Invalid(f"expected an array of {what}, got {_kind(value)}")
    return value


def _strings(value: Any, _: Any) -> tuple[str, ...]:
    return structure_each(_string, _array(value, "strings"))


def _token(item: Any) -> str | NodeToken:
    if isinstance(item, dict):
        token: NodeToken = _converter.structure(item, NodeToken)
        return token
    if isinstance(item, str):
        return _string(item)
    raise Invalid(f"expected a string or a table, got {_kind(item)}")


def _tokens(value: Any, _: Any) -> tuple[str | NodeToken, ...]:
    return structure_each(_token, _array(value, "tokens (strings or tables)"))


def _named_tables(cls: type[Any]) -> Callable[[Any, Any], dict[str, Any]]:
    """A table of ``cls`` tables by name (``[models.NAME]``, ``[prices.NAME]``)."""

    def structure(value: Any, _: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise Invalid(f"expected a table, got {show(value)}")
        return structure_named(lambda item: _converter.structure(item, cls), value)

    return structure


def _key_tables(value: Any, _: Any) -> tuple[KeySettings, ...]:
    return structure_each(
        lambda item: _converter.structure(item, KeySettings), _array(value, "tables ([[keys]])")
    )


def _table_hook(cls: type[Any]) -> Callable[[Any, Any], Any]:
    inner = make_dict_structure_fn(cls, _converter)

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise Invalid(f"expected a table, got {show(value)}")
        return inner(value, cls)

    return structure


_GENERIC_HOOKS: Final[dict[object, Callable[[Any, Any], Any]]] = {
    tuple[str, ...]: _strings,
    tuple[str | NodeToken, ...]: _tokens,
    dict[str, QueuePolicySettings]: _named_tables(QueuePolicySettings),
    dict[str, PriceSettings]: _named_tables(PriceSettings),
    tuple[KeySettings, ...]: _key_tables,
}
# Generic aliases are not classes: dispatch on equality.
_converter.register_structure_hook_func(
    lambda t: t in _GENERIC_HOOKS, lambda value, t: _GENERIC_HOOKS[t](value, t)
)
_converter.register_structure_hook_factory(attrs.has, _table_hook)
# The edge's [[providers]]: the node's own tables, structured by the node's loader.
_converter.register_structure_hook_func(
    lambda t: t == tuple[ProviderConfig, ...], lambda value, _: structure_providers(value)
)


def parse_edge_config(
    raw: dict[str, Any],
    *,
    source: str = "<config>",
    environ: Mapping[str, str] | None = None,
) -> EdgeConfig:
    """Validate a parsed TOML document and resolve its secrets (``environ``, default
    ``os.environ``, with the ``DISPATCHER_*`` defaults; see the module docstring). Raises
    :class:`ConfigError` naming every problem (its ``problems``), not just the first: the
    values' (types, unknown keys...), then what the checks across values and the secrets
    find in the rest."""
    structured = structure_all(lambda document: _converter.structure(document, EdgeConfig), raw)
    found = [Problem(source, render(path), reason) for path, reason in structured.problems]
    config = structured.value
    if config is None:
        raise ConfigError.of(found)
    later = [Problem(source, key, reason) for key, reason in _validate(config)]
    env = os.environ if environ is None else environ
    resolved, unresolved = _resolve_secrets(config, env, default_env=True, source=source)
    later += unresolved
    later += _distinct_key_problems(resolved, source)
    if not any(p.key.startswith("providers") for p in [*found, *later]):
        # What a node checks when it starts, once its file is valid (as ``dispatcher node``).
        later += _provider_startup_problems(resolved, env, source)
    for problem in later:
        # One problem per key; none about a value already reported (or left out for it).
        new = all((p.source, p.key) != (problem.source, problem.key) for p in found)
        if new and (problem.source != source or structured.unrelated(problem.key)):
            found.append(problem)
    if found:
        raise ConfigError.of(found)
    return resolved


def key_digest(key: str | bytes) -> str:
    """A key's SHA-256 in hex: how keys are compared (``[[keys]]`` may give only this)."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def tenant_digest(tenant: KeySettings) -> str:
    """The SHA-256 of a ``[[keys]]`` key (its ``key_sha256``, or its resolved ``key``)."""
    if tenant.key_sha256 is not None:
        return tenant.key_sha256.lower()
    if tenant.key is None:  # resolve_secrets moves key_env into key; this is a bug
        raise ValueError(f"key {tenant.id!r} has no resolved secret")
    return key_digest(tenant.key)


def _distinct_key_problems(config: EdgeConfig, source: str) -> list[Problem]:
    """A ``[[keys]]`` key or the metrics token may be nothing else: not another tenant's,
    not in ``api_keys`` or ``admin_keys`` (it would be unclear whose limits and rights
    apply; the metrics token would open more than ``/metrics``). A tenant with no secret
    (reported by the other checks) is left out."""
    found: list[Problem] = []
    owner: dict[str, str] = {}
    token = config.metrics.token
    named = [
        *(
            (f"keys[{index}]", tenant_digest(tenant))
            for index, tenant in enumerate(config.keys)
            if tenant.key is not None or tenant.key_sha256 is not None
        ),
        *(("api_keys", key_digest(key)) for key in config.api_keys),
        *(("admin_keys", key_digest(key)) for key in config.admin_keys),
        *((("metrics.token", key_digest(token)),) if token is not None else ()),
    ]
    single = ("keys[", "metrics.")
    for where, digest in named:
        other = owner.setdefault(digest, where)
        if other != where and (where.startswith(single) or other.startswith(single)):
            found.append(Problem(source, where, f"the same key is also in {other}"))
    return found


def _validate(config: EdgeConfig) -> list[tuple[str, str]]:
    """(key, reason) for each check across values that ``config`` fails."""
    found: list[tuple[str, str]] = []

    def check(ok: bool, key: str, reason: str) -> None:
        if not ok:
            found.append((key, reason))

    def env_name(key: str, name: str | None) -> None:
        if name is not None:
            check(
                _ENV_NAME.match(name) is not None,
                key,
                f"expected the name of an environment variable, got {name!r}",
            )

    check(0 <= config.port <= 65535, "port", f"{config.port} is not a TCP port")
    _validate_providers(config, check)
    _validate_fallbacks(config, check)
    env_name("api_keys_env", config.api_keys_env)
    env_name("admin_keys_env", config.admin_keys_env)
    env_name("nodes.tokens_env", config.nodes.tokens_env)
    for index, token in enumerate(config.nodes.tokens):
        if not isinstance(token, NodeToken):
            continue
        key = f"nodes.tokens[{index}]"
        env_name(f"{key}.value_env", token.value_env)
        check(
            (token.value is None) != (token.value_env is None),
            key,
            "give either value or value_env (exactly one)",
        )
        check(
            bool(token.ids),
            f"{key}.ids",
            'expected at least one node id or glob pattern (["*"] for any id)',
        )
        for position, pattern in enumerate(token.ids):
            check(
                _ID_PATTERN.match(pattern) is not None,
                f"{key}.ids[{position}]",
                f"expected a node id or a glob pattern of one, got {pattern!r}",
            )
    check(config.nodes.heartbeat_interval > 0, "nodes.heartbeat_interval", "must be > 0")
    check(
        config.nodes.heartbeat_timeout > config.nodes.heartbeat_interval,
        "nodes.heartbeat_timeout",
        "must be longer than nodes.heartbeat_interval",
    )
    check(config.http.max_body_size > 0, "http.max_body_size", "must be > 0")
    check(config.responses.max_stored >= 1, "responses.max_stored", "must be >= 1")
    check(config.responses.max_stored_bytes >= 1, "responses.max_stored_bytes", "must be >= 1")
    check(config.responses.max_age_s > 0, "responses.max_age_s", "must be > 0")
    check(
        (config.http.tls_certificate is None) == (config.http.tls_private_key is None),
        "http.tls_certificate",
        "tls_certificate and tls_private_key go together",
    )
    for name, policy in {
        "admission": config.admission,
        **{toml_key("models", k): v for k, v in config.models.items()},
    }.items():
        if policy.max_queue is not None:
            check(policy.max_queue >= 0, f"{name}.max_queue", "must be >= 0")
        if policy.queue_timeout_s is not None:
            check(policy.queue_timeout_s > 0, f"{name}.queue_timeout_s", "must be > 0")
        if policy.model_linger_s is not None:
            check(
                name == "admission",
                f"{name}.model_linger_s",
                "only in [admission]: a model named in [models] always waits for a node",
            )
            check(policy.model_linger_s >= 0, f"{name}.model_linger_s", "must be >= 0")
        if policy.affinity_wait_ms is not None:
            check(
                0 <= policy.affinity_wait_ms < math.inf,
                f"{name}.affinity_wait_ms",
                "must be a number of milliseconds >= 0",
            )
        if policy.affinity_load_factor is not None:
            check(
                1 <= policy.affinity_load_factor < math.inf,
                f"{name}.affinity_load_factor",
                "must be a number >= 1 (1.25: 25% above the group's average load)",
            )
    _validate_tenants(config, check, env_name)
    _validate_metrics(config.metrics, check, env_name)
    _validate_store(config.store, check, env_name)
    return found


def _validate_metrics(
    metrics: MetricsSettings,
    check: Callable[[bool, str, str], None],
    env_name: Callable[[str, str | None], None],
) -> None:
    env_name("metrics.token_env", metrics.token_env)
    check(
        metrics.token is None or metrics.token_env is None,
        "metrics",
        "give token_env or token, not both",
    )
    if metrics.token is not None:
        check(bool(metrics.token.strip()), "metrics.token", "expected a non-empty string")
    if metrics.listen is not None:
        check(
            parse_listen(metrics.listen) is not None,
            "metrics.listen",
            f'expected "host:port" (e.g. "127.0.0.1:9700"), got {metrics.listen!r}',
        )


def _validate_store(
    store: StoreSettings,
    check: Callable[[bool, str, str], None],
    env_name: Callable[[str, str | None], None],
) -> None:
    for field, schemes in (
        ("redis_url", ("redis", "unix")),
        ("database_url", ("postgresql", "postgres")),
    ):
        named = getattr(store, f"{field}_env")
        value = getattr(store, field)
        env_name(f"store.{field}_env", named)
        check(value is None or named is None, "store", f"give {field}_env or {field}, not both")
        if value is not None:
            scheme = value.partition("://")[0] if "://" in value else ""
            check(
                scheme in schemes,
                f"store.{field}",
                f"expected a URL starting {' or '.join(s + '://' for s in schemes)}",
            )
    if store.redis_url is not None:
        query = store.redis_url.partition("?")[2]
        check(
            query == "" or re.fullmatch(r"db=\d+", query) is not None,
            "store.redis_url",
            "takes no options but ?db=N (timeouts are [store] timeout_s)",
        )
    check(store.edge_count >= 1, "store.edge_count", "must be >= 1")
    check(store.timeout_s > 0, "store.timeout_s", "must be > 0")
    check(store.hold_lease_s > 0, "store.hold_lease_s", "must be > 0")
    check(store.heartbeat_s > 0, "store.heartbeat_s", "must be > 0")
    if store.edge_id is not None:
        check(
            _TENANT_ID.match(store.edge_id) is not None,
            "store.edge_id",
            "expected 1 to 64 of A-Z a-z 0-9 . _ : @ -, got " + repr(store.edge_id),
        )
    if store.node_url is not None:
        check(
            re.fullmatch(r"wss?://[^/\s]+(/\S*)?/v1/nodes/connect", store.node_url) is not None,
            "store.node_url",
            "expected a ws:// or wss:// URL ending in /v1/nodes/connect, got "
            + repr(store.node_url),
        )


# --------------------------------------------------------------------------- the in-process
# node's providers, model fallbacks

BUILT_IN_ECHO: Final = "echo"
"""The built-in echo provider's id, and its model's name, on the in-process node."""


def _validate_providers(config: EdgeConfig, check: Callable[[bool, str, str], None]) -> None:
    """The edge's ``[[providers]]``: the node's own checks (``nodes.config.check_providers``,
    against the built-in adapters), and no id clashing with the built-in echo provider."""

    def report(key: str, reason: str) -> None:
        check(False, key, reason)

    check_providers(config.providers, ADAPTERS, report)
    if config.local_node:
        for index, provider in enumerate(config.providers):
            check(
                provider.id != BUILT_IN_ECHO,
                f"providers[{index}].id",
                f"{BUILT_IN_ECHO!r} is the built-in echo provider's id (local_node = true): "
                "choose another, or set local_node = false",
            )


def _provider_startup_problems(
    config: EdgeConfig, env: Mapping[str, str], source: str
) -> list[Problem]:
    """What the in-process node reads of its providers when it starts (a key's variable in
    ``env``, a tunnel's base URL, a command): the message a node's ``dispatcher node``
    gives."""
    return [
        Problem(source, f"providers[{index}].{exc.key}", exc.reason)
        for index, exc in provider_startup_problems(config.providers, environ=env)
    ]


def model_groups(config: EdgeConfig) -> frozenset[str]:
    """The model groups this file knows of: its ``[models.NAME]`` tables, the models of its
    ``[[providers]]``, and ``echo`` while the in-process node serves it."""
    served = {model.name for provider in config.providers for model in provider.models}
    echo = {BUILT_IN_ECHO} if config.local_node else set()
    return frozenset(config.models) | served | echo


def _aliases(config: EdgeConfig) -> dict[str, str]:
    return {alias: name for name, settings in config.models.items() for alias in settings.aliases}


def fallback_chain(config: EdgeConfig, group: str) -> tuple[str, ...]:
    """The groups tried after ``group``, in order: its ``fallbacks`` (aliases resolved),
    each followed by its own (depth first), each group once, ``group`` never. The loader
    refuses cycles; this terminates on one anyway."""
    aliases = _aliases(config)
    chain: list[str] = []
    seen = {group}

    def visit(name: str) -> None:
        settings = config.models.get(name)
        for fallback in settings.fallbacks if settings is not None else ():
            target = aliases.get(fallback, fallback)
            if target not in seen:
                seen.add(target)
                chain.append(target)
                visit(target)

    visit(group)
    return tuple(chain)


def _validate_fallbacks(config: EdgeConfig, check: Callable[[bool, str, str], None]) -> None:
    """``fallbacks``: only per group; each a group (or alias) this file knows, not the
    group itself, listed once; and no group reaches itself through them."""
    check(
        not config.admission.fallbacks,
        "admission.fallbacks",
        "only in [models.NAME]: a fallback belongs to one model group",
    )
    aliases = _aliases(config)
    known = model_groups(config)
    edges: dict[str, list[str]] = {}
    for name, settings in config.models.items():
        at = toml_key("models", name)
        targets: list[str] = []
        for index, fallback in enumerate(settings.fallbacks):
            where = f"{at}.fallbacks[{index}]"
            target = aliases.get(fallback, fallback)
            if target == name:
                check(False, where, f"{fallback!r} is this model group itself")
            elif target not in known and fallback not in aliases:
                check(
                    False,
                    where,
                    f"unknown model group {fallback!r}: name a [models.NAME] table, an alias, "
                    "or a model of this file's [[providers]]",
                )
            elif target in targets:
                check(False, where, f"{fallback!r} is listed twice (as {target!r})")
            else:
                targets.append(target)
        edges[name] = targets
    reported: set[frozenset[str]] = set()
    for name in sorted(edges):
        cycle = _cycle_from(name, edges)
        if cycle is not None and frozenset(cycle) not in reported:
            reported.add(frozenset(cycle))
            check(
                False,
                f"{toml_key('models', name)}.fallbacks",
                "a cycle of fallbacks: " + " -> ".join([*cycle, cycle[0]]),
            )


def _cycle_from(start: str, edges: Mapping[str, list[str]]) -> list[str] | None:
    """A cycle of ``edges`` through ``start`` (the groups in order, ``start`` first), or
    None."""
    path = [start]
    on_path = {start}
    done: set[str] = set()

    def walk(name: str) -> list[str] | None:
        for target in edges.get(name, ()):
            if target == start:
                return list(path)
            if target in on_path or target in done:
                continue
            path.append(target)
            on_path.add(target)
            found = walk(target)
            if found is not None:
                return found
            path.pop()
            on_path.discard(target)
            done.add(target)
        return None

    return walk(start)


_SHA256 = re.compile(r"[0-9a-fA-F]{64}\Z")
_TENANT_ID = re.compile(r"[A-Za-z0-9._:@-]{1,64}\Z")


def _validate_tenants(
    config: EdgeConfig,
    check: Callable[[bool, str, str], None],
    env_name: Callable[[str, str | None], None],
) -> None:
    seen: dict[str, int] = {}
    for index, tenant in enumerate(config.keys):
        at = f"keys[{index}]"
        check(
            _TENANT_ID.match(tenant.id) is not None,
            f"{at}.id",
            "expected 1 to 64 of A-Z a-z 0-9 . _ : @ -, got " + repr(tenant.id),
        )
        other = seen.get(tenant.id)
        check(other is None, f"{at}.id", f"{tenant.id!r} is also the id of keys[{other}]")
        seen[tenant.id] = index
        env_name(f"{at}.key_env", tenant.key_env)
        given = [tenant.key, tenant.key_env, tenant.key_sha256]
        check(
            sum(value is not None for value in given) == 1,
            at,
            "give exactly one of key_env, key_sha256 or key",
        )
        if tenant.key_sha256 is not None:
            check(
                _SHA256.match(tenant.key_sha256) is not None,
                f"{at}.key_sha256",
                "expected the key's SHA-256 as 64 hex digits",
            )
        check(bool(tenant.models), f"{at}.models", 'expected at least one pattern (["*"]: any)')
        check(0 < tenant.weight < math.inf, f"{at}.weight", "must be a number > 0")
    for model, price in config.prices.items():
        at = toml_key("prices", model)
        for name, value in attrs.asdict(price).items():
            check(value is None or value >= 0, f"{at}.{name}", "must be >= 0")


def load_edge_config(
    path: str | os.PathLike[str] | None, *, environ: Mapping[str, str] | None = None
) -> EdgeConfig:
    """Read and validate an edge config file and resolve its secrets (see
    :func:`parse_edge_config`); no path means all defaults (the ``DISPATCHER_*`` variables
    still apply)."""
    if path is None:
        return parse_edge_config({}, source="(no config file)", environ=environ)
    file = Path(path)
    source = str(file)
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(source, "", "the file is not UTF-8 text") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"invalid TOML: {exc}") from None
    return parse_edge_config(raw, source=source, environ=environ)
