"""A node lost, or leaving, mid-answer, with real processes: an edge on 127.0.0.1 (in this
process, so the test reads its log and its usage rows) and a real ``dispatcher node``
process serving echo slowly. SIGKILL it mid-stream: each front end's stream ends with its
explicit error event saying the node was lost -- not that a client disconnected -- and so do
the edge's log, the request's access line and its usage row. SIGKILL it before its first
token: the gate answers 502 naming the node as lost. Ctrl-C it (it drains, then leaves) with
a short drain grace: the stream's error names the node's drain, and the log says it left
while draining. Bounds are generous; the naming itself is tested in virtual time
(``test_session_end.py``)."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from dispatcher.config import EdgeConfig
from dispatcher.gate.attempts import RunAttempt

from .fakes import ServedEdge, serve_edge
from .logs import Captured
from .test_drain_process import Proc, dispatcher_process, wait_for

WORDS = 60


@asynccontextmanager
async def edge() -> AsyncIterator[ServedEdge]:
    async with serve_edge(EdgeConfig(port=0, local_node=False), ServedEdge) as served:
        yield served


def echo_node(
    tmp_path: Path, port: int, *, token_delay: float = 0.1, drain_grace: float = 30.0
) -> AbstractAsyncContextManager[Proc]:
    """``dispatcher node`` as ``node-a``, serving echo with ``token_delay`` before each word."""
    config = tmp_path / "node-a.toml"
    config.write_text(
        f'[node]\nid = "node-a"\ndrain_grace = {drain_grace}\n'
        f'[[providers]]\nid = "echo"\ntype = "echo"\noptions = {{ token_delay = {token_delay} }}\n'
        '  [[providers.models]]\n  name = "echo"\n'
    )
    url = f"ws://127.0.0.1:{port}/v1/nodes/connect"
    return dispatcher_process(tmp_path, "node-a", "node", "--edge", url, "--config", str(config))


async def has_session(served: ServedEdge) -> bool:
    await trio.lowlevel.checkpoint()
    return "node-a" in served.dispatcher.registry.sessions


async def gone(served: ServedEdge) -> bool:
    return not await has_session(served)


TEXT = " ".join(f"w{i}" for i in range(WORDS))
MESSAGES = [{"role": "user", "content": TEXT}]

# path, body, how to find the stream's final error in its data lines
FRONT_ENDS: dict[str, tuple[str, dict[str, Any], Callable[[dict[str, Any]], str | None]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": "echo", "messages": MESSAGES, "stream": True},
        lambda data: (
            f"{data['error']['code']}: {data['error']['message']}" if "error" in data else None
        ),
    ),
    "responses": (
        "/v1/responses",
        {"model": "echo", "input": TEXT, "stream": True},
        lambda data: (
            f"{data['response']['error']['code']}: {data['response']['error']['message']}"
            if data.get("type") == "response.failed"
            else None
        ),
    ),
    "messages": (
        "/v1/messages",
        {"model": "echo", "max_tokens": 1000, "messages": MESSAGES, "stream": True},
        lambda data: (
            f"{data['error']['type']}: {data['error']['message']}"
            if data.get("type") == "error"
            else None
        ),
    ),
}


async def stream_until(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    at_word: str,
    then: Callable[[], Any],
) -> list[dict[str, Any]]:
    """Stream ``body`` to ``path``; call ``then`` once ``at_word`` came; the data events."""
    events: list[dict[str, Any]] = []
    done = False
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(orjson.loads(line.removeprefix("data: ")))
            if not done and at_word in line:
                done = True
                then()
    return events


@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
async def test_a_node_killed_mid_stream_is_named_lost(
    tmp_path: Path, logs: Captured, front_end: str
) -> None:
    path, body, error_of = FRONT_ENDS[front_end]
    async with (
        edge() as served,
        echo_node(tmp_path, served.server.address.port) as node,
        httpx.AsyncClient(base_url=served.url, timeout=30) as client,
    ):
        await wait_for(lambda: has_session(served))
        events = await stream_until(client, path, body, "w1", lambda: node.signal(signal.SIGKILL))
        await wait_for(lambda: gone(served))
    errors = [error for error in map(error_of, events) if error is not None]
    assert len(errors) == 1, events[-3:]
    assert error_of(events[-1]) == errors[0]  # the stream's last event
    error = errors[0]
    assert "node node-a was lost: its connection broke" in error, error
    assert "client disconnected" not in error
    if front_end == "chat":
        assert error.startswith("node_lost: ")
    elif front_end == "responses":
        assert error.startswith("server_error: ")
        assert "(node_lost)" in error
    else:
        assert error.startswith("api_error: ")
    assert (
        "node node-a generation 1 left: node node-a was lost: its connection broke"
        in logs.messages("dispatcher.nodes")
    )
    line = logs.line_for(path)
    assert (line["outcome"], line["error_code"]) == ("failed", "node_lost")
    assert "node node-a was lost" in line["error"]
    [row] = served.rows
    assert (row.outcome, row.node_id, row.billable_to) == ("failed", "node-a", "client")


async def test_a_node_killed_before_its_first_token_is_named_lost_in_the_502(
    tmp_path: Path, logs: Captured
) -> None:
    """Before the commit the gate recovers, and with no other node answers 502 naming the
    node as lost (the client saw nothing else)."""
    async with (
        edge() as served,
        echo_node(tmp_path, served.server.address.port) as node,
        httpx.AsyncClient(base_url=served.url, timeout=30) as client,
    ):
        await wait_for(lambda: has_session(served))

        async def sent() -> bool:
            await trio.lowlevel.checkpoint()
            return any(
                isinstance(record.attempt, RunAttempt) and record.attempt.run.sent
                for record in served.dispatcher.traffic.in_flight.values()
            )

        async with trio.open_nursery() as nursery:

            async def kill_once_sent() -> None:
                await wait_for(sent)
                node.signal(signal.SIGKILL)

            nursery.start_soon(kill_once_sent)
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "echo", "messages": MESSAGES, "echo": {"stall_after_tokens": 0}},
            )
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "node_lost"
    assert "node node-a was lost: its connection broke" in error["message"]
    assert "client disconnected" not in error["message"]
    line = logs.line_for("/v1/chat/completions")
    assert (line["status"], line["error_code"]) == (502, "node_lost")
    [row] = served.rows
    assert row.outcome == "aborted"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_a_node_stopped_mid_stream_is_named_draining(
    tmp_path: Path, logs: Captured, signum: int
) -> None:
    """Ctrl-C (or SIGTERM): the node drains; its 1 s grace ends before the 6 s answer, so it
    cancels the run and leaves. The client is told the node's drain cut it."""
    path, body, error_of = FRONT_ENDS["chat"]
    async with (
        edge() as served,
        echo_node(tmp_path, served.server.address.port, drain_grace=1.0) as node,
        httpx.AsyncClient(base_url=served.url, timeout=30) as client,
    ):
        await wait_for(lambda: has_session(served))
        events = await stream_until(client, path, body, "w1", lambda: node.signal(signum))
        assert await node.wait_exit() == 0
        await wait_for(lambda: gone(served))
    error = error_of(events[-1])
    assert error == (
        "node_draining: the model run failed: node node-a is draining (its operator stopped "
        "it): its drain grace of 1 s ended before this run did"
    ), events[-3:]
    nodes_log = logs.messages("dispatcher.nodes")
    assert "node node-a is draining (grace 1.0 s): routing nothing new to it" in nodes_log
    assert (
        "node node-a generation 1 left: node node-a left while draining (its operator stopped it)"
        in nodes_log
    )
    assert not any("was lost" in message for message in nodes_log)
    line = logs.line_for(path)
    assert (line["outcome"], line["error_code"]) == ("failed", "node_draining")
