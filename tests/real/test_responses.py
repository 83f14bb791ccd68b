"""``/v1/responses`` through the edge on the normalized path (tunnel candidates cannot serve
it: no provider speaks it natively), against the engine's chat answer to the same messages:
the same text, the status its finish reason means, the engine's usage."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from .answers import (
    CANCELS,
    COUNTING,
    COUNTING_MESSAGES,
    COUNTING_SYSTEM,
    ENGINE_MODEL,
    OVERFLOW,
    QUESTION,
    SYSTEM,
    Answer,
    chat,
)
from .stack import NORMALIZED, TUNNEL, Stack, busy_slots, seconds_until_idle, tokens_predicted

STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


@pytest.fixture(scope="module", autouse=True)
def responses_route(edge: openai.OpenAI) -> None:
    """Skip the module when the edge has no ``/v1/responses`` (a 404 for the route)."""
    try:
        edge.responses.create(model=NORMALIZED, input="Hi", max_output_tokens=1)
    except openai.NotFoundError as exc:
        pytest.skip(f"the edge answers POST /v1/responses 404: {exc.message}")


def _respond(sdk: openai.OpenAI, *, stream: bool, **knobs: Any) -> tuple[str, Any]:
    """The response's text and the response object (from ``response.completed`` /
    ``response.incomplete`` when streamed)."""
    request: dict[str, Any] = {
        "model": NORMALIZED,
        "instructions": SYSTEM,
        "input": QUESTION,
        "temperature": 0,
        "max_output_tokens": 48,
        **knobs,
    }
    if not stream:
        response = sdk.responses.create(**request)
        return response.output_text, response
    deltas: list[str] = []
    final: Any = None
    kinds: list[str] = []
    with sdk.responses.create(**request, stream=True) as events:
        for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
            elif event.type in ("response.failed", "error"):
                raise AssertionError(f"the stream failed: {event}")
    assert final is not None, f"no final event in {kinds}"
    assert kinds[0] == "response.created"
    assert "".join(deltas) == final.output_text
    return "".join(deltas), final


def _status(expected: Answer) -> tuple[str, str | None]:
    if expected.finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def _check(text: str, response: Any, expected: Answer) -> None:
    assert text == expected.text
    status, reason = _status(expected)
    assert response.status == status
    details = response.incomplete_details
    assert (details.reason if details else None) == reason
    assert response.model == NORMALIZED
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == expected.usage


@STREAMED
def test_a_response_is_the_engines_answer(
    direct: openai.OpenAI, edge: openai.OpenAI, stream: bool
) -> None:
    expected = chat(direct, ENGINE_MODEL, stream=False)
    text, response = _respond(edge, stream=stream)
    _check(text, response, expected)


@STREAMED
def test_max_output_tokens_cuts_the_response(
    direct: openai.OpenAI, edge: openai.OpenAI, stream: bool
) -> None:
    expected = chat(direct, ENGINE_MODEL, stream=False, max_tokens=5)
    assert expected.finish_reason == "length"
    text, response = _respond(edge, stream=stream, max_output_tokens=5)
    _check(text, response, expected)


@STREAMED
def test_a_context_overflow_is_a_400(edge: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        _respond(edge, stream=stream, input=OVERFLOW)
    assert raised.value.status_code == 400, raised.value.response.text


def test_the_tunnel_model_is_refused_before_any_attempt(edge: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        edge.responses.create(model=TUNNEL, input="Hi", max_output_tokens=4)
    assert raised.value.code == "no_capable_candidate"


def test_a_client_leaving_mid_stream_stops_the_generation(
    idle_engine: Stack, direct: openai.OpenAI, edge: openai.OpenAI
) -> None:
    stack = idle_engine
    full = chat(direct, ENGINE_MODEL, stream=False, messages=COUNTING_MESSAGES, max_tokens=400)
    assert (full.completion_tokens or 0) >= 100, f"a short answer: {full}"
    before = tokens_predicted(stack)
    deltas = 0
    with edge.responses.create(
        model=NORMALIZED,
        instructions=COUNTING_SYSTEM,
        input=COUNTING,
        temperature=0,
        max_output_tokens=400,
        stream=True,
    ) as events:
        for event in events:
            if event.type == "response.output_text.delta":
                deltas += 1
                if deltas >= 5:
                    break
        assert busy_slots(stack), "the engine is not generating"
    idle_after = seconds_until_idle(stack, time.monotonic())
    decoded = tokens_predicted(stack) - before
    assert decoded < (full.completion_tokens or 0) / 2, f"the engine decoded {decoded} tokens"
    CANCELS[f"responses, {NORMALIZED}"] = (idle_after, decoded, full.completion_tokens or 0)
