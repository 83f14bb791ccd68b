"""A model whose only node is restarting, with real processes: an edge on 127.0.0.1 (in this
process) and a real ``dispatcher node`` process, SIGKILLed. Within the linger a request for
its model gets a retryable 503 with ``Retry-After`` (Anthropic's shape: 529
``overloaded_error``), not a 404 the SDKs would not retry; after the linger, 404 as before.
The official ``openai`` SDK retries the 503 by itself, and a node that comes back during its
retries serves the request. The decision is the admission core's, tested in virtual time in
``tests/admission/``; bounds here are generous (a slow machine waits longer, never fails)."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from dispatcher.config import EdgeConfig, QueuePolicySettings

from .fakes import ServedEdge, serve_edge
from .test_drain_process import BOUND, node_process, wait_for

MESSAGES = [{"role": "user", "content": "back again"}]


@asynccontextmanager
async def edge(**admission: Any) -> AsyncIterator[ServedEdge]:
    config = EdgeConfig(port=0, local_node=False, admission=QueuePolicySettings(**admission))
    async with serve_edge(config, ServedEdge) as served:
        yield served


async def serving(served: ServedEdge, node_id: str = "proc-node") -> bool:
    await trio.lowlevel.checkpoint()
    session = served.dispatcher.registry.sessions.get(node_id)
    return session is not None and bool(session.hello.providers)


async def gone(served: ServedEdge) -> bool:
    return not await serving(served)


async def killed_node(served: ServedEdge, tmp_path: Path) -> None:
    """Start ``proc-node`` (echo), let it join, SIGKILL it, wait until the edge saw it go."""
    async with node_process(tmp_path, served.server.address.port) as node:
        await wait_for(lambda: serving(served))
        node.signal(signal.SIGKILL)
        assert await node.wait_exit() == -signal.SIGKILL
        await wait_for(lambda: gone(served))


async def test_each_front_end_answers_503_retry_after_then_404_after_the_linger(
    tmp_path: Path,
) -> None:
    linger = 3.0
    async with edge(model_linger_s=linger) as served:
        await killed_node(served, tmp_path)
        left = time.monotonic()
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            chat = await client.post(
                "/v1/chat/completions", json={"model": "echo", "messages": MESSAGES}
            )
            responses = await client.post("/v1/responses", json={"model": "echo", "input": "x"})
            messages = await client.post(
                "/v1/messages", json={"model": "echo", "max_tokens": 10, "messages": MESSAGES}
            )
            models = (await client.get("/v1/models")).json()["data"]
            assert time.monotonic() - left < linger, "too slow a machine for this linger"
            await trio.sleep(linger - (time.monotonic() - left) + 0.2)
            after = await client.post(
                "/v1/chat/completions", json={"model": "echo", "messages": MESSAGES}
            )
    for answer in (chat, responses):
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "2"
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "model_unavailable")
        assert error["message"].startswith(
            "no node serves model 'echo' right now (a node served it until "
        )
        assert error["message"].endswith(" ago); retry shortly")
    assert messages.status_code == 529, messages.text
    assert messages.headers["retry-after"] == "2"
    body = messages.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    assert "no node serves model 'echo' right now" in body["error"]["message"]
    assert models == []  # /v1/models lists what is served now
    assert after.status_code == 404, after.text
    assert after.json()["error"]["code"] == "model_not_found"
    assert "retry-after" not in after.headers


async def test_the_openai_sdk_retries_until_the_restarted_node_serves(tmp_path: Path) -> None:
    """The user-level proof: the SDK's own retries (it honours ``Retry-After``) carry the
    request over the node's restart. (``max_retries`` above the default 2 only so that a
    slow machine's restart still falls within them.)"""
    async with edge() as served:
        await killed_node(served, tmp_path)
        rejections = served.dispatcher.admission.statistics().rejections
        assert rejections["model_unavailable"] == 0
        async with (
            openai.AsyncOpenAI(
                base_url=f"{served.url}/v1", api_key="unused", max_retries=8
            ) as client,
            trio.open_nursery() as nursery,
        ):
            answer: list[Any] = []

            async def ask() -> None:
                answer.append(
                    await client.chat.completions.create(
                        model="echo", messages=[{"role": "user", "content": "back again"}]
                    )
                )

            nursery.start_soon(ask)

            async def refused() -> bool:
                await trio.lowlevel.checkpoint()
                stats = served.dispatcher.admission.statistics()
                return stats.rejections["model_unavailable"] >= 1

            await wait_for(refused)  # the SDK got its 503 and waits to retry
            async with node_process(tmp_path, served.server.address.port):
                with trio.fail_after(BOUND):
                    while not answer:
                        await trio.sleep(0.05)
    [completion] = answer
    assert completion.choices[0].message.content == "back again"
    assert served.dispatcher.admission.statistics().rejections["model_unavailable"] >= 1
    assert [row.outcome for row in served.rows] == ["completed"]


async def test_the_anthropic_sdk_sees_a_retryable_overloaded_error(tmp_path: Path) -> None:
    """Anthropic's SDK maps the 529 to ``OverloadedError`` (it would retry it)."""
    async with edge() as served:
        await killed_node(served, tmp_path)
        async with anthropic.AsyncAnthropic(
            base_url=served.url, api_key="unused", max_retries=0
        ) as client:
            with pytest.raises(anthropic.OverloadedError) as info:
                await client.messages.create(
                    model="echo",
                    max_tokens=10,
                    messages=[{"role": "user", "content": "back again"}],
                )
    assert info.value.status_code == 529
    assert info.value.response.headers["retry-after"] == "2"
    assert "no node serves model 'echo' right now" in str(info.value)
