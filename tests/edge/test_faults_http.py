"""Faults of issue #9 seen from a client over real sockets: an upstream 4xx is the client's
answer (the upstream's status, not a 502, not retried), and a client gone by a broken
connection (PeerGone) is recorded as a client that left, in the ledger and the metrics alike.
"""

from __future__ import annotations

import socket
from contextlib import AbstractAsyncContextManager

import httpx
import openai
import orjson
import pytest
import trio

from dispatcher import wire
from dispatcher.config import EdgeConfig, HTTPSettings, QueuePolicySettings
from dispatcher.paths.runs import RunSpec

from .fakes import ScriptedNode, ServedEdge, connect, hello, serve_edge, wait_until
from .test_admission_http import metric

Edge = ServedEdge


def open_edge(write_timeout: float = 30.0) -> AbstractAsyncContextManager[Edge]:
    config = EdgeConfig(
        port=0,
        local_node=False,
        http=HTTPSettings(write_timeout=write_timeout),
        models={"m": QueuePolicySettings()},
    )
    return serve_edge(config, Edge)


def body(**extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


async def refuse_with_400(node: ScriptedNode) -> None:
    request = await node.receive_run()
    await node.emit(
        request.run_id,
        ("run.started", {}),
        (
            "run.failed",
            {
                "code": "context_length_exceeded",
                "message": "This model's maximum context length is 8 tokens.",
                "retryable": False,
                "status": 400,
            },
        ),
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_400_is_the_clients_answer_not_a_502(stream: bool) -> None:
    async with open_edge() as edge:
        first = await connect(edge.dispatcher, hello("node-a", slots=1))
        second = await connect(edge.dispatcher, hello("node-b", slots=1))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refuse_with_400, first)
            nursery.start_soon(refuse_with_400, second)
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                response = await client.post("/v1/chat/completions", json=body(stream=stream))
            assert response.status_code == 400
            error = orjson.loads(response.content)["error"]
            assert error["type"] == "invalid_request_error"
            assert error["code"] == "context_length_exceeded"
            assert error["message"] == "This model's maximum context length is 8 tokens."
            # Not retried on the other node: exactly one run request went out.
            await trio.sleep(0.1)
            requests = [
                m for n in (first, second) for m in n.seen if isinstance(m, wire.RunRequest)
            ]
            assert len(requests) == 1
            nursery.cancel_scope.cancel()
        await wait_until(lambda: len(edge.rows) == 1)
        assert edge.rows[0].outcome == "failed"
        text = edge.dispatcher.metrics.render().decode()
        assert metric(text, "dispatcher_requests_total", model="m", outcome="failed") == 1


async def test_the_official_client_gets_bad_request_and_does_not_retry() -> None:
    async with open_edge() as edge:
        node = await connect(edge.dispatcher, hello("node-a", slots=1))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refuse_with_400, node)

            def call() -> None:
                client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="x", max_retries=2)
                with client, pytest.raises(openai.BadRequestError) as info:
                    client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}]
                    )
                assert info.value.code == "context_length_exceeded"

            await trio.to_thread.run_sync(call)
            await trio.sleep(0.1)
            assert len([m for m in node.seen if isinstance(m, wire.RunRequest)]) == 1
            nursery.cancel_scope.cancel()


async def test_a_client_cut_off_by_the_write_timeout_is_a_client_that_left() -> None:
    """The client stops reading: the edge's write times out and the response's send raises
    PeerGone (not a cancellation). The row says ``cancelled`` and the metric ``client_gone``:
    the ledger and the metric agree."""
    async with open_edge(write_timeout=0.5) as edge:
        edge.dispatcher.gate.settle_timeout = 0.2  # the scripted node never confirms the cancel
        node = await connect(edge.dispatcher, hello("node-a", slots=1))
        big = "x" * 60_000
        async with trio.open_nursery() as nursery:

            async def node_side() -> None:
                request = await node.receive_run()
                await node.send(wire.RunStarted(run_id=request.run_id, seq=0))
                for seq in range(1, 400):
                    await node.send(wire.RunDelta(run_id=request.run_id, seq=seq, text=big))
                    await trio.sleep(0.005)

            nursery.start_soon(node_side)
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", edge.server.address.port))
            payload = orjson.dumps(body(stream=True))
            await sock.send(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\n"
                + f"content-length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            # Never read: the edge's writes block until its write timeout cuts us off.
            with trio.fail_after(20):
                await wait_until(lambda: len(edge.rows) == 1, timeout=20)
            sock.close()
            nursery.cancel_scope.cancel()
        assert edge.rows[0].outcome == "cancelled"
        text = edge.dispatcher.metrics.render().decode()
        assert metric(text, "dispatcher_requests_total", model="m", outcome="client_gone") == 1


async def test_a_client_leaving_while_its_recovery_waits_is_client_gone() -> None:
    """Attempt 1 fails before the commit (its row: aborted); the recovery waits for the only
    other node, which is busy; the client leaves. The request ended by the client leaving:
    the metric says client_gone (the aborted row is the attempt's, not the request's end)."""
    async with open_edge() as edge:
        busy = await connect(edge.dispatcher, hello("node-b", slots=1))
        async with trio.open_nursery() as nursery:

            async def hold_b() -> None:
                async with edge.dispatcher.open_run(RunSpec(model="m", body=body())):
                    await trio.sleep_forever()

            nursery.start_soon(hold_b)
            await busy.receive_run()  # node-b's only slot is taken from now on
            failing = await connect(edge.dispatcher, hello("node-a", slots=1))

            async def fail_a() -> None:
                request = await failing.receive_run()
                await failing.emit(
                    request.run_id,
                    ("run.started", {}),
                    ("run.failed", {"code": "upstream_5xx", "message": "boom", "retryable": True}),
                )

            nursery.start_soon(fail_a)
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                with trio.move_on_after(1.0):
                    await client.post("/v1/chat/completions", json=body())
                    pytest.fail("answered while the only other node was busy")
            await wait_until(lambda: len(edge.rows) == 1)
            assert edge.rows[0].outcome == "aborted"
            await wait_until(lambda: "client_gone" in edge.dispatcher.metrics.render().decode())
            text = edge.dispatcher.metrics.render().decode()
            assert metric(text, "dispatcher_requests_total", model="m", outcome="client_gone") == 1
            nursery.cancel_scope.cancel()
