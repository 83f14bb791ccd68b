"""The ``openai`` adapter (normalized path): an OpenAI-compatible ``/v1/chat/completions``
server (vLLM, llama.cpp's server, OpenAI, ...) streamed over SSE.

The request body is the client's, with ``model`` set to the served name, ``stream: true`` and
(unless the ``include_usage`` option is false) ``stream_options.include_usage: true``. From the
stream: ``choices[0].delta.content`` -> deltas; ``choices[0].delta.tool_calls`` -> tool-call
deltas, passed through as they are (``tools`` and ``tool_choice`` reach the upstream in the
client's body); the choice's ``finish_reason`` -> the finish reason (passed through: ``stop``,
``length``, ``tool_calls``, ``content_filter``...); the ``usage`` chunk -> usage. A legacy
``function_call`` delta (the deprecated ``functions`` API) fails the run with code
``unsupported_function_call`` (not retryable): use ``tools``. ``data: [DONE]`` ends the
stream. With the ``cache_prompt`` option, the body also carries llama.cpp's
``cache_prompt: true`` (the engine's prompt cache hint). An ``{"error": ...}`` event fails
the run with code ``upstream_error`` (retryable), or as the client's error (its code, message
and status, not retryable) when it names a 400, 413, 415 or 422 in ``code`` (vLLM,
llama.cpp) or has code ``context_length_exceeded``. A non-2xx answer fails as
``_upstream_errors`` maps it: 400, 413, 415, 422 are the client's error, with the upstream's
``error.code`` (else ``invalid_request``), message and status.

The usage's parts (:class:`StreamUsage`): the prompt's cached tokens are
``usage.prompt_tokens_details.cached_tokens`` (OpenAI; vLLM with
``--enable-prompt-tokens-details``; llama.cpp's recent builds), else llama.cpp's
``timings.cache_n`` (the prompt tokens its cache reused); the completion's reasoning tokens
``usage.completion_tokens_details.reasoning_tokens``. Absent, they are 0.

``base_url`` is the server's root (``http://host:8000``) or its ``/v1`` prefix
(``http://host:8000/v1``, ``https://api.openai.com/v1``); the adapter posts to
``{root}/v1/chat/completions`` either way. Default: ``https://api.openai.com/v1``
(:data:`OPENAI_BASE_URL`).

``api_key_env`` names the environment variable holding the key, read once when the adapter
is built (at node start): a missing or empty variable is a :class:`~nodes.config.
NodeConfigError` then, not a failure of every later run. The key goes out as
``Authorization: Bearer <key>`` and is never logged or shown in a repr.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs
import orjson

from dispatcher import wire
from nodes.adapters._http_adapter import HTTPAdapter, chat_url, parse_options
from nodes.adapters._post import post_chunks, post_json
from nodes.adapters._upstream_errors import error_event_failure, loads_object
from nodes.adapters.base import AdapterError, RunOutput, message_text, vector_of
from nodes.config import OptionsError, ProviderConfig
from nodes.upstream.client import UpstreamPool
from nodes.upstream.lines import SSEDecoder
from nodes.upstream.pools import HTTPTimeouts, pool_size

OPENAI_BASE_URL: Final = "https://api.openai.com/v1"


@attrs.frozen(kw_only=True)
class OpenAIOptions:
    """The ``options`` table of an ``openai`` provider."""

    timeouts: HTTPTimeouts = attrs.field(factory=HTTPTimeouts)
    """``connect_timeout`` (default 10 s) and ``read_timeout`` (default 600 s; 0: none)."""
    include_usage: bool = True
    """Ask for the usage chunk (``stream_options.include_usage``); turn off for servers that
    reject ``stream_options``. Without it the runner estimates usage."""
    merge_system_messages: bool = False
    """Merge every ``system`` message into one at the start (texts joined by a blank line,
    in order), for an engine whose chat template takes a system message only first
    (Claude Code puts some in the middle of the conversation, which the edge keeps there)."""
    cache_prompt: bool = False
    """Send llama.cpp's ``cache_prompt: true`` (unless the body has ``cache_prompt``): the
    engine reuses the prefix its slot (or its host-memory prompt cache) keeps, even when it
    was started with ``--no-cache-prompt``. Off by default: OpenAI's API refuses fields it
    does not know, and vLLM's prefix caching needs no hint."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> OpenAIOptions:
        checks = {"include_usage": _flag, "merge_system_messages": _flag, "cache_prompt": _flag}
        return cls(**parse_options(raw, checks, kind="openai"))


def _flag(key: str, value: Any) -> bool:
    if type(value) is not bool:
        raise OptionsError(key, f"expected true or false, got {value!r}")
    return value


def merge_system_messages(messages: Any) -> Any:
    """``messages`` with every ``system`` message's text merged into one leading system
    message (joined by a blank line, in order); anything that is not a list of messages is
    left as it is, for the upstream to judge."""
    if not isinstance(messages, list):
        return messages
    system = [m for m in messages if isinstance(m, dict) and m.get("role") == "system"]
    if len(system) < 2 and (not system or messages[0] is system[0]):
        return messages
    text = "\n\n".join(message_text(m) for m in system)
    rest = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "system")]
    return [{"role": "system", "content": text}, *rest]


def completions_url(base_url: str) -> str:
    """``{root}/v1/chat/completions`` for a ``base_url`` with or without the ``/v1``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        return chat_url(root, "/chat/completions")
    return chat_url(root, "/v1/chat/completions")


@attrs.frozen(kw_only=True)
class OpenAIAdapter(HTTPAdapter):
    """Posts to ``url``: the full chat completions URL."""

    options: OpenAIOptions = OpenAIOptions()
    api_key: str | None = attrs.field(default=None, repr=False)

    @classmethod
    def from_provider(
        cls, provider: ProviderConfig, *, environ: Mapping[str, str] | None = None
    ) -> OpenAIAdapter:
        """Build from config; raises :class:`NodeConfigError` when ``api_key_env`` names a
        variable that is not set (or empty) in ``environ`` (default ``os.environ``)."""
        return cls(
            url=completions_url(provider.base_url or OPENAI_BASE_URL),
            api_key=provider.api_key(environ),
            options=OpenAIOptions.from_mapping(provider.options),
            connections=pool_size(provider),
        )

    async def run_on(self, client: UpstreamPool, request: wire.RunRequest, out: RunOutput) -> None:
        body = dict(request.body)
        body["model"] = request.served_model
        if self.options.merge_system_messages:
            body["messages"] = merge_system_messages(body.get("messages"))
        body["stream"] = True
        if self.options.cache_prompt:
            body.setdefault("cache_prompt", True)
        if self.options.include_usage:
            stream_options = body.get("stream_options")
            body["stream_options"] = {
                **(stream_options if isinstance(stream_options, dict) else {}),
                "include_usage": True,
            }
        headers = {"accept": "text/event-stream"}
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key}"

        finish: str | None = None
        done = False
        decoder = SSEDecoder()
        usage = StreamUsage()
        async with post_chunks(client, self.url, body, headers=headers) as chunks:
            async for piece in chunks:
                events = decoder.feed(piece)
                if events:
                    finish, done = await _take_events(events, out, usage, finish)
                    if done:
                        break
            else:
                last = decoder.flush()
                if last is not None:
                    finish, done = await _take_events([last], out, usage, finish)
        if finish is None and not done:
            raise AdapterError(
                "upstream_disconnected",
                "the stream ended without a finish_reason or [DONE]",
                retryable=True,
            )
        out.finish(finish or "stop")

    async def embed_on(
        self, client: UpstreamPool, request: wire.RunRequest, out: RunOutput
    ) -> None:
        """An embeddings run: the client's body (``model`` the served name; ``input``,
        ``encoding_format``, ``dimensions`` and ``user`` as the client sent them) posted to
        ``{root}/v1/embeddings`` beside the chat URL; ``data``'s embeddings, in ``index``
        order, floats or base64 as the upstream answered; ``usage.prompt_tokens`` as the
        prompt tokens (else the runner estimates them)."""
        body = {key: value for key, value in request.body.items() if key not in _NOT_SENT}
        body["model"] = request.served_model
        headers = {"accept": "application/json"}
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key}"
        url = self.url.removesuffix("/chat/completions") + "/embeddings"
        answer = await post_json(client, url, body, headers=headers, what="an embeddings answer")
        data = answer.get("data")
        if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
            raise AdapterError(
                "upstream_bad_response", "the upstream's answer has no data list", retryable=True
            )
        ordered = sorted(data, key=lambda item: _index(item.get("index")))
        vectors = [
            vector_of(item.get("embedding"), f"embedding {number}")
            for number, item in enumerate(ordered)
        ]
        usage = answer.get("usage")
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if type(prompt) is int and prompt >= 0:
            out.usage(prompt, 0)
        await out.embeddings(vectors)


_NOT_SENT: Final = frozenset({"stream", "stream_options"})
"""Body keys the edge reads and OpenAI's ``/v1/embeddings`` does not take."""


def _index(value: Any) -> int:
    return value if type(value) is int else 0


def _count(value: object) -> int | None:
    """A token count: a non-negative int, else None."""
    return value if type(value) is int and value >= 0 else None


def _detail(usage: Mapping[str, Any], field: str, name: str) -> int | None:
    details = usage.get(field)
    return _count(details.get(name)) if isinstance(details, dict) else None


@attrs.define
class StreamUsage:
    """The usage an OpenAI-compatible stream has reported so far (sans-IO): the last
    ``usage`` object with sane counts, and llama.cpp's ``timings.cache_n``, which may come in
    the same chunk or another. The cached count is the usage's own
    (``prompt_tokens_details.cached_tokens``) when it has one, else ``cache_n``."""

    prompt_tokens: int | None = None
    """None until a usage object came."""
    completion_tokens: int = 0
    details_cached: int | None = None
    """``prompt_tokens_details.cached_tokens`` of that usage (None: it had none)."""
    reasoning_tokens: int = 0
    cache_n: int | None = None
    """llama.cpp's ``timings.cache_n``, the last one seen."""

    def take(self, chunk: Mapping[str, Any]) -> bool:
        """Read ``chunk``'s ``usage`` and ``timings``; whether either said something."""
        taken = False
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            prompt = _count(usage.get("prompt_tokens"))
            completion = _count(usage.get("completion_tokens"))
            if prompt is not None and completion is not None:
                self.prompt_tokens, self.completion_tokens = prompt, completion
                self.details_cached = _detail(usage, "prompt_tokens_details", "cached_tokens")
                reasoning = _detail(usage, "completion_tokens_details", "reasoning_tokens")
                self.reasoning_tokens = reasoning or 0
                taken = True
        timings = chunk.get("timings")
        if isinstance(timings, dict):
            cache_n = _count(timings.get("cache_n"))
            if cache_n is not None:
                self.cache_n = cache_n
                taken = True
        return taken

    @property
    def cached_tokens(self) -> int:
        if self.details_cached is not None:
            return self.details_cached
        return self.cache_n or 0

    def report(self, out: RunOutput) -> None:
        """Report the usage known so far (nothing before a usage object came)."""
        if self.prompt_tokens is not None:
            out.usage(
                self.prompt_tokens,
                self.completion_tokens,
                cached_tokens=self.cached_tokens,
                reasoning_tokens=self.reasoning_tokens,
            )


async def _take_events(
    events: list[bytes], out: RunOutput, usage: StreamUsage, finish: str | None
) -> tuple[str | None, bool]:
    """Report the events of one read, in order: the finish reason so far (the last one a
    chunk gave, else ``finish``), and whether ``[DONE]`` came (what follows it is not read).

    The text of consecutive chunks goes out as one ``out.delta``: before anything else is
    reported (a usage, tool calls, a failure) and at the end of the read, so the runner sees
    what it saw chunk by chunk, in the same order, with fewer deltas."""
    text: list[str] = []
    done = False
    failure: AdapterError | None = None
    try:
        for data in events:
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                if data.strip() == b"[DONE]":
                    done = True
                    break
                chunk = loads_object(data, "an SSE event")  # raises unless the bytes were
                # not UTF-8 and their text, malformed sequences replaced, is an object
            if type(chunk) is not dict:
                loads_object(data, "an SSE event")  # raises: not an object
            if "error" in chunk:
                raise error_event_failure(chunk, "event")
            if ("usage" in chunk or "timings" in chunk) and usage.take(chunk):
                if text:
                    await out.delta("".join(text))
                    text.clear()
                usage.report(out)
            choices = chunk.get("choices")
            if type(choices) is not list:
                continue
            for choice in choices:
                if type(choice) is not dict or choice.get("index", 0) != 0:
                    continue  # n > 1 is not supported: only the first choice is streamed
                delta = choice.get("delta")
                if type(delta) is dict:
                    if delta.get("function_call"):
                        raise AdapterError(
                            "unsupported_function_call",
                            "the upstream answered with a legacy function_call, which "
                            "normalized runs do not relay (use tools)",
                        )
                    content = delta.get("content")
                    if content and type(content) is str:
                        text.append(content)
                    tool_calls = delta.get("tool_calls")
                    if type(tool_calls) is list:
                        calls = [call for call in tool_calls if type(call) is dict]
                        if calls:
                            if text:
                                await out.delta("".join(text))
                                text.clear()
                            await out.tool_calls(calls)
                reason = choice.get("finish_reason")
                if reason and type(reason) is str:
                    finish = reason
    except AdapterError as exc:
        failure = exc  # raised once the text before it went out
    if text:
        await out.delta(text[0] if len(text) == 1 else "".join(text))
    if failure is not None:
        raise failure
    return finish, done
