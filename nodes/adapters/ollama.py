"""The ``ollama`` adapter: Ollama's native ``POST {base_url}/api/chat``, streamed as NDJSON.

The OpenAI chat body becomes ``{"model": <served name>, "messages": [...], "stream": true,
"options": {...}}``:

* messages: ``role`` and the text of ``content`` (a string, or the ``text`` parts of a list
  joined with newlines); ``image_url`` parts with ``data:`` URLs become ``images`` (base64);
  other image URLs are refused (``invalid_request``: Ollama cannot fetch them). ``developer``
  becomes ``system``;
* tools: ``tools`` (OpenAI function tools) is forwarded as it is; ``tool_choice`` and
  ``parallel_tool_calls`` are not (Ollama has no equivalent). An ``assistant`` message's
  ``tool_calls`` become Ollama's ``[{"function": {"name", "arguments": {...}}}]`` (the
  arguments JSON string parsed; not an object: ``invalid_request``); a ``tool`` message keeps
  its text ``content`` and gets ``tool_name``, the name of the call its ``tool_call_id``
  answers (looked up in the assistant messages before it). Legacy ``function`` messages are
  passed with their role and text only;
* options: ``temperature``, ``top_p``, ``seed``, ``presence_penalty``, ``frequency_penalty``
  as they are; ``max_completion_tokens`` (else ``max_tokens``) -> ``num_predict``; ``stop`` (a
  string or a list) -> ``stop`` (a list). The provider's ``model_options`` (e.g.
  ``{num_ctx = 8192}``) are the defaults under them;
* ``response_format``: ``json_object`` -> ``format: "json"``, ``json_schema`` -> ``format:
  <the schema>``; ``keep_alive`` from the provider's options.

Each line's ``message.content`` is a delta; its ``message.tool_calls`` become OpenAI tool-call
deltas, one per call: ``{"index": i, "id": "call_<24 hex digits>", "type": "function",
"function": {"name", "arguments": <the arguments as a JSON string>}}``, ``i`` counting the
run's calls from 0. The ``done: true`` line gives usage (``prompt_eval_count``, ``eval_count``;
estimated, and marked so, when missing)
and ``done_reason`` (``length`` -> ``length``; ``stop``, ``load``, ``unload`` and anything
else -> ``stop``, or ``tool_calls`` when the answer had tool calls). An ``{"error": ...}``
line fails the run (code ``upstream_error``, retryable). A non-2xx answer fails as
``_upstream_errors`` maps it: Ollama's ``{"error": "..."}`` with 400, 413, 415 or 422 is the
client's error (code ``invalid_request``, the upstream's message and status, not retryable);
its 404 for a model it does not have is ``upstream_not_found``, retryable elsewhere. Default
``base_url``: ``http://127.0.0.1:11434`` (:data:`OLLAMA_BASE_URL`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, Final

import attrs
import orjson

from dispatcher import wire
from nodes.adapters._http_adapter import HTTPAdapter, chat_url, parse_options
from nodes.adapters._post import post_chunks, post_json
from nodes.adapters._upstream_errors import error_event_failure, loads_object
from nodes.adapters.base import (
    AdapterError,
    RunOutput,
    TokenEstimator,
    estimate_prompt_tokens,
    message_text,
    vector_of,
)
from nodes.config import OptionsError, ProviderConfig
from nodes.upstream.client import UpstreamPool
from nodes.upstream.lines import LineSplitter
from nodes.upstream.pools import HTTPTimeouts, pool_size

OLLAMA_BASE_URL: Final = "http://127.0.0.1:11434"

FINISH_REASONS: Final[Mapping[str, str]] = {
    "stop": "stop",
    "length": "length",
    "load": "stop",
    "unload": "stop",
}
"""Ollama's ``done_reason`` -> OpenAI's finish reason; anything else is ``"stop"``."""

_SAME_NAME_OPTIONS: Final = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
)


@attrs.frozen(kw_only=True)
class OllamaOptions:
    """The ``options`` table of an ``ollama`` provider."""

    timeouts: HTTPTimeouts = attrs.field(factory=HTTPTimeouts)
    """``connect_timeout`` (default 10 s) and ``read_timeout`` (default 600 s; 0: none)."""
    keep_alive: str | int | float | None = None
    """Sent as Ollama's ``keep_alive`` (how long the model stays loaded, e.g. ``"10m"``)."""
    model_options: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    """Defaults for Ollama's ``options`` (e.g. ``num_ctx``); the request's mapped values win."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> OllamaOptions:
        parsers = {"keep_alive": _keep_alive, "model_options": _table}
        return cls(**parse_options(raw, parsers, kind="ollama"))


def _keep_alive(key: str, value: Any) -> str | int | float:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise OptionsError(key, f"expected a duration string or seconds, got {value!r}")
    return value


def _table(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise OptionsError(key, f"expected a table, got {value!r}")
    return dict(value)


@attrs.frozen(kw_only=True)
class OllamaAdapter(HTTPAdapter):
    """Posts to ``url``: the full ``/api/chat`` URL."""

    options: OllamaOptions = OllamaOptions()

    @classmethod
    def from_provider(cls, provider: ProviderConfig) -> OllamaAdapter:
        return cls(
            url=chat_url(provider.base_url or OLLAMA_BASE_URL, "/api/chat"),
            options=OllamaOptions.from_mapping(provider.options),
            connections=pool_size(provider),
        )

    def payload(self, request: wire.RunRequest) -> dict[str, Any]:
        """The ``/api/chat`` body for ``request``; raises ``invalid_request``."""
        body = request.body
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise AdapterError("invalid_request", "messages: expected an array")
        tool_names: dict[str, str] = {}
        payload: dict[str, Any] = {
            "model": request.served_model,
            "messages": [_message(i, m, tool_names) for i, m in enumerate(messages)],
            "stream": True,
        }
        tools = body.get("tools")
        if isinstance(tools, list) and tools:
            payload["tools"] = tools
        options = {**self.options.model_options, **_mapped_options(body)}
        if options:
            payload["options"] = options
        response_format = body.get("response_format")
        if isinstance(response_format, dict):
            if response_format.get("type") == "json_object":
                payload["format"] = "json"
            elif response_format.get("type") == "json_schema":
                schema = response_format.get("json_schema")
                if isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
                    payload["format"] = schema["schema"]
        if self.options.keep_alive is not None:
            payload["keep_alive"] = self.options.keep_alive
        return payload

    async def run_on(self, client: UpstreamPool, request: wire.RunRequest, out: RunOutput) -> None:
        payload = self.payload(request)
        stream = _Stream(out)
        splitter = LineSplitter()
        async with post_chunks(
            client, self.url, payload, headers={"accept": "application/x-ndjson"}
        ) as chunks:
            async for piece in chunks:
                for line in splitter.feed(piece):
                    if await stream.take(line):
                        break
                if stream.final is not None:
                    break
            else:
                last = splitter.flush()
                if last is not None:
                    await stream.take(last)
        final, generated, calls_made = stream.final, stream.generated, stream.calls_made
        if final is None:
            raise AdapterError(
                "upstream_disconnected",
                "ollama's stream ended without its done line",
                retryable=True,
            )
        prompt_tokens = _count(final.get("prompt_eval_count"))
        completion_tokens = _count(final.get("eval_count"))
        out.usage(
            estimate_prompt_tokens(request.body) if prompt_tokens is None else prompt_tokens,
            generated.tokens if completion_tokens is None else completion_tokens,
            estimated=prompt_tokens is None or completion_tokens is None,
        )
        done_reason = final.get("done_reason")
        finish = FINISH_REASONS.get(done_reason, "stop") if isinstance(done_reason, str) else "stop"
        out.finish("tool_calls" if calls_made and finish == "stop" else finish)

    async def embed_on(
        self, client: UpstreamPool, request: wire.RunRequest, out: RunOutput
    ) -> None:
        """An embeddings run: Ollama's ``POST {base_url}/api/embed`` with ``{"model": <served
        name>, "input": [<the texts>]}``, the request's ``dimensions``, and the provider's
        ``keep_alive`` and ``model_options`` (as ``options``); its ``embeddings``, in order,
        and ``prompt_eval_count`` as the prompt tokens (else the runner estimates them).
        Token id inputs are refused (``invalid_request``, 400): Ollama embeds text."""
        inputs = wire.embedding_inputs(request.body)
        texts = [item for item in inputs if isinstance(item, str)]
        if len(texts) != len(inputs) or not texts:
            raise AdapterError(
                "invalid_request", "input: ollama embeds text, not token ids", status=400
            )
        payload: dict[str, Any] = {"model": request.served_model, "input": texts}
        dimensions = request.body.get("dimensions")
        if dimensions is not None:
            payload["dimensions"] = dimensions
        if self.options.model_options:
            payload["options"] = dict(self.options.model_options)
        if self.options.keep_alive is not None:
            payload["keep_alive"] = self.options.keep_alive
        url = self.url.removesuffix("/api/chat") + "/api/embed"
        headers = {"accept": "application/json"}
        answer = await post_json(client, url, payload, headers=headers, what="an embed answer")
        embeddings = answer.get("embeddings")
        if not isinstance(embeddings, list):
            raise AdapterError(
                "upstream_bad_response", "ollama's answer has no embeddings", retryable=True
            )
        vectors = [vector_of(item, f"embedding {n}") for n, item in enumerate(embeddings)]
        prompt_tokens = _count(answer.get("prompt_eval_count"))
        if prompt_tokens is not None:
            out.usage(prompt_tokens, 0)
        await out.embeddings(vectors)


class _Stream:
    """One run's NDJSON lines, taken one by one."""

    __slots__ = ("calls_made", "final", "generated", "out")

    def __init__(self, out: RunOutput) -> None:
        self.out = out
        self.generated = TokenEstimator()
        self.final: dict[str, Any] | None = None
        """The done line, once it came."""
        self.calls_made = 0

    async def take(self, line: bytes) -> bool:
        """Report one line; True once it was the done line."""
        if not line.strip():
            return False
        chunk = loads_object(line, "a line")
        if "error" in chunk:
            raise error_event_failure(chunk, "line")
        answer = chunk.get("message")
        if isinstance(answer, dict):
            content = answer.get("content")
            if isinstance(content, str) and content:
                self.generated.add(content)
                await self.out.delta(content)
            calls = _tool_call_deltas(answer.get("tool_calls"), self.calls_made)
            if calls:
                self.calls_made += len(calls)
                await self.out.tool_calls(calls)
        if chunk.get("done") is True:
            self.final = chunk
            return True
        return False


def _tool_call_deltas(raw: Any, first_index: int) -> list[dict[str, Any]]:
    """Ollama's ``message.tool_calls`` as OpenAI streaming tool-call deltas, numbered from
    ``first_index``; raises ``upstream_error`` for a call without a function name."""
    deltas: list[dict[str, Any]] = []
    for call in raw if isinstance(raw, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            raise AdapterError(
                "upstream_error", f"ollama sent a tool call without a function name: {call!r}"
            )
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments).decode()
        deltas.append(
            {
                "index": first_index + len(deltas),
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return deltas


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _mapped_options(body: wire.JSONObject) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key in _SAME_NAME_OPTIONS:
        value = body.get(key)
        if value is not None:
            options[key] = value
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is not None:
            options["num_predict"] = value
            break
    stop = body.get("stop")
    if isinstance(stop, str):
        options["stop"] = [stop]
    elif isinstance(stop, list) and stop:
        options["stop"] = stop
    return options


def _message(index: int, message: Any, tool_names: dict[str, str]) -> dict[str, Any]:
    """One OpenAI message in Ollama's shape. ``tool_names`` maps the tool call ids seen so
    far to their function names (updated from assistant messages, read for tool messages)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise AdapterError("invalid_request", f"messages[{index}]: expected an object with a role")
    role = message["role"]
    converted: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": message_text(message),
    }
    if role == "assistant" and message.get("tool_calls"):
        converted["tool_calls"] = _ollama_tool_calls(index, message["tool_calls"], tool_names)
    elif role == "tool":
        call_id = message.get("tool_call_id")
        name = tool_names.get(call_id) if isinstance(call_id, str) else None
        if name is not None:
            converted["tool_name"] = name
    content = message.get("content")
    images = []
    for part in content if isinstance(content, list) else ():
        if not isinstance(part, dict) or part.get("type") != "image_url":
            continue
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
            raise AdapterError(
                "invalid_request",
                f"messages[{index}]: ollama takes images only as base64 data: URLs",
            )
        images.append(url.partition(";base64,")[2])
    if images:
        converted["images"] = images
    return converted


def _ollama_tool_calls(index: int, raw: Any, tool_names: dict[str, str]) -> list[dict[str, Any]]:
    where = f"messages[{index}].tool_calls"
    if not isinstance(raw, list):
        raise AdapterError("invalid_request", f"{where}: expected an array")
    calls: list[dict[str, Any]] = []
    for number, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str):
            raise AdapterError(
                "invalid_request", f"{where}[{number}]: expected a function call with a name"
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments or "{}")
            except orjson.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise AdapterError(
                "invalid_request",
                f"{where}[{number}].function.arguments: expected a JSON object (ollama needs one)",
            )
        call_id = call.get("id")
        if isinstance(call_id, str):
            tool_names[call_id] = name
        calls.append({"function": {"name": name, "arguments": arguments}})
    return calls
