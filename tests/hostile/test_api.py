"""The API's own rules under hostile use: methods and ``Allow``, OPTIONS, request ids that
clients cannot use to hide requests from the ledger, and node names kept from clients."""

from __future__ import annotations

import attrs
import pytest

from ._support import (
    ADMIN_KEY,
    CLIENT_KEY,
    Edge,
    assert_error,
    bearer,
    chat,
    edge_config,
    json_request,
    open_edge,
    params,
    request_bytes,
)

CHAT = "/v1/chat/completions"


@attrs.frozen
class Method:
    method: str
    target: str
    status: int
    allow: str | None
    code: str | None = None


GET_ALLOW = "GET, HEAD, OPTIONS"
POST_ALLOW = "POST, OPTIONS"

METHODS: dict[str, Method] = {
    "delete-healthz": Method("DELETE", "/healthz", 405, GET_ALLOW, "method_not_allowed"),
    "post-healthz": Method("POST", "/healthz", 405, GET_ALLOW, "method_not_allowed"),
    "put-readyz": Method("PUT", "/readyz", 405, GET_ALLOW, "method_not_allowed"),
    "get-chat": Method("GET", CHAT, 405, POST_ALLOW, "method_not_allowed"),
    "put-chat": Method("PUT", CHAT, 405, POST_ALLOW, "method_not_allowed"),
    "delete-models": Method("DELETE", "/v1/models", 405, GET_ALLOW, "method_not_allowed"),
    "post-usage": Method("POST", "/v1/usage", 405, GET_ALLOW, "method_not_allowed"),
    "trace-metrics": Method("TRACE", "/metrics", 405, GET_ALLOW, "method_not_allowed"),
    "unknown-method": Method("BREW", "/v1/embeddings", 405, POST_ALLOW, "method_not_allowed"),
    "post-node-endpoint": Method(
        "POST", "/v1/nodes/connect", 405, "GET, OPTIONS", "method_not_allowed"
    ),
    "options-chat": Method("OPTIONS", CHAT, 204, POST_ALLOW),
    "options-healthz": Method("OPTIONS", "/healthz", 204, GET_ALLOW),
    "options-asterisk": Method("OPTIONS", "*", 204, "GET, HEAD, POST, DELETE, OPTIONS"),
    "options-unknown-path": Method("OPTIONS", "/v1/nothing", 404, None, "unknown_url"),
    "unknown-path": Method("GET", "/v1/nothing", 404, None, "unknown_url"),
    "path-traversal": Method("GET", "/v1/../healthz", 404, None, "unknown_url"),
    "get-node-endpoint-without-upgrade": Method(
        "GET", "/v1/nodes/connect", 400, None, "invalid_request"
    ),
}


@params(METHODS)
async def test_methods(edge: Edge, case: Method) -> None:
    # Method and path are checked before the key: no key is sent, none is needed to learn
    # what a path takes.
    async with edge.case():
        response = await edge.request(case.method, case.target)
        assert response.header("allow") == case.allow
        assert response.header("x-request-id")
        if case.status == 204:
            assert response.status == 204
            assert response.body == b""
        else:
            assert_error(response, case.status, code=case.code)


async def test_the_same_client_request_id_twice_is_two_ledger_rows(edge: Edge) -> None:
    async with edge.case(stream_seconds=1.0):  # four exchanges and a ledger query
        first, second = [
            await edge.exchange(
                json_request(CHAT, chat(), [bearer(), ("x-request-id", "mine-1")]), closes=False
            )
            for _ in range(2)
        ]
        for response in (first, second):
            assert response.status == 200
            assert response.header("x-request-id") == "mine-1"  # the client's, echoed
        keys = [r.header("x-dispatcher-request-id") or "" for r in (first, second)]
        assert keys[0] != keys[1]
        assert all(key.startswith("req-") for key in keys)
        rows = (await edge.dispatcher.ledger.query(client_request_id="mine-1")).rows
        assert sorted(row.request_id for row in rows) == sorted(keys)
        assert {row.client_request_id for row in rows} == {"mine-1"}
        # GET /v1/usage finds both by the client's id.
        usage = await edge.request("GET", "/v1/usage?client_request_id=mine-1", [bearer(ADMIN_KEY)])
        assert usage.json()["totals"]["requests"] == 2


@pytest.mark.parametrize(
    "value",
    ["has space", 'quote"d', "x" * 129, "caf\xe9", "semi;colon", "tab\there"],
    ids=["space", "quote", "too-long", "latin-1", "semicolon", "tab"],
)
async def test_an_unsafe_client_request_id_is_ignored(edge: Edge, value: str) -> None:
    async with edge.case():
        response = await edge.exchange(
            json_request(CHAT, chat(), [bearer(), ("x-request-id", value)]), closes=False
        )
        assert response.status == 200
        own = response.header("x-dispatcher-request-id")
        assert own is not None
        assert own.startswith("req-")
        assert response.header("x-request-id") == own  # the edge's own id stands in
        (row,) = [r for r in (await edge.dispatcher.ledger.query()).rows if r.request_id == own]
        assert row.client_request_id is None


async def test_errors_carry_request_ids_too(edge: Edge) -> None:
    async with edge.case():
        response = await edge.exchange(
            json_request(CHAT, b"{not json", [bearer(), ("x-request-id", "bad-1")]), closes=False
        )
        assert_error(response, 400, code="invalid_json")
        assert response.header("x-request-id") == "bad-1"
        assert (response.header("x-dispatcher-request-id") or "").startswith("req-")


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
async def test_node_ids_are_not_shown_to_clients(edge: Edge, stream: bool) -> None:
    async with edge.case():
        response = await edge.post(CHAT, chat(stream=stream))
        assert response.status == 200
        assert response.header("x-dispatcher-node") is None
        assert response.header("x-dispatcher-provider") is None
        assert response.header("x-dispatcher-attempts") == "1"
        assert response.header("x-dispatcher-queue-ms") is not None


async def test_node_ids_are_shown_when_exposed(caplog: pytest.LogCaptureFixture) -> None:
    async with open_edge(caplog, edge_config(expose_node_ids=True)) as edge, edge.case():
        response = await edge.post(CHAT, chat())
        assert response.header("x-dispatcher-node") == "legit"
        assert response.header("x-dispatcher-provider") == "echo"


async def test_a_head_request_gets_the_head_of_the_answer(edge: Edge) -> None:
    async with edge.case():
        response = await edge.exchange(
            request_bytes("HEAD", "/v1/models", [bearer(CLIENT_KEY)]), method="HEAD", closes=False
        )
        assert response.status == 200
        assert response.body == b""
        assert response.header("content-type") == "application/json"
