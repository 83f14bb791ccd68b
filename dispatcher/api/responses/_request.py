"""A Responses request: validated (:data:`REQUEST`), normalized to input items, and
translated to the OpenAI chat body the gate, the nodes and the usage rows speak
(:func:`chat_body`). ``docs/responses.md`` has the tables."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from ...admission import Candidate
from ...errors import BadRequest
from .. import schema
from ..schema import Invalid, JSONObject

__all__ = [
    "REQUEST",
    "ParsedResponsesRequest",
    "chat_body",
    "chat_messages",
    "message_item",
    "normalized_only",
    "parse_responses_request",
]


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
        items: list[JSONObject] = [message_item("user", given)]
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


def message_item(role: str, text: str) -> JSONObject:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def _normalize_item(item: JSONObject) -> JSONObject:
    """An input item as it is stored: messages with typed content parts, no client ids."""
    kind = item.get("type", "message")
    if kind == "message":
        content = item["content"]
        if isinstance(content, str):
            return message_item(item["role"], content)
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
