"""The ``dispatcher`` command: ``dispatcher serve`` (the edge) and ``dispatcher node``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from .config import ConfigError, EdgeConfig, load_edge_config

log = logging.getLogger("dispatcher.cli")

DEFAULT_EDGE_URL = "ws://127.0.0.1:8700/v1/nodes/connect"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dispatcher", description="One OpenAI-compatible endpoint in front of your LLMs."
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the edge (the OpenAI-compatible HTTP endpoint)")
    serve.add_argument("--config", help="edge config file (TOML)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8700; 0 = any)")
    serve.add_argument(
        "--no-local-node",
        action="store_true",
        help="do not start the in-process node serving the built-in 'echo' model",
    )

    node = sub.add_parser("node", help="run a node that dials the edge and serves models")
    node.add_argument("--edge", default=None, help=f"edge websocket URL ({DEFAULT_EDGE_URL})")
    node.add_argument("--config", help="node config file (TOML)")
    node.add_argument("--token", help="node token, if the edge requires one")
    node.add_argument("--id", dest="node_id", help="node id (default: from config or hostname)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "serve":
            config = load_edge_config(args.config)
            if args.no_local_node:
                config = attrs.evolve(config, local_node=False)
            if config.usage_db is None:
                data_dir = config.default_data_dir()
                config = attrs.evolve(config, usage_db=str(data_dir / "usage.sqlite3"))
            return trio.run(_serve, config, args.host, args.port)
        return _node(args)
    except ConfigError as exc:
        print(f"dispatcher: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # only before the signal receiver is in place
        return 130


async def _serve(config: EdgeConfig, host: str | None, port: int | None) -> int:
    """The edge until it has drained (exit status 0) or a second signal stopped it at once
    (128 + the signal number)."""
    from .http import Server
    from .service import open_dispatcher

    status = 0
    # Signals are ours from the start: one that comes during startup drains once we serve.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
            if config.local_node:
                await dispatcher.attach_local_node()

            # task_status is passed on to serve_http, which calls started().
            async def serve(task_status: trio.TaskStatus[Server]) -> None:  # noqa: ASYNC128
                await dispatcher.serve(host=host, port=port, task_status=task_status)
                # The drain and the shutdown are over: stop listening for signals too.
                nursery.cancel_scope.cancel(reason="server stopped")

            server: Server = await nursery.start(serve)
            address = server.address
            tls = config.http.tls_certificate is not None
            base = f"{'https' if tls else 'http'}://{address.host}:{address.port}"
            models = ", ".join(sorted(dispatcher.registry.models())) or "none yet"
            grace = config.http.shutdown_grace
            print(
                f"trio-dispatcher edge listening on {base}/v1\n"
                f"  models: {models}\n"
                f"  usage ledger: {config.usage_db}\n"
                f"  nodes connect to {'wss' if tls else 'ws'}://{address.host}:{address.port}"
                "/v1/nodes/connect\n"
                f"  Ctrl-C or SIGTERM drains (in-flight requests get {grace:g} s); "
                "twice stops at once",
                flush=True,
            )
            async for signum in signals:
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


def _node(args: argparse.Namespace) -> int:
    from nodes.agent import run_node
    from nodes.config import NodeConfigError, default_node_config, load_node_config

    try:
        config = load_node_config(args.config) if args.config else default_node_config()
    except NodeConfigError as exc:
        print(f"dispatcher node: configuration error: {exc}", file=sys.stderr)
        return 2
    changes: dict[str, Any] = {}
    if args.edge:
        changes["edge_url"] = args.edge
    if args.token:
        changes["token"] = args.token
    if args.node_id:
        changes["node_id"] = args.node_id
    config = attrs.evolve(config, **changes)
    print(
        f"trio-dispatcher node {config.node_id} dialling {config.edge_url}\n"
        f"  Ctrl-C or SIGTERM drains (in-flight runs get {config.drain_grace:g} s); "
        "twice stops at once",
        flush=True,
    )
    return run_node(config)
