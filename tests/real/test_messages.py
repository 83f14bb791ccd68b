"""``/v1/messages`` (Anthropic) through the edge on the normalized path, with the official
``anthropic`` SDK, against the engine's chat answer to the same messages: the same text, the
stop reason its finish reason means, the engine's usage."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
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


@pytest.fixture(scope="module")
def claude(stack: Stack) -> Iterator[anthropic.Anthropic]:
    """The ``anthropic`` SDK on the edge; the module is skipped when the edge answers
    ``/v1/messages`` 404."""
    with anthropic.Anthropic(
        base_url=stack.edge_url, api_key="sk-real", max_retries=0, timeout=300
    ) as sdk:
        try:
            sdk.messages.create(
                model=NORMALIZED, max_tokens=1, messages=[{"role": "user", "content": "Hi"}]
            )
        except anthropic.NotFoundError as exc:
            pytest.skip(f"the edge answers POST /v1/messages 404: {exc.message}")
        yield sdk


def _message(sdk: anthropic.Anthropic, *, stream: bool, **knobs: Any) -> tuple[str, Any]:
    request: dict[str, Any] = {
        "model": NORMALIZED,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 48,
        # The Messages API takes a temperature; this SDK's create() no longer has it as an
        # argument, so it goes as an extra field, which is how its users send it.
        "extra_body": {"temperature": 0},
        **knobs,
    }
    if not stream:
        message = sdk.messages.create(**request)
        text = "".join(block.text for block in message.content if block.type == "text")
        return text, message
    with sdk.messages.stream(**request) as events:
        streamed = "".join(events.text_stream)
        final = events.get_final_message()
    return streamed, final


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def _check(text: str, message: Any, expected: Answer) -> None:
    assert text == expected.text
    assert message.stop_reason == STOP_REASONS[expected.finish_reason or ""]
    assert message.model == NORMALIZED
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        expected.prompt_tokens,
        expected.completion_tokens,
    )


@STREAMED
def test_a_message_is_the_engines_answer(
    direct: openai.OpenAI, claude: anthropic.Anthropic, stream: bool
) -> None:
    expected = chat(direct, ENGINE_MODEL, stream=False)
    text, message = _message(claude, stream=stream)
    _check(text, message, expected)


@STREAMED
def test_max_tokens_cuts_the_message(
    direct: openai.OpenAI, claude: anthropic.Anthropic, stream: bool
) -> None:
    expected = chat(direct, ENGINE_MODEL, stream=False, max_tokens=5)
    assert expected.finish_reason == "length"
    text, message = _message(claude, stream=stream, max_tokens=5)
    _check(text, message, expected)


@STREAMED
def test_a_stop_sequence_ends_the_text_as_the_engine_does(
    direct: openai.OpenAI, claude: anthropic.Anthropic, stream: bool
) -> None:
    full = chat(direct, ENGINE_MODEL, stream=False)
    words = [w.strip(".,;:!?") for w in full.text.split()]
    stop = next(w for w in words[len(words) // 3 :] if len(w) >= 4)
    expected = chat(direct, ENGINE_MODEL, stream=False, stop=[stop])
    assert expected.finish_reason == "stop"
    text, message = _message(claude, stream=stream, stop_sequences=[stop])
    # docs/messages.md: a normalized run does not say that a stop sequence ended it, so the
    # stop reason is end_turn and stop_sequence null.
    _check(text, message, expected)
    assert message.stop_sequence is None


@STREAMED
def test_a_context_overflow_is_a_400(claude: anthropic.Anthropic, stream: bool) -> None:
    with pytest.raises(anthropic.APIStatusError) as raised:
        _message(claude, stream=stream, messages=[{"role": "user", "content": OVERFLOW}])
    assert raised.value.status_code == 400, raised.value.response.text
    assert isinstance(raised.value, anthropic.BadRequestError)


def test_the_tunnel_model_is_refused_before_any_attempt(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=TUNNEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )


def test_a_client_leaving_mid_stream_stops_the_generation(
    idle_engine: Stack, direct: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    stack = idle_engine
    full = chat(direct, ENGINE_MODEL, stream=False, messages=COUNTING_MESSAGES, max_tokens=400)
    assert (full.completion_tokens or 0) >= 100, f"a short answer: {full}"
    before = tokens_predicted(stack)
    pieces = 0
    with claude.messages.stream(
        model=NORMALIZED,
        system=COUNTING_SYSTEM,
        messages=[{"role": "user", "content": COUNTING}],
        max_tokens=400,
        extra_body={"temperature": 0},
    ) as events:
        for _ in events.text_stream:
            pieces += 1
            if pieces >= 5:
                break
        assert busy_slots(stack), "the engine is not generating"
    idle_after = seconds_until_idle(stack, time.monotonic())
    decoded = tokens_predicted(stack) - before
    assert decoded < (full.completion_tokens or 0) / 2, f"the engine decoded {decoded} tokens"
    CANCELS[f"messages, {NORMALIZED}"] = (idle_after, decoded, full.completion_tokens or 0)
