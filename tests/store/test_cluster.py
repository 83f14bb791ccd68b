"""The cluster without Redis (:mod:`dispatcher.store.cluster`): an edge's identity from its
config, its record as a store keeps it, and the embedded default -- the edge alone, listed in
its own ``/admin/status``, a cluster reload telling nobody."""

from __future__ import annotations

import attrs
import orjson

from dispatcher.config import EdgeConfig, StoreSettings
from dispatcher.edge import open_dispatcher
from dispatcher.store.cluster import (
    EdgeIdentity,
    LocalCluster,
    decode_record,
    edge_identity,
    encode_record,
)
from dispatcher.store.seam import EdgeReport


def test_the_edge_id_defaults_to_the_host_name_and_port() -> None:
    config = EdgeConfig(host="0.0.0.0", port=8700)
    assert edge_identity(config, hostname="box") == EdgeIdentity(
        id="box:8700", address="box:8700", node_url="ws://box:8700/v1/nodes/connect"
    )
    named = attrs.evolve(config, host="10.0.0.5", store=StoreSettings(edge_id="edge-1"))
    assert edge_identity(named, hostname="box") == EdgeIdentity(
        id="edge-1", address="10.0.0.5:8700", node_url="ws://10.0.0.5:8700/v1/nodes/connect"
    )
    v6 = EdgeConfig(host="fd00::5", port=1)
    assert edge_identity(v6, hostname="box").address == "[fd00::5]:1"


def test_the_node_url_is_the_edges_endpoint_unless_configured() -> None:
    """Where nodes dial the edge: ``store.node_url``, else its node endpoint at its address
    (``wss://`` with TLS); none on port 0 (not known before it listens)."""
    tls = attrs.evolve(
        EdgeConfig(host="edge.example", port=443),
        http=attrs.evolve(EdgeConfig().http, tls_certificate="c.pem", tls_private_key="k.pem"),
    )
    assert edge_identity(tls).node_url == "wss://edge.example:443/v1/nodes/connect"
    assert edge_identity(EdgeConfig(port=0)).node_url == ""
    proxied = attrs.evolve(
        tls, store=StoreSettings(node_url="wss://nodes.example/edge-a/v1/nodes/connect")
    )
    assert edge_identity(proxied).node_url == "wss://nodes.example/edge-a/v1/nodes/connect"


def test_a_record_comes_back_as_it_was_written() -> None:
    identity = EdgeIdentity(
        id="e", address="h:1", version="1.2", node_url="ws://h:1/v1/nodes/connect"
    )
    report = EdgeReport(started_at=10.5, in_flight=4, reloaded_at=20.0, reload_error="bad")
    kept = orjson.loads(encode_record(identity, "instance-1", report))
    assert kept["instance"] == "instance-1"
    kept["heard_ms"] = 30_000  # what the store's script adds
    record = decode_record(orjson.dumps(kept).decode(), now_ms=31_500)
    assert record is not None
    assert (record.id, record.address, record.version) == ("e", "h:1", "1.2")
    assert record.node_url == "ws://h:1/v1/nodes/connect"
    assert (record.started_at, record.in_flight, record.heard_s) == (10.5, 4, 1.5)
    assert (record.reloaded_at, record.reload_error) == (20.0, "bad")
    assert decode_record("not json", 0) is None
    assert decode_record('{"id": "e"}', 0) is None


async def test_alone_the_edge_lists_itself_and_tells_nobody() -> None:
    cluster = LocalCluster(EdgeIdentity(id="solo", address="h:1"))
    cluster.bind(lambda: EdgeReport(started_at=5.0, in_flight=2), _never)
    (record,) = (await cluster.edges()).edges
    assert (record.id, record.in_flight, record.started_at) == ("solo", 2, 5.0)
    assert await cluster.publish_reload() == 0


async def _never() -> None:
    raise AssertionError("nobody asks an edge alone to reload")


async def test_the_status_of_an_edge_alone_lists_it() -> None:
    config = EdgeConfig(port=0, store=StoreSettings(edge_id="only-me"))
    async with open_dispatcher(config) as dispatcher:
        status = await dispatcher.status()
    assert status.edge_id == "only-me"
    assert [edge.id for edge in status.edges] == ["only-me"]
    assert status.edges[0].started_at == round(dispatcher.started_at, 3)
    assert status.edges_error is None
