"""Chat completions and completions through the edge, on both paths, against the engine's own
answer to the same request: the same text at temperature 0, the same finish reason, the
engine's usage numbers."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from .answers import CANCELS, ENGINE_MODEL, MESSAGES, OVERFLOW, SYSTEM, Answer, chat, completion
from .stack import (
    NORMALIZED,
    TUNNEL,
    Stack,
    busy_slots,
    seconds_until_idle,
    tokens_predicted,
)

PATHS = pytest.mark.parametrize("model", [TUNNEL, NORMALIZED])
STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


def _same(edge: Answer, direct: Answer) -> None:
    assert edge.text == direct.text
    assert edge.finish_reason == direct.finish_reason
    assert edge.usage == direct.usage
    assert edge.tool_calls == direct.tool_calls


@PATHS
@STREAMED
def test_chat_is_the_engines_answer(
    direct: openai.OpenAI, edge: openai.OpenAI, model: str, stream: bool
) -> None:
    expected = chat(direct, ENGINE_MODEL, stream=stream)
    assert expected.text
    assert expected.prompt_tokens
    assert expected.completion_tokens
    _same(chat(edge, model, stream=stream), expected)


@PATHS
@STREAMED
def test_max_tokens_cuts_the_answer_with_length(
    direct: openai.OpenAI, edge: openai.OpenAI, model: str, stream: bool
) -> None:
    expected = chat(direct, ENGINE_MODEL, stream=stream, max_tokens=5)
    assert expected.finish_reason == "length"
    assert expected.completion_tokens == 5
    _same(chat(edge, model, stream=stream, max_tokens=5), expected)


def _a_stop_word(direct: openai.OpenAI) -> tuple[str, Answer]:
    """A word from the middle of the engine's answer, and the answer."""
    full = chat(direct, ENGINE_MODEL, stream=False)
    words = [w.strip(".,;:!?") for w in full.text.split()]
    middle = [w for w in words[len(words) // 3 :] if len(w) >= 4]
    assert middle, f"no stop word in {full.text!r}"
    return middle[0], full


@PATHS
@STREAMED
def test_a_stop_sequence_ends_the_answer_as_the_engine_does(
    direct: openai.OpenAI, edge: openai.OpenAI, model: str, stream: bool
) -> None:
    stop, full = _a_stop_word(direct)
    expected = chat(direct, ENGINE_MODEL, stream=stream, stop=[stop])
    assert expected.finish_reason == "stop"
    assert stop not in expected.text
    assert full.text.startswith(expected.text)
    assert len(expected.text) < len(full.text)
    _same(chat(edge, model, stream=stream, stop=[stop]), expected)


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@PATHS
@STREAMED
def test_tool_definitions_reach_the_engine(
    direct: openai.OpenAI, edge: openai.OpenAI, model: str, stream: bool
) -> None:
    """The tools are in the engine's prompt on both paths (its prompt count is the one with
    them), and the answer -- text or tool calls, whatever this small model makes of them --
    is the engine's."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    without = chat(direct, ENGINE_MODEL, stream=False, messages=messages)
    expected = chat(direct, ENGINE_MODEL, stream=stream, messages=messages, tools=TOOLS)
    assert (expected.prompt_tokens or 0) > (without.prompt_tokens or 0), (
        "the engine's chat template dropped the tool definitions"
    )
    _same(chat(edge, model, stream=stream, messages=messages, tools=TOOLS), expected)


@STREAMED
def test_completions_through_the_tunnel_are_the_engines(
    direct: openai.OpenAI, edge: openai.OpenAI, stream: bool
) -> None:
    expected = completion(direct, ENGINE_MODEL, stream=stream)
    assert expected.text
    assert expected.prompt_tokens
    assert expected.completion_tokens
    assert completion(edge, TUNNEL, stream=stream) == expected
    cut = completion(direct, ENGINE_MODEL, stream=stream, max_tokens=4)
    assert cut.finish_reason == "length"
    assert completion(edge, TUNNEL, stream=stream, max_tokens=4) == cut


def test_completions_refuse_the_normalized_model(edge: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        completion(edge, NORMALIZED, stream=False)
    assert raised.value.code == "no_capable_candidate"


@PATHS
@STREAMED
def test_a_context_overflow_is_relayed_as_a_400(
    direct: openai.OpenAI, edge: openai.OpenAI, model: str, stream: bool
) -> None:
    messages = [{"role": "user", "content": OVERFLOW}]
    with pytest.raises(openai.BadRequestError) as engine_said:
        chat(direct, ENGINE_MODEL, stream=stream, messages=messages)
    assert engine_said.value.status_code == 400
    with pytest.raises(openai.APIStatusError) as edge_said:
        chat(edge, model, stream=stream, messages=messages)
    assert edge_said.value.status_code == 400, edge_said.value.response.text
    assert "context" in str(edge_said.value.message).lower()


LONG = 1500
"""The disconnected generation's max_tokens: at ~100 tokens/s, 15 s of work left."""


@PATHS
def test_a_client_leaving_mid_stream_stops_the_generation(
    idle_engine: Stack, edge: openai.OpenAI, model: str
) -> None:
    stack = idle_engine
    body = {
        "model": model,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": LONG,
        "stream": True,
        "ignore_eos": True,
    }
    before = tokens_predicted(stack)
    chunks = 0
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{stack.edge_url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks += 1
            if chunks >= 5:
                assert busy_slots(stack), "the engine is not generating"
                # Leaving the loop closes iter_lines' generator, which closes the
                # response's connection: from here the client is gone.
                break
    idle_after = seconds_until_idle(stack, time.monotonic())
    decoded = tokens_predicted(stack) - before
    assert decoded < LONG, f"the engine decoded all {decoded} tokens"
    CANCELS[f"chat, {model}"] = (idle_after, decoded, LONG)
