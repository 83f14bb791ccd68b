"""A committed answer rendered in OpenAI's chat-completions shape: a ``chat.completion``
object (:func:`completion_body`), or its ``chat.completion.chunk`` SSE events
(:class:`ChunkWriter`, :func:`render_event`), with a failure after the commit as an SSE error
event (:func:`sse_error`). Pure: the routes (``api/openai/__init__.py``) send what these build.

:func:`collect` (a complete run's events as one answer) is shared with the Anthropic front end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import orjson

from ... import wire
from ...errors import openai_error_object
from ...paths.runs import Run
from ._request import ChatRequest

__all__ = [
    "ChunkWriter",
    "Collected",
    "ToolCallAccumulator",
    "collect",
    "completion_body",
    "render_event",
    "sse_error",
    "usage_object",
]


def usage_object(usage: wire.Usage | None) -> dict[str, Any]:
    """OpenAI's ``usage``: the counts, with the prompt's cached tokens
    (``prompt_tokens_details.cached_tokens``) and the completion's reasoning tokens
    (``completion_tokens_details.reasoning_tokens``), as OpenAI always answers them."""
    # A node's counts are not trusted to be sane: never relay a negative count, nor a part
    # beyond its total.
    prompt = max(0, usage.prompt_tokens) if usage else 0
    completion = max(0, usage.completion_tokens) if usage else 0
    cached = min(prompt, max(0, usage.cached_tokens)) if usage else 0
    reasoning = min(completion, max(0, usage.reasoning_tokens)) if usage else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def completion_body(
    chat: ChatRequest, run_id: str, head: Sequence[wire.RunEvent]
) -> dict[str, Any]:
    """The ``chat.completion`` of a complete run (its ``head`` ends with ``run.completed``).
    Tool-call deltas are assembled into ``message.tool_calls``; the ``content`` is null when
    there was no text but tool calls, as OpenAI answers."""
    answered = collect(head)
    usage, finish, text = answered.usage, answered.finish_reason, answered.text
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if answered.tool_calls:
        message["content"] = text or None
        message["tool_calls"] = answered.tool_calls
    return {
        "id": f"chatcmpl-{run_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": usage_object(usage),
    }


@attrs.frozen
class Collected:
    """A complete run's answer, as a non-streamed response renders it."""

    text: str
    tool_calls: list[dict[str, Any]]
    """Assembled, in OpenAI's ``message.tool_calls`` shape (:class:`ToolCallAccumulator`)."""
    usage: wire.Usage | None
    finish_reason: str


def collect(head: Sequence[wire.RunEvent]) -> Collected:
    """The events of a complete run (its head ends with ``run.completed``) as one answer: the
    text, the tool calls assembled, the last usage reported, the finish reason."""
    parts: list[str] = []
    calls = ToolCallAccumulator()
    usage: wire.Usage | None = None
    finish = "stop"
    for event in head:
        if isinstance(event, wire.RunDelta):
            parts.append(event.text)
            calls.add(event.tool_calls)
        elif isinstance(event, wire.RunUsage):
            usage = event.usage
        elif isinstance(event, wire.RunCompleted):
            finish = event.finish_reason
    return Collected("".join(parts), calls.result(), usage, finish)


class ToolCallAccumulator:
    """Streaming tool-call deltas (``{"index", "id"?, "type"?, "function": {"name"?,
    "arguments"?}}``) assembled into complete calls, by ``index``: the first ``id``, ``type``
    and ``name`` seen win, ``arguments`` pieces are concatenated."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def add(self, deltas: Sequence[wire.JSONObject]) -> None:
        for delta in deltas:
            index = delta.get("index", 0)
            if type(index) is not int:
                continue
            call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": []})
            if isinstance(delta.get("id"), str) and not call["id"]:
                call["id"] = delta["id"]
            function = delta.get("function")
            if not isinstance(function, dict):
                continue
            if isinstance(function.get("name"), str) and not call["name"]:
                call["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                call["arguments"].append(function["arguments"])

    def result(self) -> list[dict[str, Any]]:
        """The calls in ``index`` order, in OpenAI's ``message.tool_calls`` shape."""
        return [
            {
                "id": call["id"] or f"call_{index}",
                "type": "function",
                "function": {"name": call["name"], "arguments": "".join(call["arguments"])},
            }
            for index, call in sorted(self._calls.items())
        ]


class ChunkWriter:
    """Builds ``chat.completion.chunk`` SSE events for one response."""

    def __init__(self, chat: ChatRequest, run: Run) -> None:
        self._prefix = (
            b'data: {"id":"chatcmpl-'
            + run.run_id.encode()
            + b'","object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + orjson.dumps(chat.model)
            + b',"system_fingerprint":null,"choices":'
        )
        self._suffix = b',"usage":null}\n\n' if chat.include_usage else b"}\n\n"

    def choice(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._prefix + orjson.dumps([choice]) + self._suffix

    def usage(self, usage: wire.Usage | None) -> bytes:
        return self._prefix + b'[],"usage":' + orjson.dumps(usage_object(usage)) + b"}\n\n"


def sse_error(message: str, code: str) -> bytes:
    body = openai_error_object(message, error_type="server_error", code=code)
    return b"data: " + orjson.dumps(body) + b"\n\n"


def render_event(
    writer: ChunkWriter, event: wire.RunEvent, usage: wire.Usage | None, out: list[bytes]
) -> tuple[wire.Usage | None, bool]:
    """Append the SSE bytes for ``event``; return the usage so far and whether it ended."""
    if isinstance(event, wire.RunDelta):
        delta: dict[str, Any] = {}
        if event.text or not event.tool_calls:
            delta["content"] = event.text
        if event.tool_calls:
            delta["tool_calls"] = list(event.tool_calls)
        out.append(writer.choice(delta))
    elif isinstance(event, wire.RunUsage):
        return event.usage, False
    elif isinstance(event, wire.RunCompleted):
        out.append(writer.choice({}, event.finish_reason))
        return usage, True
    elif isinstance(event, wire.RunFailed):
        out.append(sse_error(f"the model run failed: {event.message}", event.code))
        return usage, True
    elif isinstance(event, wire.RunCancelled):
        out.append(sse_error("the node cancelled the run", "cancelled"))
        return usage, True
    return usage, False
