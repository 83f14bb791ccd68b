"""Why a real dial failed, as ``nodes.dial`` tells the reconnect policy (``DialCause``): the
mistakes a user makes with ``--edge``, against real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trustme

from dispatcher import EdgeConfig, open_dispatcher
from dispatcher.config import HTTPSettings
from dispatcher.http import Server
from nodes import dial as dial_module
from nodes.config import default_node_config
from nodes.dial import DialFailed, dial_edge
from nodes.reconnect import DialCause, advice

BOUND = 30.0


async def cause_of(url: str) -> DialCause:
    config = attrs.evolve(default_node_config("probe"), edge_url=url)
    with trio.fail_after(BOUND), pytest.raises(DialFailed) as failed:
        async with dial_edge(config):
            pass
    return failed.value.cause


@asynccontextmanager
async def edge(http: HTTPSettings | None = None) -> AsyncIterator[int]:
    config = EdgeConfig(port=0, local_node=False, http=http or HTTPSettings())
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        yield server.address.port
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def tls_edge(tmp_path: Path) -> AsyncIterator[int]:
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "edge.pem")
    )
    pem = str(tmp_path / "edge.pem")
    async with edge(HTTPSettings(tls_certificate=pem, tls_private_key=pem)) as port:
        yield port


async def test_nothing_listening_is_a_refused_connection() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused, and not reused
        port = closed.getsockname()[1]
        url = f"ws://127.0.0.1:{port}/v1/nodes/connect"
        cause = await cause_of(url)
    assert (cause.kind, cause.host, cause.port) == ("refused", "127.0.0.1", port)
    assert advice(cause, url).startswith(f"connection refused at 127.0.0.1:{port}: ")


async def test_a_name_that_does_not_resolve() -> None:
    cause = await cause_of("ws://no-such-edge.invalid:8700/v1/nodes/connect")
    assert (cause.kind, cause.host) == ("dns", "no-such-edge.invalid")


async def test_wss_against_a_plain_edge_is_a_failed_tls_handshake() -> None:
    async with edge() as port:
        url = f"wss://127.0.0.1:{port}/v1/nodes/connect"
        cause = await cause_of(url)
    assert cause.kind == "tls"
    assert f"If not, use ws:// (ws://127.0.0.1:{port}/v1/nodes/connect)" in advice(cause, url)


async def test_ws_against_a_tls_edge_times_out_in_the_upgrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dial_module, "CONNECT_TIMEOUT", 0.5)
    async with tls_edge(tmp_path) as port:
        url = f"ws://127.0.0.1:{port}/v1/nodes/connect"
        cause = await cause_of(url)
    assert (cause.kind, cause.stage) == ("timeout", "websocket upgrade")
    assert f"use wss:// (wss://127.0.0.1:{port}/v1/nodes/connect)" in advice(cause, url)


async def test_a_path_that_is_not_the_node_endpoint_is_a_404() -> None:
    async with edge() as port:
        url = f"ws://127.0.0.1:{port}/proxy/v1/nodes/connect"
        cause = await cause_of(url)
    assert (cause.kind, cause.status) == ("http", 404)
    assert advice(cause, url).endswith(
        f"The edge itself serves nodes at ws://127.0.0.1:{port}/v1/nodes/connect"
    )
