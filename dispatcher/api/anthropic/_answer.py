"""A committed answer rendered as Anthropic's ``message`` object, whole or as its SSE events.

Non-streamed (:func:`message_body`): the gate committed the complete run; its text becomes
one ``text`` block and its tool calls ``tool_use`` blocks (``input`` parsed from the
arguments' JSON text), after the text.

Streamed (:class:`EventWriter`): nothing is written before the gate yields the answer (it
holds the attempt until the first content), so the whole event sequence -- ``message_start``
(with the input usage), ``ping``, then per block ``content_block_start``,
``content_block_delta`` (``text_delta`` / ``input_json_delta``) and ``content_block_stop``,
then ``message_delta`` (stop reason, usage) and ``message_stop`` -- belongs to the attempt that
committed. After the commit a failure is an ``error`` event and the stream ends without
``message_delta`` / ``message_stop``: never a clean end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

import orjson

from ... import wire
from ...shared.tokens import TokenEstimator, estimate_tokens
from ..openai import collect

__all__ = [
    "PING",
    "EventWriter",
    "error_event",
    "message_body",
    "run_error_type",
    "stop_reason",
    "tool_use_id",
]


def stop_reason(finish_reason: str, *, tool_calls: bool, stop_sequence: str | None = None) -> str:
    """Anthropic's ``stop_reason`` for an OpenAI ``finish_reason``: ``stop_sequence`` when
    the run says a stop sequence ended its text (``run.completed.stop_sequence``: an engine
    that tells which, as Anthropic's does; see ``docs/messages.md``)."""
    if finish_reason == "stop" and stop_sequence is not None and not tool_calls:
        return "stop_sequence"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason in ("tool_calls", "function_call") or (tool_calls and finish_reason == "stop"):
        return "tool_use"
    if finish_reason == "content_filter":
        return "refusal"
    return "end_turn"


def tool_use_id(call_id: str, fallback: str) -> str:
    """A tool call's id as a ``tool_use`` id (``toolu_`` + the backend's id, which the client
    sends back in its ``tool_result``: the translation passes it on as the call's id)."""
    if not call_id:
        return "toolu_" + fallback
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id


def parse_input(arguments: str) -> dict[str, Any]:
    """A tool call's ``arguments`` (JSON text) as a ``tool_use`` block's ``input``: ``{}`` for
    none; text that is not a JSON object is kept under ``_raw_arguments`` rather than lost."""
    if not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def _usage(usage: wire.Usage | None, input_estimate: int, output_estimate: int) -> dict[str, int]:
    """Anthropic's ``usage``: ``input_tokens`` are the prompt's tokens neither read from nor
    written to the cache (``cache_read_input_tokens``, ``cache_creation_input_tokens``); the
    three add up to OpenAI's ``prompt_tokens``, which the run counts."""
    # A node's counts are not trusted to be sane: never relay a negative count, nor a part
    # beyond its total.
    if usage is None:
        return {
            "input_tokens": input_estimate,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": output_estimate,
        }
    prompt = max(0, usage.prompt_tokens)
    cached = min(prompt, max(0, usage.cached_tokens))
    written = min(prompt - cached, max(0, usage.cache_write_tokens))
    return {
        "input_tokens": prompt - cached - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "output_tokens": max(0, usage.completion_tokens),
    }


def message_body(
    *, message_id: str, model: str, head: Sequence[wire.RunEvent], input_estimate: int
) -> dict[str, Any]:
    """The ``message`` object of a complete run (``head`` ends with ``run.completed``)."""
    answered = collect(head)
    usage, finish, text = answered.usage, answered.finish_reason, answered.text
    sequence = head[-1].stop_sequence if isinstance(head[-1], wire.RunCompleted) else None
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for index, call in enumerate(answered.tool_calls):
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"], f"{message_id}_{index}"),
                "name": function["name"],
                "input": parse_input(function["arguments"]),
            }
        )
    reason = stop_reason(finish, tool_calls=bool(answered.tool_calls), stop_sequence=sequence)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence if reason == "stop_sequence" else None,
        "usage": _usage(usage, input_estimate, estimate_tokens(text)),
    }


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


PING: Final = event("ping", {"type": "ping"})
"""The ``ping`` event a stream sends after :data:`~dispatcher.api.anthropic.PING_INTERVAL`
seconds of silence (as Anthropic's streams do), so that clients and proxies see it alive."""


def error_event(error_type: str, message: str) -> bytes:
    return event("error", {"type": "error", "error": {"type": error_type, "message": message}})


_OVERLOADED: Final = frozenset({"upstream_5xx", "upstream_unreachable", "shutting_down"})


def run_error_type(code: str) -> str:
    """The ``error`` event's type for a run that failed after the commit: the provider's rate
    limit is ``rate_limit_error``, an overloaded or unreachable provider ``overloaded_error``,
    anything else (a broken-off run, a stall, a lost node) ``api_error``."""
    if code == "upstream_rate_limited":
        return "rate_limit_error"
    if code in _OVERLOADED:
        return "overloaded_error"
    return "api_error"


class EventWriter:
    """Renders one run's events as Messages SSE events, keeping the open content block: text
    and tool-call deltas each go into their block, a new block closing the one before.

    Tool calls arrive as OpenAI deltas keyed by ``index``; a call's block starts at its first
    delta (its ``id`` and ``name``) and takes the ``arguments`` pieces as ``input_json_delta``.
    A delta for a call whose block was already closed cannot be rendered (a block is never
    reopened): it ends the stream with an ``error`` event."""

    def __init__(self, *, message_id: str, model: str, input_estimate: int) -> None:
        self.message_id = message_id
        self.model = model
        self.input_estimate = input_estimate
        self.usage: wire.Usage | None = None
        self._output = TokenEstimator()
        self._index = -1
        self._open: Literal["text", "tool"] | None = None
        self._tool: int | None = None
        self._tools_done: set[int] = set()
        self._tool_calls = False

    def start(self, head: Sequence[wire.RunEvent]) -> bytes:
        """``message_start`` (its input usage: the run's, if ``head`` has it -- a
        ``run.usage``, or the count a first ``run.delta`` carries -- else the estimate) and a
        ``ping``."""
        for item in head:
            if isinstance(item, wire.RunUsage | wire.RunDelta) and item.usage is not None:
                self.usage = item.usage
        usage = _usage(self.usage, self.input_estimate, 0)
        usage["output_tokens"] = 0
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return event("message_start", {"type": "message_start", "message": message}) + PING

    def render(self, item: wire.RunEvent, out: list[bytes]) -> bool:
        """Append the SSE bytes of ``item``; return whether the stream ended."""
        if isinstance(item, wire.RunDelta):
            if item.text:
                self._text(item.text, out)
            if item.tool_calls:
                return self._calls(item.tool_calls, out)
        elif isinstance(item, wire.RunUsage):
            self.usage = item.usage
        elif isinstance(item, wire.RunCompleted):
            self._close(out)
            reason = stop_reason(
                item.finish_reason, tool_calls=self._tool_calls, stop_sequence=item.stop_sequence
            )
            sequence = item.stop_sequence if reason == "stop_sequence" else None
            out.append(
                event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": _usage(self.usage, self.input_estimate, self._output.tokens),
                    },
                )
            )
            out.append(event("message_stop", {"type": "message_stop"}))
            return True
        elif isinstance(item, wire.RunFailed):
            out.append(
                error_event(run_error_type(item.code), f"the model run failed: {item.message}")
            )
            return True
        elif isinstance(item, wire.RunCancelled):
            out.append(error_event("api_error", "the node cancelled the run"))
            return True
        return False

    def _start(self, block: dict[str, Any], out: list[bytes]) -> None:
        self._close(out)
        self._index += 1
        out.append(
            event(
                "content_block_start",
                {"type": "content_block_start", "index": self._index, "content_block": block},
            )
        )

    def _close(self, out: list[bytes]) -> None:
        if self._open is None:
            return
        out.append(
            event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        )
        if self._tool is not None:
            self._tools_done.add(self._tool)
        self._open, self._tool = None, None

    def _delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        out.append(
            event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self._index, "delta": delta},
            )
        )

    def _text(self, text: str, out: list[bytes]) -> None:
        if self._open != "text":
            self._start({"type": "text", "text": ""}, out)
            self._open = "text"
        self._output.add(text)
        self._delta({"type": "text_delta", "text": text}, out)

    def _calls(self, deltas: Sequence[wire.JSONObject], out: list[bytes]) -> bool:
        for delta in deltas:
            index = delta.get("index", 0)
            if type(index) is not int:
                continue
            function = delta.get("function")
            function = function if isinstance(function, dict) else {}
            if self._open != "tool" or self._tool != index:
                if index in self._tools_done:
                    out.append(
                        error_event(
                            "api_error",
                            f"the model's tool call {index} went on after the next block began",
                        )
                    )
                    return True
                call_id = delta.get("id")
                name = function.get("name")
                self._start(
                    {
                        "type": "tool_use",
                        "id": tool_use_id(
                            call_id if isinstance(call_id, str) else "",
                            f"{self.message_id}_{index}",
                        ),
                        "name": name if isinstance(name, str) else "",
                        "input": {},
                    },
                    out,
                )
                self._open, self._tool, self._tool_calls = "tool", index, True
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                self._output.add(arguments)
                self._delta({"type": "input_json_delta", "partial_json": arguments}, out)
        return False
