"""Adding a front end touches no file of the edge: a toy one, defined here and registered
with one line, served over a real socket.

The toy ``POST /v1/ping-completions`` maps ``{"model", "prompt"}`` to the typed gate request
(a chat body for the built-in echo node), runs it through the gate, answers
``{"pong": <text>}``, and renders every error in its own shape,
``{"ping_error": {"reason", "code"}}`` -- not OpenAI's.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
import trio

from dispatcher import wire
from dispatcher.api.app import FRONT_ENDS
from dispatcher.api.front import (
    FrontEnd,
    RenderedError,
    RouteContext,
    RouteSpec,
)
from dispatcher.api.seam import EdgeServices
from dispatcher.config import EdgeConfig
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.errors import BadRequest, DispatcherError
from dispatcher.gate.attempts import Answer, GateRequest
from dispatcher.gate.pool import DispatchRequest
from dispatcher.http import Request, Responder

PING_PATH = "/v1/ping-completions"

# --------------------------------------------------------------------------- the toy front end


def _field(body: object, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name}: expected a non-empty string", param=name)
    return value


async def _ping(
    edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
) -> None:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        raise BadRequest("the body is not JSON") from None
    model, prompt = _field(body, "model"), _field(body, "prompt")
    gated = GateRequest(
        request_id=ctx.request_id,
        client_request_id=ctx.client_request_id,
        dispatch=DispatchRequest(
            model=model,
            body={"model": model, "messages": [{"role": "user", "content": prompt}]},
            route=request.path,
        ),
        stream=False,
        attribution=ctx.attribution,
    )
    async with edge.gate.open(gated) as answer:
        assert isinstance(answer, Answer)  # the echo node is no tunnel
        text = "".join(e.text for e in answer.head if isinstance(e, wire.RunDelta))
    headers = ((b"content-type", b"application/json"), *ctx.headers)
    await responder.respond(200, headers, orjson.dumps({"pong": text}))


def _ping_error(exc: BaseException) -> RenderedError:
    if isinstance(exc, DispatcherError) and 400 <= exc.status <= 599:
        status, reason, code = exc.status, exc.message, exc.code
    else:
        status, reason, code = 500, "the toy broke", "internal_error"
    body = orjson.dumps({"ping_error": {"reason": reason, "code": code}})
    return RenderedError(status, body, content_type=b"application/ping-error+json")


PING = FrontEnd("ping", {PING_PATH: RouteSpec(("POST",), _ping, "client", work=True)}, _ping_error)

# --------------------------------------------------------------------------- served for real


@pytest.fixture
async def edge(nursery: trio.Nursery) -> AsyncIterator[tuple[Dispatcher, str]]:
    async with open_dispatcher(EdgeConfig(port=0)) as dispatcher:
        await dispatcher.attach_local_node()
        serve = functools.partial(dispatcher.serve, front_ends=(*FRONT_ENDS, PING))  # the line
        server = await nursery.start(serve)
        yield dispatcher, f"http://127.0.0.1:{server.address.port}"
        server.shutdown()


async def test_the_toy_answers_through_the_gate_and_the_ledger_has_its_row(
    edge: tuple[Dispatcher, str],
) -> None:
    dispatcher, url = edge
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post(
            PING_PATH,
            json={"model": "echo", "prompt": "ping pong ball"},
            headers={"x-request-id": "toy-1"},
        )
    assert response.status_code == 200, response.text
    assert response.json() == {"pong": "ping pong ball"}
    report = await dispatcher.ledger.query(client_request_id="toy-1")
    assert [(row.route, row.model_group, row.outcome) for row in report.rows] == [
        (PING_PATH, "echo", "completed")
    ]
    assert report.rows[0].request_id == response.headers["x-dispatcher-request-id"]


async def test_the_toy_renders_its_errors_in_its_own_shape(edge: tuple[Dispatcher, str]) -> None:
    _, url = edge
    async with httpx.AsyncClient(base_url=url) as client:
        missing = await client.post(PING_PATH, json={"prompt": "no model"})
        unknown = await client.post(PING_PATH, json={"model": "nope", "prompt": "x"})
        wrong_method = await client.get(PING_PATH)
        openai_route = await client.post("/v1/chat/completions", json={"prompt": "x"})
    assert missing.status_code == 400
    assert missing.headers["content-type"] == "application/ping-error+json"
    assert missing.json() == {
        "ping_error": {"reason": "model: expected a non-empty string", "code": "invalid_request"}
    }
    assert unknown.status_code == 404
    assert unknown.json()["ping_error"]["code"] == "model_not_found"
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST, OPTIONS"
    assert "ping_error" in wrong_method.json()
    # The other front ends keep their own shape.
    assert openai_route.status_code == 400
    assert openai_route.json()["error"]["type"] == "invalid_request_error"
    assert "ping_error" not in openai_route.json()
