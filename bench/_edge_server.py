"""Server processes of the ``edge`` bench section (see ``bench.edge_bench``).

* ``python -m bench._edge_server edge`` -- the edge: ``open_dispatcher`` with no local node,
  serving HTTP on an ephemeral port; nodes join over ``/v1/nodes/connect``.
* ``python -m bench._edge_server direct SPEC.json`` -- the baseline: our HTTP server
  (``serve_http``) answering ``POST /v1/chat/completions`` with fixed bytes (``SPEC.json``
  holds ``{"headers": [[name, value], ...], "body": "..."}``, captured from the edge).

Each prints ``BENCH-PORT <n>`` once listening (``bench._load.server_process`` reads it) and shuts
down gracefully (1 s grace) on SIGTERM or SIGINT.
"""

from __future__ import annotations

import signal
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import trio

from bench._load import announce_port, raise_nofile_limit

if TYPE_CHECKING:
    from dispatcher.http import Request, Responder, Server

CHAT_PATH = "/v1/chat/completions"
SHUTDOWN_GRACE = 1.0


async def _until_signal(server: Server) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            server.shutdown()  # graceful; the serving task returns when it is over
            return


async def serve_edge() -> None:
    from dispatcher.config import EdgeConfig, HTTPSettings
    from dispatcher.edge import open_dispatcher

    config = EdgeConfig(port=0, local_node=False, http=HTTPSettings(shutdown_grace=SHUTDOWN_GRACE))
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        announce_port(server.address.port)
        await _until_signal(server)


async def serve_direct(spec_path: str) -> None:
    from dispatcher.http import ServerLimits, serve_http

    spec = orjson.loads(Path(spec_path).read_bytes())
    headers = [(name.encode(), value.encode()) for name, value in spec["headers"]]
    body: bytes = spec["body"].encode()

    async def handler(request: Request, responder: Responder) -> None:
        if request.method == "POST" and request.path == CHAT_PATH:
            await request.body()
            await responder.respond(200, headers, body)
        else:
            await responder.respond(404)

    async with trio.open_nursery() as nursery:
        server: Server = await nursery.start(
            partial(serve_http, handler, port=0, limits=ServerLimits(shutdown_grace=SHUTDOWN_GRACE))
        )
        announce_port(server.address.port)
        await _until_signal(server)


def main(argv: list[str]) -> None:
    raise_nofile_limit()
    if argv == ["edge"]:
        trio.run(serve_edge)
    elif len(argv) == 2 and argv[0] == "direct":
        trio.run(serve_direct, argv[1])
    else:
        sys.exit("usage: python -m bench._edge_server edge | direct SPEC.json")


if __name__ == "__main__":
    main(sys.argv[1:])
