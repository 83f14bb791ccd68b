"""Cached and reasoning tokens as each dialect reports them, read by the adapters into the
run's ``wire.Usage`` (issue #25): OpenAI's and vLLM's ``prompt_tokens_details.cached_tokens``
and ``completion_tokens_details.reasoning_tokens``, llama.cpp's ``timings.cache_n`` (and its
recent builds' usage field, preferred), Ollama's nothing (0); the runner keeps each part
within its total."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from dispatcher import wire
from nodes.adapters.openai import StreamUsage
from nodes.runner import clamped_usage
from tests.nodes.fake_providers import FakeOllama, FakeOpenAI, serve_fake_ollama, serve_fake_openai
from tests.nodes.test_adapters_ollama import adapter_for as ollama_adapter_for
from tests.nodes.test_adapters_ollama import run as ollama_run
from tests.nodes.test_adapters_openai import adapter_for, run, usage_of


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeOpenAI:
    started: FakeOpenAI = await nursery.start(serve_fake_openai)
    return started


# ------------------------------------------------------------------ the parsing, sans-IO


class _Out:
    """A RunOutput's ``usage`` only: what :meth:`StreamUsage.report` calls."""

    def __init__(self) -> None:
        self.reported: list[tuple[int, int, dict[str, Any]]] = []

    def usage(self, prompt_tokens: int, completion_tokens: int, **parts: Any) -> None:
        self.reported.append((prompt_tokens, completion_tokens, parts))


def _seen(*chunks: dict[str, Any]) -> StreamUsage:
    usage = StreamUsage()
    for chunk in chunks:
        usage.take(chunk)
    return usage


def test_openai_and_vllm_details() -> None:
    usage = _seen(
        {
            "usage": {
                "prompt_tokens": 1200,
                "completion_tokens": 300,
                "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 256, "audio_tokens": 0},
            }
        }
    )
    out = _Out()
    usage.report(out)  # type: ignore[arg-type]
    assert out.reported == [(1200, 300, {"cached_tokens": 1024, "reasoning_tokens": 256})]


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 10, "completion_tokens": 2},
        {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": None},
        {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {}},
        {"prompt_tokens": 10, "completion_tokens": 2, "completion_tokens_details": None},
        {
            "prompt_tokens": 10,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": -1},
            "completion_tokens_details": {"reasoning_tokens": "many"},
        },
    ],
    ids=["absent", "null", "empty", "null-completion", "nonsense"],
)
def test_no_details_are_zero(usage: dict[str, Any]) -> None:
    seen = _seen({"usage": usage})
    assert (seen.prompt_tokens, seen.completion_tokens) == (10, 2)
    assert (seen.cached_tokens, seen.reasoning_tokens) == (0, 0)


def test_llama_cpp_timings_alone() -> None:
    """An older llama.cpp: its usage has no details, its last chunk's ``timings`` say what
    its cache reused, in the same chunk or in another, before or after the usage."""
    usage = {"prompt_tokens": 50, "completion_tokens": 4}
    timings = {"cache_n": 32, "prompt_n": 18, "predicted_n": 4}
    assert _seen({"usage": usage, "timings": timings}).cached_tokens == 32
    assert _seen({"timings": timings}, {"usage": usage}).cached_tokens == 32
    assert _seen({"usage": usage}, {"timings": timings}).cached_tokens == 32


def test_the_usage_field_wins_over_timings() -> None:
    """A recent llama.cpp reports both: the usage's own field is the one read."""
    usage = {
        "prompt_tokens": 50,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 30},
    }
    assert _seen({"usage": usage, "timings": {"cache_n": 32}}).cached_tokens == 30
    zero = {**usage, "prompt_tokens_details": {"cached_tokens": 0}}
    assert _seen({"timings": {"cache_n": 32}}, {"usage": zero}).cached_tokens == 0


def test_nothing_is_reported_before_a_usage() -> None:
    usage = StreamUsage()
    assert usage.take({"timings": {"cache_n": 3}})
    assert not usage.take({"choices": [], "usage": None, "timings": {"cache_n": "x"}})
    assert not usage.take({"usage": {"prompt_tokens": -1, "completion_tokens": 2}})
    out = _Out()
    usage.report(out)  # type: ignore[arg-type]
    assert out.reported == []


def test_the_runner_keeps_each_part_within_its_total() -> None:
    assert clamped_usage(10, 5, cached_tokens=99, cache_write_tokens=4, reasoning_tokens=9) == (
        wire.Usage(
            prompt_tokens=10,
            completion_tokens=5,
            cached_tokens=10,
            cache_write_tokens=0,
            reasoning_tokens=5,
        )
    )
    assert clamped_usage(10, 5, cached_tokens=6, cache_write_tokens=7) == wire.Usage(
        prompt_tokens=10, completion_tokens=5, cached_tokens=6, cache_write_tokens=4
    )
    assert clamped_usage(10, 5, cached_tokens=-3, reasoning_tokens=-1) == wire.Usage(
        prompt_tokens=10, completion_tokens=5
    )
    assert clamped_usage(-1, 5, cached_tokens=3).cached_tokens == 0


# ------------------------------------------------------------------ through the runner


async def test_openai_details_reach_the_runs_usage(fake: FakeOpenAI) -> None:
    fake.prompt_tokens, fake.cached_tokens, fake.reasoning_tokens = 1200, 1024, 3
    rec = await run(adapter_for(fake.base_url))
    assert usage_of(rec) == wire.Usage(
        prompt_tokens=1200, completion_tokens=5, cached_tokens=1024, reasoning_tokens=3
    )


async def test_llama_cpp_timings_reach_the_runs_usage(fake: FakeOpenAI) -> None:
    fake.prompt_tokens, fake.timings_cache_n = 50, 32
    rec = await run(adapter_for(fake.base_url))
    assert usage_of(rec) == wire.Usage(prompt_tokens=50, completion_tokens=5, cached_tokens=32)


async def test_llama_cpp_both_the_usage_field_wins(fake: FakeOpenAI) -> None:
    fake.prompt_tokens, fake.timings_cache_n, fake.cached_tokens = 50, 32, 30
    rec = await run(adapter_for(fake.base_url))
    assert usage_of(rec).cached_tokens == 30


async def test_a_cached_count_beyond_the_prompt_is_clamped(fake: FakeOpenAI) -> None:
    fake.prompt_tokens, fake.cached_tokens, fake.reasoning_tokens = 8, 20, 50
    rec = await run(adapter_for(fake.base_url))
    assert usage_of(rec) == wire.Usage(
        prompt_tokens=8, completion_tokens=5, cached_tokens=8, reasoning_tokens=5
    )


async def test_ollama_reports_no_cache(nursery: trio.Nursery) -> None:
    fake: FakeOllama = await nursery.start(serve_fake_ollama)
    fake.include_counts = True
    rec = await ollama_run(ollama_adapter_for(fake.base_url))
    usages = [e.usage for e in rec.events("r1") if isinstance(e, wire.RunUsage)]
    assert len(usages) == 1
    assert usages[0].prompt_tokens == fake.prompt_tokens
    assert (usages[0].cached_tokens, usages[0].cache_write_tokens) == (0, 0)
    assert usages[0].reasoning_tokens == 0
