"""A node's configuration: who it is, where the edge is, which providers and models it serves.

Build a :class:`NodeConfig` in Python, take :func:`default_node_config` (one built-in ``echo``
model), or load a TOML file with ``nodes.load_node_config`` (:func:`read_node_config` here,
given the adapter registry). Loading validates everything and reports every problem (not just
the first) in one :class:`NodeConfigError`, each naming the file, the key and the reason, for
example ``node.toml: providers[1].models[0].slots: expected a positive integer, got 'x'``.
Unknown keys are errors too (a typo must not silently fall back to a default).

Loading is attrs + cattrs, like the edge's (``dispatcher.config``): the file is structured into
the frozen classes below, each field's annotation says what the loader accepts (a
:class:`_Check` in ``Annotated``: ``slots: Annotated[int, _integer(minimum=1)]``), a
structuring failure becomes ``file: key.path: reason``, and what spans fields (a token or its
variable, backoff bounds, duplicate ids) is checked afterwards.

Which adapter types exist is not this module's business: the loader asks the registry it is
given (:class:`AdapterKind` per type; ``nodes.adapters.ADAPTERS`` by default) whether a type
exists, whether it may be tunnelled, and whether its ``options`` table is valid.

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
from typing import Annotated, Any, Final, Literal, Protocol, get_args, get_origin

import attrs
from cattrs.gen import make_dict_structure_fn
from cattrs.preconf.tomllib import make_converter

from dispatcher import wire
from dispatcher.shared.config_errors import (
    ConfigFileError,
    Invalid,
    Problem,
    render,
    show,
    structure_all,
    structure_each,
)

DEFAULT_EDGE_URL: Final = "ws://127.0.0.1:8700" + wire.NODE_CONNECT_PATH
"""Where a node dials when its configuration names no edge (an edge on this machine, on
``dispatcher serve``'s default port)."""
DEFAULT_GIVE_UP_AFTER: Final = 60.0
"""Seconds after which a node that never got in to its edge gives up (``give_up_after``)."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class NodeConfigError(ConfigFileError):
    """An invalid node configuration. ``str()`` is ``"<file>: <key>: <reason>"``."""


class OptionsError(Exception):
    """An adapter's ``options`` table is invalid; ``key`` is relative to that table."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class AdapterKind(Protocol):
    """What loading a config needs to know of one adapter type (``nodes.adapters.AdapterSpec``
    is one)."""

    @property
    def tunnel(self) -> bool:
        """May a provider of this type be served with ``path = "tunnel"``?"""

    @property
    def routes(self) -> tuple[wire.RouteName, ...]:
        """What a normalized provider of this type serves (``wire.NORMALIZED_ROUTES``, and
        ``"embeddings"`` for an adapter that embeds)."""

    @property
    def tunnel_routes(self) -> tuple[wire.RouteName, ...]:
        """What a tunnel provider of this type that declares no ``routes`` serves
        (``wire.DEFAULT_TUNNEL_ROUTES``: an OpenAI-compatible server's)."""

    def check_options(self, raw: Mapping[str, Any]) -> None:
        """Check a provider's ``options`` table; raises :class:`OptionsError`."""


# --------------------------------------------------------------------------- value checks


@attrs.frozen
class _Check:
    """``Annotated`` metadata: how the loader checks (and converts) a field's TOML value;
    ``structure`` raises :class:`Invalid`."""

    structure: Callable[[Any], Any]


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise Invalid(f"expected a non-empty string, got {show(value)}")
    return value


def _integer(*, minimum: int) -> _Check:
    def structure(value: Any) -> int:
        if type(value) is not int or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise Invalid(f"expected {kind}, got {show(value)}")
        return value

    return _Check(structure)


def _number(*, minimum: float, strict: bool = False) -> _Check:
    """A finite number ``>= minimum`` (``> minimum`` when ``strict``), as a float."""

    def structure(value: Any) -> float:
        ok = type(value) in (int, float) and math.isfinite(value)
        if not (ok and (value > minimum if strict else value >= minimum)):
            bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
            raise Invalid(f"expected a number {bound}, got {show(value)}")
        return float(value)

    return _Check(structure)


def _env_name(value: Any) -> str:
    name = _string(value)
    if not _ENV_NAME.match(name):
        raise Invalid(f"expected the name of an environment variable, got {name!r}")
    return name


def _http_url(value: Any) -> str:
    url = _string(value)
    if not url.startswith(("http://", "https://")):
        raise Invalid(f"expected an http:// or https:// URL, got {url!r}")
    return url


def _command(value: Any) -> tuple[str, ...]:
    """A command line: one string (split like a shell) or an array of strings."""
    if isinstance(value, str):
        try:
            argv = shlex.split(value)
        except ValueError as exc:
            raise Invalid(f"cannot split the command line: {exc}") from None
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        argv = list(value)
    else:
        raise Invalid(f"expected a string or an array of strings, got {show(value)}")
    if not argv:
        raise Invalid("expected a non-empty command")
    return tuple(argv)


def _distinct_names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise Invalid(f"expected an array of non-empty strings, got {show(value)}")
    if len(set(value)) != len(value):
        raise Invalid("duplicate entries")
    return tuple(value)


def _routes(value: Any) -> tuple[wire.RouteName, ...]:
    names = _distinct_names(value)
    unknown = [name for name in names if name not in wire.ROUTES]
    if unknown:
        raise Invalid(f"expected routes among {', '.join(wire.ROUTES)}, got {unknown[0]!r}")
    if not names:
        raise Invalid("expected at least one route")
    return names  # type: ignore[return-value]  # each checked to be a wire.RouteName


def _boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise Invalid(f"expected true or false, got {show(value)}")
    return value


_BOOLEAN: Final = _Check(_boolean)
_ENV_VAR: Final = _Check(_env_name)
_HTTP_URL: Final = _Check(_http_url)
_COMMAND: Final = _Check(_command)
_NAMES: Final = _Check(_distinct_names)
_ROUTES: Final = _Check(_routes)


# --------------------------------------------------------------------------- the configuration


@attrs.frozen(kw_only=True)
class ModelConfig:
    """One model a provider serves. ``name`` is what clients ask for; ``served_name`` what the
    provider calls it (defaults to ``name``)."""

    name: str
    served_name: str = attrs.field(default=attrs.Factory(lambda self: self.name, takes_self=True))
    slots: Annotated[int, _integer(minimum=1)] = 1
    long_context_slots: Annotated[int, _integer(minimum=0)] = 0
    context_window: Annotated[int, _integer(minimum=1)] | None = None
    capabilities: Annotated[tuple[str, ...], _NAMES] = ()


@attrs.frozen(kw_only=True)
class ProviderConfig:
    """One engine or upstream the node drives, through the adapter named by ``type`` (a key
    of the adapter registry, ``nodes.adapters.ADAPTERS``).

    ``options`` holds adapter knobs (for ``echo`` see :class:`nodes.adapters.echo.EchoOptions`).
    ``api_key_env`` is the *name* of an environment variable holding the upstream's key,
    never the key itself.
    """

    id: str
    type: str
    path: wire.ExecutionPath = "normalized"
    base_url: Annotated[str, _HTTP_URL] | None = None
    command: Annotated[tuple[str, ...], _COMMAND] | None = None
    api_key_env: Annotated[str, _ENV_VAR] | None = None
    options: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    models: tuple[ModelConfig, ...] = ()
    routes: Annotated[tuple[wire.RouteName, ...], _ROUTES] = ()
    """The APIs a tunnel provider serves (``wire.RouteName``); empty: an OpenAI-compatible
    server's (``wire.DEFAULT_TUNNEL_ROUTES``). A normalized provider's are its adapter's."""

    def api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The upstream's key: the value of ``api_key_env`` in ``environ`` (default
        ``os.environ``), None when no variable is named. Raises :class:`NodeConfigError`
        (source ``provider '<id>'``, key ``api_key_env``) when it is not set or empty."""
        if self.api_key_env is None:
            return None
        key = (os.environ if environ is None else environ).get(self.api_key_env)
        if not key:
            raise NodeConfigError(
                f"provider {self.id!r}",
                "api_key_env",
                f"environment variable {self.api_key_env} is not set",
            )
        return key


@attrs.frozen(kw_only=True)
class NodeConfig:
    """Everything a node needs. Times are seconds."""

    node_id: str
    label: str = ""
    edge_url: str = DEFAULT_EDGE_URL
    edges: tuple[str, ...] = ()
    """Several edges to serve at once (their node endpoints' URLs); empty: ``edge_url``
    alone. The node shares its slots between them (:mod:`nodes.granting`)."""
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
    give_up_after: float = DEFAULT_GIVE_UP_AFTER
    """A node the edge never welcomed stops trying this long after its first attempt (and
    ``dispatcher node`` exits with status 3): a wrong URL, port or TLS setting, or an edge
    that is not there, is said instead of retried for ever."""
    keep_trying: bool = False
    """Never give up, even if the edge never welcomed this node (a service started before
    its edge). A node that got in once reconnects for ever either way."""
    drain_grace: float = 30.0
    """On SIGTERM / Ctrl-C (or :class:`nodes.agent.Drain`), how long the node's in-flight runs
    and tunnels get to finish after it told the edge ``node.draining``, before it leaves."""
    edge_ca_file: str | None = None
    """For a ``wss://`` edge: a PEM file of the CA certificates to trust for it, instead of the
    system's (an edge with a certificate of your own CA)."""
    edge_tls_server_name: str | None = None
    """For a ``wss://`` edge: the name its certificate must carry (and the SNI sent), when it
    is not the URL's host (an edge dialled by IP address, say)."""

    @property
    def edge_urls(self) -> tuple[str, ...]:
        """The edges this node serves: :attr:`edges`, or :attr:`edge_url` alone."""
        return self.edges or (self.edge_url,)


_ENDPOINT_SEGMENTS: Final = frozenset({"v1", "node", "nodes", "connect"})
"""Path segments that are (a misspelling of) part of
:data:`~dispatcher.wire.NODE_CONNECT_PATH`: where the endpoint's path starts in a URL a person
typed; what comes before is a reverse proxy's prefix."""


def suggest_edge_url(url: str) -> str | None:
    """The edge node endpoint ``url`` most likely means, or None when it names no host.

    The host, port and query as given; the scheme ``ws`` (``wss`` for ``https`` and
    ``wss``; a URL without one gets ``ws://``); the path replaced by
    :data:`~dispatcher.wire.NODE_CONNECT_PATH`, after the reverse proxy's prefix if there is
    one (the segments before the first of ``v1``, ``node``, ``nodes``, ``connect``, in any
    case)::

        ws://edge:8700/v1/node/connect    -> ws://edge:8700/v1/nodes/connect
        http://edge:8700                  -> ws://edge:8700/v1/nodes/connect
        https://edge.example/proxy/v1/    -> wss://edge.example/proxy/v1/nodes/connect
    """
    text = url.strip()
    if "://" not in text:
        text = "ws://" + text.lstrip("/")
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018  # raises ValueError for a port that is not a number
    except ValueError:
        return None
    if not parts.hostname:
        return None
    scheme = "wss" if parts.scheme.lower() in ("https", "wss") else "ws"
    segments = [segment for segment in parts.path.split("/") if segment]
    cut = next(
        (i for i, segment in enumerate(segments) if segment.lower() in _ENDPOINT_SEGMENTS),
        len(segments),
    )
    path = "".join(f"/{segment}" for segment in segments[:cut]) + wire.NODE_CONNECT_PATH
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, parts.query, ""))


def check_edge_url(url: str) -> str | None:
    """Why ``url`` is not an edge's node endpoint (``ws[s]://HOST[:PORT][/PREFIX]/v1/nodes/
    connect``), with the likely fix (:func:`suggest_edge_url`); None when it is one."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  # raises ValueError for a port that is not a number
    except ValueError as exc:
        return f"expected a ws:// or wss:// URL, got {url!r} ({exc})"
    suggestion = suggest_edge_url(url)
    fix = f" (try {suggestion})" if suggestion is not None else ""
    if parts.scheme.lower() not in ("ws", "wss") or not parts.hostname:
        return f"expected a ws:// or wss:// URL, got {url!r}{fix}"
    if not parts.path.endswith(wire.NODE_CONNECT_PATH):
        return f"expected a URL ending in {wire.NODE_CONNECT_PATH}, got {url!r}{fix}"
    return None


def default_node_config(node_id: str | None = None) -> NodeConfig:
    """A node serving the built-in ``echo`` model (provider ``echo``, 8 slots), announcing what
    echo honours: ``tools`` (a forced tool call is answered with one) and ``json`` (JSON
    mode and JSON schemas are answered with JSON); not images."""
    return NodeConfig(
        node_id=node_id or socket.gethostname(),
        providers=(
            ProviderConfig(
                id="echo",
                type="echo",
                models=(ModelConfig(name="echo", slots=8, capabilities=("tools", "json")),),
            ),
        ),
    )


def _model_info(model: ModelConfig) -> wire.ModelInfo:
    """A model as the hello announces it: as configured (a :class:`ModelConfig` has exactly
    the fields of ``wire.ModelInfo``, by name and type; its validation is what it adds)."""
    return wire.ModelInfo(**attrs.asdict(model, recurse=False))


def _announced_routes(
    provider: ProviderConfig, adapters: Mapping[str, AdapterKind] | None
) -> tuple[wire.RouteName, ...]:
    """What the hello says ``provider`` serves: empty for its path's default."""
    if provider.routes or adapters is None:
        return provider.routes
    kind = adapters.get(provider.type)
    if kind is None:
        return ()
    if provider.path == "tunnel":
        served = kind.tunnel_routes
        return () if set(served) == set(wire.DEFAULT_TUNNEL_ROUTES) else served
    if set(kind.routes) == set(wire.NORMALIZED_ROUTES):
        return ()
    return kind.routes


def hello_from_config(
    config: NodeConfig, adapters: Mapping[str, AdapterKind] | None = None
) -> wire.Hello:
    """The ``hello`` announcing this node: everything but provider credentials (which never
    leave the node). ``adapter`` is the provider's ``type``; a normalized provider's
    ``routes`` are its type's in ``adapters`` (``nodes.adapters.ADAPTERS`` for a node), a
    tunnel provider's as configured."""
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
                models=tuple(_model_info(model) for model in provider.models),
                routes=_announced_routes(provider, adapters),
            )
            for provider in config.providers
        ),
    )


# --------------------------------------------------------------------------- the file


@attrs.frozen(kw_only=True)
class _NodeTable:
    """The file's ``[node]`` table; a key left out takes :class:`NodeConfig`'s default."""

    id: str | None = None
    label: str | None = None
    edge_url: str | None = None
    edges: tuple[str, ...] | None = None
    token: str | None = attrs.field(default=None, repr=False)
    token_env: Annotated[str, _ENV_VAR] | None = None
    heartbeat_timeout_factor: Annotated[float, _number(minimum=1.0)] | None = None
    handshake_timeout: Annotated[float, _number(minimum=0.0, strict=True)] | None = None
    reconnect_min_backoff: Annotated[float, _number(minimum=0.0, strict=True)] | None = None
    reconnect_max_backoff: Annotated[float, _number(minimum=0.0, strict=True)] | None = None
    reconnect_reset_after: Annotated[float, _number(minimum=0.0)] | None = None
    give_up_after: Annotated[float, _number(minimum=0.0)] | None = None
    keep_trying: Annotated[bool, _BOOLEAN] | None = None
    drain_grace: Annotated[float, _number(minimum=0.0)] | None = None
    edge_ca_file: str | None = None
    edge_tls_server_name: str | None = None


@attrs.frozen(kw_only=True)
class _NodeFile:
    node: _NodeTable = _NodeTable()
    providers: tuple[ProviderConfig, ...] = ()


_converter = make_converter(forbid_extra_keys=True)
_converter.register_structure_hook(str, lambda value, _: _string(value))


def _checked(value: Any, annotated: Any) -> Any:
    base, *metadata = get_args(annotated)
    for check in metadata:
        if isinstance(check, _Check):
            return check.structure(value)
    return _converter.structure(value, base)


def _choice(value: Any, literal: Any) -> Any:
    choices: tuple[str, ...] = get_args(literal)
    text = _string(value)
    if text not in choices:
        raise Invalid(f"expected one of {', '.join(choices)}, got {text!r}")
    return text


def _table(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"expected a table, got {show(value)}")
    return dict(value)


def _is_tables(kind: Any) -> bool:
    args = get_args(kind)
    return get_origin(kind) is tuple and len(args) == 2 and args[1] is ... and attrs.has(args[0])


def _tables(value: Any, kind: Any) -> tuple[Any, ...]:
    """An array of tables (``[[providers]]``), each structured as the tuple's item class."""
    if not isinstance(value, list):
        raise Invalid(f"expected an array of tables, got {show(value)}")
    item_class = get_args(kind)[0]
    return structure_each(lambda item: _converter.structure(item, item_class), value)


def _table_hook(cls: type[Any]) -> Callable[[Any, Any], Any]:
    inner = make_dict_structure_fn(cls, _converter)

    def structure(value: Any, _: Any) -> Any:
        return inner(_table(value, None), cls)

    return structure


def _is_annotated(kind: Any) -> bool:
    return get_origin(kind) is Annotated


def _is_literal(kind: Any) -> bool:
    return get_origin(kind) is Literal


def _is_options(kind: Any) -> bool:
    return bool(kind == Mapping[str, Any])


_converter.register_structure_hook_func(_is_annotated, _checked)
_converter.register_structure_hook_func(_is_literal, _choice)
_converter.register_structure_hook_func(_is_options, _table)
_converter.register_structure_hook_func(_is_tables, _tables)
_converter.register_structure_hook_factory(attrs.has, _table_hook)


# --------------------------------------------------------------------------- loading TOML


def read_node_config(
    path: str | os.PathLike[str],
    *,
    environ: Mapping[str, str] | None = None,
    adapters: Mapping[str, AdapterKind],
) -> NodeConfig:
    """Read and validate a node configuration file; see ``docs/node.md`` for the format.

    ``environ`` (default ``os.environ``) resolves ``node.token_env``. ``adapters`` is the
    adapter registry that provider types are checked against, and must be given: the adapters
    import this module, so it names none of them. ``nodes.load_node_config`` is this with the
    built-in ``nodes.adapters.ADAPTERS`` by default. Raises :class:`NodeConfigError`.
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
    return parse_node_config(
        data,
        source=source,
        environ=os.environ if environ is None else environ,
        adapters=adapters,
    )


def parse_node_config(
    data: Mapping[str, Any],
    *,
    source: str,
    environ: Mapping[str, str],
    adapters: Mapping[str, AdapterKind],
) -> NodeConfig:
    """Validate a parsed TOML document against ``adapters`` and resolve ``node.token_env``
    in ``environ``. Raises :class:`NodeConfigError` naming ``source`` and every problem
    (its ``problems``): the values' (types, unknown keys...), then what the checks across
    values find in the rest."""
    structured = structure_all(lambda document: _converter.structure(document, _NodeFile), data)
    found = [Problem(source, render(path), reason) for path, reason in structured.problems]
    file = structured.value
    if file is None:
        raise NodeConfigError.of(found)
    later: list[tuple[str, str]] = []

    def report(key: str, reason: str) -> None:
        later.append((key, reason))

    node = file.node
    if node.id is not None:
        bad_id = _bad_id(node.id)
        if bad_id is not None:
            report("node.id", bad_id)
    if node.edge_url is not None:
        bad_url = check_edge_url(node.edge_url)
        if bad_url is not None:
            report("node.edge_url", bad_url)
    if node.edges is not None:
        if node.edge_url is not None:
            report("node.edges", "give edge_url (one edge) or edges (several), not both")
        if not node.edges:
            report("node.edges", "expected at least one edge URL")
        for index, url in enumerate(node.edges):
            bad_url = check_edge_url(url)
            if bad_url is not None:
                report(f"node.edges[{index}]", bad_url)
            elif url in node.edges[:index]:
                report(f"node.edges[{index}]", f"{url!r} is listed twice")
    token = _node_token(node, environ, report)
    defaults = NodeConfig(node_id="")
    min_backoff = defaults.reconnect_min_backoff
    if node.reconnect_min_backoff is not None:
        min_backoff = node.reconnect_min_backoff
    max_backoff = defaults.reconnect_max_backoff
    if node.reconnect_max_backoff is not None:
        max_backoff = node.reconnect_max_backoff
    if max_backoff < min_backoff:
        report(
            "node.reconnect_max_backoff",
            f"must be at least reconnect_min_backoff ({min_backoff}), got {max_backoff}",
        )
    if not file.providers:
        report("providers", "expected at least one [[providers]] table")
    check_providers(file.providers, adapters, report)
    for key, reason in later:
        # One problem per key; none about a value already reported (or left out for it).
        if all(p.key != key for p in found) and structured.unrelated(key):
            found.append(Problem(source, key, reason))
    if found:
        raise NodeConfigError.of(found)

    settings: dict[str, Any] = {
        name: getattr(node, name) for name in _NODE_SETTINGS if getattr(node, name) is not None
    }
    return attrs.evolve(
        defaults,
        node_id=node.id or socket.gethostname(),
        token=token,
        providers=file.providers,
        reconnect_min_backoff=min_backoff,
        reconnect_max_backoff=max_backoff,
        **settings,
    )


def _bad_id(value: str) -> str | None:
    """Why an edge would refuse ``value`` as a node or provider id in the hello, or None."""
    if not 0 < len(value) <= wire.MAX_ID_LENGTH:
        return f"must be 1 to {wire.MAX_ID_LENGTH} characters"
    if wire.ID_PATTERN.fullmatch(value) is None:
        return (
            f"expected letters, digits and . _ : - (starting with a letter or digit), got {value!r}"
        )
    return None


_NODE_SETTINGS: Final = (
    "label",
    "edge_url",
    "edges",
    "heartbeat_timeout_factor",
    "handshake_timeout",
    "reconnect_reset_after",
    "give_up_after",
    "keep_trying",
    "drain_grace",
    "edge_ca_file",
    "edge_tls_server_name",
)
"""The ``[node]`` keys that are :class:`NodeConfig` fields of the same name."""


def _node_token(
    node: _NodeTable, environ: Mapping[str, str], report: Callable[[str, str], None]
) -> str | None:
    if node.token_env is None:
        return node.token
    if node.token is not None:
        report("node.token_env", "give either token or token_env, not both")
        return None
    token = environ.get(node.token_env)
    if not token:
        report("node.token_env", f"environment variable {node.token_env} is not set")
        return None
    return token


def structure_providers(value: Any) -> tuple[ProviderConfig, ...]:
    """An array of ``[[providers]]`` tables structured as a node's file has them (each
    value checked, unknown keys refused): what another file holding ``[[providers]]`` (the
    edge's, for its in-process node) structures them with. Raises cattrs' errors and
    :class:`~dispatcher.shared.config_errors.Invalid` (walked by ``structure_all``)."""
    providers: tuple[ProviderConfig, ...] = _converter.structure(value, tuple[ProviderConfig, ...])
    return providers


def check_providers(
    providers: tuple[ProviderConfig, ...],
    adapters: Mapping[str, AdapterKind],
    report: Callable[[str, str], None],
    *,
    key: str = "providers",
) -> None:
    """The checks across values of structured ``[[providers]]`` (at ``key``): ids the edge
    accepts and distinct, the type in ``adapters`` (and tunnelled only if it may be), the
    routes, the ``options``, the models. Each problem is ``report(key path, reason)``."""
    for index, provider in enumerate(providers):
        where = f"{key}[{index}]"
        bad_id = _bad_id(provider.id)
        if bad_id is not None:
            report(f"{where}.id", bad_id)
        _check_provider(provider, where, adapters, report)
        if any(other.id == provider.id for other in providers[:index]):
            report(f"{where}.id", f"duplicate provider id {provider.id!r}")


def _check_provider(
    provider: ProviderConfig,
    key: str,
    adapters: Mapping[str, AdapterKind],
    report: Callable[[str, str], None],
) -> None:
    kind = adapters.get(provider.type)
    if kind is None:
        report(f"{key}.type", f"expected one of {', '.join(adapters)}, got {provider.type!r}")
    elif provider.path == "tunnel" and not kind.tunnel:
        report(f"{key}.path", f"a {provider.type!r} provider can only run normalized, not tunnel")
    if provider.routes and provider.path != "tunnel":
        report(
            f"{key}.routes",
            "only a tunnel provider declares its routes (a normalized one serves its adapter's)",
        )
    if kind is not None:
        try:
            kind.check_options(provider.options)
        except OptionsError as exc:
            report(f"{key}.options.{exc.key}", exc.reason)
    if not provider.models:
        report(f"{key}.models", "expected at least one [[providers.models]] table")
    for index, model in enumerate(provider.models):
        where = f"{key}.models[{index}]"
        if model.long_context_slots > model.slots:
            report(
                f"{where}.long_context_slots",
                f"must not exceed slots ({model.slots}), got {model.long_context_slots}",
            )
        if any(other.name == model.name for other in provider.models[:index]):
            report(f"{where}.name", f"duplicate model name {model.name!r}")
