"""The ``anthropic`` adapter (normalized path): Anthropic's Messages API, ``POST
{base_url}/v1/messages``, streamed over SSE (or, with ``stream = false``, one JSON answer).

The run's body is an OpenAI chat-completions body; :func:`messages_body` translates it (pure):

* ``system`` and ``developer`` messages -> ``system`` (text blocks, in order, wherever they
  stood); ``user`` -> a user turn (text parts -> ``text`` blocks, ``image_url`` parts ->
  ``image`` blocks: a ``data:`` URL as ``base64``, another URL as ``url``; other parts are
  ``invalid_request``); ``assistant`` -> its text as a ``text`` block and its ``tool_calls`` as
  ``tool_use`` blocks (``input`` = the arguments parsed: a JSON object, else
  ``invalid_request``); ``tool`` -> a ``tool_result`` block (``tool_use_id`` = its
  ``tool_call_id``) in a user turn. Consecutive turns of one role merge into one (Anthropic
  alternates), a user turn's ``tool_result`` blocks first;
* ``tools`` (function tools) -> ``name`` / ``description`` / ``input_schema``; ``tool_choice``
  ``auto`` / ``none`` / ``required`` / a named function -> ``auto`` / ``none`` / ``any`` /
  ``tool``; ``parallel_tool_calls: false`` -> ``disable_parallel_tool_use``;
* ``max_completion_tokens`` (else ``max_tokens``, else the ``max_tokens`` option) ->
  ``max_tokens`` (Anthropic requires one); ``stop`` -> ``stop_sequences``; ``temperature``
  (capped at 1, Anthropic's range) and ``top_p`` as they are; ``user`` ->
  ``metadata.user_id``; ``response_format`` ``json_schema`` -> ``output_config.format``;
* ``reasoning_effort`` -> ``thinking: {"type": "enabled", "budget_tokens": <EFFORT_BUDGETS>}``,
  the budget added to ``max_tokens`` and ``temperature`` / ``top_p`` left out (Anthropic
  refuses them with thinking); not while a forced tool choice is asked nor while the last
  user turn carries tool results (Anthropic wants the thinking blocks of that assistant turn
  back, which a chat conversation does not keep). The thinking itself is not relayed (a
  normalized run has no channel for it); its tokens are among the output tokens;
* prompt caching: the client's ``cache_control`` on a text or image part passes on; a request
  with none gets breakpoints on the last system block and on the last block of the
  conversation (option ``prompt_cache``, default true), so a conversation's next turn reads
  what this one wrote.

The answer (:class:`MessagesStream`, sans-IO) -> the run's events: ``text_delta`` -> deltas;
a ``tool_use`` block -> tool-call deltas (``index`` counting the run's calls, ``id`` the
block's, the name, then each ``input_json_delta`` as an ``arguments`` piece; ``{}`` for a call
without input); ``thinking`` and other blocks are skipped; ``stop_reason`` -> the finish
reason (:data:`STOP_REASONS`), a ``stop_sequence`` with the sequence it matched; usage:
``prompt_tokens`` = ``input_tokens`` + ``cache_read_input_tokens`` +
``cache_creation_input_tokens`` (``cached_tokens`` and ``cache_write_tokens`` those two),
``completion_tokens`` = ``output_tokens`` (``reasoning_tokens``: its
``output_tokens_details.thinking_tokens``) -- reported at ``message_start`` (before any
content, so the edge knows the prompt's count when the answer starts) and at the end.

Failures: a non-2xx answer as ``_upstream_errors`` maps it (400, 413 are the client's error
with Anthropic's message and status; 401/403, 404, 429 and 5xx -- Anthropic's 529
``overloaded_error`` among them -- are retryable); an ``error`` event (:func:`event_failure`)
fails the run; a stream that ends before ``message_stop`` is ``upstream_disconnected``.
``api_key_env`` names the variable with the key (read when the node starts), sent as
``x-api-key`` with ``anthropic-version``; ``base_url`` defaults to ``https://api.anthropic.com``
(:data:`ANTHROPIC_BASE_URL`), with or without its ``/v1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import orjson

from dispatcher import wire
from nodes.adapters._http_adapter import HTTPAdapter, chat_url, parse_options
from nodes.adapters._post import post_chunks, post_json
from nodes.adapters._upstream_errors import loads_object, parse_error
from nodes.adapters.base import AdapterError, RunOutput, message_text
from nodes.config import OptionsError, ProviderConfig
from nodes.upstream.client import UpstreamPool
from nodes.upstream.lines import SSEDecoder
from nodes.upstream.pools import HTTPTimeouts, pool_size

ANTHROPIC_BASE_URL: Final = "https://api.anthropic.com"
ANTHROPIC_VERSION: Final = "2023-06-01"
"""The ``anthropic-version`` header sent (the API's only stable version)."""
DEFAULT_MAX_TOKENS: Final = 4096
"""``max_tokens`` when the request sets none (Anthropic requires one)."""

STOP_REASONS: Final[Mapping[str, str]] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "pause_turn": "stop",
    "refusal": "content_filter",
}
"""Anthropic's ``stop_reason`` -> OpenAI's finish reason; anything else is ``"stop"``."""

EFFORT_BUDGETS: Final[Mapping[str, int]] = {
    "minimal": 1024,
    "low": 2048,
    "medium": 8192,
    "high": 24576,
    "xhigh": 32768,
}
"""``reasoning_effort`` -> the thinking budget (Anthropic's minimum is 1024 tokens); ``none``
and anything else: no thinking."""

EPHEMERAL: Final[Mapping[str, str]] = {"type": "ephemeral"}


# --------------------------------------------------------------------------- options


@attrs.frozen(kw_only=True)
class AnthropicOptions:
    """The ``options`` table of an ``anthropic`` provider."""

    timeouts: HTTPTimeouts = attrs.field(factory=HTTPTimeouts)
    """``connect_timeout`` (default 10 s) and ``read_timeout`` (default 600 s; 0: none)."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """``max_tokens`` of a request that sets none."""
    prompt_cache: bool = True
    """Mark the end of the system prompt and of the conversation as cache breakpoints when
    the request carries no ``cache_control`` of its own."""
    stream: bool = True
    """Stream the answer (SSE). False: one JSON answer per run (nothing reaches the edge
    before the whole answer, so the edge's ``first_token_timeout_s`` bounds the run)."""
    anthropic_version: str = ANTHROPIC_VERSION
    """The ``anthropic-version`` header."""
    anthropic_beta: tuple[str, ...] = ()
    """Sent as ``anthropic-beta`` (comma-separated) when not empty."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> AnthropicOptions:
        parsers = {
            "max_tokens": _positive,
            "prompt_cache": _flag,
            "stream": _flag,
            "anthropic_version": _text,
            "anthropic_beta": _names,
        }
        return cls(**parse_options(raw, parsers, kind="anthropic"))


def _flag(key: str, value: Any) -> bool:
    if type(value) is not bool:
        raise OptionsError(key, f"expected true or false, got {value!r}")
    return value


def _positive(key: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise OptionsError(key, f"expected a positive integer, got {value!r}")
    return value


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise OptionsError(key, f"expected a non-empty string, got {value!r}")
    return value


def _names(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise OptionsError(key, f"expected a list of non-empty strings, got {value!r}")
    return tuple(value)


def messages_url(base_url: str) -> str:
    """``{root}/v1/messages`` for a ``base_url`` with or without its ``/v1``."""
    root = base_url.rstrip("/")
    return chat_url(root, "/messages" if root.endswith("/v1") else "/v1/messages")


# --------------------------------------------------------------------------- the request


def _invalid(message: str) -> AdapterError:
    return AdapterError("invalid_request", message, status=400)


def messages_body(
    body: Mapping[str, Any], model: str, options: AnthropicOptions = AnthropicOptions()
) -> dict[str, Any]:
    """The Messages API body for an OpenAI chat ``body`` (see the module docstring), for
    the served name ``model``. Raises ``invalid_request`` (the client's error, status 400)
    for what cannot be translated."""
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _invalid("messages: expected a non-empty array")
    system, turns = _conversation(raw_messages)
    if not turns:
        raise _invalid("messages: expected at least one user or assistant message")
    payload: dict[str, Any] = {"model": model, "max_tokens": _max_tokens(body, options)}
    tools = _tools(body.get("tools"))
    if tools:
        payload["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
        if choice is not None:
            payload["tool_choice"] = choice
    if system:
        payload["system"] = system
    payload["messages"] = turns
    stop = body.get("stop")
    sequences = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    sequences = [s for s in sequences if isinstance(s, str) and s]
    if sequences:
        payload["stop_sequences"] = sequences
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and _number(temperature):
        payload["temperature"] = min(temperature, 1.0)
    top_p = body.get("top_p")
    if _number(top_p):
        payload["top_p"] = top_p
    user = body.get("user")
    if isinstance(user, str) and user:
        payload["metadata"] = {"user_id": user}
    output_format = _output_format(body.get("response_format"))
    if output_format is not None:
        payload["output_config"] = {"format": output_format}
    budget = _thinking_budget(body, payload)
    if budget is not None:
        payload["thinking"] = {"type": "enabled", "budget_tokens": budget}
        payload["max_tokens"] += budget
        payload.pop("temperature", None)
        payload.pop("top_p", None)
    if options.prompt_cache and not _has_cache_control(payload):
        _mark_breakpoints(payload)
    if options.stream:
        payload["stream"] = True
    return payload


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _max_tokens(body: Mapping[str, Any], options: AnthropicOptions) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise _invalid(f"{key}: expected a positive integer")
        return value
    return options.max_tokens


def _conversation(messages: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The system blocks and the alternating turns of an OpenAI ``messages`` array."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _invalid(f"messages[{index}]: expected an object with a role")
        role = message["role"]
        if role in ("system", "developer"):
            system.extend(b for b in _blocks(index, message.get("content")) if b.get("text"))
            continue
        if role == "user":
            blocks = _blocks(index, message.get("content"))
            turn_role = "user"
        elif role == "assistant":
            blocks = [b for b in _blocks(index, message.get("content")) if b.get("text")]
            blocks += _tool_uses(index, message.get("tool_calls"))
            turn_role = "assistant"
        elif role == "tool":
            blocks = [_tool_result(index, message)]
            turn_role = "user"
        else:
            raise _invalid(f"messages[{index}].role: {role!r} is not supported here")
        if not blocks:
            continue  # an assistant message that said nothing
        if turns and turns[-1]["role"] == turn_role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": turn_role, "content": blocks})
    for turn in turns:
        if turn["role"] == "user":
            # tool results first: Anthropic takes them only at the start of the user turn
            turn["content"].sort(key=lambda block: block["type"] != "tool_result")
    return system, turns


def _blocks(index: int, content: Any) -> list[dict[str, Any]]:
    """A message's ``content`` as text and image blocks."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _invalid(f"messages[{index}].content: expected a string or an array")
    blocks: list[dict[str, Any]] = []
    for number, part in enumerate(content):
        where = f"messages[{index}].content[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            continue  # an assistant's refusal part: nothing the model said
        if kind == "text" and isinstance(part.get("text"), str):
            if not part["text"]:
                continue  # Anthropic refuses empty text blocks
            block: dict[str, Any] = {"type": "text", "text": part["text"]}
        elif kind == "image_url" and isinstance(part, dict):
            block = {"type": "image", "source": _image_source(where, part.get("image_url"))}
        else:
            raise _invalid(f"{where}: a {kind or 'malformed'} part cannot go to this model")
        if isinstance(part.get("cache_control"), dict):
            block["cache_control"] = part["cache_control"]
        blocks.append(block)
    return blocks


def _image_source(where: str, image: Any) -> dict[str, Any]:
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url:
        raise _invalid(f"{where}.image_url: expected a URL")
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        media_type, _, encoding = head.removeprefix("data:").partition(";")
        if encoding != "base64" or not data or not media_type:
            raise _invalid(f"{where}.image_url: expected a base64 data: URL")
        return {"type": "base64", "media_type": media_type, "data": data}
    if url.startswith(("https://", "http://")):
        return {"type": "url", "url": url}
    raise _invalid(f"{where}.image_url: expected an http(s) or data: URL")


def _tool_uses(index: int, raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    where = f"messages[{index}].tool_calls"
    if not isinstance(raw, list):
        raise _invalid(f"{where}: expected an array")
    blocks: list[dict[str, Any]] = []
    for number, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        call_id = call.get("id") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise _invalid(f"{where}[{number}]: expected a function call with a name")
        if not isinstance(call_id, str) or not call_id:
            raise _invalid(f"{where}[{number}].id: expected the call's id")
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise _invalid(f"{where}[{number}].function.arguments: expected a JSON object")
        blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments})
    return blocks


def _tool_result(index: int, message: dict[str, Any]) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _invalid(f"messages[{index}].tool_call_id: expected the id of the call answered")
    content = message.get("content")
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    if isinstance(content, list):
        blocks = _blocks(index, content)
        if blocks:
            result["content"] = blocks
    else:
        text = message_text(message)
        if text:
            result["content"] = text
    return result


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _invalid("tools: expected an array")
    tools: list[dict[str, Any]] = []
    for number, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _invalid(f"tools[{number}]: only function tools can go to this model")
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise _invalid(f"tools[{number}].function.name: expected a name")
        parameters = function.get("parameters")
        converted: dict[str, Any] = {
            "name": name,
            "input_schema": (
                parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
            ),
        }
        description = function.get("description")
        if isinstance(description, str) and description:
            converted["description"] = description
        tools.append(converted)
    return tools


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    converted: dict[str, Any] | None = None
    if choice == "auto":
        converted = {"type": "auto"}
    elif choice == "none":
        converted = {"type": "none"}
    elif choice == "required":
        converted = {"type": "any"}
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise _invalid("tool_choice.function.name: expected a tool's name")
        converted = {"type": "tool", "name": name}
    elif choice is not None:
        raise _invalid(f"tool_choice: {choice!r} is not supported")
    if parallel is False and (converted is None or converted["type"] != "none"):
        converted = {**(converted or {"type": "auto"}), "disable_parallel_tool_use": True}
    return converted


def _output_format(response_format: Any) -> dict[str, Any] | None:
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return None
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return {"type": "json_schema", "schema": schema} if isinstance(schema, dict) else None


def _thinking_budget(body: Mapping[str, Any], payload: Mapping[str, Any]) -> int | None:
    effort = body.get("reasoning_effort")
    budget = EFFORT_BUDGETS.get(effort) if isinstance(effort, str) else None
    if budget is None:
        return None
    if payload.get("tool_choice", {}).get("type") in ("any", "tool"):
        return None  # Anthropic refuses a forced tool choice with thinking
    last = payload["messages"][-1]
    if last["role"] == "user" and any(b["type"] == "tool_result" for b in last["content"]):
        return None  # mid tool loop: that assistant turn's thinking blocks are not kept
    return budget


def _has_cache_control(payload: Mapping[str, Any]) -> bool:
    blocks = [*payload.get("system", ()), *payload.get("tools", ())]
    for turn in payload["messages"]:
        blocks.extend(turn["content"])
    return any("cache_control" in block for block in blocks)


def _mark_breakpoints(payload: dict[str, Any]) -> None:
    """Cache breakpoints on the last system block and the conversation's last block."""
    system = payload.get("system")
    if system:
        system[-1]["cache_control"] = dict(EPHEMERAL)
    content = payload["messages"][-1]["content"]
    if content:
        content[-1]["cache_control"] = dict(EPHEMERAL)


# --------------------------------------------------------------------------- the answer


@attrs.frozen
class AnthropicUsage:
    """Anthropic's counts, cumulative, as its ``usage`` objects give them."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    thinking_tokens: int = 0
    """``output_tokens_details.thinking_tokens``: of the output, those spent thinking."""

    def updated(self, raw: Any) -> AnthropicUsage:
        """These counts with those ``raw`` (a ``usage`` object) gives replacing them."""
        if not isinstance(raw, dict):
            return self
        details = raw.get("output_tokens_details")
        if isinstance(details, dict):
            raw = {**raw, "thinking_tokens": details.get("thinking_tokens")}
        changes = {
            field: value
            for field in attrs.fields_dict(AnthropicUsage)
            if type(value := raw.get(field)) is int and value >= 0
        }
        return attrs.evolve(self, **changes) if changes else self

    @property
    def prompt_tokens(self) -> int:
        """Every input token, OpenAI's way: those read from and written to the cache too."""
        return self.input_tokens + self.cache_read_input_tokens + self.cache_creation_input_tokens


Piece = str | list[dict[str, Any]]
"""What a run emits: text, or tool-call deltas (OpenAI's streaming shape)."""


@attrs.define
class _Block:
    kind: str
    tool: int | None = None
    """The run's tool-call index of a ``tool_use`` block."""
    has_arguments: bool = False


@attrs.define
class MessagesStream:
    """One answer's events (the SSE ``data`` objects, or a whole message), taken in order:
    :meth:`take` gives the pieces each one means; what the answer said so far is kept
    (usage, stop reason, whether it ended). Sans-IO."""

    usage: AnthropicUsage = attrs.Factory(AnthropicUsage)
    counted: bool = False
    """A ``usage`` object came (``message_start``, or the whole message)."""
    stop_reason: str | None = None
    stop_sequence: str | None = None
    ended: bool = False
    """``message_stop`` came (or the whole message was taken)."""
    _blocks: dict[int, _Block] = attrs.Factory(dict)
    _tools: int = 0

    @property
    def finish_reason(self) -> str:
        return STOP_REASONS.get(self.stop_reason or "", "stop")

    @property
    def matched_sequence(self) -> str | None:
        """The stop sequence that ended the text, when one did."""
        return self.stop_sequence if self.stop_reason == "stop_sequence" else None

    def take(self, event: Mapping[str, Any]) -> list[Piece]:
        kind = event.get("type")
        if kind == "error":
            raise event_failure(event)
        if kind == "message_start":
            message = event.get("message")
            if isinstance(message, dict):
                self.usage = self.usage.updated(message.get("usage"))
                self.counted = self.counted or isinstance(message.get("usage"), dict)
            return []
        if kind == "content_block_start":
            return self._start(event.get("index"), event.get("content_block"))
        if kind == "content_block_delta":
            return self._delta(event.get("index"), event.get("delta"))
        if kind == "content_block_stop":
            return self._stop(event.get("index"))
        if kind == "message_delta":
            delta = event.get("delta")
            if isinstance(delta, dict):
                reason, sequence = delta.get("stop_reason"), delta.get("stop_sequence")
                if isinstance(reason, str):
                    self.stop_reason = reason
                if isinstance(sequence, str):
                    self.stop_sequence = sequence
            self.usage = self.usage.updated(event.get("usage"))
            return []
        if kind == "message_stop":
            self.ended = True
        return []  # ping, and event types Anthropic may add

    def take_message(self, message: Mapping[str, Any]) -> list[Piece]:
        """A whole (non-streamed) ``message`` object's pieces."""
        if message.get("type") == "error":
            raise event_failure(message)
        content = message.get("content")
        if not isinstance(content, list):
            raise AdapterError(
                "upstream_bad_response",
                "the provider's message has no content array",
                retryable=True,
            )
        pieces: list[Piece] = []
        for index, block in enumerate(content):
            if isinstance(block, dict) and block.get("type") == "tool_use":
                arguments = block.get("input")
                pieces += self._start(index, {**block, "input": {}})
                pieces += self._delta(
                    index, {"type": "input_json_delta", "partial_json": _json(arguments or {})}
                )
                pieces += self._stop(index)
            else:
                pieces += self._start(index, block)
        self.usage = self.usage.updated(message.get("usage"))
        self.counted = isinstance(message.get("usage"), dict)
        reason, sequence = message.get("stop_reason"), message.get("stop_sequence")
        self.stop_reason = reason if isinstance(reason, str) else None
        self.stop_sequence = sequence if isinstance(sequence, str) else None
        self.ended = True
        return pieces

    def _start(self, index: Any, block: Any) -> list[Piece]:
        if type(index) is not int or not isinstance(block, dict):
            return []
        kind = block.get("type")
        if kind == "text":
            self._blocks[index] = _Block("text")
            text = block.get("text")
            return [text] if isinstance(text, str) and text else []
        if kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise AdapterError(
                    "upstream_error",
                    f"the provider sent a tool_use block without an id or name: {block!r}",
                    retryable=True,
                )
            tool = self._tools
            self._tools += 1
            entry = self._blocks[index] = _Block("tool_use", tool)
            head: dict[str, Any] = {
                "index": tool,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            given = block.get("input")
            if isinstance(given, dict) and given:
                head["function"]["arguments"] = _json(given)
                entry.has_arguments = True
            return [[head]]
        self._blocks[index] = _Block(str(kind))  # thinking, redacted_thinking, server tools
        return []

    def _delta(self, index: Any, delta: Any) -> list[Piece]:
        block = self._blocks.get(index) if type(index) is int else None
        if block is None or not isinstance(delta, dict):
            return []
        kind = delta.get("type")
        if kind == "text_delta" and block.kind == "text":
            text = delta.get("text")
            return [text] if isinstance(text, str) and text else []
        if kind == "input_json_delta" and block.kind == "tool_use":
            partial = delta.get("partial_json")
            if not isinstance(partial, str) or not partial:
                return []
            block.has_arguments = True
            return [[{"index": block.tool, "function": {"arguments": partial}}]]
        return []  # thinking_delta, signature_delta, citations_delta...

    def _stop(self, index: Any) -> list[Piece]:
        block = self._blocks.get(index) if type(index) is int else None
        if block is None or block.kind != "tool_use" or block.has_arguments:
            return []
        block.has_arguments = True
        return [[{"index": block.tool, "function": {"arguments": "{}"}}]]


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def event_failure(value: Any) -> AdapterError:
    """The failure an ``error`` event (``{"type": "error", "error": {"type", "message"}}``)
    means: ``invalid_request_error`` / ``request_too_large`` are the client's error (status
    400 / 413); ``rate_limit_error`` is ``upstream_rate_limited``, ``overloaded_error`` and
    ``api_error`` ``upstream_5xx``, anything else ``upstream_error`` -- retryable."""
    error = value.get("error") if isinstance(value, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    said = parse_error(value).message or "an error event without a message"
    if kind == "invalid_request_error":
        return AdapterError("invalid_request", said, status=400)
    if kind == "request_too_large":
        return AdapterError("request_too_large", said, status=413)
    code = {
        "rate_limit_error": "upstream_rate_limited",
        "overloaded_error": "upstream_5xx",
        "api_error": "upstream_5xx",
    }.get(kind if isinstance(kind, str) else "", "upstream_error")
    return AdapterError(code, f"the provider sent an error event ({kind}): {said}", retryable=True)


# --------------------------------------------------------------------------- the adapter


@attrs.frozen(kw_only=True)
class AnthropicAdapter(HTTPAdapter):
    """Posts to ``url``: the full ``/v1/messages`` URL."""

    options: AnthropicOptions = AnthropicOptions()
    api_key: str | None = attrs.field(default=None, repr=False)

    @classmethod
    def from_provider(
        cls, provider: ProviderConfig, *, environ: Mapping[str, str] | None = None
    ) -> AnthropicAdapter:
        """Build from config; raises :class:`NodeConfigError` when ``api_key_env`` names a
        variable that is not set (or empty) in ``environ`` (default ``os.environ``)."""
        return cls(
            url=messages_url(provider.base_url or ANTHROPIC_BASE_URL),
            api_key=provider.api_key(environ),
            options=AnthropicOptions.from_mapping(provider.options),
            connections=pool_size(provider),
        )

    def headers(self) -> dict[str, str]:
        options = self.options
        headers = {
            "accept": "text/event-stream" if options.stream else "application/json",
            "anthropic-version": options.anthropic_version,
        }
        if options.anthropic_beta:
            headers["anthropic-beta"] = ",".join(options.anthropic_beta)
        if self.api_key is not None:
            headers["x-api-key"] = self.api_key
        return headers

    async def run_on(self, client: UpstreamPool, request: wire.RunRequest, out: RunOutput) -> None:
        payload = messages_body(request.body, request.served_model, self.options)
        answer = MessagesStream()
        if self.options.stream:
            async with post_chunks(client, self.url, payload, headers=self.headers()) as chunks:
                await _relay_stream(chunks, answer, out)
        else:
            message = await post_json(
                client, self.url, payload, headers=self.headers(), what="a message"
            )
            pieces = answer.take_message(message)
            _report_usage(answer, out)
            await _emit(pieces, out)
        if not answer.ended:
            raise AdapterError(
                "upstream_disconnected",
                "the provider's stream ended before message_stop",
                retryable=True,
            )
        _report_usage(answer, out)
        out.finish(answer.finish_reason, stop_sequence=answer.matched_sequence)


async def _relay_stream(chunks: Any, answer: MessagesStream, out: RunOutput) -> None:
    decoder = SSEDecoder()
    async for piece in chunks:
        for data in decoder.feed(piece):
            await _take_event(data, answer, out)
            if answer.ended:
                return
    last = decoder.flush()
    if last is not None:
        await _take_event(last, answer, out)


async def _take_event(data: bytes, answer: MessagesStream, out: RunOutput) -> None:
    counted = answer.counted
    pieces = answer.take(loads_object(data, "an SSE event"))
    if answer.counted and not counted:
        _report_usage(answer, out)  # message_start: the prompt's count, before any content
    await _emit(pieces, out)


async def _emit(pieces: Sequence[Piece], out: RunOutput) -> None:
    for piece in pieces:
        if isinstance(piece, str):
            await out.delta(piece)
        else:
            await out.tool_calls(piece)


def _report_usage(answer: MessagesStream, out: RunOutput) -> None:
    if not answer.counted:
        return  # the runner estimates
    usage = answer.usage
    out.usage(
        usage.prompt_tokens,
        usage.output_tokens,
        cached_tokens=usage.cache_read_input_tokens,
        cache_write_tokens=usage.cache_creation_input_tokens,
        reasoning_tokens=min(usage.thinking_tokens, usage.output_tokens),
    )
