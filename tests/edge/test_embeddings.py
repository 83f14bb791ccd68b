"""``POST /v1/embeddings`` on normalized providers, end to end through a real edge: the official
``openai`` SDK (float and base64, one input or a list) against the in-process echo node and
against a real ``dispatcher node`` process whose ``openai`` provider embeds with a fake OpenAI
server; with scripted nodes, the gate's rules for an embeddings run -- recovery before the
commit, cancellation, one usage row per attempt, a node's bad answer refused -- and a model
whose only provider cannot embed answering 400 ``no_capable_candidate``."""

from __future__ import annotations

import base64
import functools
import math
import struct
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio

from dispatcher import wire
from dispatcher.api.openai._embeddings import IN_A_THREAD
from dispatcher.config import EdgeConfig, NodeSettings
from nodes.adapters import EMBEDDING_ROUTES
from nodes.adapters.echo import echo_embedding
from tests.edge.fakes import ScriptedNode, ServedEdge, connect, hello, serve_edge, wait_until
from tests.nodes.fake_providers import FakeOpenAI, fake_vector, serve_fake_openai

CONFIG = EdgeConfig(
    port=0,
    local_node=False,
    expose_node_ids=True,
    nodes=NodeSettings(heartbeat_interval=1000, heartbeat_timeout=3000),
)


def sdk(edge: ServedEdge) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key="unused", max_retries=0)


def near(got: list[float], want: list[float]) -> bool:
    """Equal as float32 values are (the wire carries float32)."""
    return len(got) == len(want) and all(
        math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-7) for g, w in zip(got, want, strict=True)
    )


# --------------------------------------------------------------------------- the echo node


async def test_the_openai_sdk_embeds_with_the_echo_node() -> None:
    async with serve_edge(CONFIG, ServedEdge, local_node=True) as edge, sdk(edge) as client:
        floats = await client.embeddings.create(
            model="echo", input=["hello world", "hi"], encoding_format="float"
        )
        assert [item.index for item in floats.data] == [0, 1]
        assert near(floats.data[0].embedding, echo_embedding("hello world"))
        assert near(floats.data[1].embedding, echo_embedding("hi"))
        assert floats.model == "echo"
        assert floats.object == "list"
        assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (3, 3)

        encoded = await client.embeddings.create(
            model="echo", input="hi", encoding_format="base64", dimensions=16
        )
        (item,) = encoded.data
        embedding: Any = item.embedding  # typed as floats; the SDK passes base64 through
        assert isinstance(embedding, str)
        values = list(struct.unpack("<16f", base64.b64decode(embedding)))
        assert near(values, echo_embedding("hi", 16))

        # The SDK's default: it asks base64 and decodes it itself.
        default = await client.embeddings.create(model="echo", input="hi")
        assert near(list(default.data[0].embedding), echo_embedding("hi"))

        raw = await client.embeddings.with_raw_response.create(
            model="echo", input=[[1, 2, 3]], encoding_format="float"
        )
        assert raw.headers["x-dispatcher-node"] == "local"
        body = raw.http_response.json()
        assert body["data"][0]["object"] == "embedding"
        assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert [(row.route, row.outcome, row.path) for row in edge.rows] == [
        ("/v1/embeddings", "completed", "normalized")
    ] * 4
    assert [(row.prompt_tokens, row.completion_tokens) for row in edge.rows] == [
        (3, 0),
        (1, 0),
        (1, 0),
        (3, 0),
    ]


async def test_the_quick_start_curl() -> None:
    """``dispatcher serve`` alone answers ``/v1/embeddings`` for ``echo`` (docs/quickstart.md)."""
    async with (
        serve_edge(CONFIG, ServedEdge, local_node=True) as edge,
        httpx.AsyncClient(base_url=edge.url) as client,
    ):
        answer = await client.post("/v1/embeddings", content=b'{"model":"echo","input":"hi"}')
    assert answer.status_code == 200
    (item,) = answer.json()["data"]
    assert len(item["embedding"]) == 256
    assert near(item["embedding"], echo_embedding("hi"))


async def test_a_large_batch_is_answered_whole() -> None:
    """2,048 inputs of 256 values: over several run.embeddings frames, rendered in a worker
    thread (over ``IN_A_THREAD``), in order."""
    texts = [f"text {i}" for i in range(2048)]
    async with serve_edge(CONFIG, ServedEdge, local_node=True) as edge, sdk(edge) as client:
        assert len(texts) * len(wire.encode_vector([0.0] * 256)) > IN_A_THREAD
        floats = await client.embeddings.create(model="echo", input=texts, encoding_format="float")
    assert [item.index for item in floats.data] == list(range(2048))
    for index in (0, 1000, 2047):
        assert near(floats.data[index].embedding, echo_embedding(texts[index]))
    assert floats.usage.prompt_tokens == 2 * 2048


# --------------------------------------------------------------------------- a node process


NODE_TOML = """\
[node]
id = "embed-node"
edge_url = "ws://127.0.0.1:{port}/v1/nodes/connect"

[[providers]]
id = "oa"
type = "openai"
base_url = "{base_url}/v1"
api_key_env = "EMBED_TEST_KEY"

  [[providers.models]]
  name = "embedder"
  served_name = "text-embedding-fake"
  slots = 2
"""


async def test_a_node_process_embeds_with_its_openai_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBED_TEST_KEY", "sk-upstream")
    async with (
        serve_edge(CONFIG, ServedEdge) as edge,
        trio.open_nursery() as nursery,
    ):
        fake: FakeOpenAI = await nursery.start(serve_fake_openai, FakeOpenAI(prompt_tokens=9))
        fake.api_key = "sk-upstream"
        config = tmp_path / "node.toml"
        config.write_text(NODE_TOML.format(port=edge.server.address.port, base_url=fake.base_url))
        command = [sys.executable, "-m", "dispatcher", "node", "--config", str(config)]
        node = await nursery.start(functools.partial(trio.run_process, command, check=False))
        try:
            with trio.fail_after(30):
                while "embed-node" not in edge.dispatcher.registry.sessions:
                    await edge.dispatcher.registry.wait_changed()
            async with sdk(edge) as client:
                floats = await client.embeddings.create(
                    model="embedder", input=["one", "three"], encoding_format="float"
                )
                encoded = await client.embeddings.create(
                    model="embedder", input="four", encoding_format="base64", dimensions=4
                )
                chat = await client.chat.completions.create(
                    model="embedder", messages=[{"role": "user", "content": "hi"}]
                )
        finally:
            node.terminate()
        nursery.cancel_scope.cancel()
    assert [item.embedding for item in floats.data] == [
        fake_vector("one", 8),
        fake_vector("three", 8),
    ]
    assert floats.model == "embedder"
    assert floats.usage.prompt_tokens == 9
    (item,) = encoded.data
    embedding: Any = item.embedding  # typed as floats; the SDK passes base64 through
    assert isinstance(embedding, str)
    assert list(struct.unpack("<4f", base64.b64decode(embedding))) == fake_vector("four", 4)
    assert chat.choices[0].message.content == fake.expected_text  # the same provider chats
    embeds = [r for r in fake.requests if r.path == "/v1/embeddings"]
    assert [r.json for r in embeds] == [
        {"model": "text-embedding-fake", "input": ["one", "three"], "encoding_format": "float"},
        {
            "model": "text-embedding-fake",
            "input": "four",
            "encoding_format": "base64",
            "dimensions": 4,
        },
    ]
    assert all(r.authorization == "Bearer sk-upstream" for r in embeds)
    assert [(r.route, r.prompt_tokens, r.usage_source) for r in edge.rows[:2]] == [
        ("/v1/embeddings", 9, "reported")
    ] * 2


# --------------------------------------------------------------------------- scripted nodes


def embedding_hello(
    node_id: str, *, routes: tuple[wire.RouteName, ...] = EMBEDDING_ROUTES
) -> wire.Hello:
    greeting = hello(node_id, model="m", slots=2)
    (provider,) = greeting.providers
    return attrs.evolve(greeting, providers=(attrs.evolve(provider, routes=routes),))


VECTOR = wire.encode_vector([0.5, 0.25])
USAGE: dict[str, object] = {"usage": wire.Usage(prompt_tokens=4, completion_tokens=0)}


def answered(count: int) -> tuple[tuple[str, dict[str, object]], ...]:
    return (
        ("run.started", {}),
        ("run.embeddings", {"index": 0, "vectors": (VECTOR,) * count}),
        ("run.usage", USAGE),
        ("run.completed", {}),
    )


@asynccontextmanager
async def scripted(
    *node_ids: str, **kwargs: Any
) -> AsyncIterator[tuple[ServedEdge, list[ScriptedNode]]]:
    async with serve_edge(CONFIG, ServedEdge) as edge:
        nodes = [await connect(edge.dispatcher, embedding_hello(n, **kwargs)) for n in node_ids]
        yield edge, nodes


async def post(edge: ServedEdge, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as client:
        return await client.post("/v1/embeddings", json=body)


async def test_a_failure_before_the_answer_is_recovered_on_another_node() -> None:
    async with scripted("node-a", "node-b") as (edge, nodes), trio.open_nursery() as nursery:
        runs: list[wire.RunRequest] = []

        async def serve(node: ScriptedNode) -> None:
            request = await node.receive_run()
            runs.append(request)
            if len(runs) == 1:
                await node.emit(
                    request.run_id,
                    ("run.started", {}),
                    ("run.failed", {"code": "upstream_5xx", "message": "boom", "retryable": True}),
                )
            else:
                await node.emit(request.run_id, *answered(2))

        for node in nodes:
            nursery.start_soon(serve, node)
        response = await post(
            edge, {"model": "m", "input": ["a", "b"], "encoding_format": "base64"}
        )
        await wait_until(lambda: len(edge.rows) == 2)
        nursery.cancel_scope.cancel()
    assert response.status_code == 200, response.text
    assert response.headers["x-dispatcher-attempts"] == "2"
    assert [item["embedding"] for item in response.json()["data"]] == [VECTOR, VECTOR]
    assert response.json()["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert [request.route for request in runs] == ["embeddings", "embeddings"]
    assert runs[0].body == {"model": "m-served", "input": ["a", "b"], "encoding_format": "base64"}
    assert [(row.attempt, row.outcome) for row in edge.rows] == [(1, "aborted"), (2, "completed")]
    assert edge.rows[1].prompt_tokens == 4


async def test_a_client_leaving_cancels_the_run_and_its_row_says_so() -> None:
    async with scripted("node-a") as (edge, (node,)):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, edge, {"model": "m", "input": "a"})
            request = await node.receive_run()
            await node.emit(request.run_id, ("run.started", {}))
            nursery.cancel_scope.cancel()  # the client leaves
        cancel = await node.receive()
        assert isinstance(cancel, wire.RunCancel)
        assert cancel.run_id == request.run_id
        await node.send(
            wire.RunCancelled(
                run_id=request.run_id, seq=1, usage=wire.Usage(prompt_tokens=1, completion_tokens=0)
            )
        )
        await wait_until(lambda: len(edge.rows) == 1)
    (row,) = edge.rows
    assert (row.outcome, row.prompt_tokens) == ("cancelled", 1)


async def test_a_node_answering_too_few_vectors_is_a_502() -> None:
    async with scripted("node-a") as (edge, (node,)), trio.open_nursery() as nursery:

        async def serve() -> None:
            request = await node.receive_run()
            await node.emit(request.run_id, *answered(1))

        nursery.start_soon(serve)
        response = await post(edge, {"model": "m", "input": ["a", "b"]})
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_bad_response"
    assert "1 embeddings for 2 inputs" in response.json()["error"]["message"]


async def test_a_model_whose_provider_cannot_embed_is_a_clear_400() -> None:
    async with scripted("node-a", routes=()) as (edge, _nodes):
        response = await post(edge, {"model": "m", "input": "a"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "no_capable_candidate"
    assert "its 'echo' adapter does not serve 'embeddings'" in error["message"]
    assert edge.rows == []
