"""The ``dispatcher`` command: ``dispatcher serve`` (the edge), ``dispatcher node``, and
``dispatcher check-config FILE...`` (the start-up checks of either, and what it would serve).

A startup failure -- a bad config, a secret variable that is not set, a port in use, TLS
files that cannot be loaded, an edge URL that is not one, a provider key that is missing --
is one line on stderr naming the thing and the reason (a config file's every problem, a line
each), and exit status 2; no traceback. A node that never got in to its edge gives up with
exit status 3 (``nodes.agent.EXIT_GAVE_UP``) unless ``--keep-trying``::

    dispatcher: edge.toml: api_keys: expected an array of strings, got a string
    dispatcher: cannot listen on 127.0.0.1:8700: address already in use
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import ipaddress
import logging
import math
import os
import re
import signal
import ssl
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from nodes import load_node_config, provider_startup_problems
from nodes.agent import run_node
from nodes.config import (
    DEFAULT_EDGE_URL,
    DEFAULT_GIVE_UP_AFTER,
    NodeConfig,
    NodeConfigError,
    check_edge_url,
    default_node_config,
)
from nodes.dial import edge_ssl_context

from . import __version__
from .config import (
    ConfigError,
    EdgeConfig,
    NodeToken,
    load_edge_config,
)
from .config.summary import (
    KINDS,
    ConfigKind,
    config_kind,
    describe_edge,
    describe_node,
    describe_stores,
)
from .observe.logs import LOG_FORMATS, configure_logging
from .shared.config_errors import ConfigFileError, Problem
from .shared.excgroups import first_leaf

if TYPE_CHECKING:
    from .edge import Dispatcher as EdgeDispatcher
    from .http import Address, Server

log = logging.getLogger("dispatcher.cli")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class StartupError(Exception):
    """The daemon cannot start; ``str()`` names the thing and the reason (one line)."""


def _parser() -> argparse.ArgumentParser:
    # --log-level goes before or after the subcommand: each parser has its own copy (not a
    # shared parent, whose action objects argparse shares), and the subcommand's leaves the
    # top-level value alone unless given.
    def log_level(parser: argparse.ArgumentParser, default: str) -> None:
        parser.add_argument(
            "--log-level",
            default=default,
            type=str.upper,
            choices=LOG_LEVELS,
            help="log level (default INFO)",
        )
        parser.add_argument(
            "--log-format",
            default="text" if default != argparse.SUPPRESS else default,
            choices=LOG_FORMATS,
            help="text (readable, key=value fields; the default) or json (one object a line)",
        )

    parser = argparse.ArgumentParser(
        prog="dispatcher", description="One OpenAI-compatible endpoint in front of your LLMs."
    )
    log_level(parser, "INFO")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the edge (the OpenAI-compatible HTTP endpoint)")
    log_level(serve, argparse.SUPPRESS)
    serve.add_argument("--config", help="edge config file (TOML)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8700; 0 = any)")
    serve.add_argument(
        "--no-local-node",
        action="store_true",
        help="do not serve the built-in 'echo' model in-process (local_node = false; the "
        "config's [[providers]] are still served)",
    )

    node = sub.add_parser("node", help="run a node that dials the edge and serves models")
    log_level(node, argparse.SUPPRESS)
    node.add_argument(
        "--edge",
        action="append",
        default=None,
        help=f"edge websocket URL ({DEFAULT_EDGE_URL}); repeat it to serve several edges, "
        "which share this node's slots",
    )
    node.add_argument("--config", help="node config file (TOML)")
    node.add_argument("--token", help="node token, if the edge requires one")
    node.add_argument("--id", dest="node_id", help="node id (default: from config or hostname)")
    node.add_argument(
        "--keep-trying",
        action="store_true",
        default=None,
        help="never give up dialling, even if the edge never let this node in (a service "
        "started before its edge); without it, a node that never got in exits with status 3 "
        "after --give-up-after seconds",
    )
    node.add_argument(
        "--give-up-after",
        type=float,
        metavar="SECONDS",
        help=f"how long a node that never got in keeps trying (default "
        f"{DEFAULT_GIVE_UP_AFTER:g}, or give_up_after in the config)",
    )
    _check_config_parser(sub)
    migrate = sub.add_parser(
        "migrate",
        help="create or update the shared database's tables ([store] database_url)",
        description="What an edge does when it starts, alone: for an operator who migrates "
        "before rolling the edges. Safe while edges run or start (an advisory lock).",
    )
    log_level(migrate, argparse.SUPPRESS)
    migrate.add_argument("--config", required=True, help="edge config file (TOML)")
    return parser


def _check_config_parser(sub: Any) -> None:
    check = sub.add_parser(
        "check-config",
        help="check edge or node config files as the daemon would start, say what they serve",
        description="Exit status 0 when every file is valid, 2 when one is not (on stderr).",
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="an edge or node config (TOML)")
    check.add_argument(
        "--kind", choices=KINDS, help="the kind of every FILE (default: from its content)"
    )


def version() -> str:
    """``trio-dispatcher VERSION``, from the installed package's metadata (this checkout's
    ``__version__`` when it is not installed)."""
    try:
        number = importlib.metadata.version("trio-dispatcher")
    except importlib.metadata.PackageNotFoundError:
        number = __version__
    return f"trio-dispatcher {number}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format, sys.stderr)
    expected = (ConfigError, NodeConfigError, StartupError)
    try:
        if args.command == "serve":
            return _serve_command(args)
        if args.command == "check-config":
            return _check_config_command(args)
        if args.command == "migrate":
            return _migrate_command(args)
        return _node_command(args)
    except expected as exc:
        return _fail(exc)
    except BaseExceptionGroup as group:
        # From inside trio.run: what failed at startup, wrapped by the nurseries.
        failure = first_leaf(group, expected)
        if failure is None:
            raise
        return _fail(failure)
    except KeyboardInterrupt:  # only before the signal receiver is in place
        return 130


def _fail(exc: BaseException) -> int:
    """Say what failed on stderr, one line per problem (a config file's every problem), and
    return exit status 2."""
    lines = exc.lines() if isinstance(exc, ConfigFileError) else [str(exc)]
    print("".join(f"dispatcher: {line}\n" for line in lines), end="", file=sys.stderr, flush=True)
    return 2


# --------------------------------------------------------------------------- serve


def _serve_command(args: argparse.Namespace) -> int:
    config = _edge_config(args)
    _check_tls(config)
    _check_usage_db(config.usage_db)
    if config.store.outbox is not None:
        _check_usage_db(config.store.outbox)
    log.debug("edge config: %r", config)  # secrets have repr=False
    return trio.run(_serve, config, functools.partial(_edge_config, args))


def _edge_config(args: argparse.Namespace) -> EdgeConfig:
    """The config file with the command line's overrides: at start-up, and again for each
    reload (SIGHUP, ``POST /admin/reload``)."""
    config = load_edge_config(args.config)
    if args.no_local_node:
        config = attrs.evolve(config, local_node=False)
    if args.host is not None:
        config = attrs.evolve(config, host=args.host)
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            raise StartupError(f"--port: {args.port} is not a TCP port")
        config = attrs.evolve(config, port=args.port)
    if config.usage_db is None:
        data_dir = config.default_data_dir()
        config = attrs.evolve(config, usage_db=str(data_dir / "usage.sqlite3"))
    if config.store.database_url is not None and config.store.outbox is None:
        store = attrs.evolve(config.store, outbox=config.outbox_path())
        config = attrs.evolve(config, store=store)
    return config


def _check_tls(config: EdgeConfig) -> None:
    """Load the TLS certificate and key now, so a missing or bad file is a one-line error
    before anything starts."""
    http = config.http
    if http.tls_certificate is None or http.tls_private_key is None:
        return
    for key, path in (
        ("http.tls_certificate", http.tls_certificate),
        ("http.tls_private_key", http.tls_private_key),
    ):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise StartupError(f"{key}: cannot read {path}: {_strerror(exc)}") from None
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(http.tls_certificate, http.tls_private_key)
    except (ssl.SSLError, OSError) as exc:
        raise StartupError(
            f"http.tls_certificate: cannot load {http.tls_certificate} with "
            f"{http.tls_private_key}: {_strerror(exc)}"
        ) from None


def _check_usage_db(path: str | None, *, create: bool = True) -> None:
    """The ledger's directory exists (made when ``create``) and is writable; without
    ``create`` a missing one must be creatable (its nearest existing parent writable)."""
    if path is None or path == ":memory:":
        return
    directory = Path(path).expanduser().parent
    if not create:
        existing = next(d for d in (directory, *directory.parents) if d.exists())
        if not os.access(existing, os.W_OK):
            raise StartupError(f"usage_db: cannot write to the directory {existing}")
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(
            f"usage_db: cannot create the directory {directory}: {_strerror(exc)}"
        ) from None
    if not os.access(directory, os.W_OK):
        raise StartupError(f"usage_db: cannot write to the directory {directory}")


def _strerror(exc: BaseException) -> str:
    """An OS or TLS error's reason, lower-case first, without the errno noise."""
    if isinstance(exc, ssl.SSLError):
        text = re.sub(r"\s*\(_ssl\.c:\d+\)$", "", str(exc))
        if exc.reason == "PEM_LIB" or "PEM lib" in text:
            return "not a PEM certificate and key (SSL: PEM_LIB)"
        return text
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    text = text or type(exc).__name__
    return text[:1].lower() + text[1:]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name (other than localhost), or "" / "0.0.0.0": all interfaces


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def auth_summary(config: EdgeConfig) -> list[str]:
    """The banner's auth lines: who may use the edge, read its usage, join it as a node."""
    client = len(set(config.client_api_keys())) + len(config.keys)
    admin = set(config.admin_api_keys())
    tokens = config.node_tokens()
    if client:
        lines = [f"client auth: on ({_plural(client, 'key')})"]
    else:
        lines = ["client auth: OFF — anyone can use this edge"]
    if admin:
        lines.append(f"admin auth: on ({_plural(len(admin), 'key')})")
    elif client:
        lines.append("admin auth: on (no admin key configured: GET /v1/usage refuses everyone)")
    else:
        lines.append("admin auth: OFF — anyone can read GET /v1/usage and /admin/status")
    if tokens:
        bound = sum(isinstance(token, NodeToken) for token in tokens)
        parts = [f"{len(tokens) - bound} for any node id"] if bound < len(tokens) else []
        parts += [f"{bound} bound to node ids"] if bound else []
        lines.append(f"node auth: on ({_plural(len(tokens), 'token')}: {', '.join(parts)})")
    else:
        lines.append("node auth: OFF — any node may join and take over any node id")
    lines.append(_metrics_auth(config, clients=bool(client), admins=bool(admin)))
    return lines


def _metrics_auth(config: EdgeConfig, *, clients: bool, admins: bool) -> str:
    """Who may read ``/metrics`` on the edge's own listener (``api.app``'s rule)."""
    keys = ["an admin key"] if admins else ["a client key"] if clients else []
    if config.metrics_token() is not None:
        keys.insert(0, "the metrics token")
    if not keys:
        return "metrics auth: OFF — anyone can read /metrics"
    return f"metrics auth: on ({' or '.join(keys)})"


def _where(address: Address) -> str:
    host = f"[{address.host}]" if ":" in address.host else address.host
    return f"{host}:{address.port}"


async def _start_metrics_listener(
    dispatcher: EdgeDispatcher, nursery: trio.Nursery
) -> Server | None:
    """The metrics listener (``metrics.listen``), in the edge's nursery; None when the config
    sets none. Its address in use is a start-up failure like the main one's."""
    listen = dispatcher.config.metrics.listen
    if listen is None:
        return None
    try:
        server: Server = await nursery.start(dispatcher.serve_metrics)
    except OSError as exc:
        raise StartupError(f"metrics.listen: cannot listen on {listen}: {_strerror(exc)}") from None
    return server


async def _serve(config: EdgeConfig, source: Callable[[], EdgeConfig] | None = None) -> int:
    """The edge until it has drained (exit status 0) or a second signal stopped it at once
    (128 + the signal number). SIGHUP reloads the config from ``source``."""
    # Imported here, not at the top: ``dispatcher --help`` and ``dispatcher node`` do not
    # load the edge (HTTP server, gate, SQLite ledger, Prometheus client): about 0.3 s of
    # imports, which would double their startup. No import cycle is involved.
    from .edge import collect_young_generation, open_dispatcher, tune_collector_for_serving

    status = 0
    # Signals are ours from the start: one that comes during startup drains once we serve.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
            dispatcher.config_source = source

            # task_status is passed on to serve_http, which calls started().
            async def serve(task_status: trio.TaskStatus[Server]) -> None:  # noqa: ASYNC128
                await dispatcher.serve(task_status=task_status)
                # The drain and the shutdown are over: stop listening for signals too.
                nursery.cancel_scope.cancel(reason="server stopped")

            # Listen first: a port in use is then the only thing said (no node logs before).
            try:
                server: Server = await nursery.start(serve)
            except OSError as exc:
                where = f"[{config.host}]" if ":" in config.host else config.host
                raise StartupError(
                    f"cannot listen on {where}:{config.port}: {_strerror(exc)}"
                ) from None
            scrape = await _start_metrics_listener(dispatcher, nursery)
            if config.local_node or config.providers:
                # echo (local_node) and the file's [[providers]], in this process
                await dispatcher.attach_local_node()
            # Start-up's objects are frozen out of the cycle collector's work, full
            # collections made rare: they took seconds, freeing nothing, under 10,000 streams.
            tune_collector_for_serving()
            nursery.start_soon(collect_young_generation)
            address = server.address
            tls = config.http.tls_certificate is not None
            base = f"{'https' if tls else 'http'}://{address.host}:{address.port}"
            models = ", ".join(sorted(dispatcher.registry.models())) or "none yet"
            grace = config.http.shutdown_grace
            auth = "".join(f"  {line}\n" for line in auth_summary(config))
            stores = "".join(f"  {line}\n" for line in describe_stores(config, config.usage_db))
            if scrape is not None:
                auth += f"  metrics listener (no auth): http://{_where(scrape.address)}/metrics\n"
            print(
                f"trio-dispatcher edge listening on {base}/v1\n"
                f"  models: {models}\n"
                f"{auth}"
                f"{stores}"
                f"  nodes connect to {'wss' if tls else 'ws'}://{address.host}:{address.port}"
                "/v1/nodes/connect\n"
                f"  Ctrl-C or SIGTERM drains (in-flight requests get {grace:g} s); "
                "twice stops at once",
                flush=True,
            )
            if not _is_loopback(config.host):
                if not config.client_api_keys() and not config.keys:
                    log.warning(
                        "serving %s (not loopback) with NO client API key: anyone who can "
                        "reach this port can use it; set api_keys or DISPATCHER_API_KEYS",
                        config.host or "all interfaces",
                    )
                if not config.node_tokens():
                    log.warning(
                        "serving %s (not loopback) with NO node token: anyone who can reach "
                        "this port can join as a node, take over node ids and receive "
                        "prompts; set nodes.tokens or DISPATCHER_NODE_TOKENS",
                        config.host or "all interfaces",
                    )
            if scrape is not None and not _is_loopback(scrape.address.host):
                log.warning(
                    "serving /metrics with NO auth on %s (metrics.listen, not loopback): "
                    "anyone who can reach it reads the node, provider and model names",
                    _where(scrape.address),
                )
            async for signum in signals:
                if signum == signal.SIGHUP:
                    # Logged either way; a file that cannot be used changes nothing.
                    with contextlib.suppress(ConfigError, LookupError):
                        await dispatcher.reload_config()
                    continue
                name = signal.Signals(signum).name
                if server.shutting_down:
                    log.warning("%s again: stopping now", name)
                    status = 128 + signum
                    nursery.cancel_scope.cancel(reason="second signal")
                    break
                log.info(
                    "%s: draining (in-flight requests get %g s; again to stop at once)",
                    name,
                    grace,
                )
                server.shutdown()
    return status


# --------------------------------------------------------------------------- migrate


def _migrate_command(args: argparse.Namespace) -> int:
    """The shared database's tables brought to this dispatcher's version: a line per part."""
    from .store.backends import migrate_database  # the edge's code: not for every command

    config = load_edge_config(args.config)
    try:
        lines = migrate_database(config.store)
    except (ValueError, RuntimeError) as exc:
        raise StartupError(str(exc)) from None
    print("".join(f"{line}\n" for line in lines), end="", flush=True)
    return 0


# --------------------------------------------------------------------------- node


def _node_command(args: argparse.Namespace) -> int:
    config = load_node_config(args.config) if args.config else default_node_config()
    changes: dict[str, Any] = {}
    if args.edge:
        for url in args.edge:
            reason = check_edge_url(url)
            if reason is not None:
                raise StartupError(f"--edge: {reason}")
        if len(set(args.edge)) < len(args.edge):
            raise StartupError("--edge: an edge is given twice")
        if len(args.edge) == 1:
            changes["edge_url"], changes["edges"] = args.edge[0], ()
        else:
            changes["edges"] = tuple(args.edge)
    if args.token:
        changes["token"] = args.token
    if args.node_id:
        changes["node_id"] = args.node_id
    if args.keep_trying:
        changes["keep_trying"] = True
    if args.give_up_after is not None:
        if not 0 <= args.give_up_after < math.inf:
            raise StartupError(f"--give-up-after: expected seconds >= 0, got {args.give_up_after}")
        changes["give_up_after"] = args.give_up_after
    config = attrs.evolve(config, **changes)
    _check_node(config, args.config)
    if config.keep_trying:
        patience = "keeps trying until the edge lets it in (--keep-trying)"
    else:
        patience = (
            f"gives up (exit status 3) if the edge has not let it in within "
            f"{config.give_up_after:g} s; --keep-trying never does"
        )
    print(
        f"trio-dispatcher node {config.node_id} dialling {', '.join(config.edge_urls)}\n"
        f"  {patience}\n"
        f"  Ctrl-C or SIGTERM drains (in-flight runs get {config.drain_grace:g} s); "
        "twice stops at once",
        flush=True,
    )
    return run_node(config)


def _check_node(config: NodeConfig, source: str | None) -> None:
    """What the node reads when it starts (a provider's api_key_env, a cli command, the
    edge's CA file): fail now, one line per problem (every provider's), rather than inside
    the daemon."""
    found: list[Problem] = []
    for index, exc in provider_startup_problems(config.providers):
        if not source:
            raise exc
        found.append(Problem(source, f"providers[{index}].{exc.key}", exc.reason))
    if config.edge_ca_file is not None and any(
        url.lower().startswith("wss:") for url in config.edge_urls
    ):
        try:
            edge_ssl_context(config)
        except (OSError, ssl.SSLError) as exc:
            reason = f"cannot load {config.edge_ca_file}: {_strerror(exc)}"
            if not source:
                raise StartupError(f"edge_ca_file: {reason}") from None
            found.append(Problem(source, "node.edge_ca_file", reason))
    if found:
        raise NodeConfigError.of(found)


# --------------------------------------------------------------------------- check-config


def _check_config_command(args: argparse.Namespace) -> int:
    """Each file through the daemon's own loader and start-up checks: what it would serve on
    stdout, or the one-line failure on stderr. 2 when any file failed."""
    status = 0
    for path in args.files:
        try:
            kind, lines = _check_config_file(path, args.kind)
        except (ConfigError, NodeConfigError, StartupError) as exc:
            status = _fail(exc)
            continue
        body = "".join(f"\n  {line}" for line in lines)
        print(f"{path}: a valid {kind} config{body}", flush=True)
    return status


def _check_config_file(path: str, kind: ConfigKind | None) -> tuple[ConfigKind, list[str]]:
    if kind is None:
        kind = _detect_kind(path)
    if kind == "node":
        node = load_node_config(path)
        _check_node(node, path)
        return kind, describe_node(node)
    config = load_edge_config(path)
    usage_db = config.usage_db or str(config.default_data_dir() / "usage.sqlite3")
    _check_tls(config)
    _check_usage_db(usage_db, create=False)
    return kind, describe_edge(config, auth=auth_summary(config), usage_db=usage_db)


def _detect_kind(path: str) -> ConfigKind:
    """From the file's content; a file that cannot be read or parsed is left to the edge's
    loader, which says why in its words."""
    try:
        with open(path, "rb") as file:
            return config_kind(tomllib.load(file))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return "edge"
