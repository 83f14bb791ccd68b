"""An Anthropic Messages request: validated strictly, then translated to the OpenAI chat body
the gate, the nodes and the usage rows already speak.

:func:`parse_messages_request` checks the body against :data:`MESSAGES` (built from the
schema nodes of :mod:`dispatcher.api.validation`, with a strictness rule per object: a field
the Messages API does not define is a 400, as Anthropic answers it) and then the rules across
messages (a ``tool_result`` answers a ``tool_use`` of the message before it, a named
``tool_choice`` names one of the ``tools``). Every failure is a
:class:`~dispatcher.errors.BadRequest` whose message starts with the path of the field at
fault; the front end renders it as ``invalid_request_error``.

:func:`to_chat_body` is the translation (``docs/messages.md`` has the table):

* ``system`` -> a leading ``system`` message (text blocks joined by a blank line);
* a user message's ``tool_result`` blocks -> ``tool`` messages (in their order, before the
  message's text, which becomes a ``user`` message);
* an assistant message's ``tool_use`` blocks -> its ``tool_calls`` (``arguments`` = the
  ``input`` as JSON text), its text blocks -> its ``content``;
* ``tools`` -> function tools; ``tool_choice`` auto / any / tool / none -> ``"auto"`` /
  ``"required"`` / ``{"type": "function", ...}`` / ``"none"``;
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
* ``stop_sequences`` -> ``stop``; ``max_tokens``, ``temperature``, ``top_p``, ``stream`` as
  they are; ``metadata.user_id`` -> ``user``; ``echo`` (the built-in echo model's per-request
  knobs, ``nodes/adapters/echo.py``) as it is, as the chat and Responses routes forward it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

import attrs
import orjson

from ...errors import BadRequest
from ...shared.tokens import estimate_tokens
from ...wire import JSONObject
from .. import validation
from ..common import REASONING_EFFORT
from ..validation import (
    ANY_OBJECT,
    BOOLEAN,
    NON_EMPTY,
    STRING,
    Array,
    Enum,
    Integer,
    Mismatch,
    Number,
    Object,
    OneOf,
    Rule,
    String,
)

__all__ = [
    "MESSAGES",
    "MessagesRequest",
    "count_input_tokens",
    "parse_count_tokens_request",
    "parse_messages_request",
    "to_chat_body",
]

# --------------------------------------------------------------------------- strictness


def _known(*names: str) -> Rule:
    """The object may have only these fields (Anthropic's API refuses extra inputs); a
    ``null`` counts as absent, as everywhere in :mod:`~dispatcher.api.validation` (the SDK's
    ``model_dump()`` of a block it received writes its unset fields as ``null``)."""
    allowed = frozenset(names)

    def rule(value: JSONObject) -> None:
        for name, item in value.items():
            if name not in allowed and item is not None:
                raise Mismatch("unknown_parameter", "extra inputs are not permitted", name)

    return rule


def _strict(
    fields: Mapping[str, validation.Schema],
    required: tuple[str, ...] = (),
    *,
    tag: str | None = None,
    rules: tuple[Rule, ...] = (),
    what: str = "an object",
) -> Object:
    """An :class:`Object` whose fields are exactly ``fields`` (and its ``tag``)."""
    names = (*fields, *((tag,) if tag else ()))
    return Object(fields, required, rules=(*rules, _known(*names)), what=what)


@attrs.frozen
class Blocks:
    """A content block picked by its ``type``: ``variants`` are the types accepted where the
    block is (``where``: "a user message"); any other type, including the ones Anthropic
    defines and this edge does not translate (image, document, thinking...), is a 400 that
    names it."""

    variants: Mapping[str, Object]
    where: str

    def check(self, value: object, depth: int) -> None:
        if type(value) is not dict:
            raise Mismatch("invalid_type", f"must be a content block object, got {_kind(value)}")
        tag = value.get("type")
        if tag is None:
            raise Mismatch("missing_required_parameter", "a block type is required", "type")
        if type(tag) is not str:
            raise Mismatch("invalid_type", f"must be a string, got {_kind(tag)}", "type")
        block = self.variants.get(tag)
        if block is None:
            accepted = ", ".join(f"'{name}'" for name in self.variants)
            raise Mismatch(
                "unsupported_value",
                f"content blocks of type {_shown(tag)} are not supported in {self.where} "
                f"(supported: {accepted})",
                "type",
            )
        block.check(value, depth)

    def describe(self) -> str:
        return "a content block object"


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), "null" if value is None else "an array" if type(value) is list else "an object"
    )


def _shown(value: str) -> str:
    text = orjson.dumps(value).decode()
    return "'" + (text[1:-1] if len(text) <= 42 else text[1:38] + "...") + "'"


# --------------------------------------------------------------------------- the schema

_CACHE_CONTROL: Final = ANY_OBJECT
"""Prompt caching hints: accepted and ignored (no backend of ours caches by them)."""
TOOL_NAME: Final = String(
    pattern=re.compile(r"[a-zA-Z0-9_-]{1,64}"),
    what="a name of 1 to 64 letters, digits, underscores or dashes",
)
_TEXT: Final = _strict({"text": STRING, "cache_control": _CACHE_CONTROL}, ("text",), tag="type")
_TEXT_BLOCKS: Final = Array(Blocks({"text": _TEXT}, "'system'"), what="an array of text blocks")
_TEXT_OR_BLOCKS: Final = OneOf(
    {str: STRING, list: _TEXT_BLOCKS}, what="a string or an array of text blocks"
)


def _system_has_something(message: JSONObject) -> None:
    if message.get("content") is None and not message.get("output_config"):
        raise Mismatch(
            "missing_required_parameter",
            "a system message needs content or output_config",
            "content",
        )


_DIRECT: Final = _strict({"type": Enum(("direct",))}, ("type",))
"""A ``tool_use``'s ``caller``: only the model itself (server tools' callers are not
supported)."""
_TOOL_USE: Final = _strict(
    {
        "id": NON_EMPTY,
        "name": TOOL_NAME,
        "input": ANY_OBJECT,
        "caller": _DIRECT,
        "cache_control": _CACHE_CONTROL,
    },
    ("id", "name", "input"),
    tag="type",
)
_TOOL_RESULT: Final = _strict(
    {
        "tool_use_id": NON_EMPTY,
        "content": OneOf(
            {str: STRING, list: Array(Blocks({"text": _TEXT}, "a tool_result's content"))},
            what="a string or an array of text blocks",
        ),
        "is_error": BOOLEAN,
        "cache_control": _CACHE_CONTROL,
    },
    ("tool_use_id",),
    tag="type",
)


def _content(where: str, blocks: Mapping[str, Object]) -> OneOf:
    return OneOf(
        {str: STRING, list: Array(Blocks(blocks, where), what="an array of content blocks")},
        what="a string or an array of content blocks",
    )


EFFORTS: Final = ("low", "medium", "high", "xhigh", "max")
_EFFORT: Final = Enum(EFFORTS)
_MESSAGE_ROLES: Final[Mapping[str, Object]] = {
    # A system message in the conversation (beta ``mid-conversation-system-2026-04-07``):
    # kept in place; ``clear_at: "next_user_message"`` shows it only until a later user
    # message; its ``output_config.effort`` is the turn's effort.
    "system": _strict(
        {
            "content": _TEXT_OR_BLOCKS,
            "clear_at": Enum(("next_user_message", "never")),
            "output_config": _strict({"effort": _EFFORT}),
        },
        tag="role",
        rules=(_system_has_something,),
    ),
    "user": _strict(
        {"content": _content("a user message", {"text": _TEXT, "tool_result": _TOOL_RESULT})},
        ("content",),
        tag="role",
    ),
    "assistant": _strict(
        {"content": _content("an assistant message", {"text": _TEXT, "tool_use": _TOOL_USE})},
        ("content",),
        tag="role",
    ),
}
MESSAGE: Final = validation.Tagged("role", _MESSAGE_ROLES, "a message object")


def _input_schema_is_an_object(tool: JSONObject) -> None:
    if tool["input_schema"].get("type") != "object":
        raise Mismatch("invalid_value", "must be a JSON schema of type 'object'", "input_schema")


def _client_tool(tool: JSONObject) -> None:
    kind = tool.get("type")
    if kind is not None and kind != "custom":
        shown = _shown(kind) if isinstance(kind, str) else _kind(kind)
        raise Mismatch(
            "unsupported_value",
            f"tools of type {shown} (Anthropic's server and client-defined built-in tools) "
            "are not supported; only custom tools (name, description, input_schema) are",
            "type",
        )


@attrs.frozen
class _Tool:
    """A tool: its ``type`` first (a server tool has no ``input_schema`` to miss), then the
    custom tool's fields."""

    custom: Object

    def check(self, value: object, depth: int) -> None:
        if type(value) is dict:
            _client_tool(value)
        self.custom.check(value, depth)

    def describe(self) -> str:
        return self.custom.describe()


_TOOL: Final = _Tool(
    _strict(
        {
            "name": TOOL_NAME,
            "description": STRING,
            "input_schema": ANY_OBJECT,
            "type": STRING,
            "strict": BOOLEAN,
            "eager_input_streaming": BOOLEAN,
            "cache_control": _CACHE_CONTROL,
        },
        ("name", "input_schema"),
        rules=(_input_schema_is_an_object,),
        what="a tool object",
    )
)
_PARALLEL: Final = {"disable_parallel_tool_use": BOOLEAN}
_TOOL_CHOICE: Final = validation.Tagged(
    "type",
    {
        "auto": _strict(_PARALLEL, tag="type"),
        "any": _strict(_PARALLEL, tag="type"),
        "tool": _strict({"name": TOOL_NAME, **_PARALLEL}, ("name",), tag="type"),
        "none": _strict({}, tag="type"),
    },
    "a tool choice object",
)
UNSUPPORTED: Final[Mapping[str, str]] = {
    "top_k": "top_k sampling has no equivalent in the chat completions backends",
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported",
    "compaction": "server-side compaction is not supported",
    "fallbacks": "fallback models are not supported (configure the model group's candidates)",
}
"""Fields the Messages API defines and this edge cannot honour: a 400 naming them."""

_THINKING_DISPLAY: Final = {"display": Enum(("summarized", "omitted"))}
_THINKING: Final = validation.Tagged(
    "type",
    {
        "adaptive": _strict(_THINKING_DISPLAY, tag="type"),
        "enabled": _strict(
            {"budget_tokens": Integer(low=1), **_THINKING_DISPLAY}, ("budget_tokens",), tag="type"
        ),
        "between_tools": _strict({}, tag="type"),
        "disabled": _strict({}, tag="type"),
    },
    "a thinking object",
)
_OUTPUT_CONFIG: Final = _strict(
    {
        "effort": _EFFORT,
        "format": validation.Tagged(
            "type",
            {"json_schema": _strict({"schema": ANY_OBJECT}, ("schema",), tag="type")},
            "an output format object",
        ),
    }
)
_ACCEPTED: Final = String(max_length=1024)

_FIELDS: Final[Mapping[str, validation.Schema]] = {
    "model": NON_EMPTY,
    "max_tokens": Integer(low=1),
    "system": _TEXT_OR_BLOCKS,
    "messages": Array(MESSAGE, min_items=1, what="a non-empty array of messages"),
    "tools": Array(_TOOL, what="an array of tools"),
    "tool_choice": _TOOL_CHOICE,
    "stop_sequences": Array(STRING, what="an array of strings"),
    "temperature": Number(0, 1),
    "top_p": Number(0, 1),
    "stream": BOOLEAN,
    "metadata": _strict({"user_id": String(max_length=256)}),
    "thinking": _THINKING,
    "output_config": _OUTPUT_CONFIG,
    # accepted and ignored (docs/messages.md): server-side context editing (the edge forwards
    # the whole conversation it is sent), prompt caching hints, the service tier, a speed,
    # where inference runs
    "context_management": ANY_OBJECT,
    "cache_control": ANY_OBJECT,
    "service_tier": Enum(("auto", "standard_only")),
    "speed": _ACCEPTED,
    "inference_geo": _ACCEPTED,
    "echo": ANY_OBJECT,
}


def _no_unsupported(body: JSONObject) -> None:
    for name, why in UNSUPPORTED.items():
        if body.get(name) is not None:
            raise Mismatch("unsupported_parameter", f"not supported: {why}", name)


def _top_level(fields: Mapping[str, validation.Schema], required: tuple[str, ...]) -> Object:
    # The unsupported fields are known (their rule names them), the rest are extra inputs.
    return Object(
        fields, required, rules=(_no_unsupported, _known(*fields, *UNSUPPORTED)), what="an object"
    )


MESSAGES: Final = _top_level(_FIELDS, ("model", "max_tokens", "messages"))
"""``POST /v1/messages``."""

COUNT_TOKENS: Final = _top_level(_FIELDS, ("model", "messages"))
"""``POST /v1/messages/count_tokens``: whatever ``/v1/messages`` accepts (``max_tokens``
optional), as Claude Code sends it the same body; only the input is counted."""

# --------------------------------------------------------------------------- parsing


@attrs.frozen(kw_only=True)
class MessagesRequest:
    model: str
    """The name the client asked for (every answer says it)."""
    body: JSONObject
    """The client's Messages body, validated."""
    stream: bool
    stop_sequences: tuple[str, ...]


def _validate(raw: bytes, shape: Object) -> JSONObject:
    body = validation.load_object(raw)
    validation.validate(body, shape)
    _check_conversation(body)
    return body


def parse_messages_request(raw: bytes) -> MessagesRequest:
    """Parse and validate a ``POST /v1/messages`` body; raise :class:`BadRequest` naming the
    field at fault."""
    body = _validate(raw, MESSAGES)
    return MessagesRequest(
        model=body["model"],
        body=body,
        stream=body.get("stream") is True,
        stop_sequences=tuple(body.get("stop_sequences") or ()),
    )


def parse_count_tokens_request(raw: bytes) -> JSONObject:
    """Parse and validate a ``POST /v1/messages/count_tokens`` body."""
    return _validate(raw, COUNT_TOKENS)


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(f"'{param}': {message}", param=param, code="invalid_value")


def _check_conversation(body: JSONObject) -> None:
    """The rules across fields: ``tool_choice`` that needs tools has them (and names one of
    them); each ``tool_result`` answers a ``tool_use`` of the assistant message right
    before it."""
    tools = body.get("tools") or []
    names = {tool["name"] for tool in tools}
    choice = body.get("tool_choice")
    if choice is not None and choice["type"] in ("any", "tool") and not tools:
        raise _bad(f"type '{choice['type']}' needs 'tools'", "tool_choice")
    if choice is not None and choice["type"] == "tool" and choice["name"] not in names:
        raise _bad(f"names {_shown(choice['name'])}, which is none of the tools", "tool_choice")
    if len(names) != len(tools):
        raise _bad("tool names must be unique", "tools")
    offered: set[str] = set()
    for index, message in enumerate(body["messages"]):
        if message["role"] == "system":
            continue  # between a tool use and its result, it changes neither
        content = message["content"]
        blocks = content if isinstance(content, list) else []
        if message["role"] == "assistant":
            offered = {block["id"] for block in blocks if block["type"] == "tool_use"}
            continue
        for number, block in enumerate(blocks):
            if block["type"] == "tool_result" and block["tool_use_id"] not in offered:
                raise _bad(
                    f"tool_use_id {_shown(block['tool_use_id'])} answers no tool_use block of "
                    "the assistant message right before it",
                    f"messages[{index}].content[{number}].tool_use_id",
                )
        offered = set()


# --------------------------------------------------------------------------- translation


def _text(content: str | list[JSONObject]) -> str:
    if isinstance(content, str):
        return content
    return "".join(block["text"] for block in content if block["type"] == "text")


def _system_text(system: str | list[JSONObject]) -> str:
    if isinstance(system, str):
        return system
    return "\n\n".join(block["text"] for block in system)


def _tool_result_text(block: JSONObject) -> str:
    content = block.get("content")
    text = "" if content is None else content if isinstance(content, str) else _text(content)
    if block.get("is_error") is True:
        return f"[tool error] {text}" if text else "[tool error]"
    return text


def _translate_message(message: JSONObject) -> list[JSONObject]:
    content = message["content"]
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    if message["role"] == "assistant":
        calls = [
            {
                "id": block["id"],
                "type": "function",
                "function": {
                    "name": block["name"],
                    "arguments": orjson.dumps(block["input"]).decode(),
                },
            }
            for block in content
            if block["type"] == "tool_use"
        ]
        text = _text(content)
        out: JSONObject = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            out["tool_calls"] = calls
        return [out]
    translated: list[JSONObject] = [
        {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _tool_result_text(block)}
        for block in content
        if block["type"] == "tool_result"
    ]
    texts = [block for block in content if block["type"] == "text"]
    if texts or not translated:
        translated.append({"role": "user", "content": _text(texts)})
    return translated


def _shown_messages(messages: list[JSONObject]) -> list[JSONObject]:
    """The conversation as the model is shown it: a system message with ``clear_at:
    "next_user_message"`` is left out once a user message follows it, and one with no
    content (only an ``output_config``) shows nothing."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    return [
        message
        for index, message in enumerate(messages)
        if message["role"] != "system"
        or (
            message.get("content") is not None
            and not (message.get("clear_at") == "next_user_message" and index < last_user)
        )
    ]


def to_chat_messages(body: JSONObject) -> list[JSONObject]:
    """The chat messages of a validated Messages body: ``system`` first, then each message
    translated in its place -- a system message in the conversation as a ``system``
    message where it is, except between an assistant's tool calls and their results (chat
    wants the ``tool`` messages right after the calls): there it follows the results."""
    messages: list[JSONObject] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _system_text(body["system"])})
    held: list[JSONObject] = []  # system messages right after an assistant's tool calls
    for message in _shown_messages(body["messages"]):
        if message["role"] == "system":
            system = {"role": "system", "content": _system_text(message["content"])}
            last = messages[-1] if messages else None
            if held or (
                last is not None and last["role"] == "assistant" and last.get("tool_calls")
            ):
                held.append(system)
            else:
                messages.append(system)
            continue
        translated = _translate_message(message)
        results = [m for m in translated if m["role"] == "tool"]
        messages.extend(results)
        messages.extend(held)
        held = []
        messages.extend(m for m in translated if m["role"] != "tool")
    messages.extend(held)
    return messages


_BUDGET_EFFORTS: Final = ((4096, "low"), (16384, "medium"))
"""A thinking budget below each bound means that effort; above the last, ``high``."""


def reasoning_effort(body: JSONObject) -> str | None:
    """The effort a validated Messages body asks the model to reason with: the latest
    system message's ``output_config.effort``, else the request's, else from ``thinking``
    (``enabled``: by its budget; ``adaptive``: ``medium``); None with thinking disabled or
    not asked for. A model that does not reason is not given it (``api.common``)."""
    thinking = body.get("thinking") or {}
    if thinking.get("type") == "disabled":
        return None
    for message in reversed(body["messages"]):
        effort = (message.get("output_config") or {}).get("effort")
        if message["role"] == "system" and effort is not None:
            return str(effort)
    effort = (body.get("output_config") or {}).get("effort")
    if effort is not None:
        return str(effort)
    if thinking.get("type") == "enabled":
        budget = thinking["budget_tokens"]
        return next((name for bound, name in _BUDGET_EFFORTS if budget < bound), "high")
    if thinking.get("type") in ("adaptive", "between_tools"):
        return "medium"
    return None


_TOOL_CHOICES: Final[Mapping[str, str]] = {"auto": "auto", "any": "required", "none": "none"}


def to_chat_body(body: JSONObject) -> JSONObject:
    """The OpenAI chat-completions body a validated Messages ``body`` means (see the module
    docstring)."""
    chat: JSONObject = {"model": body["model"], "messages": to_chat_messages(body)}
    if body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences"):
        chat["stop"] = list(body["stop_sequences"])
    if body.get("stream") is True:
        chat["stream"] = True
    if body.get("echo") is not None:
        chat["echo"] = body["echo"]  # the built-in echo model's knobs, as chat forwards them
    user = (body.get("metadata") or {}).get("user_id")
    if user is not None:
        chat["user"] = user
    effort = reasoning_effort(body)
    if effort is not None:
        chat[REASONING_EFFORT] = effort
    output_format = (body.get("output_config") or {}).get("format")
    if output_format is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": output_format["schema"]},
        }
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_function_tool(tool) for tool in tools]
    choice = body.get("tool_choice")
    if choice is not None and tools:
        kind = choice["type"]
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            chat["tool_choice"] = _TOOL_CHOICES[kind]
        if choice.get("disable_parallel_tool_use") is True and kind != "none":
            chat["parallel_tool_calls"] = False
    return chat


def _function_tool(tool: JSONObject) -> JSONObject:
    function: JSONObject = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


# --------------------------------------------------------------------------- counting


def count_input_tokens(body: JSONObject) -> int:
    """The estimate of a validated Messages (or count_tokens) body's input, by the one token
    estimator (:func:`~dispatcher.shared.tokens.estimate_tokens`): ``system``, each
    message's text, tool uses (name and input JSON) and tool results, and each tool's name,
    description and input schema."""
    tokens = 0
    if body.get("system") is not None:
        tokens += estimate_tokens(_system_text(body["system"]))
    for message in _shown_messages(body["messages"]):
        content = message["content"]
        if isinstance(content, str):
            tokens += estimate_tokens(content)
            continue
        for block in content:
            kind = block["type"]
            if kind == "text":
                tokens += estimate_tokens(block["text"])
            elif kind == "tool_use":
                tokens += estimate_tokens(
                    block["name"] + " " + orjson.dumps(block["input"]).decode()
                )
            elif kind == "tool_result":
                tokens += estimate_tokens(_tool_result_text(block))
    for tool in body.get("tools") or ():
        described = " ".join(
            (
                tool["name"],
                tool.get("description") or "",
                orjson.dumps(tool["input_schema"]).decode(),
            )
        )
        tokens += estimate_tokens(described)
    return tokens
