"""A tunnel attempt's HTTP rules and its pre-commit phase, below the gate.

The gate runs :func:`commit_tunnel` inside a tunnel attempt; the API's relay
(:mod:`dispatcher.api.tunnel_relay`) sends the committed answer's :class:`TunnelHead`, then the
rest, with the header rules, SSE filter and usage sniffing defined here.

What the provider receives (:func:`upstream_headers`, :func:`upstream_body`): the client's
method, path, query and body with ``model`` replaced by the served name; the client's headers
minus hop-by-hop ones, ``Host``, ``Content-Length``, ``Accept-Encoding`` and the client's own
``Authorization`` (the node adds the provider's key). For ``"stream": true`` without
``stream_options.include_usage`` the edge adds that option so that the stream reports usage,
and strips the extra usage chunk it causes (the SSE event whose JSON has ``"choices": []`` and
a ``usage`` object) from what the client receives (:class:`SSEFilter`).

What the client receives (:func:`client_headers`): the provider's status, its headers minus
hop-by-hop ones, ``Content-Length``, ``Date`` and any the edge sets itself, and the body byte
for byte (apart from that stripped chunk) but for the model's name: a ``"model"`` member
holding the served name gets the name the client asked for (:class:`ModelRewrite`, a
byte-level substitution, no re-serializing).

The pre-commit phase (:func:`commit_tunnel`): send the request, await the start, and read up
to the commit point -- the first SSE event that carries content, or a whole body (up to
:data:`BUFFER_LIMIT` bytes). Whether the status itself fails the attempt (5xx / 429) is the
gate's decision (:func:`dispatcher.gate.rules.tunnel_status_failure`); the body of such a
status is not read.

Usage: read from the JSON body or the stream's usage chunk without altering the bytes
(:func:`usage_of`, :func:`body_usage`, :func:`tail_usage`, :attr:`SSEFilter.usage`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

import attrs
import orjson
import trio

from .. import wire
from ..errors import TunnelFailed
from .tunnel import Tunnel

BUFFER_LIMIT: Final = 256 * 1024
"""A non-streamed body up to this size is answered whole, with ``Content-Length``."""
USAGE_TAIL: Final = 16 * 1024
"""Of a larger non-streamed body, how much of the end is kept to find ``usage`` in."""
MAX_SSE_EVENT: Final = 64 * 1024
"""An unfinished SSE event longer than this is passed on without waiting for its end (it
cannot be the usage chunk)."""

_HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
_REQUEST_DROP: Final = _HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"authorization",
    b"x-api-key",
    b"accept-encoding",
    b"expect",
}
_RESPONSE_DROP: Final = _HOP_BY_HOP | {b"content-length", b"date"}
_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_FIELD_VALUE: Final = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")
_SSE_BOUNDARY: Final = re.compile(rb"(?>\r\n|\n|\r)(?>\r\n|\n|\r)")
_SSE_LINE: Final = re.compile(rb"\r\n|\n|\r")
_USAGE_KEY: Final = b'"usage"'

_STREAM_USAGE_ROUTES: Final = frozenset({"/v1/chat/completions", "/v1/completions"})


# --------------------------------------------------------------------------- headers


def _connection_listed(headers: Sequence[tuple[bytes, bytes]]) -> set[bytes]:
    return {
        name.strip().lower()
        for key, value in headers
        if key.lower() == b"connection"
        for name in value.split(b",")
    }


def upstream_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The client's headers for the provider: minus hop-by-hop ones (and those the
    ``Connection`` header names), ``Host``, ``Content-Length``, ``Accept-Encoding``,
    ``Expect``, ``Authorization`` and ``X-Api-Key`` (the client's key for the edge, in OpenAI's
    and in Anthropic's way); ``Content-Type: application/json`` when the client sent none."""
    listed = _connection_listed(headers)
    out = [
        (key.decode("latin-1"), value.decode("latin-1"))
        for key, value in headers
        if key.lower() not in _REQUEST_DROP and key.lower() not in listed
    ]
    if not any(key.lower() == "content-type" for key, _ in out):
        out.append(("content-type", "application/json"))
    return out


def client_headers(
    start_headers: Sequence[tuple[str, str]], own: Sequence[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """The provider's response headers for the client, then ``own``: minus hop-by-hop ones,
    ``Content-Length`` and ``Date`` (our server frames the body and dates the response), the
    names in ``own``, and anything that is not a valid header."""
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in start_headers]
    drop = _RESPONSE_DROP | _connection_listed(raw) | {name.lower() for name, _ in own}
    out: list[tuple[bytes, bytes]] = []
    for key, value in raw:
        key = key.lower()
        value = value.strip()
        if key in drop or not _TOKEN.match(key) or not _FIELD_VALUE.match(value):
            continue
        out.append((key, value))
    out.extend(own)
    return out


_BINARY_TYPES: Final = ("audio/", "image/", "video/", "application/octet-stream")


def _is_binary(headers: Sequence[tuple[str, str]]) -> bool:
    """A response whose content type says it is not text (speech audio, an image): the
    model's name is never rewritten in it."""
    for key, value in headers:
        if key.lower() == "content-type":
            return value.strip().lower().startswith(_BINARY_TYPES)
    return False


def _is_sse(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    for key, value in headers:
        if key == b"content-type":
            return value.split(b";")[0].strip().lower() == b"text/event-stream"
    return False


# --------------------------------------------------------------------------- usage


TokenCounts = wire.Usage
"""A provider's usage as its answer reports it (never ``estimated``)."""


def _count(value: object) -> int | None:
    """A token count: a non-negative int (``None``, absent: 0), else None."""
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        return None
    return value


def _detail(usage: dict[str, Any], field: str, name: str) -> int:
    details = usage.get(field)
    if not isinstance(details, dict):
        return 0
    return _count(details.get(name)) or 0


def usage_of(value: object) -> TokenCounts | None:
    """The ``usage`` of an OpenAI response object, if it has a well-formed one
    (``completion_tokens`` may be absent, as in embeddings)."""
    if not isinstance(value, dict):
        return None
    return _openai_counts(value.get("usage"), "prompt", "completion")


def _openai_counts(usage: object, inputs: str, outputs: str) -> TokenCounts | None:
    """OpenAI's usage object under either naming (chat's ``prompt`` / ``completion``, the
    Responses API's ``input`` / ``output``): the two totals (``<inputs>_tokens`` a count,
    ``<outputs>_tokens`` absent as 0) and their parts, the cached tokens of
    ``<inputs>_tokens_details`` and the reasoning ones of ``<outputs>_tokens_details``."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get(f"{inputs}_tokens")
    completion = _count(usage.get(f"{outputs}_tokens"))
    if type(prompt) is not int or prompt < 0 or completion is None:
        return None
    return wire.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=min(prompt, _detail(usage, f"{inputs}_tokens_details", "cached_tokens")),
        reasoning_tokens=min(
            completion, _detail(usage, f"{outputs}_tokens_details", "reasoning_tokens")
        ),
    )


UsageReader = Callable[[object], TokenCounts | None]
"""How a route reads usage from its answer's parsed JSON (:func:`usage_of`: OpenAI's
``usage.prompt_tokens`` / ``completion_tokens``)."""


def body_usage(body: bytes, read: UsageReader = usage_of) -> TokenCounts | None:
    try:
        return read(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def tail_usage(tail: bytes, read: UsageReader = usage_of) -> TokenCounts | None:
    """``usage`` from the end of a JSON body too large to keep whole (OpenAI puts it last;
    Anthropic and the Responses API near the end)."""
    at = tail.rfind(_USAGE_KEY)
    if at < 0:
        return None
    brace = tail.find(b"{", at)
    if brace < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(tail[brace:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return read({"usage": value})


# --------------------------------------------------------------------------- dialects

Dialect = Literal["openai", "anthropic", "responses"]
"""The API a tunnel speaks, by its route: OpenAI's chat completions, completions and embeddings
(``"openai"``), Anthropic's Messages (``/v1/messages``), OpenAI's Responses
(``/v1/responses``). It decides the commit point, where usage is read, what a failure event
is and the error event the edge writes after the commit."""

_DIALECTS: Final[Mapping[str, Dialect]] = {
    "/v1/messages": "anthropic",
    "/v1/responses": "responses",
}


def dialect_of(path: str) -> Dialect:
    """The dialect of a tunnel's route (its request's path)."""
    return _DIALECTS.get(path, "openai")


def anthropic_usage(usage: object) -> TokenCounts | None:
    """An Anthropic ``usage`` object as :class:`wire.Usage`: ``prompt_tokens`` = ``input_tokens``
    + ``cache_read_input_tokens`` + ``cache_creation_input_tokens`` (Anthropic counts the three
    apart; OpenAI's prompt tokens include the cached ones), ``cached_tokens`` =
    ``cache_read_input_tokens``, ``cache_write_tokens`` = ``cache_creation_input_tokens``,
    ``completion_tokens`` = ``output_tokens``."""
    if not isinstance(usage, dict) or "input_tokens" not in usage:
        return None
    counts = [
        _count(usage.get(name))
        for name in (
            "input_tokens",
            "cache_read_input_tokens",
            "cache_creation_input_tokens",
            "output_tokens",
        )
    ]
    if any(count is None for count in counts):
        return None
    fresh, read, written, output = (count or 0 for count in counts)
    return wire.Usage(
        prompt_tokens=fresh + read + written,
        completion_tokens=output,
        cached_tokens=read,
        cache_write_tokens=written,
    )


def responses_usage(usage: object) -> TokenCounts | None:
    """A Responses ``usage`` object as :class:`wire.Usage`: ``input_tokens`` (cached ones
    included, ``input_tokens_details.cached_tokens``), ``output_tokens`` (reasoning included,
    ``output_tokens_details.reasoning_tokens``)."""
    return _openai_counts(usage, "input", "output")


def _anthropic_body_usage(value: object) -> TokenCounts | None:
    return anthropic_usage(value.get("usage")) if isinstance(value, dict) else None


def _responses_body_usage(value: object) -> TokenCounts | None:
    return responses_usage(value.get("usage")) if isinstance(value, dict) else None


_READERS: Final[Mapping[Dialect, UsageReader]] = {
    "openai": usage_of,
    "anthropic": _anthropic_body_usage,
    "responses": _responses_body_usage,
}


def dialect_usage(dialect: Dialect) -> UsageReader:
    """How a whole answer of ``dialect`` reports its usage."""
    return _READERS[dialect]


# --------------------------------------------------------------------------- the model name

_MODEL_KEY: Final = b'"model"'
_MODEL_GAP: Final = 8
"""Whitespace allowed on either side of the ``:`` of a ``"model"`` member (OpenAI pretty-prints
non-streamed bodies with one space; vLLM and llama.cpp write none)."""


@attrs.frozen(init=False)
class ModelRewrite:
    """Replaces the provider's served model name by the name the client asked for in what the
    client receives, without parsing or re-serializing the JSON: every ``"model"`` member whose
    value is exactly the served name (as JSON encodes it) gets the asked name instead. A match
    is always a member's key: inside a JSON string every ``"`` is escaped. In OpenAI's answers
    the one ``"model"`` member is the top-level one.

    Call it on whole texts (a body, complete SSE events); :meth:`stream` rewrites a body that
    arrives in pieces (a match may straddle two)."""

    pattern: re.Pattern[bytes]
    template: bytes
    max_match: int
    """The longest a match can be: a streamed body keeps this much back until more comes."""
    compact: bytes
    """``"model":"<served>"``, as vLLM and llama.cpp write it: when every ``"model"`` in a
    text is this, a plain replace does it (several times cheaper than the pattern)."""
    compact_asked: bytes

    def __init__(self, served: str, asked: str) -> None:
        served_json = orjson.dumps(served)
        asked_json = orjson.dumps(asked)
        gap = rb"[ \t\r\n]{0,%d}" % _MODEL_GAP
        key = re.escape(_MODEL_KEY)
        self.__attrs_init__(
            re.compile(b"(" + key + gap + b":" + gap + b")" + re.escape(served_json)),
            b"\\g<1>" + asked_json.replace(b"\\", b"\\\\"),
            len(_MODEL_KEY) + 2 * _MODEL_GAP + 1 + len(served_json),
            _MODEL_KEY + b":" + served_json,
            _MODEL_KEY + b":" + asked_json,
        )

    @classmethod
    def between(cls, served: str, asked: object) -> ModelRewrite | None:
        """The rewrite from ``served`` to ``asked`` (the client's ``model``), or None when there
        is nothing to rewrite (the same name, or no name asked)."""
        if not isinstance(asked, str) or asked == served:
            return None
        return cls(served, asked)

    def __call__(self, data: bytes) -> bytes:
        keys = data.count(_MODEL_KEY)
        if not keys:
            return data
        if data.count(self.compact) == keys:
            return data.replace(self.compact, self.compact_asked)
        return self.pattern.sub(self.template, data)

    def stream(self) -> ModelRewriteStream:
        return ModelRewriteStream(self)


class ModelRewriteStream:
    """:class:`ModelRewrite` over a body in pieces: :meth:`feed` returns what can be sent,
    keeping back at most ``max_match`` bytes that may be the start of a match;
    :meth:`finish` returns the rest."""

    def __init__(self, rewrite: ModelRewrite) -> None:
        self._rewrite = rewrite
        self._carry = b""

    def feed(self, data: bytes) -> bytes:
        buf = self._carry + data if self._carry else data
        cut = len(buf) - self._rewrite.max_match
        if cut <= 0:
            self._carry = buf
            return b""
        # A match that begins before the cut is complete in buf (no match is longer than
        # max_match): it goes out whole; one that begins after it waits for more.
        for match in self._rewrite.pattern.finditer(buf, max(0, cut - self._rewrite.max_match)):
            if match.start() < cut < match.end():
                cut = match.end()
        self._carry = buf[cut:]
        return self._rewrite(buf[:cut])

    def finish(self) -> bytes:
        rest, self._carry = self._carry, b""
        return self._rewrite(rest)


class SSEFilter:
    """Passes an SSE byte stream through unchanged, event by event, except the one usage
    chunk the edge asked for (``strip_usage_chunk``); notes the stream's ``usage``.

    Complete events are passed on as soon as they are complete; an unfinished one waits for
    its end (or :meth:`finish`). Only events that mention ``"usage"`` are parsed (and, before
    the first content, every event); in the native dialects (``anthropic``, ``responses``)
    also the few whose type says they carry the usage, the response object or an error."""

    def __init__(
        self,
        *,
        strip_usage_chunk: bool,
        find_content: bool = False,
        rewrite: ModelRewrite | None = None,
        dialect: Dialect = "openai",
    ) -> None:
        self._strip = strip_usage_chunk and dialect == "openai"
        self._rewrite = rewrite
        """Applied to what is passed on (the events are read as the provider sent them)."""
        self.dialect: Dialect = dialect
        self._pending = b""
        self._skip_next = False
        self.usage: TokenCounts | None = None
        self._raw_usage: dict[str, Any] = {}
        """Anthropic: the usage members seen so far (``message_start``, then
        ``message_delta``'s, which update them)."""
        self.stripped = False
        self.done = False
        """The stream's last event went through (``data: [DONE]``, Anthropic's
        ``message_stop``, a Responses ``response.completed`` / ``.incomplete`` /
        ``.failed``): the client has the whole answer once it is sent."""
        self.events = 0
        self.content_seen = not find_content
        """An event that carries content went through (with ``find_content``, every event
        is parsed until then)."""
        self.failure: str | None = None
        """Native dialects: the message of an error event (Anthropic ``error``, Responses
        ``error`` / ``response.failed``) seen before any content: the attempt failed, and
        the client has seen nothing of it."""
        self.response: dict[str, Any] | None = None
        """Responses: the last response object an event carried (for the edge's own
        ``response.failed``)."""
        self.sequence = -1
        """Responses: the last ``sequence_number`` seen."""

    def feed(self, data: bytes) -> bytes:
        buf = self._pending + data if self._pending else data
        passed = self._pass(buf)
        if len(self._pending) > MAX_SSE_EVENT:
            passed += self._pending
            self._pending = b""
            self._skip_next = True
            self.content_seen = True  # an event this large is output, whatever it holds
        return self._rewrite(passed) if self._rewrite is not None and passed else passed

    def _pass(self, buf: bytes) -> bytes:
        """What of ``buf`` is passed on (the rest kept pending): before the first content,
        event by event up to it; after it, the plain events at once
        (:meth:`_plain_events`), then event by event from the first that says something."""
        if self.dialect == "openai" and not self.content_seen:
            head = self._feed_events(buf, until_content=True)
            if self._pending and self._has_seen_content():  # the first content came
                rest, self._pending = self._pending, b""
                return head + self._pass(rest)
            return head
        cut = self._plain_events(buf)
        passed = self._feed_events(buf[cut:] if cut else buf)
        return buf[:cut] + passed if cut else passed

    def _has_seen_content(self) -> bool:
        return self.content_seen

    def _plain_events(self, buf: bytes) -> int:
        """Where the leading complete events of ``buf`` end that go through as they are and
        say nothing the filter notes -- in an OpenAI stream after its first content, the
        events before the first ``[DONE]`` and the first ``"usage"`` that is not a null one
        (the stream's chunks but its last) --, found by scanning the bytes, not event by event
        (0: none; the rest is read one by one)."""
        if self.dialect != "openai" or not self.content_seen or self._skip_next:
            return 0
        stop = len(buf)
        for found in (
            buf.find(_DONE_EVENT),
            buf.find(_DONE_EVENT_NO_SPACE),
            -1 if (live := _LIVE_USAGE.search(buf)) is None else live.start(),
        ):
            if 0 <= found < stop:
                stop = found
        # (``stop`` is inside an event: the boundaries before it are whole in buf[:stop])
        parts = _SSE_BOUNDARY.split(buf[:stop] if stop < len(buf) else buf)
        cut = stop - len(parts[-1])
        if cut == len(buf) and buf[-1:] == b"\r":
            return 0  # a CR at the very end may be the first half of a CRLF
        self.events += len(parts) - 1
        return cut

    def _feed_events(self, buf: bytes, *, until_content: bool = False) -> bytes:
        """:meth:`feed`'s complete events of ``buf``, read one by one: what is passed on (the
        rest, an unfinished event -- or, ``until_content``, what follows the first event
        that carries content --, is kept pending)."""
        out: list[bytes] = []
        sent = 0  # buf[:sent] is decided (passed on or stripped)
        event_start = 0
        native = self.dialect != "openai"
        probe = -1 if native else buf.find(_USAGE_KEY)
        for match in _SSE_BOUNDARY.finditer(buf):
            end = match.end()
            if end == len(buf) and buf[-1] == 0x0D:
                break  # a CR at the very end may be the first half of a CRLF
            self.events += 1
            if native:
                if self._skip_next:
                    self._skip_next = False
                else:
                    self._native(buf[event_start:end])
                event_start = end
                continue
            if buf.startswith(_DONE_EVENT, event_start) or buf.startswith(
                _DONE_EVENT_NO_SPACE, event_start
            ):
                self.done = True
            if self._skip_next:
                self._skip_next = False
            elif 0 <= probe < end and _usage_given(buf, probe, end):
                if self._inspect(buf[event_start:end]):
                    out.append(buf[sent:event_start])
                    sent = end
            elif not self.content_seen and _carries_content(buf[event_start:end]):
                self.content_seen = True
            if 0 <= probe < end:
                probe = buf.find(_USAGE_KEY, end)
            event_start = end
            if until_content and self.content_seen:
                break
        out.append(buf[sent:event_start])
        self._pending = buf[event_start:]
        return b"".join(out)

    def finish(self) -> bytes:
        """What is left: an unfinished last event, passed on as it is."""
        rest, self._pending = self._pending, b""
        if rest and not self._skip_next:
            if self.dialect != "openai":
                self.events += 1
                self._native(rest)
            elif _USAGE_KEY in rest:
                self.events += 1
                if self._inspect(rest):
                    return b""
        return self._rewrite(rest) if self._rewrite is not None and rest else rest

    def error_event(self, message: str, code: str) -> bytes:
        """The event the edge ends a committed stream with when it cannot go on (the tunnel
        broke off or stalled, the edge is shutting down), in the stream's dialect: OpenAI's
        ``data: {"error": ...}``; Anthropic's ``event: error`` (``api_error``,
        ``overloaded_error`` when shutting down); a Responses ``response.failed`` whose
        response (the last one the stream carried) has ``status: "failed"`` and the
        ``error``."""
        if self.dialect == "anthropic":
            kind = "overloaded_error" if code == "shutting_down" else "api_error"
            error = {"type": "error", "error": {"type": kind, "message": message}}
            return b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"
        if self.dialect == "responses":
            self.sequence += 1
            response: dict[str, Any] = {
                **(self.response or {"object": "response"}),
                "status": "failed",
                "error": {"code": "server_error", "message": message},
            }
            event = {
                "type": "response.failed",
                "sequence_number": self.sequence,
                "response": response,
            }
            raw = b"event: response.failed\ndata: " + orjson.dumps(event) + b"\n\n"
            return self._rewrite(raw) if self._rewrite is not None else raw
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _inspect(self, event: bytes) -> bool:
        """Note the event's usage; True if it is the usage chunk to strip."""
        value = _event_json(event)
        if value is None:
            return False
        if not self.content_seen and _has_content(value):
            self.content_seen = True
        usage = usage_of(value)
        if usage is None:
            return False
        self.usage = usage
        if (
            self._strip
            and not self.stripped
            and isinstance(value, dict)
            and value.get("choices") == []
        ):
            self.stripped = True
            return True
        return False

    def _native(self, event: bytes) -> None:
        """Read one event of a native dialect (never altered, never stripped)."""
        kind = _event_type(event)
        if self.dialect == "responses" and (number := _SEQUENCE.search(event)) is not None:
            self.sequence = max(self.sequence, int(number.group(1)))
        if kind in _TERMINAL[self.dialect]:
            self.done = True
        if self.content_seen and kind not in _READ[self.dialect]:
            return
        value = _event_json(event)
        if not isinstance(value, dict):
            return
        if self.dialect == "anthropic":
            self._anthropic(value)
        else:
            self._responses(value)

    def _anthropic(self, value: dict[str, Any]) -> None:
        kind = value.get("type")
        if not self.content_seen:
            if kind == "error":
                self.failure = _error_message(value.get("error"))
                return
            if _anthropic_content(value):
                self.content_seen = True
        usage: object = None
        if kind == "message_start" and isinstance(value.get("message"), dict):
            usage = value["message"].get("usage")
        elif kind == "message_delta":
            usage = value.get("usage")
        if isinstance(usage, dict):
            self._raw_usage.update((k, v) for k, v in usage.items() if v is not None)
            self.usage = anthropic_usage(self._raw_usage) or self.usage

    def _responses(self, value: dict[str, Any]) -> None:
        kind = value.get("type")
        response = value.get("response")
        if isinstance(response, dict):
            self.response = {k: v for k, v in response.items() if k not in ("output", "usage")}
            self.response["output"] = []
            self.response["usage"] = None
            self.usage = responses_usage(response.get("usage")) or self.usage
        if self.content_seen:
            return
        if kind == "error":
            self.failure = _error_message(value)
        elif kind == "response.failed":
            error = response.get("error") if isinstance(response, dict) else None
            self.failure = _error_message(error)
        elif _responses_content(value):
            self.content_seen = True


_DONE_EVENT: Final = b"data: [DONE]"
_DONE_EVENT_NO_SPACE: Final = b"data:[DONE]"
_CONTENT_KEYS: Final = ("content", "text", "tool_calls", "function_call", "refusal")
_REASONING_KEYS: Final = ("reasoning_content", "reasoning")
_EVENT_LINE: Final = re.compile(rb"(?:\A|[\r\n])event:[ ]?([^\r\n]*)")
_TYPE_MEMBER: Final = re.compile(rb'"type"[ \t\r\n]*:[ \t\r\n]*"([^"\\]*)"')
_SEQUENCE: Final = re.compile(rb'"sequence_number"[ \t\r\n]*:[ \t\r\n]*([0-9]{1,18})')
_TERMINAL: Final[Mapping[Dialect, frozenset[str]]] = {
    "openai": frozenset(),
    "anthropic": frozenset({"message_stop"}),
    "responses": frozenset({"response.completed", "response.incomplete", "response.failed"}),
}
"""The event types that end a stream of each native dialect."""
_READ: Final[Mapping[Dialect, frozenset[str]]] = {
    "openai": frozenset(),
    "anthropic": frozenset({"message_start", "message_delta"}),
    "responses": frozenset(
        {
            "response.created",
            "response.in_progress",
            "response.completed",
            "response.incomplete",
            "response.failed",
        }
    ),
}
"""The event types of each native dialect parsed after the commit: those with the usage or
the response object."""


def _event_type(event: bytes) -> str:
    """An SSE event's type: its ``event:`` field, else its JSON's first ``"type"`` member (the
    top-level one in Anthropic's and OpenAI's events, which put it first); ``""`` if none."""
    match = _EVENT_LINE.search(event)
    if match is None:
        match = _TYPE_MEMBER.search(event)
    return match.group(1).strip().decode("utf-8", "replace") if match is not None else ""


def _error_message(error: object) -> str:
    if isinstance(error, dict):
        message = error.get("message")
        kind = error.get("type") or error.get("code")
        if isinstance(message, str) and message:
            return f"{kind}: {message}" if isinstance(kind, str) and kind else message
    return "the provider sent an error event"


def _anthropic_content(value: dict[str, Any]) -> bool:
    """Anthropic's first content: a ``content_block_delta``, or a ``content_block_start`` of a
    tool call (or of a block that already holds text)."""
    kind = value.get("type")
    if kind == "content_block_delta":
        return True
    if kind != "content_block_start":
        return False
    block = value.get("content_block")
    if not isinstance(block, dict):
        return False
    if block.get("type") in ("tool_use", "server_tool_use"):
        return True
    return bool(block.get("text") or block.get("thinking"))


def _responses_content(value: dict[str, Any]) -> bool:
    """The Responses API's first content: a non-empty ``response.*.delta`` (output text,
    refusal, function call arguments, reasoning), or an output item that holds content (a
    function call's, a message's with content, a reasoning item's with a summary)."""
    kind = value.get("type")
    if not isinstance(kind, str):
        return False
    if kind.endswith(".delta"):
        return bool(value.get("delta"))
    if kind not in ("response.output_item.added", "response.output_item.done"):
        return False
    item = value.get("item")
    if not isinstance(item, dict):
        return False
    item_type = item.get("type")
    if item_type == "message":
        return bool(item.get("content"))
    if item_type == "reasoning":
        return bool(item.get("summary") or item.get("content"))
    return True


_JSON_SPACE: Final = b" \t\r\n"
_LIVE_USAGE: Final = re.compile(rb'"usage"(?![ \t\r\n]*:[ \t\r\n]*null)')
"""A ``"usage"`` that is not a member whose value is null."""


def _usage_given(buf: bytes, at: int, end: int) -> bool:
    """Whether ``buf[at:end]`` (``at``: where ``"usage"`` first occurs in it) may give a
    usage: a ``"usage"`` member whose value is not ``null``. OpenAI's chunks carry
    ``"usage":null`` on every event of a stream that asked for the usage (and the usage
    only on the last): those are passed on without parsing their JSON. (A ``"usage"`` that
    is not followed by a colon is a string, not a member.)"""
    while 0 <= at < end:
        colon = at + len(_USAGE_KEY)
        while colon < end and buf[colon] in _JSON_SPACE:
            colon += 1
        if colon < end and buf[colon] == 0x3A:  # ':'
            value = colon + 1
            while value < end and buf[value] in _JSON_SPACE:
                value += 1
            if not buf.startswith(b"null", value, end):
                return True
        at = buf.find(_USAGE_KEY, colon, end)
    return False


def _event_json(event: bytes) -> object:
    """The JSON of an SSE event's ``data`` lines, or None."""
    lines = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in _SSE_LINE.split(event)
        if line.startswith(b"data:")
    ]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None


def _has_content(value: object) -> bool:
    """A chunk (chat or text completion) with a choice whose delta carries content, text,
    tool calls or reasoning; role-only preambles, finish chunks and usage chunks do not."""
    if not isinstance(value, dict):
        return False
    choices = value.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):  # /v1/completions
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(key) for key in (*_CONTENT_KEYS, *_REASONING_KEYS)
        ):
            return True
    return False


def _carries_content(event: bytes) -> bool:
    return _has_content(_event_json(event))


# --------------------------------------------------------------------------- the pre-commit


@attrs.frozen(kw_only=True)
class TunnelCall:
    """What a tunnel attempt relays of the client's HTTP request."""

    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """The client's headers, as received (:func:`upstream_headers` filters them)."""
    body: Mapping[str, object] = attrs.field(factory=dict)
    """The client's parsed JSON body."""
    raw_body: Callable[[str], bytes] | None = None
    """When set, the body for the provider given the served model name, as bytes sent after
    ``tunnel.request`` in binary frames (a multipart upload); ``body`` then only names the
    ``model`` the client asked for. None: ``body`` as JSON, its ``model`` the served name
    (:func:`upstream_body`)."""


@attrs.define(eq=False)
class PreCommit:
    """The clock of a tunnel attempt's pre-commit phase, as the gate runs it: until the first
    output the first-token timeout applies; :meth:`output` (some of the answer arrived, e.g.
    a piece of a non-streamed body) switches to the stall timeout from now."""

    _scope: trio.CancelScope
    stall_timeout_s: float
    output_at: float | None = None

    def output(self) -> None:
        now = trio.current_time()
        self.output_at = now
        self._scope.deadline = now + self.stall_timeout_s


def upstream_body(body: Mapping[str, object], served_model: str, route: str) -> tuple[bytes, bool]:
    """The body for the provider and whether the edge added ``include_usage`` to it."""
    out: dict[str, object] = {**body, "model": served_model}
    if route in _STREAM_USAGE_ROUTES and out.get("stream") is True:
        options = out.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            out["stream_options"] = {
                **(options if isinstance(options, dict) else {}),
                "include_usage": True,
            }
            return orjson.dumps(out), True
    return orjson.dumps(out), False


@attrs.frozen(kw_only=True)
class TunnelHead:
    """What a tunnel attempt's pre-commit phase read (:func:`commit_tunnel`): the relay sends
    it first, then the rest of the response."""

    start: wire.TunnelStart
    data: bytes = b""
    """The body bytes read before the commit, as the client gets them (filtered, for SSE)."""
    sse: SSEFilter | None = None
    """For a 2xx event stream: the filter the rest goes through."""
    complete: bool = False
    """The body ended within ``data``."""
    model_rewrite: ModelRewrite | None = None
    """The served model name -> the client's, for what the client receives (already applied
    to ``data`` and by ``sse``; the relay applies it to another body)."""
    dialect: Dialect = "openai"
    """The API the answer speaks (:func:`dialect_of` its route): where its usage is."""

    @property
    def ok(self) -> bool:
        return 200 <= self.start.status < 300


async def commit_tunnel(
    tunnel: Tunnel, call: TunnelCall, served_model: str, pre_commit: PreCommit
) -> TunnelHead:
    """The pre-commit phase of a tunnel attempt, which the gate runs: send the request, await
    the response's start, and for a 2xx read up to the commit point -- the first SSE event
    that carries content (or the end of the stream), or a whole non-streamed body (or its
    first :data:`BUFFER_LIMIT` bytes). Any other status returns at once, its body unread: the
    gate decides whether it fails the attempt (5xx / 429: leaving the tunnel aborts it) or is
    the answer, relayed as it is. Raises :class:`TunnelFailed` when the tunnel fails; the body
    breaking off before the commit is retryable: the client has seen nothing of it."""
    if call.raw_body is None:
        body, injected = upstream_body(call.body, served_model, call.path)
        sent: str | bytes = body.decode("utf-8")
    else:
        sent, injected = call.raw_body(served_model), False
    rewrite = ModelRewrite.between(served_model, call.body.get("model"))
    dialect = dialect_of(call.path)
    await tunnel.send_request(
        method=call.method,
        path=call.path,
        query=call.query,
        headers=upstream_headers(call.headers),
        body=sent,
    )
    start = await tunnel.start()
    if rewrite is not None and _is_binary(start.headers):
        rewrite = None  # audio or an image: relayed unchanged
    if not 200 <= start.status < 300:
        return TunnelHead(start=start, model_rewrite=rewrite, dialect=dialect)
    try:
        if _is_sse(client_headers(start.headers, ())):
            sse = SSEFilter(
                strip_usage_chunk=injected, find_content=True, rewrite=rewrite, dialect=dialect
            )
            return await _sse_head(tunnel, start, sse, rewrite)
        head = await _body_head(tunnel, start, pre_commit)
        return attrs.evolve(head, model_rewrite=rewrite, dialect=dialect)
    except TunnelFailed as exc:
        raise TunnelFailed(exc.message, code=exc.code, retryable=True) from exc


async def _sse_head(
    tunnel: Tunnel, start: wire.TunnelStart, sse: SSEFilter, rewrite: ModelRewrite | None
) -> TunnelHead:
    """Read the stream up to its first content. An error event before it (a native
    dialect's) fails the attempt: the client has seen nothing of it."""
    parts: list[bytes] = []
    size = 0
    dialect = sse.dialect
    while not sse.content_seen and size <= BUFFER_LIMIT:
        data = await tunnel.receive_some()
        if not data:
            parts.append(sse.finish())
            _check_failure(tunnel, sse)
            data = b"".join(parts)
            return TunnelHead(
                start=start,
                data=data,
                sse=sse,
                complete=True,
                model_rewrite=rewrite,
                dialect=dialect,
            )
        out = sse.feed(data)
        _check_failure(tunnel, sse)
        parts.append(out)
        size += len(out)
    return TunnelHead(
        start=start, data=b"".join(parts), sse=sse, model_rewrite=rewrite, dialect=dialect
    )


def _check_failure(tunnel: Tunnel, sse: SSEFilter) -> None:
    if sse.failure is not None:
        raise TunnelFailed(
            f"the provider behind {tunnel.candidate.label} sent an error event before any "
            f"content: {sse.failure}",
            code="upstream_error_event",
            retryable=True,
        )


async def _body_head(tunnel: Tunnel, start: wire.TunnelStart, pre_commit: PreCommit) -> TunnelHead:
    parts: list[bytes] = []
    size = 0
    while data := await tunnel.receive_some():
        pre_commit.output()
        parts.append(data)
        size += len(data)
        if size > BUFFER_LIMIT:
            return TunnelHead(start=start, data=b"".join(parts))
    return TunnelHead(start=start, data=b"".join(parts), complete=True)


__all__ = [
    "BUFFER_LIMIT",
    "MAX_SSE_EVENT",
    "USAGE_TAIL",
    "Dialect",
    "ModelRewrite",
    "ModelRewriteStream",
    "PreCommit",
    "SSEFilter",
    "TokenCounts",
    "TunnelCall",
    "TunnelHead",
    "UsageReader",
    "anthropic_usage",
    "body_usage",
    "client_headers",
    "commit_tunnel",
    "dialect_of",
    "dialect_usage",
    "responses_usage",
    "tail_usage",
    "upstream_body",
    "upstream_headers",
    "usage_of",
]
