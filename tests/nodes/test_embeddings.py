"""Embeddings on the node: echo's deterministic vectors, the runner's ``run.embeddings`` (split
to fit a frame, one vector per input, a route the adapter does not serve refused), the hello
announcing ``embeddings`` for the adapters that embed, and the ``openai`` and ``ollama``
adapters against fake providers on loopback (written from the OpenAI and Ollama API
references: ``POST /v1/embeddings``, ``POST /api/embed``)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import pytest
import trio

from dispatcher import wire
from nodes.adapters import ADAPTERS, EMBEDDING_ROUTES, Adapter, EchoAdapter
from nodes.adapters.base import RunOutput, estimate_tokens
from nodes.adapters.cli import CLIAdapter, CLIOptions
from nodes.adapters.echo import ECHO_DIMENSIONS, EchoOptions, echo_embedding
from nodes.adapters.ollama import OllamaAdapter
from nodes.adapters.openai import OpenAIAdapter
from nodes.config import ModelConfig, NodeConfig, ProviderConfig, hello_from_config
from nodes.runner import embeddings_frames, open_runner
from tests.nodes._helpers import Recorder, assert_no_address, assert_well_formed
from tests.nodes.fake_providers import (
    FakeOllama,
    FakeOpenAI,
    fake_vector,
    serve_fake_ollama,
    serve_fake_openai,
)


def embed_request(
    value: Any = "hello world", run_id: str = "r1", *, provider_id: str = "p", **body: Any
) -> wire.RunRequest:
    return wire.RunRequest(
        run_id=run_id,
        provider_id=provider_id,
        model="m",
        served_model="served-m",
        body={"model": "served-m", "input": value, **body},
        route="embeddings",
    )


async def run(adapter: Adapter, request: wire.RunRequest) -> Recorder:
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={request.provider_id: adapter}) as runner:
            runner.start(request)
            await rec.wait_terminal(request.run_id)
    assert_well_formed(rec.events(request.run_id))
    return rec


def vectors_of(rec: Recorder, run_id: str = "r1") -> list[list[float]]:
    """The run's vectors, checking that its run.embeddings continue one another."""
    vectors: list[list[float]] = []
    for event in rec.events(run_id):
        if isinstance(event, wire.RunEmbeddings):
            assert event.index == len(vectors)
            vectors.extend(wire.decode_vector(v) for v in event.vectors)
    return vectors


def usage_of(rec: Recorder, run_id: str = "r1") -> wire.Usage:
    (usage,) = [e.usage for e in rec.events(run_id) if isinstance(e, wire.RunUsage)]
    assert isinstance(usage, wire.Usage)
    return usage


def completed(rec: Recorder, run_id: str = "r1") -> bool:
    return isinstance(rec.terminal(run_id), wire.RunCompleted)


def failed(rec: Recorder, run_id: str = "r1") -> wire.RunFailed:
    terminal = rec.terminal(run_id)
    assert isinstance(terminal, wire.RunFailed), terminal
    return terminal


# --------------------------------------------------------------------------- echo


def test_echo_embedding_is_a_deterministic_unit_vector() -> None:
    vector = echo_embedding("hi")
    assert len(vector) == ECHO_DIMENSIONS == 256
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-12)
    assert echo_embedding("hi") == vector
    assert echo_embedding("hi!") != vector
    assert len(echo_embedding("hi", 3)) == 3
    # The recipe the echo module documents, written again here, and one value pinned.
    assert echo_embedding("hi", 20) == pytest.approx(documented_embedding("hi", 20), abs=1e-15)
    assert echo_embedding("hi", 4)[0] == pytest.approx(-0.8051957801351955, abs=1e-12)


def documented_embedding(text: str, dimensions: int) -> list[float]:
    seed = hashlib.sha256(text.encode()).digest()
    values = []
    for i in range(dimensions):
        digest = hashlib.sha256(seed + (i // 8).to_bytes(4, "big")).digest()
        u = int.from_bytes(digest[(i % 8) * 4 : (i % 8) * 4 + 4], "big")
        values.append(u / 2**31 - 1)
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


async def test_echo_embeds_each_input_through_the_runner() -> None:
    rec = await run(EchoAdapter(), embed_request(["hi there", "hi", [1, 2, 3]]))
    assert completed(rec)
    vectors = vectors_of(rec)
    assert len(vectors) == 3
    expected = [echo_embedding("hi there"), echo_embedding("hi"), echo_embedding("1 2 3")]
    for got, want in zip(vectors, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)  # float32 on the wire
        assert math.isclose(math.fsum(v * v for v in got), 1.0, rel_tol=1e-5)
    assert usage_of(rec) == wire.Usage(prompt_tokens=2 + 1 + 3, completion_tokens=0)


async def test_echo_takes_dimensions_and_refuses_what_it_cannot() -> None:
    rec = await run(EchoAdapter(), embed_request("hi", dimensions=16))
    assert [len(v) for v in vectors_of(rec)] == [16]
    rec = await run(EchoAdapter(), embed_request("hi", dimensions=100_000))
    assert (failed(rec).code, failed(rec).status) == ("invalid_value", 400)


async def test_echo_fault_knobs_apply_to_embeddings() -> None:
    rec = await run(EchoAdapter(EchoOptions(fail_before_first_token=True)), embed_request())
    assert (failed(rec).code, failed(rec).retryable) == ("echo_fault", True)
    rec = await run(EchoAdapter(), embed_request(echo={"fail_before_first_token": True}))
    assert failed(rec).code == "echo_fault"


async def test_a_stalled_embedding_is_cancelled() -> None:
    rec = Recorder()
    request = embed_request(echo={"stall_after_tokens": 0})
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"p": EchoAdapter()}) as runner:
            runner.start(request)
            await rec.wait_for(lambda: bool(rec.events("r1")))
            runner.cancel("r1", "client gone")
            terminal = await rec.wait_terminal("r1")
    assert isinstance(terminal, wire.RunCancelled)
    assert_well_formed(rec.events("r1"))


# --------------------------------------------------------------------------- the runner


def test_frames_split_a_batch_under_the_frame_limit() -> None:
    vector = wire.encode_vector([0.25] * 3072)  # 16,384 characters
    vectors = [vector] * 300
    frames = embeddings_frames(vectors)
    assert len(frames) > 1
    assert [first for first, _, _ in frames] == [
        sum(len(batch) for _, batch, _ in frames[:n]) for n in range(len(frames))
    ]
    assert [vector for _, batch, _ in frames for vector in batch] == vectors
    for first, batch, size in frames:
        assert size == sum(map(len, batch)) <= wire.MAX_EMBEDDINGS_CHARS
        event = wire.RunEmbeddings(run_id="r" * 64, seq=10**6, index=first, vectors=batch)
        assert len(wire.encode(event)) < wire.MAX_FRAME_SIZE


async def test_a_large_batch_arrives_whole_over_several_events() -> None:
    request = embed_request(["word"] * 2048, dimensions=1024)
    rec = await run(EchoAdapter(), request)
    events = [e for e in rec.events("r1") if isinstance(e, wire.RunEmbeddings)]
    assert len(events) > 1
    for event in events:
        assert len(wire.encode(event)) < wire.MAX_FRAME_SIZE
    assert len(vectors_of(rec)) == 2048


class _Answers:
    """An adapter that embeds with whatever vectors it is given."""

    def __init__(self, *batches: Sequence[str]) -> None:
        self.batches = batches

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        raise AssertionError("not a chat run")

    async def embed(self, request: wire.RunRequest, out: RunOutput) -> None:
        for batch in self.batches:
            await out.embeddings(batch)


async def test_one_vector_per_input_or_the_run_fails() -> None:
    one = wire.encode_vector([1.0])
    rec = await run(_Answers([one], [one]), embed_request(["a", "b"]))
    assert completed(rec)
    assert usage_of(rec).estimated  # the adapter reported none: the runner estimated
    rec = await run(_Answers([one]), embed_request(["a", "b"]))
    assert (failed(rec).code, failed(rec).retryable) == ("upstream_bad_response", True)
    assert failed(rec).message == "the upstream answered 1 embeddings for 2 inputs"
    rec = await run(_Answers([one, one, one]), embed_request(["a", "b"]))
    assert failed(rec).code == "upstream_bad_response"
    assert not vectors_of(rec)  # nothing of a batch over the count was sent


async def test_a_vector_over_a_frame_fails_clearly() -> None:
    huge = wire.encode_vector([0.0] * 200_000)
    rec = await run(_Answers([huge]), embed_request("a"))
    assert failed(rec).code == "embedding_too_large"
    assert "200000 dimensions" in failed(rec).message


async def test_a_route_the_adapter_does_not_serve_is_refused() -> None:
    cli = CLIAdapter(command=("true",), options=CLIOptions())
    rec = await run(cli, embed_request())
    assert (failed(rec).code, failed(rec).retryable) == ("unsupported_route", True)
    images = wire.RunRequest(
        run_id="r1", provider_id="p", model="m", served_model="m", body={}, route="images"
    )
    rec = await run(EchoAdapter(), images)
    assert failed(rec).code == "unsupported_route"


def test_the_hello_announces_embeddings_for_the_adapters_that_embed() -> None:
    model = (ModelConfig(name="m", served_name="m"),)
    config = NodeConfig(
        node_id="n",
        providers=(
            ProviderConfig(id="e", type="echo", models=model),
            ProviderConfig(id="o", type="openai", base_url="http://x", models=model),
            ProviderConfig(id="l", type="ollama", models=model),
            ProviderConfig(id="c", type="cli", command=("true",), models=model),
            ProviderConfig(id="t", type="openai", path="tunnel", base_url="http://x", models=model),
        ),
    )
    hello = hello_from_config(config, ADAPTERS)
    routes = {provider.id: provider.served_routes for provider in hello.providers}
    assert routes == {
        "e": EMBEDDING_ROUTES,
        "o": EMBEDDING_ROUTES,
        "l": EMBEDDING_ROUTES,
        "c": wire.NORMALIZED_ROUTES,
        "t": wire.DEFAULT_TUNNEL_ROUTES,
    }
    assert "embeddings" in EMBEDDING_ROUTES
    assert [p.routes for p in hello_from_config(config).providers] == [()] * 5


# --------------------------------------------------------------------------- openai


def openai_adapter(base_url: str, api_key: str | None = None) -> OpenAIAdapter:
    provider = ProviderConfig(
        id="p",
        type="openai",
        base_url=base_url,
        api_key_env="FAKE_KEY" if api_key is not None else None,
        models=(ModelConfig(name="m", served_name="served-m"),),
    )
    return OpenAIAdapter.from_provider(
        provider, environ={} if api_key is None else {"FAKE_KEY": api_key}
    )


@pytest.fixture
async def fake_openai(nursery: trio.Nursery) -> FakeOpenAI:
    started: FakeOpenAI = await nursery.start(serve_fake_openai)
    return started


@pytest.mark.parametrize("encoding", ["float", "base64"])
@pytest.mark.parametrize("suffix", ["", "/v1"])
async def test_openai_embeds(fake_openai: FakeOpenAI, encoding: str, suffix: str) -> None:
    fake_openai.api_key = "sk-embed"
    fake_openai.prompt_tokens = 11
    adapter = openai_adapter(fake_openai.base_url + suffix, api_key="sk-embed")
    request = embed_request(
        ["one", "three"], encoding_format=encoding, dimensions=4, user="u", stream=False
    )
    rec = await run(adapter, request)
    assert vectors_of(rec) == [fake_vector("one", 4), fake_vector("three", 4)]
    assert usage_of(rec) == wire.Usage(prompt_tokens=11, completion_tokens=0)
    (seen,) = fake_openai.requests
    assert (seen.method, seen.path) == ("POST", "/v1/embeddings")
    assert seen.authorization == "Bearer sk-embed"
    assert seen.json == {
        "model": "served-m",
        "input": ["one", "three"],
        "encoding_format": encoding,
        "dimensions": 4,
        "user": "u",
    }


async def test_openai_data_is_put_in_index_order(fake_openai: FakeOpenAI) -> None:
    fake_openai.reverse_data = True
    rec = await run(openai_adapter(fake_openai.base_url), embed_request(["a", "bb", "ccc"]))
    assert vectors_of(rec) == [fake_vector(t, 8) for t in ("a", "bb", "ccc")]


async def test_openai_token_id_inputs_pass_through(fake_openai: FakeOpenAI) -> None:
    rec = await run(openai_adapter(fake_openai.base_url), embed_request([[1, 2], [3]]))
    assert vectors_of(rec) == [fake_vector([1, 2], 8), fake_vector([3], 8)]
    assert fake_openai.requests[0].json["input"] == [[1, 2], [3]]


async def test_openai_client_errors_carry_the_upstream_status(fake_openai: FakeOpenAI) -> None:
    fake_openai.status = 400
    fake_openai.error_message = "dimensions is not supported by this model"
    fake_openai.error_code = "invalid_value"
    rec = await run(openai_adapter(fake_openai.base_url), embed_request(dimensions=3))
    failure = failed(rec)
    assert (failure.code, failure.status, failure.retryable) == ("invalid_value", 400, False)
    assert failure.message == "dimensions is not supported by this model"


async def test_openai_server_errors_are_retryable_and_name_no_address(
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.status = 503
    fake_openai.error_message = f"down at {fake_openai.base_url}"
    rec = await run(openai_adapter(fake_openai.base_url), embed_request())
    failure = failed(rec)
    assert (failure.code, failure.retryable) == ("upstream_5xx", True)
    assert_no_address(failure.message, fake_openai.base_url)


# --------------------------------------------------------------------------- ollama


@pytest.fixture
async def fake_ollama(nursery: trio.Nursery) -> FakeOllama:
    started: FakeOllama = await nursery.start(serve_fake_ollama)
    return started


def ollama_adapter(base_url: str, **options: Any) -> OllamaAdapter:
    provider = ProviderConfig(
        id="p",
        type="ollama",
        base_url=base_url,
        options=options,
        models=(ModelConfig(name="m", served_name="served-m"),),
    )
    return OllamaAdapter.from_provider(provider)


async def test_ollama_embeds(fake_ollama: FakeOllama) -> None:
    fake_ollama.prompt_tokens = 5
    adapter = ollama_adapter(fake_ollama.base_url, keep_alive="5m", model_options={"num_ctx": 512})
    rec = await run(adapter, embed_request(["one", "three"], dimensions=4))
    assert vectors_of(rec) == [fake_vector("one", 4), fake_vector("three", 4)]
    assert usage_of(rec) == wire.Usage(prompt_tokens=5, completion_tokens=0)
    (seen,) = fake_ollama.requests
    assert (seen.method, seen.path) == ("POST", "/api/embed")
    assert seen.json == {
        "model": "served-m",
        "input": ["one", "three"],
        "dimensions": 4,
        "options": {"num_ctx": 512},
        "keep_alive": "5m",
    }


async def test_ollama_without_counts_the_runner_estimates(fake_ollama: FakeOllama) -> None:
    fake_ollama.include_counts = False
    rec = await run(ollama_adapter(fake_ollama.base_url), embed_request("one two three"))
    assert len(vectors_of(rec)) == 1
    usage = usage_of(rec)
    assert usage.estimated
    assert usage.prompt_tokens == estimate_tokens("one two three") >= 3


async def test_ollama_refuses_token_ids(fake_ollama: FakeOllama) -> None:
    rec = await run(ollama_adapter(fake_ollama.base_url), embed_request([1, 2, 3]))
    failure = failed(rec)
    assert (failure.code, failure.status) == ("invalid_request", 400)
    assert not fake_ollama.requests


async def test_ollama_not_found_is_retryable(fake_ollama: FakeOllama) -> None:
    fake_ollama.status = 404
    fake_ollama.error_message = 'model "served-m" not found, try pulling it first'
    rec = await run(ollama_adapter(fake_ollama.base_url), embed_request())
    assert (failed(rec).code, failed(rec).retryable) == ("upstream_not_found", True)


def test_an_anthropic_tunnel_declaring_no_routes_serves_messages() -> None:
    """Anthropic's API speaks Messages, not OpenAI's routes: a tunnel to it that declares no
    ``routes`` serves ``messages``; one that declares routes serves those."""
    model = (ModelConfig(name="m", served_name="m"),)
    config = NodeConfig(
        node_id="n",
        providers=(
            ProviderConfig(id="a", type="anthropic", path="tunnel", models=model),
            ProviderConfig(
                id="b", type="anthropic", path="tunnel", routes=("messages", "chat"), models=model
            ),
            ProviderConfig(id="n", type="anthropic", models=model),
        ),
    )
    routes = {p.id: p.served_routes for p in hello_from_config(config, ADAPTERS).providers}
    assert routes == {"a": ("messages",), "b": ("messages", "chat"), "n": wire.NORMALIZED_ROUTES}
