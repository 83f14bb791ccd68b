"""What the edge accepts in an OpenAI request body, checked before anything is dispatched.

:func:`parse` (the bytes) and :func:`validate` (a parsed body) raise
:class:`~dispatcher.errors.BadRequest` -- a 400 in OpenAI's error shape -- and nothing else,
whatever the input:

* the body must be JSON, an object, within the caller's size limit if it gives one (else
  :class:`~dispatcher.errors.PayloadTooLarge`, 413), and nested at most
  :data:`MAX_JSON_DEPTH` levels: the encoders that later serialize a body refuse ~254 levels,
  and a client must not be able to reach them (code ``invalid_json``);
* it must match its route's schema -- :data:`CHAT_COMPLETIONS`, :data:`COMPLETIONS`,
  :data:`EMBEDDINGS`: every field the OpenAI API documents is checked for its type, range or
  allowed values; fields it does not know are left alone (providers have extensions). The
  error's ``param`` is the path of the field at fault (``messages[2].content[0].type``), its
  ``code`` one of ``invalid_type``, ``invalid_value``, ``missing_required_parameter`` or
  ``unsupported_value``, and its message starts with that path, quoted.

A schema is a tree of small frozen nodes (:class:`Object`, :class:`Array`, :class:`String`,
:class:`Tagged` ...) that *check* a value and build nothing: the body the edge forwards stays
the client's own dict. ``null`` counts as an absent field unless the field is required (and
not :attr:`Object.nullable`). The check recurses along the schema, never along the data, so
it cannot exhaust the stack. The depth limit is part of the same pass: where the schema knows
the structure, its own nesting bounds the depth; what it does not know (an unknown field, a
tool's ``parameters``, a JSON schema) is walked, level by level, and only there -- so a body
with no free-form parts costs no walk at all.

docs/api.md lists what is validated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import attrs
import orjson

from ..errors import BadRequest, PayloadTooLarge

MAX_JSON_DEPTH: Final = 64
"""The deepest nesting of arrays and objects a request body may have; the body object itself is
level 1. Generous for the JSON schemas in ``tools`` and ``response_format``; far below the 254
levels at which orjson refuses to serialize."""

JSONObject = dict[str, Any]

_TOO_DEEP: Final = f"nested deeper than the limit of {MAX_JSON_DEPTH} levels of arrays and objects"

# --------------------------------------------------------------------------- entry points


def parse(raw: bytes, schema: Schema, *, max_size: int | None = None) -> JSONObject:
    """The request body ``raw`` as a JSON object that matches ``schema``; raise
    :class:`BadRequest` (or :class:`PayloadTooLarge` over ``max_size`` bytes) if it is not."""
    body = load_object(raw, max_size=max_size)
    validate(body, schema)
    return body


def load_object(raw: bytes, *, max_size: int | None = None) -> JSONObject:
    """Parse a request body that must be a JSON object (its depth is :func:`validate`'s
    business: the walk is shared with the schema's)."""
    if max_size is not None and len(raw) > max_size:
        raise PayloadTooLarge(
            f"request body of {len(raw)} bytes is over the size limit of {max_size} bytes"
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson gives up at 1024 levels; name the limit the client hit, ours, if the text
        # shows it early (a scan of the whole text would let a client make each bad body
        # cost a second of the event loop: 8 MB of "a", or [], is millions of tokens).
        if _text_deeper_than(raw[:_DEPTH_SCAN], MAX_JSON_DEPTH):
            raise BadRequest(f"request body is {_TOO_DEEP}", code="invalid_json") from None
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if type(body) is not dict:
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


def validate(body: JSONObject, schema: Schema) -> None:
    """Check ``body`` against ``schema`` and :data:`MAX_JSON_DEPTH`; raise
    :class:`BadRequest` naming the field at fault."""
    try:
        schema.check(body, 1)
    except Invalid as exc:
        raise exc.as_bad_request() from None


_DEPTH_SCAN: Final = 4096
"""How much of a body that is not valid JSON is scanned for nesting past the limit (at most
a millisecond). Past it, the error is orjson's own."""
_TOKENS: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


def _text_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` (not necessarily valid) opens more than ``limit`` levels,
    strings skipped. For the error path only: a regex scan, not a parse."""
    depth = 0
    for token in _TOKENS.finditer(raw):
        char = token[0][:1]
        if char == b"[" or char == b"{":
            depth += 1
            if depth > limit:
                return True
        elif char == b"]" or char == b"}":
            depth -= 1
    return False


def _check_nesting(value: list[Any] | JSONObject, depth: int) -> None:
    """Raise :class:`Invalid` if ``value``, a container at level ``depth``, nests containers
    past :data:`MAX_JSON_DEPTH`. Recursive, but never more than that many calls deep."""
    if depth > MAX_JSON_DEPTH:
        raise Invalid("invalid_json", _TOO_DEEP)
    for child in value.values() if type(value) is dict else value:
        if type(child) is dict or type(child) is list:
            _check_nesting(child, depth + 1)


# --------------------------------------------------------------------------- schema nodes


class Invalid(Exception):
    """A value does not match its schema. ``at`` is the path, innermost segment first: each
    container adds its own segment while the error passes through it."""

    def __init__(self, code: str, reason: str, *at: str | int) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.at: list[str | int] = list(reversed(at))

    @property
    def param(self) -> str | None:
        out: list[str] = []
        for segment in reversed(self.at):
            if isinstance(segment, int):
                out.append(f"[{segment}]")
            else:
                out.append(f".{segment}" if out else segment)
        return "".join(out) or None

    def as_bad_request(self) -> BadRequest:
        param = self.param
        message = f"'{param}': {self.reason}" if param else f"request body: {self.reason}"
        return BadRequest(message, param=param, code=self.code)


class Schema(Protocol):
    def check(self, value: object, depth: int) -> None:
        """Return if ``value`` matches; raise :class:`Invalid` if not. ``depth`` is the level
        of ``value`` in the body (the body is 1)."""

    def describe(self) -> str:
        """What a matching value is, for messages: "a boolean", "a number from 0 to 2"."""


def _kind(value: object) -> str:
    """The JSON type of ``value``, with an article."""
    if value is None:
        return "null"
    return _KINDS.get(type(value), type(value).__name__)


_KINDS: Final[Mapping[type, str]] = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def _shown(value: object) -> str:
    """A short rendering of a scalar for a message (containers by their kind only)."""
    if isinstance(value, str | int | float | bool):
        text = orjson.dumps(value).decode()
        return text if len(text) <= 40 else text[:37] + "..."
    return _kind(value)


def _wrong_type(schema: Schema, value: object) -> Invalid:
    return Invalid("invalid_type", f"must be {schema.describe()}, got {_kind(value)}")


def _one_of(values: tuple[str, ...]) -> str:
    quoted = [f"'{v}'" for v in values]
    return quoted[0] if len(quoted) == 1 else "one of " + ", ".join(quoted)


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" from {low:g} to {high:g}"
    if low is not None:
        return f" of at least {low:g}"
    if high is not None:
        return f" of at most {high:g}"
    return ""


@attrs.frozen
class Boolean:
    def check(self, value: object, depth: int) -> None:
        if type(value) is not bool:
            raise _wrong_type(self, value)

    def describe(self) -> str:
        return "a boolean"


@attrs.frozen
class Integer:
    """An integer (a JSON ``true`` is not one, nor is ``1.0``) within ``low`` .. ``high``."""

    low: int | None = None
    high: int | None = None

    def check(self, value: object, depth: int) -> None:
        if type(value) is not int:
            raise _wrong_type(self, value)
        if (self.low is not None and value < self.low) or (
            self.high is not None and value > self.high
        ):
            raise Invalid("invalid_value", f"must be {self.describe()}, got {value}")

    def describe(self) -> str:
        if self.low == 1 and self.high is None:
            return "a positive integer"
        if self.low == 0 and self.high is None:
            return "a non-negative integer"
        return "an integer" + _range(self.low, self.high)


@attrs.frozen
class Number:
    """An integer or a fraction within ``low`` .. ``high``."""

    low: float | None = None
    high: float | None = None

    def check(self, value: object, depth: int) -> None:
        if type(value) is not float and type(value) is not int:
            raise _wrong_type(self, value)
        if (self.low is not None and value < self.low) or (
            self.high is not None and value > self.high
        ):
            raise Invalid("invalid_value", f"must be {self.describe()}, got {_shown(value)}")

    def describe(self) -> str:
        return "a number" + _range(self.low, self.high)


@attrs.frozen
class String:
    min_length: int = 0
    max_length: int | None = None
    pattern: re.Pattern[str] | None = None
    """The whole string must match it (``fullmatch``)."""
    what: str | None = None
    """What the string is, for messages, instead of one derived from the limits."""

    def check(self, value: object, depth: int) -> None:
        if type(value) is not str:
            raise _wrong_type(self, value)
        if len(value) < self.min_length or (
            self.max_length is not None and len(value) > self.max_length
        ):
            raise Invalid(
                "invalid_value", f"must be {self.describe()}, got {len(value)} characters"
            )
        if self.pattern is not None and self.pattern.fullmatch(value) is None:
            raise Invalid("invalid_value", f"must be {self.describe()}, got {_shown(value)}")

    def describe(self) -> str:
        if self.what is not None:
            return self.what
        if self.min_length == 1 and self.max_length is None:
            return "a non-empty string"
        if self.max_length is not None and self.min_length:
            return f"a string of {self.min_length} to {self.max_length} characters"
        if self.max_length is not None:
            return f"a string of at most {self.max_length} characters"
        return "a string"


@attrs.frozen
class Enum:
    """One of a few strings."""

    values: tuple[str, ...]
    _set: frozenset[str] = attrs.field(init=False, repr=False)

    @_set.default
    def _make_set(self) -> frozenset[str]:
        return frozenset(self.values)

    def check(self, value: object, depth: int) -> None:
        if type(value) is not str:
            raise _wrong_type(self, value)
        if value not in self._set:
            raise Invalid("invalid_value", f"must be {self.describe()}, got {_shown(value)}")

    def describe(self) -> str:
        return _one_of(self.values)


def enum(*values: str) -> Enum:
    return Enum(values)


def _length(value: list[Any], low: int, high: int | None, schema: Schema) -> None:
    if len(value) < low or (high is not None and len(value) > high):
        raise Invalid("invalid_value", f"must be {schema.describe()}, got {len(value)} items")


@attrs.frozen
class Array:
    items: Schema
    min_items: int = 0
    max_items: int | None = None
    what: str | None = None

    def check(self, value: object, depth: int) -> None:
        if type(value) is not list:
            raise _wrong_type(self, value)
        _length(value, self.min_items, self.max_items, self)
        check = self.items.check
        depth += 1
        for index, item in enumerate(value):
            try:
                check(item, depth)
            except Invalid as exc:
                exc.at.append(index)
                raise

    def describe(self) -> str:
        if self.what is not None:
            return self.what
        if self.min_items == 1 and self.max_items is None:
            return "a non-empty array"
        if self.max_items is not None:
            return f"an array of {self.min_items} to {self.max_items} items"
        return "an array"


@attrs.frozen
class Tokens:
    """An array of token ids (non-negative integers): a loop of its own, as such arrays run to
    thousands of items."""

    min_items: int = 0

    def check(self, value: object, depth: int) -> None:
        if type(value) is not list:
            raise _wrong_type(self, value)
        _length(value, self.min_items, None, self)
        for index, token in enumerate(value):
            if type(token) is not int or token < 0:
                raise Invalid(
                    "invalid_type" if type(token) is not int else "invalid_value",
                    f"must be a token id (a non-negative integer), got {_shown(token)}",
                    index,
                )

    def describe(self) -> str:
        return "a non-empty array of token ids" if self.min_items else "an array of token ids"


@attrs.frozen
class ByFirstItem:
    """An array of one of several kinds, all its items like the first: ``["a", "b"]``,
    ``[1, 2]`` or ``[[1], [2]]``. ``kinds`` maps the first item's type to the schema of the
    whole array."""

    kinds: Mapping[type, Schema]
    what: str
    min_items: int = 1
    max_items: int | None = None

    def check(self, value: object, depth: int) -> None:
        if type(value) is not list:
            raise _wrong_type(self, value)
        _length(value, self.min_items, self.max_items, self)
        if not value:
            return
        schema = self.kinds.get(type(value[0]))
        if schema is None:
            raise Invalid(
                "invalid_type", f"must be an item of {self.describe()}, got {_kind(value[0])}", 0
            )
        schema.check(value, depth)

    def describe(self) -> str:
        return self.what


@attrs.frozen
class OneOf:
    """A value whose JSON type picks its schema: a string, or an array of parts."""

    kinds: Mapping[type, Schema]
    what: str

    def check(self, value: object, depth: int) -> None:
        schema = self.kinds.get(type(value))
        if schema is None:
            raise _wrong_type(self, value)
        schema.check(value, depth)

    def describe(self) -> str:
        return self.what


Rule = Callable[[JSONObject], None]
"""A check across the fields of one object, run once they are each valid; raises
:class:`Invalid` naming the field at fault."""


@attrs.frozen
class Object:
    """A JSON object: each field it knows is checked when present (``null`` counts as absent);
    those it does not know are accepted as they are, once their depth is."""

    fields: Mapping[str, Schema] = attrs.field(factory=dict)
    required: tuple[str, ...] = ()
    nullable: tuple[str, ...] = ()
    """Required fields that may be ``null`` (a ``function`` message's ``content``)."""
    rules: tuple[Rule, ...] = ()
    what: str = "an object"
    _checks: Mapping[str, Callable[[object, int], None]] = attrs.field(init=False, repr=False)

    @_checks.default
    def _bind(self) -> Mapping[str, Callable[[object, int], None]]:
        return {name: schema.check for name, schema in self.fields.items()}

    def check(self, value: object, depth: int) -> None:
        if type(value) is not dict:
            raise _wrong_type(self, value)
        for name in self.required:
            if value.get(name) is None and name not in self.nullable:
                wanted = f"{self.fields[name].describe()} is required"
                if name in value:
                    raise Invalid("invalid_type", wanted + ", got null", name)
                raise Invalid("missing_required_parameter", wanted, name)
        checks = self._checks
        depth += 1
        for name, item in value.items():
            try:
                check = checks.get(name)
                if check is not None:
                    if item is not None:
                        check(item, depth)
                elif type(item) is dict or type(item) is list:
                    _check_nesting(item, depth)
            except Invalid as exc:
                exc.at.append(name)
                raise
        for rule in self.rules:
            rule(value)

    def describe(self) -> str:
        return self.what


@attrs.frozen
class Tagged:
    """An object whose ``tag`` field (``type``, ``role``) picks its schema."""

    tag: str
    variants: Mapping[str, Object]
    what: str
    where: str = ""
    """Where the object is, for the message of a tag it may not have there: "in a system
    message"."""

    def check(self, value: object, depth: int) -> None:
        if type(value) is not dict:
            raise _wrong_type(self, value)
        tag = value.get(self.tag)
        schema = self.variants.get(tag) if type(tag) is str else None
        if schema is None:
            allowed = _one_of(tuple(self.variants)) + (f" {self.where}" if self.where else "")
            if tag is None:
                raise Invalid("missing_required_parameter", f"{allowed} is required", self.tag)
            raise Invalid(
                "invalid_type" if type(tag) is not str else "invalid_value",
                f"must be {allowed}, got {_shown(tag)}",
                self.tag,
            )
        schema.check(value, depth)

    def describe(self) -> str:
        return self.what


@attrs.frozen
class Map:
    """An object used as a map: any keys (each a ``keys`` if given), every value a ``values``."""

    values: Schema
    keys: Schema | None = None
    max_items: int | None = None
    what: str = "an object"

    def check(self, value: object, depth: int) -> None:
        if type(value) is not dict:
            raise _wrong_type(self, value)
        if self.max_items is not None and len(value) > self.max_items:
            raise Invalid(
                "invalid_value", f"must have at most {self.max_items} keys, got {len(value)}"
            )
        keys, check = self.keys, self.values.check
        depth += 1
        for key, item in value.items():
            try:
                if keys is not None:
                    try:
                        keys.check(key, depth)
                    except Invalid:
                        raise Invalid(
                            "invalid_value", f"keys must be {keys.describe()}, got {_shown(key)}"
                        ) from None
                check(item, depth)
            except Invalid as exc:
                exc.at.append(key)
                raise

    def describe(self) -> str:
        return self.what


@attrs.frozen
class FreeForm:
    """Any JSON object, such as a JSON schema: only its depth is checked."""

    def check(self, value: object, depth: int) -> None:
        if type(value) is not dict:
            raise _wrong_type(self, value)
        _check_nesting(value, depth)

    def describe(self) -> str:
        return "an object"


ANY_OBJECT: Final = FreeForm()


# --------------------------------------------------------------------------- shared pieces
#
# The allowed values follow the OpenAI API reference as openai-python 3.57 types it.

_NAME: Final = String(
    pattern=re.compile(r"[a-zA-Z0-9_-]{1,64}"),
    what="a name of 1 to 64 letters, digits, underscores or dashes",
)
STRING: Final = String()
NON_EMPTY: Final = String(min_length=1)
BOOLEAN: Final = Boolean()
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
        raise Invalid("invalid_value", "only allowed when 'stream' is true", "stream_options")


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
MESSAGE: Final = Tagged("role", _MESSAGES, "a message object")

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
        raise Invalid("unsupported_value", "only n=1 is supported", "n")


def _top_logprobs_need_logprobs(body: JSONObject) -> None:
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise Invalid("invalid_value", "needs 'logprobs' to be true", "top_logprobs")


CHAT_COMPLETIONS: Final = Object(
    {
        "model": NON_EMPTY,
        "messages": Array(MESSAGE, min_items=1, what="a non-empty array of messages"),
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
        raise Invalid("invalid_value", f"must be at least 'n' ({n}), got {best_of}", "best_of")


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
    raise Invalid(
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


__all__ = [
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "COMPLETIONS_OR_EMBEDDINGS",
    "EMBEDDINGS",
    "MAX_JSON_DEPTH",
    "Invalid",
    "Schema",
    "load_object",
    "parse",
    "tunnel_schema",
    "validate",
]
