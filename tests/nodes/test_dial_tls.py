"""A node dialling a ``wss://`` edge whose certificate comes from a CA of its own: the real
edge (``dispatcher.serve`` with ``http.tls_certificate``) on 127.0.0.1, certificates made by
trustme, the node trusting that CA through ``edge_ca_file`` (and naming the certificate's
host with ``edge_tls_server_name`` when it dials an address the certificate does not carry).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trustme

from dispatcher.config import EdgeConfig, HTTPSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.shared.transport import ConnectionClosed
from nodes.agent import serve_node
from nodes.config import NodeConfig, default_node_config
from nodes.dial import dial_edge, edge_dial

BOUND = 30.0


@asynccontextmanager
async def tls_edge(tmp_path: Path, *names: str) -> AsyncIterator[tuple[Dispatcher, int, str]]:
    """The edge over TLS with a certificate for ``names``; yields it, its port and the path
    of the CA's certificate (the only one that verifies it)."""
    ca = trustme.CA()
    issued = ca.issue_cert(*names)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    issued.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "edge.pem"))
    http = HTTPSettings(
        tls_certificate=str(tmp_path / "edge.pem"), tls_private_key=str(tmp_path / "edge.pem")
    )
    config = EdgeConfig(port=0, local_node=False, http=http)
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        yield dispatcher, server.address.port, str(tmp_path / "ca.pem")
        nursery.cancel_scope.cancel()


def node(port: int, **changes: Any) -> NodeConfig:
    return attrs.evolve(
        default_node_config("tls-node"),
        edge_url=f"wss://127.0.0.1:{port}/v1/nodes/connect",
        **changes,
    )


async def test_a_node_trusts_the_edge_through_its_ca_file(tmp_path: Path) -> None:
    async with (
        tls_edge(tmp_path, "127.0.0.1") as (dispatcher, port, ca_file),
        trio.open_nursery() as nursery,
    ):
        with trio.fail_after(BOUND):
            await nursery.start(serve_node, node(port, edge_ca_file=ca_file))
        assert "tls-node" in dispatcher.registry.sessions
        assert "echo" in dispatcher.registry.models()
        nursery.cancel_scope.cancel()


async def test_the_certificate_name_can_differ_from_the_address(tmp_path: Path) -> None:
    async with tls_edge(tmp_path, "edge.internal") as (dispatcher, port, ca_file):
        config = node(port, edge_ca_file=ca_file, edge_tls_server_name="edge.internal")
        async with trio.open_nursery() as nursery:
            with trio.fail_after(BOUND):
                await nursery.start(serve_node, config)
            assert "tls-node" in dispatcher.registry.sessions
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("names", "changes"),
    [
        (("127.0.0.1",), {}),  # the system's CAs do not know trustme's
        (("edge.internal",), {"with_ca": True}),  # the certificate is not for 127.0.0.1
    ],
    ids=["unknown-ca", "wrong-name"],
)
async def test_a_certificate_that_does_not_verify_fails_the_dial(
    tmp_path: Path, names: tuple[str, ...], changes: dict[str, Any]
) -> None:
    async with tls_edge(tmp_path, *names) as (dispatcher, port, ca_file):
        config = node(port, edge_ca_file=ca_file if changes.get("with_ca") else None)
        with trio.fail_after(BOUND), pytest.raises(ConnectionClosed) as failed:
            async with dial_edge(config):
                pass
        assert "certificate" in str(failed.value).lower(), str(failed.value)
        assert dispatcher.registry.sessions == {}


def test_a_ca_file_that_cannot_be_loaded_fails_at_once(tmp_path: Path) -> None:
    (tmp_path / "empty.pem").write_text("")
    with pytest.raises(FileNotFoundError):
        edge_dial(node(1, edge_ca_file=str(tmp_path / "missing.pem")))
    with pytest.raises(ssl.SSLError, match=r"(?i)no certificate"):
        edge_dial(node(1, edge_ca_file=str(tmp_path / "empty.pem")))
