"""What the HTTP adapters (``ollama``, ``openai``) share: timeouts, one streamed POST with
upstream errors mapped to :class:`~nodes.adapters.base.AdapterError`, an SSE decoder, and
option parsing.

Error mapping (see ``docs/node.md``):

=================================================  ==========================  =========
what happened                                      code                        retryable
=================================================  ==========================  =========
cannot connect, or any timeout (connect, read...)  ``upstream_unreachable``    yes
the connection broke after the response began      ``upstream_disconnected``   yes
HTTP 429                                           ``upstream_rate_limited``   yes
HTTP 5xx                                           ``upstream_5xx``            yes
any other HTTP 4xx                                 ``upstream_4xx``            no
another non-2xx status, or a body we cannot parse  ``upstream_bad_response``   yes
=================================================  ==========================  =========

A 4xx/5xx message carries the upstream's own error message when its body has one
(``{"error": {"message": ...}}``, ``{"error": "..."}``, ``{"detail": ...}`` or
``{"message": ...}``), else the start of the body text.

Each run opens its own ``httpx.AsyncClient`` inside ``async with`` (see :func:`post_stream`):
the simplest lifetime that is always correct under cancellation. The price is no connection
reuse across runs: a new TCP connection (and TLS handshake for ``https``) per run, which is
noise for a local engine and tens of milliseconds for a remote one.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

import attrs
import httpx  # noqa: ASYNC127  (the project depends on httpx; see pyproject.toml)
import orjson
import trio

from nodes.adapters.base import AdapterError
from nodes.config import OptionsError

DEFAULT_CONNECT_TIMEOUT: Final = 10.0
DEFAULT_READ_TIMEOUT: Final = 600.0
"""Longest silence between two pieces of a response (a model loading before its first token
may take minutes). The edge keeps its own stall timeouts."""
WRITE_TIMEOUT: Final = 30.0
MAX_ERROR_BODY: Final = 64 * 1024
"""How much of an error response's body is read to find the upstream's message."""
MAX_ERROR_MESSAGE: Final = 1000
"""Characters of the upstream's message kept in an AdapterError message."""
DRAIN_TIMEOUT: Final = 1.0
"""Bound on finishing httpx's iterators after the response was closed (normally instant)."""

_T = TypeVar("_T")


@attrs.frozen(kw_only=True)
class HTTPTimeouts:
    connect: float = DEFAULT_CONNECT_TIMEOUT
    read: float | None = DEFAULT_READ_TIMEOUT
    """None: wait for the upstream forever (until the run is cancelled)."""

    def as_httpx(self) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect, read=self.read, write=WRITE_TIMEOUT, pool=self.connect
        )


def parse_timeout_option(key: str, value: Any, fields: dict[str, Any]) -> bool:
    """Parse ``connect_timeout`` / ``read_timeout`` into ``fields``; False for other keys.

    ``connect_timeout`` is a number > 0; ``read_timeout`` a number > 0, or 0 for none."""
    if key not in ("connect_timeout", "read_timeout"):
        return False
    ok = type(value) in (int, float) and math.isfinite(value)
    if key == "connect_timeout":
        if not ok or value <= 0:
            raise OptionsError(key, f"expected a number > 0, got {value!r}")
        fields["connect"] = float(value)
    else:
        if not ok or value < 0:
            raise OptionsError(key, f"expected a number >= 0 (0: no timeout), got {value!r}")
        fields["read"] = float(value) or None
    return True


def chat_url(base_url: str, path: str) -> str:
    """``base_url`` (trailing slashes dropped) joined with ``path``."""
    return base_url.rstrip("/") + path


def display_url(url: str) -> str:
    """``url`` without credentials, for messages."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return "<invalid URL>"
    return str(parsed.copy_with(username=None, password=None, query=None))


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def loads_object(text: str | bytes, what: str) -> dict[str, Any]:
    """A JSON object from the upstream, or ``upstream_bad_response``."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise AdapterError(
            "upstream_bad_response",
            f"the upstream sent {what} that is not JSON: {_clip(str(text), 200)!r}",
            retryable=True,
        ) from None
    if not isinstance(value, dict):
        raise AdapterError(
            "upstream_bad_response",
            f"the upstream sent {what} that is not a JSON object: {_clip(str(text), 200)!r}",
            retryable=True,
        )
    return value


def error_text(value: Any) -> str | None:
    """The message in an upstream's error JSON, if it has one."""
    if not isinstance(value, dict):
        return None
    for key in ("error", "detail", "message"):
        inner = value.get(key)
        if isinstance(inner, str) and inner:
            return inner
        if isinstance(inner, dict):
            found = error_text(inner)
            if found:
                return found
    return None


@asynccontextmanager
async def post_stream(
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str],
    timeouts: HTTPTimeouts,
) -> AsyncIterator[httpx.Response]:
    """POST ``body`` as JSON to ``url`` and give the streamed 2xx response.

    The client and the response live inside this block: leaving it -- normally, by an error,
    or cancelled -- closes the upstream connection. A non-2xx status and every transport
    error (also those raised while the caller reads the body inside the block) come out as
    :class:`AdapterError`. Read lines with :func:`response_lines`, which closes the iterator
    when left early.
    """
    where = display_url(url)
    started = False
    try:
        async with (
            httpx.AsyncClient(timeout=timeouts.as_httpx(), follow_redirects=False) as client,
            client.stream(
                "POST",
                url,
                content=dumps(body),
                headers={"content-type": "application/json", **headers},
            ) as response,
        ):
            started = True
            if not 200 <= response.status_code < 300:
                raise await _status_error(response, where)
            yield response
    except httpx.TimeoutException as exc:
        raise AdapterError(
            "upstream_unreachable",
            f"{where}: timed out ({type(exc).__name__})",
            retryable=True,
        ) from None
    except httpx.TransportError as exc:
        if started:
            raise AdapterError(
                "upstream_disconnected",
                f"{where}: the connection broke mid-response: {_describe(exc)}",
                retryable=True,
            ) from None
        raise AdapterError(
            "upstream_unreachable", f"{where}: cannot connect: {_describe(exc)}", retryable=True
        ) from None
    except httpx.DecodingError as exc:
        raise AdapterError(
            "upstream_bad_response",
            f"{where}: cannot decode the response: {_describe(exc)}",
            retryable=True,
        ) from None


@asynccontextmanager
async def response_lines(response: httpx.Response) -> AsyncIterator[AsyncIterator[str]]:
    """``response.aiter_lines()``, finished properly however the block is left."""
    async with _finished(response, response.aiter_lines()) as lines:
        yield lines


@asynccontextmanager
async def _finished(
    response: httpx.Response, iterator: AsyncIterator[_T]
) -> AsyncIterator[AsyncIterator[_T]]:
    """``iterator`` (one of httpx's response iterators), finished when the block is left.

    httpx's iterators are a chain of async generators (lines over text over bytes over raw
    over httpcore's...). ``contextlib.aclosing`` closes only the outermost one when the
    caller stops early; the others are left suspended and Trio warns (ResourceWarning) when
    they are garbage collected. So: close the response (and its connection), then resume the
    chain until it ends -- the read at its bottom fails at once on the closed connection and
    that error unwinds every generator. Shielded and bounded, so it runs when cancelled too.
    """
    try:
        yield iterator
    finally:
        with trio.move_on_after(DRAIN_TIMEOUT, shield=True):
            await response.aclose()
            try:
                async for _ in iterator:
                    pass
            except Exception:  # the read on the closed connection fails: expected
                pass


async def _status_error(response: httpx.Response, where: str) -> AdapterError:
    status = response.status_code
    raw = bytearray()
    async with _finished(response, response.aiter_bytes()) as chunks:
        async for chunk in chunks:
            raw += chunk
            if len(raw) >= MAX_ERROR_BODY:
                break
    text = bytes(raw[:MAX_ERROR_BODY]).decode("utf-8", errors="replace")
    try:
        upstream = error_text(orjson.loads(text))
    except orjson.JSONDecodeError:
        upstream = None
    if upstream is None:
        upstream = " ".join(text.split()) or response.reason_phrase or "no message"
    detail = f"{where} answered HTTP {status}: {_clip(upstream, MAX_ERROR_MESSAGE)}"
    if status == 429:
        return AdapterError("upstream_rate_limited", detail, retryable=True)
    if 500 <= status < 600:
        return AdapterError("upstream_5xx", detail, retryable=True)
    if 400 <= status < 500:
        return AdapterError("upstream_4xx", detail, retryable=False)
    return AdapterError("upstream_bad_response", detail, retryable=True)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class SSEDecoder:
    """Server-sent events, line by line: :meth:`feed` each line (without its end of line);
    it returns an event's ``data`` (its ``data:`` lines joined by newlines) when a blank
    line ends the event. Comments, ``event:``, ``id:`` and ``retry:`` fields are ignored."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def flush(self) -> str | None:
        """The pending event's data at the end of the stream (None if there is none)."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data.clear()
        return data
