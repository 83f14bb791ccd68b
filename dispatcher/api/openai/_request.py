"""What the OpenAI front end accepts in a request body: the schemas of
``POST /v1/chat/completions`` (:data:`CHAT_COMPLETIONS`), ``POST /v1/completions``
(:data:`COMPLETIONS`) and ``POST /v1/embeddings`` (:data:`EMBEDDINGS`), built from the nodes of
:mod:`dispatcher.api.validation`, and the parsers that check a body against them
(:func:`parse_chat_request`, :func:`parse_tunnel_body`).

Every field the OpenAI API documents is checked for its type, range or allowed values; fields
it does not know are left alone (providers have extensions). A bad body is a
:class:`~dispatcher.errors.BadRequest` whose ``param`` is the path of the field at fault and
whose ``code`` is one of ``invalid_type``, ``invalid_value``, ``missing_required_parameter``
or ``unsupported_value``. The body is kept as the client sent it.

docs/api.md lists what is validated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import attrs

from ...wire import JSONObject
from ..validation import (
    ANY_OBJECT,
    BOOLEAN,
    NON_EMPTY,
    STRING,
    Array,
    ByFirstItem,
    Integer,
    Map,
    Mismatch,
    Number,
    Object,
    OneOf,
    Schema,
    String,
    Tagged,
    Tokens,
    enum,
    load_object,
    parse,
    validate,
)

__all__ = [
    "CHAT_COMPLETIONS",
    "CHAT_MESSAGE",
    "COMPLETIONS",
    "COMPLETIONS_OR_EMBEDDINGS",
    "EMBEDDINGS",
    "TEMPERATURE",
    "TOKEN_LIMIT",
    "TOP_P",
    "ChatRequest",
    "parse_chat_request",
    "parse_tunnel_body",
    "tunnel_schema",
]

# --------------------------------------------------------------------------- the schemas
#
# The allowed values follow the OpenAI API reference as openai-python 3.57 types it.

_NAME: Final = String(
    pattern=re.compile(r"[a-zA-Z0-9_-]{1,64}"),
    what="a name of 1 to 64 letters, digits, underscores or dashes",
)
TOKEN_LIMIT: Final = Integer(low=1)
TEMPERATURE: Final = Number(0, 2)
TOP_P: Final = Number(0, 1)
PENALTY: Final = Number(-2, 2)
SEED: Final = Integer()
STOP: Final = OneOf(
    {str: STRING, list: Array(STRING, max_items=4, what="an array of at most 4 strings")},
    what="a string or an array of at most 4 strings",
)
LOGIT_BIAS: Final = Map(
    Number(-100, 100),
    keys=String(pattern=re.compile(r"[0-9]{1,10}"), what="token ids (decimal integers)"),
    what="an object mapping token ids to numbers from -100 to 100",
)
STREAM_OPTIONS: Final = Object({"include_usage": BOOLEAN, "include_obfuscation": BOOLEAN})


def _needs_stream(body: JSONObject) -> None:
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise Mismatch("invalid_value", "only allowed when 'stream' is true", "stream_options")


def _under(key: str, payload: Schema) -> Object:
    """A member of a tagged union that carries its payload under the key its tag names:
    ``{"type": "image_url", "image_url": {...}}``."""
    return Object({key: payload}, required=(key,))


_PARTS: Final[Mapping[str, Object]] = {
    "text": Object({"text": STRING}, required=("text",)),
    "image_url": _under(
        "image_url",
        Object({"url": NON_EMPTY, "detail": enum("auto", "low", "high", "original")}, ("url",)),
    ),
    "input_audio": _under(
        "input_audio",
        Object({"data": STRING, "format": enum("wav", "mp3")}, ("data", "format")),
    ),
    "file": _under("file", Object({"file_data": STRING, "file_id": STRING, "filename": STRING})),
    "refusal": Object({"refusal": STRING}, required=("refusal",)),
}


def _content(parts: tuple[str, ...], where: str) -> OneOf:
    """Message content: a string, or an array of parts of the given types."""
    part = Tagged("type", {name: _PARTS[name] for name in parts}, "a content part object", where)
    return OneOf(
        {str: STRING, list: Array(part, what="an array of content parts")},
        what="a string or an array of content parts",
    )


_TEXT_ONLY: Final = ("text",)
_FUNCTION_CALL: Final = Object({"name": STRING, "arguments": STRING}, ("name", "arguments"))
_TOOL_CALL: Final = Tagged(
    "type",
    {
        "function": Object({"id": STRING, "function": _FUNCTION_CALL}, ("id", "function")),
        "custom": Object(
            {"id": STRING, "custom": Object({"name": STRING, "input": STRING}, ("name", "input"))},
            ("id", "custom"),
        ),
    },
    "a tool call object",
)
_MESSAGES: Final[Mapping[str, Object]] = {
    "system": Object(
        {"content": _content(_TEXT_ONLY, "in a system message"), "name": STRING}, ("content",)
    ),
    "developer": Object(
        {"content": _content(_TEXT_ONLY, "in a developer message"), "name": STRING}, ("content",)
    ),
    "user": Object(
        {
            "content": _content(("text", "image_url", "input_audio", "file"), "in a user message"),
            "name": STRING,
        },
        ("content",),
    ),
    "assistant": Object(
        {
            "content": _content(("text", "refusal"), "in an assistant message"),
            "refusal": STRING,
            "name": STRING,
            "audio": Object({"id": STRING}, ("id",)),
            "tool_calls": Array(_TOOL_CALL, what="an array of tool calls"),
            "function_call": _FUNCTION_CALL,
        }
    ),
    "tool": Object(
        {"content": _content(_TEXT_ONLY, "in a tool message"), "tool_call_id": STRING},
        ("content", "tool_call_id"),
    ),
    "function": Object(
        {"content": STRING, "name": STRING}, ("content", "name"), nullable=("content",)
    ),
}
CHAT_MESSAGE: Final = Tagged("role", _MESSAGES, "a message object")

_FUNCTION: Final = Object(
    {"name": _NAME, "description": STRING, "parameters": ANY_OBJECT, "strict": BOOLEAN},
    ("name",),
)
_GRAMMAR: Final = Object(
    {"definition": STRING, "syntax": enum("lark", "regex")}, ("definition", "syntax")
)
_CUSTOM_TOOL: Final = Object(
    {
        "name": NON_EMPTY,
        "description": STRING,
        "format": Tagged(
            "type", {"text": Object(), "grammar": _under("grammar", _GRAMMAR)}, "a format object"
        ),
    },
    ("name",),
)
_TOOL: Final = Tagged(
    "type",
    {"function": _under("function", _FUNCTION), "custom": _under("custom", _CUSTOM_TOOL)},
    "a tool object",
)
_NAMED: Final = Object({"name": NON_EMPTY}, ("name",))
_ALLOWED_TOOLS: Final = Object(
    {"mode": enum("auto", "required"), "tools": Array(ANY_OBJECT, what="an array of tools")},
    ("mode", "tools"),
)
_TOOL_CHOICE: Final = OneOf(
    {
        str: enum("none", "auto", "required"),
        dict: Tagged(
            "type",
            {
                "function": _under("function", _NAMED),
                "custom": _under("custom", _NAMED),
                "allowed_tools": _under("allowed_tools", _ALLOWED_TOOLS),
            },
            "a tool choice object",
        ),
    },
    what="'none', 'auto', 'required' or a tool choice object",
)
_JSON_SCHEMA: Final = Object(
    {"name": _NAME, "description": STRING, "schema": ANY_OBJECT, "strict": BOOLEAN}, ("name",)
)
_RESPONSE_FORMAT: Final = Tagged(
    "type",
    {
        "text": Object(),
        "json_object": Object(),
        "json_schema": _under("json_schema", _JSON_SCHEMA),
    },
    "a response format object",
)
_AUDIO: Final = Object(
    {
        "format": enum("wav", "aac", "mp3", "flac", "opus", "pcm16"),
        "voice": OneOf(
            {str: NON_EMPTY, dict: Object({"id": NON_EMPTY}, ("id",))},
            what="a voice name or an object with a voice id",
        ),
    },
    ("format", "voice"),
)
_LOCATION: Final = Object({"city": STRING, "country": STRING, "region": STRING, "timezone": STRING})
_WEB_SEARCH: Final = Object(
    {
        "search_context_size": enum("low", "medium", "high"),
        "user_location": Tagged(
            "type", {"approximate": _under("approximate", _LOCATION)}, "a user location object"
        ),
    }
)


def _only_one_choice(body: JSONObject) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise Mismatch("unsupported_value", "only n=1 is supported", "n")


def _top_logprobs_need_logprobs(body: JSONObject) -> None:
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise Mismatch("invalid_value", "needs 'logprobs' to be true", "top_logprobs")


CHAT_COMPLETIONS: Final = Object(
    {
        "model": NON_EMPTY,
        "messages": Array(CHAT_MESSAGE, min_items=1, what="a non-empty array of messages"),
        "stream": BOOLEAN,
        "stream_options": STREAM_OPTIONS,
        "max_tokens": TOKEN_LIMIT,
        "max_completion_tokens": TOKEN_LIMIT,
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "n": Integer(),
        "presence_penalty": PENALTY,
        "frequency_penalty": PENALTY,
        "stop": STOP,
        "seed": SEED,
        "logprobs": BOOLEAN,
        "top_logprobs": Integer(0, 20),
        "logit_bias": LOGIT_BIAS,
        "user": STRING,
        "safety_identifier": STRING,
        "prompt_cache_key": STRING,
        "prompt_cache_retention": enum("in_memory", "24h"),
        "tools": Array(_TOOL, max_items=128, what="an array of at most 128 tools"),
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": BOOLEAN,
        "functions": Array(_FUNCTION, max_items=128, what="an array of at most 128 functions"),
        "function_call": OneOf(
            {str: enum("none", "auto"), dict: _NAMED},
            what="'none', 'auto' or an object naming a function",
        ),
        "response_format": _RESPONSE_FORMAT,
        "metadata": Map(
            String(max_length=512),
            keys=String(max_length=64),
            max_items=16,
            what="an object of at most 16 strings",
        ),
        "store": BOOLEAN,
        "reasoning_effort": enum("none", "minimal", "low", "medium", "high", "xhigh", "max"),
        "verbosity": enum("low", "medium", "high"),
        "service_tier": enum("auto", "default", "flex", "scale", "priority", "fast"),
        "modalities": Array(enum("text", "audio"), what="an array of 'text' or 'audio'"),
        "audio": _AUDIO,
        "prediction": Tagged(
            "type",
            {"content": Object({"content": _content(_TEXT_ONLY, "in a prediction")})},
            "a prediction object",
        ),
        "web_search_options": _WEB_SEARCH,
    },
    required=("model", "messages"),
    rules=(_only_one_choice, _needs_stream, _top_logprobs_need_logprobs),
)
"""``POST /v1/chat/completions``."""

_PROMPT_ITEMS: Final[Mapping[type, Schema]] = {
    str: Array(STRING),
    int: Tokens(),
    list: Array(Tokens(min_items=1)),
}


def _best_of_covers_n(body: JSONObject) -> None:
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and n is not None and best_of < n:
        raise Mismatch("invalid_value", f"must be at least 'n' ({n}), got {best_of}", "best_of")


COMPLETIONS: Final = Object(
    {
        "model": NON_EMPTY,
        "prompt": OneOf(
            {
                str: STRING,
                list: ByFirstItem(
                    _PROMPT_ITEMS,
                    what="a non-empty array of strings, of token ids or of token id arrays",
                ),
            },
            what="a string, an array of strings, an array of token ids or an array of token "
            "id arrays",
        ),
        "max_tokens": Integer(low=0),
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "n": Integer(1, 128),
        "best_of": Integer(0, 20),
        "stream": BOOLEAN,
        "stream_options": STREAM_OPTIONS,
        "stop": STOP,
        "echo": BOOLEAN,
        "logprobs": Integer(0, 5),
        "suffix": STRING,
        "seed": SEED,
        "user": STRING,
        "presence_penalty": PENALTY,
        "frequency_penalty": PENALTY,
        "logit_bias": LOGIT_BIAS,
    },
    required=("model", "prompt"),
    rules=(_needs_stream, _best_of_covers_n),
)
"""``POST /v1/completions``."""

EMBEDDINGS: Final = Object(
    {
        "model": NON_EMPTY,
        "input": OneOf(
            {
                str: NON_EMPTY,
                list: ByFirstItem(
                    {str: Array(NON_EMPTY), int: Tokens(), list: Array(Tokens(min_items=1))},
                    what="a non-empty array of at most 2048 strings, token ids or token id arrays",
                    max_items=2048,
                ),
            },
            what="a non-empty string, an array of strings, an array of token ids or an array "
            "of token id arrays",
        ),
        "encoding_format": enum("float", "base64"),
        "dimensions": Integer(low=1),
        "user": STRING,
        # Not OpenAI's, but the edge reads it (whether to stream the relayed answer).
        "stream": BOOLEAN,
        "stream_options": ANY_OBJECT,
    },
    required=("model", "input"),
)
"""``POST /v1/embeddings``."""


def _prompt_or_input(body: JSONObject) -> None:
    raise Mismatch(
        "missing_required_parameter",
        "required for /v1/completions ('input' for /v1/embeddings)",
        "prompt",
    )


COMPLETIONS_OR_EMBEDDINGS: Final = Object(
    {"model": NON_EMPTY}, required=("model",), rules=(_prompt_or_input,)
)
"""A tunnel body with neither a ``prompt`` nor an ``input``: refused, once its model is."""

TUNNEL_SCHEMAS: Final[Mapping[str, Schema]] = {
    "/v1/completions": COMPLETIONS,
    "/v1/embeddings": EMBEDDINGS,
}


def tunnel_schema(body: JSONObject, route: str | None = None) -> Schema:
    """The schema of a body for a tunnel-only route: the route's, or, without one, what the
    body is -- a completion if it has a ``prompt``, an embedding if it has an ``input``."""
    known = TUNNEL_SCHEMAS.get(route) if route is not None else None
    if known is not None:
        return known
    if "prompt" in body:
        return COMPLETIONS
    if "input" in body:
        return EMBEDDINGS
    return COMPLETIONS_OR_EMBEDDINGS


# --------------------------------------------------------------------------- parsing


@attrs.frozen(kw_only=True)
class ChatRequest:
    model: str
    body: dict[str, Any]
    stream: bool
    include_usage: bool


def parse_chat_request(raw: bytes, *, max_size: int | None = None) -> ChatRequest:
    """Parse and validate a chat-completions body (:data:`CHAT_COMPLETIONS`); raise
    :class:`~dispatcher.errors.BadRequest` naming the bad field. The body is kept as the
    client sent it."""
    body = parse(raw, CHAT_COMPLETIONS, max_size=max_size)
    options = body.get("stream_options")
    return ChatRequest(
        model=body["model"],
        body=body,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
    )


def parse_tunnel_body(
    raw: bytes, *, route: str | None = None, max_size: int | None = None
) -> dict[str, Any]:
    """Parse and validate a ``/v1/completions`` or ``/v1/embeddings`` body (without ``route``,
    the body says which: :func:`tunnel_schema`); raise :class:`~dispatcher.errors.BadRequest`
    naming the bad field. The body is kept as the client sent it."""
    body = load_object(raw, max_size=max_size)
    validate(body, tunnel_schema(body, route))
    return body
