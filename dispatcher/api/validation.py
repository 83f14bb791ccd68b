"""The schema toolkit every front end validates its request bodies with, before anything is
dispatched.

:func:`parse` (the bytes) and :func:`validate` (a parsed body) raise
:class:`~dispatcher.errors.BadRequest` -- a 400 in OpenAI's error shape, which a front end
renders in its own -- and nothing else, whatever the input:

* the body must be JSON, an object, within the caller's size limit if it gives one (else
  :class:`~dispatcher.errors.PayloadTooLarge`, 413), and nested at most
  :data:`MAX_JSON_DEPTH` levels: the encoders that later serialize a body refuse ~254 levels,
  and a client must not be able to reach them (code ``invalid_json``);
* it must match its route's schema, which each front end builds from these nodes in its
  ``_request`` module (``api/openai/_request.py``'s chat completions, completions and
  embeddings, ``api/responses/_request.py``, ``api/anthropic/_request.py``). The error's
  ``param`` is the path of the field at fault (``messages[2].content[0].type``), its ``code``
  the one the check raised (``invalid_type``, ``invalid_value``,
  ``missing_required_parameter``, ``unsupported_value`` ...), and its message starts with that
  path, quoted.

A schema is a tree of small frozen nodes (:class:`Object`, :class:`Array`, :class:`String`,
:class:`Tagged` ...) that *check* a value and build nothing: the body the edge forwards stays
the client's own dict. ``null`` counts as an absent field unless the field is required (and
not :attr:`Object.nullable`); fields an :class:`Object` does not know are left alone unless
one of its ``rules`` refuses them. The check recurses along the schema, never along the data,
so it cannot exhaust the stack. The depth limit is part of the same pass: where the
schema knows the structure, its own nesting bounds the depth; what it does not know (an
unknown field, a tool's ``parameters``, a JSON schema) is walked, level by level, and only
there -- so a body with no free-form parts costs no walk at all.

docs/api.md, docs/responses.md and docs/messages.md list what each route validates.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import attrs
import orjson

from ..errors import BadRequest, PayloadTooLarge
from ..wire import JSONObject

MAX_JSON_DEPTH: Final = 64
"""The deepest nesting of arrays and objects a request body may have; the body object itself is
level 1. Generous for the JSON schemas in ``tools`` and ``response_format``; far below the 254
levels at which orjson refuses to serialize."""

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
    except Mismatch as exc:
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
    """Raise :class:`Mismatch` if ``value``, a container at level ``depth``, nests containers
    past :data:`MAX_JSON_DEPTH`. Recursive, but never more than that many calls deep."""
    if depth > MAX_JSON_DEPTH:
        raise Mismatch("invalid_json", _TOO_DEEP)
    for child in value.values() if type(value) is dict else value:
        if type(child) is dict or type(child) is list:
            _check_nesting(child, depth + 1)


# --------------------------------------------------------------------------- schema nodes


class Mismatch(Exception):
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
        """Return if ``value`` matches; raise :class:`Mismatch` if not. ``depth`` is the level
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


def _wrong_type(schema: Schema, value: object) -> Mismatch:
    return Mismatch("invalid_type", f"must be {schema.describe()}, got {_kind(value)}")


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
            raise Mismatch("invalid_value", f"must be {self.describe()}, got {value}")

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
            raise Mismatch("invalid_value", f"must be {self.describe()}, got {_shown(value)}")

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
            raise Mismatch(
                "invalid_value", f"must be {self.describe()}, got {len(value)} characters"
            )
        if self.pattern is not None and self.pattern.fullmatch(value) is None:
            raise Mismatch("invalid_value", f"must be {self.describe()}, got {_shown(value)}")

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
            raise Mismatch("invalid_value", f"must be {self.describe()}, got {_shown(value)}")

    def describe(self) -> str:
        return _one_of(self.values)


def enum(*values: str) -> Enum:
    return Enum(values)


def _length(value: list[Any], low: int, high: int | None, schema: Schema) -> None:
    if len(value) < low or (high is not None and len(value) > high):
        raise Mismatch("invalid_value", f"must be {schema.describe()}, got {len(value)} items")


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
            except Mismatch as exc:
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
                raise Mismatch(
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
            raise Mismatch(
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
:class:`Mismatch` naming the field at fault."""


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
                    raise Mismatch("invalid_type", wanted + ", got null", name)
                raise Mismatch("missing_required_parameter", wanted, name)
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
            except Mismatch as exc:
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
                raise Mismatch("missing_required_parameter", f"{allowed} is required", self.tag)
            raise Mismatch(
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
            raise Mismatch(
                "invalid_value", f"must have at most {self.max_items} keys, got {len(value)}"
            )
        keys, check = self.keys, self.values.check
        depth += 1
        for key, item in value.items():
            try:
                if keys is not None:
                    try:
                        keys.check(key, depth)
                    except Mismatch:
                        raise Mismatch(
                            "invalid_value", f"keys must be {keys.describe()}, got {_shown(key)}"
                        ) from None
                check(item, depth)
            except Mismatch as exc:
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

STRING: Final = String()
NON_EMPTY: Final = String(min_length=1)
BOOLEAN: Final = Boolean()


__all__ = [
    "ANY_OBJECT",
    "BOOLEAN",
    "MAX_JSON_DEPTH",
    "NON_EMPTY",
    "STRING",
    "Array",
    "Boolean",
    "ByFirstItem",
    "Enum",
    "FreeForm",
    "Integer",
    "Map",
    "Mismatch",
    "Number",
    "Object",
    "OneOf",
    "Rule",
    "Schema",
    "String",
    "Tagged",
    "Tokens",
    "enum",
    "load_object",
    "parse",
    "validate",
]
