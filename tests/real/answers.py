"""What the tests compare: an answer reduced to its text (or tool calls), finish reason and
usage, however it came (streamed or not, chat or completions), through the official ``openai``
SDK as a user would call it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import openai

from .stack import CONTEXT

SYSTEM = "You are a helpful assistant. Answer in one short paragraph."
QUESTION = "What is the capital of France, and what is it famous for?"
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": QUESTION},
]
OVERFLOW = " ".join(["elephant"] * (CONTEXT * 2))
"""A user message of more tokens than the engine's context."""
COUNTING_SYSTEM = "You are a helpful assistant."
COUNTING = "Count from 1 to 300, one number per line."
"""A request this model answers at length (~190 tokens) on its own, without ``ignore_eos``
(which the Responses and Messages front ends rightly refuse): the disconnect tests of those
routes leave after a few tokens."""
COUNTING_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": COUNTING_SYSTEM},
    {"role": "user", "content": COUNTING},
]
PROMPT = "The three primary colors are"
"""The completions route's prompt."""

ENGINE_MODEL = "smollm2"
"""What the direct calls name (llama-server serves its one model under any name)."""


@attrs.frozen
class Answer:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    tool_calls: tuple[tuple[str, str], ...] = ()
    """(name, arguments) per call."""

    @property
    def usage(self) -> tuple[int | None, int | None, int | None]:
        return self.prompt_tokens, self.completion_tokens, self.total_tokens

    @classmethod
    def of(
        cls,
        text: str,
        finish_reason: str | None,
        usage: Any,
        tool_calls: tuple[tuple[str, str], ...] = (),
    ) -> Answer:
        """From the SDK's ``usage`` object (None: the engine reported none)."""
        if usage is None:
            return cls(text, finish_reason, None, None, None, tool_calls)
        counts = usage.prompt_tokens, usage.completion_tokens, usage.total_tokens
        return cls(text, finish_reason, *counts, tool_calls)


@contextmanager
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """An SDK client with no retries (a retry would hide a failure) and a generous timeout."""
    with openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="sk-real", max_retries=0, timeout=300
    ) as sdk:
        yield sdk


def chat(sdk: openai.OpenAI, model: str, *, stream: bool, **knobs: Any) -> Answer:
    """A chat completion at temperature 0 (``knobs`` override the request's fields)."""
    request: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 48,
        **knobs,
    }
    if not stream:
        completion = sdk.chat.completions.create(**request)
        choice = completion.choices[0]
        usage = completion.usage
        calls = tuple(
            (call.function.name, call.function.arguments)
            for call in choice.message.tool_calls or ()
            if call.type == "function"
        )
        return Answer.of(
            choice.message.content or "",
            choice.finish_reason,
            usage,
            calls,
        )
    pieces: list[str] = []
    finish: str | None = None
    usage_seen: Any = None
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    with sdk.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    ) as chunks:
        for chunk in chunks:
            if chunk.usage is not None:
                usage_seen = chunk.usage
            for streamed in chunk.choices:
                if streamed.delta.content:
                    pieces.append(streamed.delta.content)
                for call in streamed.delta.tool_calls or ():
                    if call.function and call.function.name:
                        names[call.index] = call.function.name
                    if call.function and call.function.arguments:
                        arguments.setdefault(call.index, []).append(call.function.arguments)
                if streamed.finish_reason:
                    finish = streamed.finish_reason
    calls = tuple(
        (names.get(index, ""), "".join(arguments.get(index, [])))
        for index in sorted(set(names) | set(arguments))
    )
    return Answer.of(
        "".join(pieces),
        finish,
        usage_seen,
        calls,
    )


def completion(sdk: openai.OpenAI, model: str, *, stream: bool, **knobs: Any) -> Answer:
    """A (legacy) completion at temperature 0."""
    request: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 32,
        **knobs,
    }
    if not stream:
        answer = sdk.completions.create(**request)
        usage = answer.usage
        return Answer.of(
            answer.choices[0].text,
            answer.choices[0].finish_reason,
            usage,
        )
    pieces: list[str] = []
    finish: str | None = None
    usage_seen: Any = None
    with sdk.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    ) as chunks:
        for chunk in chunks:
            if chunk.usage is not None:
                usage_seen = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.text)
                if choice.finish_reason:
                    finish = choice.finish_reason
    return Answer.of(
        "".join(pieces),
        finish,
        usage_seen,
    )


NUMBERS: dict[str, dict[str, list[float]]] = {}
"""What the measuring test recorded: route label -> measure -> samples (the conftest prints
them as a table at the end of the run)."""


REPORT: list[str] = []
"""Lines a measuring test leaves for the end of the run (``test_affinity``'s table)."""


CANCELS: dict[str, tuple[float, int, int]] = {}
"""The disconnect tests' findings: model -> (seconds from the client leaving to the engine's
slot idle, tokens the engine decoded, tokens asked for)."""


GAVE_UP: dict[str, tuple[float, int, int]] = {}
"""``test_giving_up``'s findings: "route, streamed|whole, after N s" -> (seconds from the
client closing its socket to the engine's slot free, tokens the slot decoded after that,
tokens it had decoded before)."""


@attrs.frozen
class Timing:
    ttft: float
    """Seconds from sending the request to the first content."""
    total: float
    tokens: int

    @property
    def decode_tps(self) -> float:
        """Tokens after the first per second after the first."""
        return (self.tokens - 1) / (self.total - self.ttft) if self.total > self.ttft else 0.0

    @property
    def e2e_tps(self) -> float:
        return self.tokens / self.total


def timed_stream(sdk: openai.OpenAI, model: str, tokens: int) -> Timing:
    """A streamed chat completion of exactly ``tokens`` tokens (llama.cpp's ``ignore_eos``):
    the time to its first content and to its end."""
    started = time.perf_counter()
    first: float | None = None
    usage_seen: Any = None
    request: dict[str, Any] = {
        "model": model,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": tokens,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    with sdk.chat.completions.create(**request, stream=True) as chunks:
        for chunk in chunks:
            if first is None and any(c.delta.content for c in chunk.choices):
                first = time.perf_counter() - started
            if chunk.usage is not None:
                usage_seen = chunk.usage
    total = time.perf_counter() - started
    assert first is not None, "no content streamed"
    assert usage_seen is not None, "no usage chunk"
    return Timing(first, total, usage_seen.completion_tokens)
