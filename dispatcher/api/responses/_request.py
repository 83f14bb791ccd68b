"""A Responses request: validated (:data:`REQUEST`), normalized to input items, and
translated to the OpenAI chat body the gate, the nodes and the usage rows speak
(:func:`chat_body`). ``docs/responses.md`` has the tables."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import orjson

from ...errors import BadRequest
from ...wire import JSONObject
from .. import validation
from ..common import REASONING_EFFORT
from ..openai._request import TEMPERATURE, TOKEN_LIMIT, TOP_P  # the ranges chat has
from ..validation import Mismatch

__all__ = [
    "REQUEST",
    "ParsedResponsesRequest",
    "chat_body",
    "items_to_chat_messages",
    "message_item",
    "parse_responses_request",
]


def _only(*known: str) -> validation.Rule:
    """A rule refusing any field but ``known``, naming it."""
    allowed = frozenset(known)

    def rule(value: JSONObject) -> None:
        for name in value:
            if name not in allowed:
                raise Mismatch("unsupported_parameter", "is not supported by this endpoint", name)

    return rule


def _strict(
    fields: Mapping[str, validation.Schema],
    required: tuple[str, ...] = (),
    *,
    rules: tuple[validation.Rule, ...] = (),
    what: str = "an object",
) -> validation.Object:
    return validation.Object(fields, required, rules=(_only(*fields), *rules), what=what)


_TEXT_PART: Final = _strict({"type": validation.STRING, "text": validation.STRING}, ("text",))
_OUTPUT_TEXT_PART: Final = _strict(
    {
        "type": validation.STRING,
        "text": validation.STRING,
        "annotations": validation.Array(validation.ANY_OBJECT, max_items=0, what="an empty array"),
        "logprobs": validation.Array(validation.ANY_OBJECT, what="an array"),
    },
    ("text",),
)
_REFUSAL_PART: Final = _strict(
    {"type": validation.STRING, "refusal": validation.STRING}, ("refusal",)
)


def _message_content(parts: Mapping[str, validation.Object], where: str) -> validation.OneOf:
    part = validation.Tagged("type", parts, "a content part object", where)
    return validation.OneOf(
        {str: validation.STRING, list: validation.Array(part, what="an array of content parts")},
        what="a string or an array of content parts",
    )


_INPUT_CONTENT: Final = _message_content({"input_text": _TEXT_PART}, "in an input message")
_ASSISTANT_CONTENT: Final = _message_content(
    {"output_text": _OUTPUT_TEXT_PART, "refusal": _REFUSAL_PART, "input_text": _TEXT_PART},
    "in an assistant message",
)
_STATUS: Final = validation.enum("in_progress", "completed", "incomplete")
_MESSAGE_FIELDS: Final[Mapping[str, validation.Schema]] = {
    "type": validation.STRING,
    "role": validation.STRING,
    "id": validation.STRING,
    "status": _STATUS,
}
_MESSAGES: Final[Mapping[str, validation.Object]] = {
    role: _strict({**_MESSAGE_FIELDS, "content": _INPUT_CONTENT}, ("content",))
    for role in ("user", "system", "developer")
}
_CALLER: Final = validation.ANY_OBJECT
"""Who made a call (``{"type": "direct"}`` or a program's): accepted, not needed."""
_OUTPUT: Final = validation.OneOf(
    {
        str: validation.STRING,
        list: validation.Array(
            validation.Tagged("type", {"input_text": _TEXT_PART}, "an output part"),
            what="an array of input_text parts",
        ),
    },
    what="a string or an array of input_text parts",
)
_REASONING_ITEM: Final = _strict(
    {
        "type": validation.STRING,
        "id": validation.STRING,
        "summary": validation.Array(validation.ANY_OBJECT, what="an array of summary parts"),
        "content": validation.Array(validation.ANY_OBJECT, what="an array of reasoning parts"),
        "encrypted_content": validation.STRING,
        "status": _STATUS,
    },
)


def _call(value: str) -> validation.Object:
    """A ``function_call`` (its ``arguments``) or ``custom_tool_call`` (its ``input``)."""
    return _strict(
        {
            "type": validation.STRING,
            "id": validation.STRING,
            "call_id": validation.NON_EMPTY,
            "name": validation.NON_EMPTY,
            "namespace": validation.NON_EMPTY,
            value: validation.STRING,
            "caller": _CALLER,
            "status": _STATUS,
        },
        ("call_id", "name", value),
    )


_CALL_OUTPUT: Final = _strict(
    {
        "type": validation.STRING,
        "id": validation.STRING,
        "call_id": validation.NON_EMPTY,
        "output": _OUTPUT,
        "status": _STATUS,
    },
    ("call_id", "output"),
)
_ITEMS: Final[Mapping[str, validation.Schema]] = {
    "message": validation.Tagged(
        "role",
        {
            **_MESSAGES,
            "assistant": _strict({**_MESSAGE_FIELDS, "content": _ASSISTANT_CONTENT}, ("content",)),
        },
        "a message item",
    ),
    "function_call": _call("arguments"),
    "function_call_output": _CALL_OUTPUT,
    "custom_tool_call": _call("input"),
    "custom_tool_call_output": _CALL_OUTPUT,
    # A reasoning item of an earlier turn (what a reasoning model produced, often only as
    # encrypted content): accepted and dropped, as no engine behind the edge can read another
    # model's reasoning.
    "reasoning": _REASONING_ITEM,
}
_ITEM_TYPES: Final = ", ".join(_ITEMS)


@attrs.frozen
class _Item:
    """An input item: its ``type`` (``message`` when absent, as the API's easy input
    message has none) picks its schema; other item types are refused by name."""

    def check(self, value: object, depth: int) -> None:
        if type(value) is not dict:
            raise Mismatch("invalid_type", "must be an input item object")
        kind = value.get("type", "message")
        item = _ITEMS.get(kind) if type(kind) is str else None
        if item is None:
            if type(kind) is not str:
                raise Mismatch("invalid_type", "must be a string", "type")
            raise Mismatch(
                "unsupported_value",
                f"item type {kind!r} is not supported: use one of {_ITEM_TYPES}",
                "type",
            )
        item.check(value, depth)

    def describe(self) -> str:
        return "an input item object"


_TOOL_NAME: Final = validation.String(
    pattern=re.compile(r"[a-zA-Z0-9_-]{1,64}"),
    what="a name of 1 to 64 letters, digits, underscores or dashes",
)
_TOOL_COMMON: Final[Mapping[str, validation.Schema]] = {
    "type": validation.STRING,
    "name": _TOOL_NAME,
    "description": validation.STRING,
    # tool search and programmatic calls: what the backend does not do, so every tool is
    # loaded and called directly
    "defer_loading": validation.BOOLEAN,
    "allowed_callers": validation.Array(validation.STRING, what="an array of strings"),
}
_FUNCTION_TOOL: Final = _strict(
    {
        **_TOOL_COMMON,
        "parameters": validation.ANY_OBJECT,
        "strict": validation.BOOLEAN,
        "output_schema": validation.ANY_OBJECT,
    },
    ("name",),
)
_CUSTOM_FORMAT: Final = validation.Tagged(
    "type",
    {
        "text": _strict({"type": validation.STRING}),
        "grammar": _strict(
            {
                "type": validation.STRING,
                "syntax": validation.enum("lark", "regex"),
                "definition": validation.STRING,
            },
            ("syntax", "definition"),
        ),
    },
    "a custom tool format object",
)
_CUSTOM_TOOL: Final = _strict({**_TOOL_COMMON, "format": _CUSTOM_FORMAT}, ("name",))
_NAMESPACE_TOOL: Final = _strict(
    {
        "type": validation.STRING,
        "name": _TOOL_NAME,
        "description": validation.STRING,
        "tools": validation.Array(
            validation.Tagged(
                "type",
                {"function": _FUNCTION_TOOL, "custom": _CUSTOM_TOOL},
                "a function or custom tool object",
                "in a namespace",
            ),
            min_items=1,
            what="a non-empty array of function or custom tools",
        ),
    },
    ("name", "tools"),
)
BUILT_IN_TOOLS: Final = (
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "mcp",
    "computer",
    "computer_use_preview",
    "local_shell",
    "shell",
    "apply_patch",
    "tool_search",
    "programmatic_tool_calling",
)
"""The Responses API's built-in tools: run by OpenAI's servers, or called with actions only
OpenAI's models are trained for. No backend of the edge runs them: a request offering them
has them dropped (``x-dispatcher-dropped-tools`` says which), or refused where the edge is
configured so (``[responses] built_in_tools = "refuse"``)."""


@attrs.frozen
class _Tool:
    """A tool: ``function``, ``custom`` and ``namespace`` by their schemas; a built-in tool
    by its ``type`` only (it is dropped, or refused by the route); any other type refused."""

    variants: Mapping[str, validation.Object]

    def check(self, value: object, depth: int) -> None:
        if type(value) is not dict:
            raise Mismatch("invalid_type", "must be a tool object")
        kind = value.get("type")
        if type(kind) is not str:
            if kind is None:
                raise Mismatch("missing_required_parameter", "a tool type is required", "type")
            raise Mismatch("invalid_type", "must be a string", "type")
        variant = self.variants.get(kind)
        if variant is not None:
            variant.check(value, depth)
        elif kind not in BUILT_IN_TOOLS:
            raise Mismatch(
                "invalid_value",
                f"tool type {kind!r} is unknown: use function, custom or namespace (or one "
                "of the API's built-in tools, which this edge drops)",
                "type",
            )
        else:
            validation.ANY_OBJECT.check(value, depth)

    def describe(self) -> str:
        return "a tool object"


_TOOL: Final = _Tool(
    {"function": _FUNCTION_TOOL, "custom": _CUSTOM_TOOL, "namespace": _NAMESPACE_TOOL}
)
_NAMED_CHOICE: Final = _strict({"type": validation.STRING, "name": validation.NON_EMPTY}, ("name",))
_TOOL_CHOICE: Final = validation.OneOf(
    {
        str: validation.enum("none", "auto", "required"),
        dict: validation.Tagged(
            "type",
            {"function": _NAMED_CHOICE, "custom": _NAMED_CHOICE},
            "a tool choice object",
        ),
    },
    what='"none", "auto", "required" or a function or custom tool choice object',
)
_FORMAT: Final = validation.Tagged(
    "type",
    {
        "text": _strict({"type": validation.STRING}),
        "json_object": _strict({"type": validation.STRING}),
        "json_schema": _strict(
            {
                "type": validation.STRING,
                "name": validation.NON_EMPTY,
                "schema": validation.ANY_OBJECT,
                "description": validation.STRING,
                "strict": validation.BOOLEAN,
            },
            ("name", "schema"),
        ),
    },
    "a text format object",
)
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARY: Final = validation.enum("auto", "concise", "detailed")
_REASONING: Final = _strict(
    {
        "effort": validation.Enum(REASONING_EFFORTS),
        "summary": _SUMMARY,
        "generate_summary": _SUMMARY,
        "context": validation.enum("auto", "current_turn", "all_turns"),
        "mode": validation.STRING,
    }
)
INCLUDABLE: Final = (
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)
"""What ``include`` may ask for: each is accepted, and none adds anything to an answer of
this edge (no reasoning items, logprobs or built-in tool calls are produced)."""
_ACCEPTED_STRING: Final = validation.String(max_length=1024)


def _not_in_background(body: JSONObject) -> None:
    if body.get("background") is True:
        raise Mismatch(
            "unsupported_value",
            "background responses are not supported: leave it out or false, and keep the "
            "connection (stream: true keeps a long answer coming)",
            "background",
        )


REQUEST: Final = _strict(
    {
        "model": validation.NON_EMPTY,
        "input": validation.OneOf(
            {
                str: validation.STRING,
                list: validation.Array(_Item(), what="an array of input items"),
            },
            what="a string or an array of input items",
        ),
        "instructions": validation.STRING,
        "tools": validation.Array(_TOOL, what="an array of tools"),
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": validation.BOOLEAN,
        "max_output_tokens": TOKEN_LIMIT,
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "stream": validation.BOOLEAN,
        "stream_options": _strict({"include_obfuscation": validation.BOOLEAN}),
        "metadata": validation.Map(
            validation.String(max_length=512),
            keys=validation.String(max_length=64),
            max_items=16,
            what="an object of at most 16 string values",
        ),
        "store": validation.BOOLEAN,
        "previous_response_id": validation.NON_EMPTY,
        "text": _strict({"format": _FORMAT, "verbosity": validation.enum("low", "medium", "high")}),
        "truncation": validation.enum("disabled"),
        "reasoning": _REASONING,
        "include": validation.Array(
            validation.Enum(INCLUDABLE), what="an array of includable names"
        ),
        "prompt_cache_key": _ACCEPTED_STRING,
        "prompt_cache_retention": validation.enum("in_memory", "24h"),
        "service_tier": validation.enum("auto", "default", "flex", "scale", "priority"),
        "safety_identifier": _ACCEPTED_STRING,
        "user": _ACCEPTED_STRING,
        "client_metadata": validation.ANY_OBJECT,
        "background": validation.BOOLEAN,
        # The built-in echo model's per-request knobs (nodes/adapters/echo.py), forwarded as
        # the chat routes forward them: what the tests inject faults and tool calls with.
        "echo": validation.ANY_OBJECT,
    },
    ("model", "input"),
    rules=(_not_in_background,),
)
"""What ``POST /v1/responses`` accepts; any other field is answered 400 naming it
(``docs/responses.md`` says, per field, what is honoured and what accepted and ignored)."""


@attrs.frozen
class ClientTool:
    """A tool as the client named it: what a call of its chat function is answered as."""

    name: str
    namespace: str | None = None
    """The ``namespace`` tool it came in (its chat function's name is flattened)."""
    custom: bool = False
    """A ``custom`` tool: its chat function takes one string, ``input``, and a call of it is
    answered as a ``custom_tool_call``."""


def chat_tool_name(name: str, namespace: str | None) -> str:
    """The chat function's name of a client's tool: its own name, or for a tool inside a
    namespace ``{namespace}__{name}`` (shortened with a digest of both past the chat
    completions limit of 64 characters). The same for the same two names, so the tool calls
    of a stored conversation keep naming the same function."""
    if namespace is None:
        return name
    flat = f"{namespace}__{name}"
    if len(flat) <= 64:
        return flat
    digest = hashlib.sha256(f"{namespace}.{name}".encode()).hexdigest()[:8]
    return f"{flat[:55]}_{digest}"


CUSTOM_TOOL_PARAMETERS: Final[JSONObject] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's input, as text."}},
    "required": ["input"],
    "additionalProperties": False,
}
"""A ``custom`` tool as a chat function: one string argument, ``input``."""


@attrs.frozen
class ToolPlan:
    """The request's tools as the chat backends take them: function tools (namespaces
    flattened, custom tools as functions of one string), what each chat name means to the
    client, and the built-in tools dropped."""

    chat: tuple[JSONObject, ...] = ()
    by_chat_name: Mapping[str, ClientTool] = attrs.field(factory=dict)
    dropped: tuple[str, ...] = ()
    """The types of the built-in tools dropped (each once, in order)."""

    def client_tool(self, chat_name: str) -> ClientTool:
        """What a call of ``chat_name`` is (a plain function when the plan has no such name:
        the model called a tool it was not offered)."""
        return self.by_chat_name.get(chat_name) or ClientTool(chat_name)

    def choice_name(self, name: str) -> str:
        """The chat name a ``tool_choice`` naming ``name`` means: a tool of that chat name, or
        else the one tool inside a namespace with that name."""
        if name in self.by_chat_name:
            return name
        inside = [chat for chat, tool in self.by_chat_name.items() if tool.name == name]
        return inside[0] if len(inside) == 1 else name


def plan_tools(tools: Sequence[JSONObject]) -> ToolPlan:
    """The :class:`ToolPlan` of a validated request's ``tools``; raises :class:`BadRequest`
    when two tools would be one chat function."""
    chat: list[JSONObject] = []
    by_chat_name: dict[str, ClientTool] = {}
    dropped: list[str] = []

    def add(tool: JSONObject, where: str, namespace: JSONObject | None) -> None:
        custom = tool["type"] == "custom"
        space = None if namespace is None else namespace["name"]
        name = chat_tool_name(tool["name"], space)
        if name in by_chat_name:
            raise BadRequest(
                f"'{where}.name': the tool name {tool['name']!r} is given twice"
                + (
                    ""
                    if space is None
                    else f" (as {name!r}, the name of namespace {space!r}'s tool)"
                ),
                param=f"{where}.name",
                code="invalid_value",
            )
        by_chat_name[name] = ClientTool(tool["name"], space, custom)
        function: JSONObject = {"name": name}
        description = _described(tool, namespace)
        if description:
            function["description"] = description
        if custom:
            function["parameters"] = CUSTOM_TOOL_PARAMETERS
        else:
            for key in ("parameters", "strict"):
                if tool.get(key) is not None:
                    function[key] = tool[key]
        chat.append({"type": "function", "function": function})

    for index, tool in enumerate(tools):
        kind = tool["type"]
        if kind == "namespace":
            for inner, member in enumerate(tool["tools"]):
                add(member, f"tools[{index}].tools[{inner}]", tool)
        elif kind in ("function", "custom"):
            add(tool, f"tools[{index}]", None)
        elif kind not in dropped:
            dropped.append(kind)
    return ToolPlan(tuple(chat), by_chat_name, tuple(dropped))


def _described(tool: JSONObject, namespace: JSONObject | None) -> str:
    """A chat function's description: the tool's, with what its custom format and its
    namespace say."""
    parts = [tool.get("description") or ""]
    text_format = tool.get("format") if tool["type"] == "custom" else None
    if isinstance(text_format, dict) and text_format["type"] == "grammar":
        parts.append(
            f"The input must match this {text_format['syntax']} grammar:\n"
            + text_format["definition"]
        )
    if namespace is not None and namespace.get("description"):
        parts.append(f"(One of the tools of {namespace['name']}: {namespace['description']})")
    return "\n\n".join(part for part in parts if part)


@attrs.frozen(kw_only=True)
class ParsedResponsesRequest:
    model: str
    body: JSONObject
    """The request as the client sent it (validated)."""
    items: tuple[JSONObject, ...]
    """The request's own input items, normalized (a string input is one user message;
    reasoning items dropped)."""
    stream: bool
    store: bool
    tools: ToolPlan = ToolPlan()


def parse_responses_request(raw: bytes, *, max_size: int | None = None) -> ParsedResponsesRequest:
    """Parse and validate a ``POST /v1/responses`` body (:data:`REQUEST`); raise
    :class:`BadRequest` naming the bad field."""
    body = validation.parse(raw, REQUEST, max_size=max_size)
    given = body["input"]
    if isinstance(given, str):
        items: list[JSONObject] = [message_item("user", given)]
    else:
        items = [normal for item in given if (normal := _normalize_item(item)) is not None]
    if not items:
        raise BadRequest(
            "'input': must not be empty (reasoning items alone are dropped)",
            param="input",
            code="invalid_value",
        )
    return ParsedResponsesRequest(
        model=body["model"],
        body=body,
        items=tuple(items),
        stream=body.get("stream") is True,
        store=body.get("store") is not False,
        tools=plan_tools(body.get("tools") or ()),
    )


def message_item(role: str, text: str) -> JSONObject:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def _normalize_item(item: JSONObject) -> JSONObject | None:
    """An input item as it is stored: messages with typed content parts, calls and their
    outputs with only what the conversation needs, no client ids; None for a reasoning item
    (dropped)."""
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
    if kind == "reasoning":
        return None
    if kind in ("function_call", "custom_tool_call"):
        value = "arguments" if kind == "function_call" else "input"
        call: JSONObject = {"type": kind, "call_id": item["call_id"], "name": item["name"]}
        if item.get("namespace") is not None:
            call["namespace"] = item["namespace"]
        call[value] = item[value]
        return call
    output = item["output"]
    if not isinstance(output, str):
        output = "".join(part["text"] for part in output)
    return {"type": kind, "call_id": item["call_id"], "output": output}


# --------------------------------------------------------------------------- translation


def custom_tool_arguments(text: str) -> str:
    """A custom tool's input as its chat function's arguments (JSON text)."""
    return orjson.dumps({"input": text}).decode()


def custom_tool_input(arguments: str) -> str:
    """A custom tool's input from its chat function's arguments: the ``input`` string of the
    JSON object a model wrote, or the arguments as they are when they are no such object."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    text = value.get("input") if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments


def items_to_chat_messages(
    instructions: str | None, items: Sequence[JSONObject]
) -> list[JSONObject]:
    """Responses items as chat messages: ``instructions`` first as a system message; a
    ``function_call`` or ``custom_tool_call`` joins the assistant message just before it (or
    starts one with null content) as a tool call of its chat function
    (:func:`chat_tool_name`); an output is a ``tool`` message."""
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
        elif kind in ("function_call", "custom_tool_call"):
            arguments = (
                item["arguments"]
                if kind == "function_call"
                else custom_tool_arguments(item["input"])
            )
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {
                    "name": chat_tool_name(item["name"], item.get("namespace")),
                    "arguments": arguments,
                },
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
        "messages": items_to_chat_messages(body.get("instructions"), [*history, *request.items]),
    }
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    plan = request.tools
    if plan.chat:
        chat["tools"] = list(plan.chat)
        choice = body.get("tool_choice")
        if isinstance(choice, str):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict):
            chat["tool_choice"] = {
                "type": "function",
                "function": {"name": plan.choice_name(choice["name"])},
            }
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
    ):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat[REASONING_EFFORT] = effort
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
