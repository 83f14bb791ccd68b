"""A Responses answer: the ``response`` object built from the run's events (:class:`Turn`),
its ``output`` items and the stream events that announce them, numbered as SSE
(:class:`Events`)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Final

import orjson

from ... import wire
from ...wire import JSONObject
from ._request import (
    ParsedResponsesRequest,
    ToolPlan,
    custom_tool_input,
    message_item,
)

__all__ = ["Events", "Turn", "error_code", "final_event"]


def _usage(usage: wire.Usage | None) -> JSONObject:
    prompt = max(0, usage.prompt_tokens) if usage else 0
    completion = max(0, usage.completion_tokens) if usage else 0
    cached = min(prompt, max(0, usage.cached_tokens)) if usage else 0
    reasoning = min(completion, max(0, usage.reasoning_tokens)) if usage else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


_INCOMPLETE: Final[Mapping[str, str]] = {
    "length": "max_output_tokens",
    "content_filter": "content_filter",
}


def error_code(failed: wire.RunFailed) -> str:
    """The Responses API's error code for a run that failed after the commit."""
    code = failed.code
    if failed.status == 429 or "rate_limit" in code:
        return "rate_limit_exceeded"
    if "context_length" in code:
        return "context_length_exceeded"
    return "server_error"


class _Output:
    """Builds a response's ``output`` items from run events, and the stream events that
    announce them (``events``, each without its ``sequence_number``)."""

    def __init__(self, response_id: str, tools: ToolPlan | None = None) -> None:
        self._tools = tools or ToolPlan()
        self._base = response_id.removeprefix("resp_")
        self.items: list[JSONObject] = []
        self.events: list[JSONObject] = []
        self._open: JSONObject | None = None
        self._call_index: int | None = None
        self._chat_name = ""
        self._arguments: list[str] = []
        self._text: list[str] = []
        self.usage: wire.Usage | None = None

    def _add(self, item: JSONObject) -> None:
        self._open = item
        self.events.append(
            {
                "type": "response.output_item.added",
                "output_index": len(self.items),
                "item": dict(item, content=[]) if item["type"] == "message" else dict(item),
            }
        )
        if item["type"] == "message":
            self.events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": len(self.items),
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                }
            )

    def text(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self._open["type"] != "message":
            self.close("completed")
            self._add(
                {
                    "type": "message",
                    "id": f"msg_{self._base}_{len(self.items)}",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
            )
        assert self._open is not None
        self._text.append(text)
        self.events.append(
            {
                "type": "response.output_text.delta",
                "item_id": self._open["id"],
                "output_index": len(self.items),
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        )

    def tool_calls(self, deltas: Sequence[wire.JSONObject]) -> None:
        for delta in deltas:
            index = delta.get("index", 0)
            function = delta.get("function")
            function = function if isinstance(function, dict) else {}
            if self._open is None or self._open["type"] == "message" or (self._call_index != index):
                self.close("completed")
                call_id = delta.get("id")
                name = function.get("name")
                self._call_index = index
                self._chat_name = name if isinstance(name, str) else ""
                self._add(
                    self._call_item(
                        call_id
                        if isinstance(call_id, str) and call_id
                        else f"call_{self._base}_{len(self.items)}"
                    )
                )
            assert self._open is not None
            if not self._chat_name and isinstance(function.get("name"), str):
                # a backend that names the function only in a later delta: the added event
                # went out without it, the done events carry it
                self._chat_name = function["name"]
                self._open.update(self._call_item(self._open["call_id"]), id=self._open["id"])
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                self._arguments.append(arguments)
                if self._open["type"] == "custom_tool_call":
                    continue  # its input is known whole at the end (it is inside JSON)
                self.events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self._open["id"],
                        "output_index": len(self.items),
                        "delta": arguments,
                    }
                )

    def _call_item(self, call_id: str) -> JSONObject:
        """The output item of a call of the chat function :attr:`_chat_name`: a
        ``function_call``, or a ``custom_tool_call`` for a custom tool; a tool inside a
        namespace by its own name, with its ``namespace``."""
        tool = self._tools.client_tool(self._chat_name) if self._chat_name else None
        number = len(self.items)
        item: JSONObject
        if tool is not None and tool.custom:
            item = {"type": "custom_tool_call", "id": f"ctc_{self._base}_{number}"}
            item.update(call_id=call_id, name=tool.name, input="", status="in_progress")
        else:
            item = {"type": "function_call", "id": f"fc_{self._base}_{number}"}
            item.update(call_id=call_id, name=tool.name if tool else "", arguments="")
            item["status"] = "in_progress"
        if tool is not None and tool.namespace is not None:
            item["namespace"] = tool.namespace
        return item

    def close(self, status: str) -> None:
        """End the open item (if any) with ``status``."""
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.items)
        item["status"] = status
        if item["type"] == "message":
            text = "".join(self._text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            self.events.append(
                {"type": "response.output_text.done", **common, "text": text, "logprobs": []}
            )
            self.events.append({"type": "response.content_part.done", **common, "part": part})
            self._text = []
        elif item["type"] == "custom_tool_call":
            item["input"] = custom_tool_input("".join(self._arguments))
            common = {"item_id": item["id"], "output_index": index}
            if item["input"]:
                self.events.append(
                    {
                        "type": "response.custom_tool_call_input.delta",
                        **common,
                        "delta": item["input"],
                    }
                )
            self.events.append(
                {"type": "response.custom_tool_call_input.done", **common, "input": item["input"]}
            )
            self._arguments = []
            self._call_index = None
        else:
            item["arguments"] = "".join(self._arguments)
            self.events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
            self._arguments = []
            self._call_index = None
        self.items.append(item)
        self.events.append(
            {"type": "response.output_item.done", "output_index": index, "item": item}
        )

    def take_events(self) -> list[JSONObject]:
        events, self.events = self.events, []
        return events


_OWN: Final = frozenset(("function", "custom", "namespace"))
"""The tool types a response echoes (the built-in ones were dropped)."""


def _echoed(tool: JSONObject) -> JSONObject:
    if tool["type"] != "function":
        return tool
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", True),
    }


class Turn:
    """One Responses request being answered: its response object as it grows."""

    def __init__(self, request: ParsedResponsesRequest, previous: str | None) -> None:
        body = request.body
        self.request = request
        self.id = "resp_" + secrets.token_hex(16)
        self.created_at = int(time.time())
        self.output = _Output(self.id, request.tools)
        text = body.get("text") or {}
        reasoning = body.get("reasoning") or {}
        self.fields: JSONObject = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": request.model,
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous,
            "store": request.store,
            "temperature": body.get("temperature"),
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": [_echoed(tool) for tool in body.get("tools") or () if tool["type"] in _OWN],
            "top_p": body.get("top_p"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": None},
            "service_tier": "default",
            "truncation": "disabled",
            "usage": None,
            "metadata": body.get("metadata") or {},
        }

    def feed(self, event: wire.RunEvent) -> bool:
        """Take one run event; True once the run ended."""
        output = self.output
        if isinstance(event, wire.RunDelta):
            output.text(event.text)
            output.tool_calls(event.tool_calls)
        elif isinstance(event, wire.RunUsage):
            output.usage = event.usage
        elif isinstance(event, wire.RunCompleted):
            incomplete = _INCOMPLETE.get(event.finish_reason)
            output.close("incomplete" if incomplete else "completed")
            self.fields["status"] = "incomplete" if incomplete else "completed"
            if incomplete:
                self.fields["incomplete_details"] = {"reason": incomplete}
            return True
        elif isinstance(event, wire.RunFailed):
            self.fail(error_code(event), f"the model run failed ({event.code}): {event.message}")
            return True
        elif isinstance(event, wire.RunCancelled):
            self.fail("server_error", "the node cancelled the run")
            return True
        return False

    def fail(self, code: str, message: str) -> None:
        self.output.close("incomplete")
        self.fields["status"] = "failed"
        self.fields["error"] = {"code": code, "message": message}

    def response(self) -> JSONObject:
        fields = dict(self.fields, output=list(self.output.items))
        if fields["status"] != "in_progress":
            fields["usage"] = _usage(self.output.usage)
        return fields

    def conversation(self, history: Sequence[JSONObject]) -> list[JSONObject]:
        """What a later turn's ``previous_response_id`` prepends."""
        outputs = [_normalize_output(item) for item in self.output.items]
        return [*history, *self.request.items, *outputs]


def _normalize_output(item: JSONObject) -> JSONObject:
    if item["type"] == "message":
        text = "".join(part["text"] for part in item["content"])
        return message_item("assistant", text)
    value = "arguments" if item["type"] == "function_call" else "input"
    call: JSONObject = {"type": item["type"], "call_id": item["call_id"], "name": item["name"]}
    if "namespace" in item:
        call["namespace"] = item["namespace"]
    call[value] = item[value]
    return call


class Events:
    """Stream events as SSE, numbered."""

    def __init__(self) -> None:
        self._sequence = 0

    def encode(self, events: Sequence[JSONObject]) -> bytes:
        out: list[bytes] = []
        for event in events:
            event = {**event, "sequence_number": self._sequence}
            self._sequence += 1
            out.append(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event))
            out.append(b"\n\n")
        return b"".join(out)


def final_event(turn: Turn) -> JSONObject:
    """The event that ends a stream: ``response.completed``, ``.incomplete`` or ``.failed``."""
    response = turn.response()
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
    return {"type": kind.get(response["status"], "response.failed"), "response": response}
