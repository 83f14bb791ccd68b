"""The OpenAI Responses front end: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}`` (see ``docs/responses.md``).

A Responses request is translated into the typed :class:`~dispatcher.gate.GateRequest` with an
OpenAI chat body (``instructions`` and the ``input`` items as ``messages``, function ``tools``,
``tool_choice``, ``max_output_tokens`` as ``max_tokens`` ...), so it takes the same gate,
recovery, cancellation and usage rows as chat completions; the ledger's row records the route
``/v1/responses``. Only normalized candidates serve it (:func:`normalized_only`): a tunnel
relays bytes, and no provider is declared to speak ``/v1/responses`` natively.

Nothing is written before the gate yields the committed answer: for a stream, the preamble
(``response.created``, ``response.in_progress``) goes out with the first content, so a failure
before it is still an HTTP status (and recovered by the gate). After it, a failure is a
``response.failed`` event with an error ``code`` and the stream ends there -- never a
``response.completed``.

Stored responses (``store``, true unless the client says false) live in the edge's
:class:`~dispatcher.responses_store.ResponseStore` (SQLite beside the usage ledger, bounded by
count, bytes and age), reached through the seam (``EdgeServices.response_store``);
``previous_response_id`` prepends the stored conversation.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import orjson
import trio

from .. import wire
from ..admission import Candidate
from ..errors import BadRequest, NotFound
from ..gate import Answer
from ..http import PeerGone, Request, Responder
from ..responses_store import ResponseStore, StoredResponse
from . import schema
from .common import (
    JSON_HEADERS,
    ModelCall,
    dispatch_headers,
    model_route,
    openai_error,
    relay_rest,
)
from .front import FrontEnd, Route, RouteContext, RouteSpec
from .schema import Invalid, JSONObject
from .seam import EdgeServices

__all__ = [
    "FRONT_END",
    "RESPONSES_PATH",
    "RESPONSE_ID_ROUTE",
    "ParsedResponsesRequest",
    "ResponseStore",
    "StoredResponse",
    "make_front_end",
    "normalized_only",
    "parse_responses_request",
]

RESPONSES_PATH: Final = "/v1/responses"
RESPONSE_ID_ROUTE: Final = "/v1/responses/{id}"
"""The route of one stored response: a pattern route (``api.app`` matches the last path
segment as ``{id}``)."""

SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)

# --------------------------------------------------------------------------- the request


def _only(*known: str) -> schema.Rule:
    """A rule refusing any field but ``known``, naming it."""
    allowed = frozenset(known)

    def rule(value: JSONObject) -> None:
        for name in value:
            if name not in allowed:
                raise Invalid("unsupported_parameter", "is not supported by this endpoint", name)

    return rule


def _strict(
    fields: Mapping[str, schema.Schema], required: tuple[str, ...] = (), *, what: str = "an object"
) -> schema.Object:
    return schema.Object(fields, required, rules=(_only(*fields),), what=what)


_TEXT_PART: Final = _strict({"type": schema.STRING, "text": schema.STRING}, ("text",))
_OUTPUT_TEXT_PART: Final = _strict(
    {
        "type": schema.STRING,
        "text": schema.STRING,
        "annotations": schema.Array(schema.ANY_OBJECT, max_items=0, what="an empty array"),
        "logprobs": schema.Array(schema.ANY_OBJECT, what="an array"),
    },
    ("text",),
)
_REFUSAL_PART: Final = _strict({"type": schema.STRING, "refusal": schema.STRING}, ("refusal",))


def _message_content(parts: Mapping[str, schema.Object], where: str) -> schema.OneOf:
    part = schema.Tagged("type", parts, "a content part object", where)
    return schema.OneOf(
        {str: schema.STRING, list: schema.Array(part, what="an array of content parts")},
        what="a string or an array of content parts",
    )


_INPUT_CONTENT: Final = _message_content({"input_text": _TEXT_PART}, "in an input message")
_ASSISTANT_CONTENT: Final = _message_content(
    {"output_text": _OUTPUT_TEXT_PART, "refusal": _REFUSAL_PART, "input_text": _TEXT_PART},
    "in an assistant message",
)
_STATUS: Final = schema.enum("in_progress", "completed", "incomplete")
_MESSAGE_FIELDS: Final[Mapping[str, schema.Schema]] = {
    "type": schema.STRING,
    "role": schema.STRING,
    "id": schema.STRING,
    "status": _STATUS,
}
_MESSAGES: Final[Mapping[str, schema.Object]] = {
    role: _strict({**_MESSAGE_FIELDS, "content": _INPUT_CONTENT}, ("content",))
    for role in ("user", "system", "developer")
}
_ITEMS: Final[Mapping[str, schema.Schema]] = {
    "message": schema.Tagged(
        "role",
        {
            **_MESSAGES,
            "assistant": _strict({**_MESSAGE_FIELDS, "content": _ASSISTANT_CONTENT}, ("content",)),
        },
        "a message item",
    ),
    "function_call": _strict(
        {
            "type": schema.STRING,
            "id": schema.STRING,
            "call_id": schema.NON_EMPTY,
            "name": schema.NON_EMPTY,
            "arguments": schema.STRING,
            "status": _STATUS,
        },
        ("call_id", "name", "arguments"),
    ),
    "function_call_output": _strict(
        {
            "type": schema.STRING,
            "id": schema.STRING,
            "call_id": schema.NON_EMPTY,
            "output": schema.OneOf(
                {
                    str: schema.STRING,
                    list: schema.Array(
                        schema.Tagged("type", {"input_text": _TEXT_PART}, "an output part"),
                        what="an array of input_text parts",
                    ),
                },
                what="a string or an array of input_text parts",
            ),
            "status": _STATUS,
        },
        ("call_id", "output"),
    ),
}


@attrs.frozen
class _Item:
    """An input item: its ``type`` (``message`` when absent, as the API's easy input
    message has none) picks its schema; other item types are refused by name."""

    def check(self, value: object, depth: int) -> None:
        if type(value) is not dict:
            raise Invalid("invalid_type", "must be an input item object")
        kind = value.get("type", "message")
        item = _ITEMS.get(kind) if type(kind) is str else None
        if item is None:
            if type(kind) is not str:
                raise Invalid("invalid_type", "must be a string", "type")
            raise Invalid(
                "unsupported_value",
                f"item type {kind!r} is not supported: use message, function_call or "
                "function_call_output",
                "type",
            )
        item.check(value, depth)

    def describe(self) -> str:
        return "an input item object"


_FUNCTION_TOOL: Final = _strict(
    {
        "type": schema.STRING,
        "name": schema.String(
            pattern=re.compile(r"[a-zA-Z0-9_-]{1,64}"),
            what="a name of 1 to 64 letters, digits, underscores or dashes",
        ),
        "description": schema.STRING,
        "parameters": schema.ANY_OBJECT,
        "strict": schema.BOOLEAN,
    },
    ("name",),
)
_TOOL: Final = schema.Tagged("type", {"function": _FUNCTION_TOOL}, "a function tool object")
_TOOL_CHOICE: Final = schema.OneOf(
    {
        str: schema.enum("none", "auto", "required"),
        dict: schema.Tagged(
            "type",
            {"function": _strict({"type": schema.STRING, "name": schema.NON_EMPTY}, ("name",))},
            "a tool choice object",
        ),
    },
    what='"none", "auto", "required" or a function tool choice object',
)
_FORMAT: Final = schema.Tagged(
    "type",
    {
        "text": _strict({"type": schema.STRING}),
        "json_object": _strict({"type": schema.STRING}),
        "json_schema": _strict(
            {
                "type": schema.STRING,
                "name": schema.NON_EMPTY,
                "schema": schema.ANY_OBJECT,
                "description": schema.STRING,
                "strict": schema.BOOLEAN,
            },
            ("name", "schema"),
        ),
    },
    "a text format object",
)

REQUEST: Final = _strict(
    {
        "model": schema.NON_EMPTY,
        "input": schema.OneOf(
            {str: schema.STRING, list: schema.Array(_Item(), what="an array of input items")},
            what="a string or an array of input items",
        ),
        "instructions": schema.STRING,
        "tools": schema.Array(_TOOL, what="an array of function tools"),
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": schema.BOOLEAN,
        "max_output_tokens": schema.TOKEN_LIMIT,
        "temperature": schema.TEMPERATURE,
        "top_p": schema.TOP_P,
        "stream": schema.BOOLEAN,
        "stream_options": _strict({"include_obfuscation": schema.BOOLEAN}),
        "metadata": schema.Map(
            schema.String(max_length=512),
            keys=schema.String(max_length=64),
            max_items=16,
            what="an object of at most 16 string values",
        ),
        "store": schema.BOOLEAN,
        "previous_response_id": schema.NON_EMPTY,
        "text": _strict({"format": _FORMAT}),
        "truncation": schema.enum("disabled"),
        # The built-in echo model's per-request knobs (nodes/adapters/echo.py), forwarded as
        # the chat routes forward them: what the tests inject faults and tool calls with.
        "echo": schema.ANY_OBJECT,
    },
    ("model", "input"),
)
"""What ``POST /v1/responses`` accepts; any other field is answered 400 naming it."""


@attrs.frozen(kw_only=True)
class ParsedResponsesRequest:
    model: str
    body: JSONObject
    """The request as the client sent it (validated)."""
    items: tuple[JSONObject, ...]
    """The request's own input items, normalized (a string input is one user message)."""
    stream: bool
    store: bool


def parse_responses_request(raw: bytes, *, max_size: int | None = None) -> ParsedResponsesRequest:
    """Parse and validate a ``POST /v1/responses`` body (:data:`REQUEST`); raise
    :class:`BadRequest` naming the bad field."""
    body = schema.parse(raw, REQUEST, max_size=max_size)
    given = body["input"]
    if isinstance(given, str):
        items: list[JSONObject] = [_message("user", given)]
    else:
        items = [_normalize_item(item) for item in given]
    if not items:
        raise BadRequest("'input': must not be empty", param="input", code="invalid_value")
    return ParsedResponsesRequest(
        model=body["model"],
        body=body,
        items=tuple(items),
        stream=body.get("stream") is True,
        store=body.get("store") is not False,
    )


def _message(role: str, text: str) -> JSONObject:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def _normalize_item(item: JSONObject) -> JSONObject:
    """An input item as it is stored: messages with typed content parts, no client ids."""
    kind = item.get("type", "message")
    if kind == "message":
        content = item["content"]
        if isinstance(content, str):
            return _message(item["role"], content)
        parts = []
        for part in content:
            if part["type"] == "refusal":
                parts.append({"type": "refusal", "refusal": part["refusal"]})
            else:
                parts.append({"type": part["type"], "text": part["text"]})
        return {"type": "message", "role": item["role"], "content": parts}
    if kind == "function_call":
        return {
            "type": "function_call",
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
        }
    output = item["output"]
    if not isinstance(output, str):
        output = "".join(part["text"] for part in output)
    return {"type": "function_call_output", "call_id": item["call_id"], "output": output}


# --------------------------------------------------------------------------- translation


def chat_messages(instructions: str | None, items: Sequence[JSONObject]) -> list[JSONObject]:
    """Responses items as chat messages: ``instructions`` first as a system message; a
    ``function_call`` joins the assistant message just before it (or starts one with null
    content) as a tool call; a ``function_call_output`` is a ``tool`` message."""
    messages: list[JSONObject] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        if kind == "message":
            texts = [part.get("text", part.get("refusal", "")) for part in item["content"]]
            if item["role"] == "assistant" or len(texts) == 1:
                content: Any = "".join(texts)
            else:
                content = [{"type": "text", "text": text} for text in texts]
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


def chat_body(request: ParsedResponsesRequest, history: Sequence[JSONObject]) -> JSONObject:
    """The OpenAI chat body the gate dispatches for ``request`` after ``history``."""
    body = request.body
    chat: JSONObject = {
        "model": request.model,
        "messages": chat_messages(body.get("instructions"), [*history, *request.items]),
    }
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    tools = body.get("tools")
    if tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    key: tool[key]
                    for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None
                },
            }
            for tool in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, str):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("echo") is not None:
        chat["echo"] = body["echo"]
    text_format = (body.get("text") or {}).get("format")
    if isinstance(text_format, dict) and text_format["type"] != "text":
        if text_format["type"] == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    key: text_format[key]
                    for key in ("name", "schema", "description", "strict")
                    if text_format.get(key) is not None
                },
            }
    return chat


def normalized_only(candidate: Candidate) -> str | None:
    """The admission predicate of ``/v1/responses``: a tunnel relays the client's bytes to a
    provider, and none is declared to speak ``/v1/responses``."""
    if candidate.path == "normalized":
        return None
    return "serves this model through a tunnel, which cannot speak /v1/responses"


# --------------------------------------------------------------------------- the answer


def _usage(usage: wire.Usage | None) -> JSONObject:
    prompt = max(0, usage.prompt_tokens) if usage else 0
    completion = max(0, usage.completion_tokens) if usage else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
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

    def __init__(self, response_id: str) -> None:
        self._base = response_id.removeprefix("resp_")
        self.items: list[JSONObject] = []
        self.events: list[JSONObject] = []
        self._open: JSONObject | None = None
        self._call_index: int | None = None
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
            if (
                self._open is None
                or self._open["type"] != "function_call"
                or (self._call_index != index)
            ):
                self.close("completed")
                call_id = delta.get("id")
                name = function.get("name")
                self._call_index = index
                self._add(
                    {
                        "type": "function_call",
                        "id": f"fc_{self._base}_{len(self.items)}",
                        "call_id": call_id
                        if isinstance(call_id, str) and call_id
                        else (f"call_{self._base}_{len(self.items)}"),
                        "name": name if isinstance(name, str) else "",
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            assert self._open is not None
            if not self._open["name"] and isinstance(function.get("name"), str):
                self._open["name"] = function["name"]
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                self._arguments.append(arguments)
                self.events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self._open["id"],
                        "output_index": len(self.items),
                        "delta": arguments,
                    }
                )

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


class _Turn:
    """One Responses request being answered: its response object as it grows."""

    def __init__(self, request: ParsedResponsesRequest, previous: str | None) -> None:
        body = request.body
        self.request = request
        self.id = "resp_" + secrets.token_hex(16)
        self.created_at = int(time.time())
        self.output = _Output(self.id)
        tools = body.get("tools") or []
        text = body.get("text") or {}
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
            "tools": [
                {
                    "type": "function",
                    "name": tool["name"],
                    "description": tool.get("description"),
                    "parameters": tool.get("parameters"),
                    "strict": tool.get("strict", True),
                }
                for tool in tools
            ],
            "top_p": body.get("top_p"),
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
        return _message("assistant", text)
    return {
        "type": "function_call",
        "call_id": item["call_id"],
        "name": item["name"],
        "arguments": item["arguments"],
    }


class _Events:
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


# --------------------------------------------------------------------------- routes


StoreOf = Callable[[EdgeServices], ResponseStore]
"""Where a route finds the store: the edge's (``EdgeServices.response_store``), or one an
embedder or a test gave :func:`make_front_end`."""


def _edge_store(edge: EdgeServices) -> ResponseStore:
    return edge.response_store


async def _history(
    store: ResponseStore, previous: str | None, owner: str | None
) -> list[JSONObject]:
    if previous is None:
        return []
    stored = await store.get(previous, owner)
    if stored is None:
        raise BadRequest(
            f"previous response {previous!r} was not found: it was not stored (store: false), "
            "was deleted, or is past the store's bounds",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return list(stored.conversation)


def _create_route(store_of: StoreOf) -> Route:
    @model_route
    async def create_response(call: ModelCall, responder: Responder) -> str:
        request = parse_responses_request(await call.request.body())
        previous = request.body.get("previous_response_id")
        owner = call.ctx.attribution
        store = store_of(call.edge)
        history = await _history(store, previous, owner)
        gated = call.gate_request(
            chat_body(request, history), stream=request.stream, predicate=normalized_only
        )
        turn = _Turn(request, previous)

        async def keep() -> None:
            # Before the answer's last byte: a client that chains on it at once finds it.
            if request.store and turn.fields["status"] in ("completed", "incomplete"):
                await store.put(turn.response(), turn.conversation(history), owner)

        async with call.edge.gate.open(gated) as answer:
            assert isinstance(answer, Answer), "the predicate admits normalized candidates only"
            headers = (*call.ctx.headers, *dispatch_headers(answer.result, answer.attempts))
            try:
                reply = _Reply(turn, answer, responder, headers, keep)
                if request.stream:
                    await _stream(call.edge, reply)
                else:
                    await _complete(reply)
            except PeerGone:
                answer.client_gone()  # a reset is a client leaving, like a cancellation
                raise
            return "completed" if isinstance(answer.terminal, wire.RunCompleted) else "failed"

    return create_response


@attrs.frozen
class _Reply:
    """What delivering one committed answer takes: the response being built, the gate's
    answer, where it goes (with the attempt's headers), and how to store it once complete."""

    turn: _Turn
    answer: Answer
    responder: Responder
    headers: Sequence[tuple[bytes, bytes]]
    keep: Callable[[], Awaitable[None]]


async def _complete(reply: _Reply) -> None:
    """A non-streamed answer: the gate committed it complete."""
    for event in reply.answer.head:
        if reply.turn.feed(event):
            break
    await reply.keep()
    body = reply.turn.response()
    await reply.responder.respond(200, (*JSON_HEADERS, *reply.headers), orjson.dumps(body))


async def _stream(edge: EdgeServices, reply: _Reply) -> None:
    """A streamed answer: the gate committed at its first content; the preamble goes out with
    it. From here a failure is ``response.failed``."""
    events = _Events()
    started = reply.turn.response()
    preamble: list[JSONObject] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    stream = await reply.responder.start_stream(200, (*SSE_HEADERS, *reply.headers))

    async def send(ended: bool) -> None:
        # the events of the batch that ended the answer go out with the final one, below
        if not ended and (chunk := reply.turn.output.take_events()):
            await stream.send(events.encode(chunk))

    ended = False
    with edge.stream_scope() as scope:
        for event in reply.answer.head:
            if ended := reply.turn.feed(event):
                break
        await stream.send(events.encode([*preamble, *reply.turn.output.take_events()]))
        if not ended:
            ended = await relay_rest(reply.answer, reply.turn.feed, send)
        if not ended:  # the run's events ended without a terminal one
            reply.turn.fail("server_error", "the model run ended without finishing")
        await reply.keep()
        await stream.send(events.encode([*reply.turn.output.take_events(), _final(reply.turn)]))
    if scope.cancelled_caught:
        reply.turn.fail("server_error", "the dispatcher is shutting down")
        with trio.move_on_after(1, shield=True):
            await stream.send(events.encode([*reply.turn.output.take_events(), _final(reply.turn)]))


def _final(turn: _Turn) -> JSONObject:
    response = turn.response()
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
    return {"type": kind.get(response["status"], "response.failed"), "response": response}


def _response_id(request: Request) -> str:
    response_id = request.path.rpartition("/")[2]
    if not response_id:
        raise NotFound("no response id in the path", code="unknown_url")
    return response_id


def _not_found(response_id: str) -> NotFound:
    return NotFound(
        f"response {response_id!r} was not found: it was not stored (store: false), was "
        "deleted, or is past the store's bounds",
        code="response_not_found",
    )


def _stored_route(store_of: StoreOf) -> Route:
    async def stored_response(
        edge: EdgeServices, request: Request, responder: Responder, ctx: RouteContext
    ) -> None:
        store = store_of(edge)
        response_id = _response_id(request)
        if request.query:
            raise BadRequest(
                f"query parameters are not supported on {RESPONSES_PATH}/{{id}}",
                code="unsupported_parameter",
            )
        headers = (*JSON_HEADERS, *ctx.headers)
        if request.method == "DELETE":
            if not await store.delete(response_id, ctx.attribution):
                raise _not_found(response_id)
            body: JSONObject = {"id": response_id, "object": "response.deleted", "deleted": True}
            await responder.respond(200, headers, orjson.dumps(body))
            return
        stored = await store.get(response_id, ctx.attribution)
        if stored is None:
            raise _not_found(response_id)
        await responder.respond(200, headers, orjson.dumps(stored.response))

    return stored_response


def make_front_end(store: ResponseStore | None = None) -> FrontEnd:
    """The Responses front end over ``store``; None (what :data:`FRONT_END` is): the edge's
    own, ``EdgeServices.response_store``, which ``open_dispatcher`` opens beside the ledger."""
    store_of: StoreOf = _edge_store if store is None else (lambda _: store)
    return FrontEnd(
        "responses",
        {
            RESPONSES_PATH: RouteSpec(("POST",), _create_route(store_of), "client", work=True),
            RESPONSE_ID_ROUTE: RouteSpec(("GET", "DELETE"), _stored_route(store_of), "client"),
        },
        openai_error,
    )


FRONT_END: Final = make_front_end()
"""The front end ``api.app.FRONT_ENDS`` registers, over the edge's store."""
