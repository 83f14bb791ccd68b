"""The built-in deterministic ``echo`` model: streams the last user message back, word by word.

Each token is a word with the whitespace that follows it (leading whitespace goes with the
first word), so the concatenated deltas equal the echoed text exactly. Usage:
``prompt_tokens`` is the number of words of all messages, ``completion_tokens`` the number of
tokens emitted; the finish reason is ``"stop"``, or ``"length"`` when ``max_completion_tokens``
(or else ``max_tokens``) cut the reply short.

Knobs (:class:`EchoOptions`) come from the provider's ``options`` table and can be overridden
per request by an object under the request body key ``"echo"``, e.g.
``{"model": "echo", "messages": [...], "echo": {"token_delay": 0.05, "fail_after_tokens": 3}}``.
They make echo a test double for every way a real engine misbehaves.

With ``tool_call = {name = "get_weather", arguments = '{"city": "Paris"}'}`` (``arguments``
a JSON string or a table; default ``{}``) echo answers with that one tool call instead of text:
three tool-call deltas (``index`` 0 with ``id`` ``call_echo_0``, ``type`` and the name and empty
arguments; then the arguments in two pieces), finish reason ``"tool_calls"``. ``token_delay``
applies before each delta; the other fault knobs count text tokens only, except
``fail_before_first_token``. A request can turn it off with ``"echo": {"tool_call": null}``.
With ``tool_call_once = true`` as well, a conversation that already holds a tool result (a
``tool`` message) is answered with text instead: the last tool result's, echoed -- one round
trip, as an agent's model calls a tool, reads what it returned and answers.

Echo honours what it announces (``tools`` and ``json``, see
:func:`nodes.config.default_node_config`), so clients that bind tools or ask for structured
output work against it:

* ``tools`` with a ``tool_choice`` that forces a call (``"required"``: the first tool; a named
  function: that one) -> a call to it, its arguments an object filled from the function's
  ``parameters`` schema (:func:`example_of`: each required property from its type, strings
  with the echoed text); tools offered with ``"auto"`` are answered with text, as a model may;
* ``response_format`` ``json_object`` -> ``{"echo": <the text>}``; ``json_schema`` -> an object
  filled from its ``schema`` the same way. Streamed like any text.

Echo embeds too (route ``embeddings``), deterministically: the same text always gets the same
vector, on any machine (:func:`echo_embedding`). A vector has :data:`ECHO_DIMENSIONS` (256)
values, or the request's ``dimensions`` (at most :data:`MAX_ECHO_DIMENSIONS`); it is a unit
vector (L2 norm 1) made from SHA-256 of the text in counter mode: value *i* is the *i*-th
big-endian uint32 *u* of ``SHA-256(SHA-256(text) || n)`` for n = 0, 1, ... (4-byte big-endian
n; eight values per digest) mapped to ``u / 2**31 - 1``, then the whole divided by its norm.
An input of token ids is embedded as the text of its ids joined by spaces. ``prompt_tokens`` is
the number of words of the inputs (token ids: one each). The fault knobs apply before the
answer: ``fail_before_first_token``, ``token_delay`` (one wait), ``stall_after_tokens = 0``,
``drop_connection_after_tokens = 0``, ``ignore_cancel``.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Mapping
from typing import Any, Final

import attrs
import orjson
import trio

from dispatcher import wire
from nodes.adapters.base import (
    AdapterError,
    DropConnection,
    RunOutput,
    estimate_tokens,
    message_text,
)
from nodes.config import OptionsError, ProviderConfig

_TOKEN = re.compile(r"\s*\S+\s*")
ECHO_DIMENSIONS: Final = 256
"""The size of echo's embeddings, unless a request asks ``dimensions``."""
MAX_ECHO_DIMENSIONS: Final = 8192
"""The most ``dimensions`` echo embeds with."""
_EMBEDDINGS_PER_CHECKPOINT: Final = 32


@attrs.frozen
class EchoToolCall:
    """The tool call echo answers with (option ``tool_call``)."""

    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


@attrs.frozen(kw_only=True)
class EchoOptions:
    token_delay: float = 0.0
    """Seconds to wait before each token. 0: tokens go out as fast as the connection takes
    them (the runner coalesces what piles up)."""
    fail_before_first_token: bool = False
    """Fail (``run.failed``, code ``echo_fault``, retryable) before any text."""
    fail_after_tokens: int | None = None
    """Fail the same way after this many tokens."""
    stall_after_tokens: int | None = None
    """Emit nothing more after this many tokens, forever (until cancelled)."""
    drop_connection_after_tokens: int | None = None
    """Drop the node's whole connection after this many tokens (no terminal event)."""
    ignore_cancel: bool = False
    """Ignore ``run.cancel``: run to the natural end and send ``run.completed``."""
    reply: str | None = None
    """Stream this text instead of the last user message."""
    tool_call: EchoToolCall | None = None
    """Answer with this tool call instead of text (finish reason ``"tool_calls"``)."""
    tool_call_once: bool = False
    """Make :attr:`tool_call` only while the conversation holds no tool result; then answer
    with the last tool result's text."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> EchoOptions:
        """Parse an ``options`` table. Raises :class:`~nodes.config.OptionsError`."""
        return cls(**_parse_fields(raw))

    def with_overrides(self, raw: Mapping[str, Any]) -> EchoOptions:
        """These options with the fields of a per-request ``"echo"`` object replaced. Raises
        :class:`~nodes.config.OptionsError`."""
        return attrs.evolve(self, **_parse_fields(raw))


def _parse_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "token_delay":
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                raise OptionsError(key, f"expected a number >= 0, got {value!r}")
            fields[key] = float(value)
        elif key in ("fail_before_first_token", "ignore_cancel", "tool_call_once"):
            if type(value) is not bool:
                raise OptionsError(key, f"expected true or false, got {value!r}")
            fields[key] = value
        elif key in ("fail_after_tokens", "stall_after_tokens", "drop_connection_after_tokens"):
            if value is not None and (type(value) is not int or value < 0):
                raise OptionsError(key, f"expected an integer >= 0, got {value!r}")
            fields[key] = value
        elif key == "reply":
            if value is not None and not isinstance(value, str):
                raise OptionsError(key, f"expected a string, got {value!r}")
            fields[key] = value
        elif key == "tool_call":
            fields[key] = None if value is None else _parse_tool_call(key, value)
        else:
            raise OptionsError(key, "unknown echo option")
    return fields


def _parse_tool_call(key: str, value: Any) -> EchoToolCall:
    if not isinstance(value, dict) or set(value) - {"name", "arguments"}:
        raise OptionsError(key, f"expected a table with name and arguments, got {value!r}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise OptionsError(f"{key}.name", f"expected a non-empty string, got {name!r}")
    arguments = value.get("arguments", {})
    if isinstance(arguments, dict):
        arguments = orjson.dumps(arguments).decode()
    if not isinstance(arguments, str):
        raise OptionsError(f"{key}.arguments", f"expected JSON text or a table, got {arguments!r}")
    return EchoToolCall(name=name, arguments=arguments)


def split_tokens(text: str) -> list[str]:
    """``text`` as echo's tokens: words with their following whitespace; ``"".join`` of the
    result is ``text``."""
    tokens = _TOKEN.findall(text)
    if not tokens and text:  # whitespace only
        tokens = [text]
    return tokens


@attrs.frozen
class EchoAdapter:
    options: EchoOptions = EchoOptions()

    @classmethod
    def from_provider(cls, provider: ProviderConfig) -> EchoAdapter:
        return cls(EchoOptions.from_mapping(provider.options))

    def options_for(self, body: wire.JSONObject) -> EchoOptions:
        """The options of one request: the provider's, with the body's ``"echo"`` object's
        overrides."""
        options = self.options
        if "echo" in body:
            overrides = body["echo"]
            if not isinstance(overrides, dict):
                raise AdapterError("invalid_request", "echo: expected an object")
            try:
                options = options.with_overrides(overrides)
            except OptionsError as exc:
                raise AdapterError("invalid_request", f"echo.{exc.key}: {exc.reason}") from None
        return options

    async def embed(self, request: wire.RunRequest, out: RunOutput) -> None:
        """One deterministic vector per input (:func:`echo_embedding`)."""
        body = request.body
        options = self.options_for(body)
        if options.ignore_cancel:
            out.ignore_cancel()
        inputs = wire.embedding_inputs(body)
        if not inputs:
            raise AdapterError("invalid_request", "input: expected text or token ids to embed")
        dimensions = body.get("dimensions", ECHO_DIMENSIONS)
        if type(dimensions) is not int or not 1 <= dimensions <= MAX_ECHO_DIMENSIONS:
            raise AdapterError(
                "invalid_value",
                f"dimensions: echo embeds with 1 to {MAX_ECHO_DIMENSIONS}, got {dimensions!r}",
                status=400,
            )
        texts = [item if isinstance(item, str) else " ".join(map(str, item)) for item in inputs]
        prompt_tokens = sum(
            len(item.split()) if isinstance(item, str) else len(item) for item in inputs
        )
        if options.fail_before_first_token:
            raise AdapterError(
                "echo_fault", "injected failure before the embeddings", retryable=True
            )
        if options.token_delay:
            await trio.sleep(options.token_delay)
        if options.stall_after_tokens == 0:
            await trio.sleep_forever()
        if options.drop_connection_after_tokens == 0:
            raise DropConnection("echo: drop_connection_after_tokens=0")
        out.usage(prompt_tokens, 0)
        vectors = []
        for number, text in enumerate(texts, 1):
            vectors.append(wire.encode_vector(echo_embedding(text, dimensions)))
            if number % _EMBEDDINGS_PER_CHECKPOINT == 0:
                await trio.lowlevel.checkpoint()  # a large batch lets the node's other work run
        await out.embeddings(vectors)

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        body = request.body
        options = self.options_for(body)
        if options.ignore_cancel:
            out.ignore_cancel()

        messages = body.get("messages", [])
        if not isinstance(messages, list):
            raise AdapterError("invalid_request", "messages: expected an array")
        prompt_tokens = sum(len(message_text(m).split()) for m in messages)
        results = [m for m in messages if isinstance(m, dict) and m.get("role") == "tool"]
        answered = options.tool_call_once and bool(results)
        if options.reply is not None:
            text = options.reply
        elif answered:
            text = message_text(results[-1])
        else:
            users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            if not users:
                raise AdapterError("invalid_request", "echo needs a user message to echo")
            text = message_text(users[-1])

        call = None if answered else options.tool_call
        if call is None and not answered and "tool_call" not in body.get("echo", {}):
            call = forced_tool_call(body, text)
        tokens = split_tokens(structured_reply(body, text) or text)
        finish = "stop"
        limit = _max_tokens(body)
        if limit is not None and len(tokens) > limit:
            tokens, finish = tokens[:limit], "length"

        if options.fail_before_first_token:
            raise AdapterError(
                "echo_fault", "injected failure before the first token", retryable=True
            )
        out.usage(prompt_tokens, 0)
        if call is not None:
            await _answer_tool_call(call, options.token_delay, prompt_tokens, out)
            return
        for emitted in range(len(tokens) + 1):
            if emitted == options.fail_after_tokens:
                raise AdapterError(
                    "echo_fault", f"injected failure after {emitted} tokens", retryable=True
                )
            if emitted == options.stall_after_tokens:
                await trio.sleep_forever()
            if emitted == options.drop_connection_after_tokens:
                raise DropConnection(f"echo: drop_connection_after_tokens={emitted}")
            if emitted == len(tokens):
                break
            if options.token_delay:
                await trio.sleep(options.token_delay)
            await out.delta(tokens[emitted])
            out.usage(prompt_tokens, emitted + 1)
        out.finish(finish)


def echo_embedding(text: str, dimensions: int = ECHO_DIMENSIONS) -> list[float]:
    """Echo's embedding of ``text``: a unit vector of ``dimensions`` values drawn from
    SHA-256 of the text (the module's docstring says how), the same for the same text."""
    seed = hashlib.sha256(text.encode("utf-8")).digest()
    blocks = (dimensions + 7) // 8
    raw = b"".join(hashlib.sha256(seed + n.to_bytes(4, "big")).digest() for n in range(blocks))
    values = [u / 2**31 - 1 for u in struct.unpack(f">{dimensions}I", raw[: dimensions * 4])]
    norm = math.sqrt(math.fsum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


async def _answer_tool_call(
    call: EchoToolCall, delay: float, prompt_tokens: int, out: RunOutput
) -> None:
    half = len(call.arguments) // 2
    deltas: list[dict[str, Any]] = [
        {
            "index": 0,
            "id": "call_echo_0",
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        },
        {"index": 0, "function": {"arguments": call.arguments[:half]}},
        {"index": 0, "function": {"arguments": call.arguments[half:]}},
    ]
    for delta in deltas:
        if delay:
            await trio.sleep(delay)
        await out.tool_calls([delta])
    out.usage(prompt_tokens, estimate_tokens(call.name + " " + call.arguments))
    out.finish("tool_calls")


def forced_tool_call(body: wire.JSONObject, text: str) -> EchoToolCall | None:
    """The call a request's ``tool_choice`` forces (``"required"``: the first tool; a named
    function: that one), its arguments filled from the function's schema; None when no call
    is forced."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    choice = body.get("tool_choice")
    functions = [
        t["function"]
        for t in tools
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    ]
    if isinstance(choice, dict):
        wanted = choice.get("function")
        name = wanted.get("name") if isinstance(wanted, dict) else None
        functions = [f for f in functions if f["name"] == name]
    elif choice != "required":
        return None
    if not functions:
        return None
    function = functions[0]
    arguments = example_of(function.get("parameters"), text)
    return EchoToolCall(function["name"], orjson.dumps(arguments).decode())


def structured_reply(body: wire.JSONObject, text: str) -> str | None:
    """The JSON text a ``response_format`` asks for, or None for plain text."""
    response_format = body.get("response_format")
    if not isinstance(response_format, dict):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return orjson.dumps({"echo": text}).decode()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return orjson.dumps(example_of(schema, text)).decode()
    return None


_MAX_DEPTH = 8


def example_of(schema: Any, text: str, depth: int = 0) -> Any:
    """A value that fits a JSON schema's shape, for a test double: objects with their required
    properties (all of them when none are listed), strings as ``text`` (an enum's first
    value), numbers 0, booleans false, arrays empty. Unknown or malformed schemas give an
    object of nothing."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return text
    if kind in ("integer", "number"):
        return 0
    if kind == "boolean":
        return False
    if kind == "array":
        return []
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return {}
    required = schema.get("required")
    names = (
        [n for n in required if n in properties] if isinstance(required, list) else list(properties)
    )
    return {name: example_of(properties[name], text, depth + 1) for name in names}


def _max_tokens(body: wire.JSONObject) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise AdapterError("invalid_request", f"{key}: expected a positive integer")
        return value
    return None
