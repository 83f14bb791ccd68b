"""What the HTTP adapters (``ollama``, ``openai``) share: timeouts, one streamed POST with
upstream errors mapped to :class:`~nodes.adapters.base.AdapterError`, an SSE decoder, and
option parsing.

Error mapping (see ``docs/node.md``). An upstream's answer that says the *request* is wrong is
the client's error: it carries the upstream's ``status``, is not retryable, and its message is
the upstream's own. Everything else is the node's or the provider's problem: no ``status``,
and retryable, so the edge may try another candidate.

=================================================  ==========================  =========  ======
what happened                                      code                        retryable  status
=================================================  ==========================  =========  ======
HTTP 400, 413, 415, 422 (the client's error)       the upstream's own code,    no         yes
                                                   else ``invalid_request``
HTTP 401, 403 (the node's key)                     ``upstream_unauthorized``   yes        --
HTTP 404 (wrong model name or base URL)            ``upstream_not_found``      yes        --
HTTP 429                                           ``upstream_rate_limited``   yes        --
any other HTTP 4xx (408, 409, 405...)              ``upstream_4xx``            yes        --
HTTP 5xx                                           ``upstream_5xx``            yes        --
another non-2xx status, or a body we cannot parse  ``upstream_bad_response``   yes        --
cannot connect, or any timeout (connect, read...)  ``upstream_unreachable``    yes        --
the connection broke after the response began      ``upstream_disconnected``   yes        --
=================================================  ==========================  =========  ======

The upstream's message and code are read from its error JSON (:func:`parse_error`: OpenAI's
``{"error": {"message", "type", "code", "param"}}``, Ollama's ``{"error": "..."}``, vLLM's and
llama.cpp's variants, ``{"detail": ...}``, ``{"message": ...}``), else the start of the body
text. A client's-error message is that text alone; the others read ``the provider answered
HTTP <status>: <text>``.

No message names the provider: messages are composed without its URL, and every
:class:`~nodes.adapters.base.AdapterError` leaving :func:`post_stream` -- also those the
caller raises inside the block, e.g. about a body it could not parse -- has the provider's URL,
origin, ``host:port``, host and base path and the node's credentials removed
(:class:`Redactor`); the upstream's text may quote any of them. The node's own log keeps the
URL (INFO, logger ``nodes.adapters.http``).

Each run opens its own ``httpx.AsyncClient`` inside ``async with`` (see :func:`post_stream`):
the simplest lifetime that is always correct under cancellation. The price is no connection
reuse across runs: a new TCP connection (and TLS handshake for ``https``) per run, which is
noise for a local engine and tens of milliseconds for a remote one.
"""

from __future__ import annotations

import logging
import math
import re
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
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
MAX_MESSAGE: Final = MAX_ERROR_MESSAGE + 200
"""Characters of any AdapterError message leaving :func:`post_stream`. Text is cut only after
it was redacted: a cut through an address would leave a part no redaction recognises."""
DRAIN_TIMEOUT: Final = 1.0
"""Bound on finishing httpx's iterators after the response was closed (normally instant)."""

CLIENT_ERROR_STATUSES: Final = frozenset({400, 413, 415, 422})
"""Upstream statuses that say the request itself is wrong: the client's error."""
CODE_ALIASES: Final[Mapping[str, str]] = {"exceed_context_size_error": "context_length_exceeded"}
"""Upstream error codes (or, without a code, types) renamed to OpenAI's: llama.cpp's server
answers a too-long prompt with type ``exceed_context_size_error``."""

log = logging.getLogger("nodes.adapters.http")

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


def split_timeouts(raw: Mapping[str, Any]) -> tuple[HTTPTimeouts, dict[str, Any]]:
    """An HTTP provider's ``options``: its ``connect_timeout`` / ``read_timeout`` parsed (see
    :func:`parse_timeout_option`), and the other keys as they are."""
    timeouts: dict[str, Any] = {}
    rest = {
        key: value for key, value in raw.items() if not parse_timeout_option(key, value, timeouts)
    }
    return HTTPTimeouts(**timeouts), rest


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
    """A JSON object from the upstream, or ``upstream_bad_response`` quoting ``text`` whole
    (:func:`post_stream` redacts, then cuts it)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise AdapterError(
            "upstream_bad_response",
            f"the upstream sent {what} that is not JSON: {str(text)!r}",
            retryable=True,
        ) from None
    if not isinstance(value, dict):
        raise AdapterError(
            "upstream_bad_response",
            f"the upstream sent {what} that is not a JSON object: {str(text)!r}",
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


_CODE = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,63}")
"""What an upstream error code may look like to be passed on (anything else is dropped)."""


@attrs.frozen
class UpstreamError:
    """What an upstream's error JSON says; None where it says nothing usable."""

    message: str | None = None
    code: str | None = None
    """Its own error code: OpenAI's ``error.code`` (``"context_length_exceeded"``), renamed
    by :data:`CODE_ALIASES`."""
    status: int | None = None
    """An HTTP status the body itself names: vLLM and llama.cpp put it in ``code``."""


def parse_error(value: Any) -> UpstreamError:
    """Read an error body: OpenAI's ``{"error": {"message", "type", "code", "param"}}``,
    vLLM's ``{"message", "type", "code": 400}`` (also under ``error``), llama.cpp's
    ``{"error": {"code": 400, "message", "type"}}``, Ollama's ``{"error": "..."}``."""
    if not isinstance(value, dict):
        return UpstreamError()
    inner = value.get("error")
    fields = inner if isinstance(inner, dict) else value
    raw_code, kind = fields.get("code"), fields.get("type")
    code: str | None = None
    if isinstance(raw_code, str) and _CODE.fullmatch(raw_code):
        code = CODE_ALIASES.get(raw_code, raw_code)
    elif isinstance(kind, str) and kind in CODE_ALIASES:
        code = CODE_ALIASES[kind]
    status = raw_code if type(raw_code) is int and 100 <= raw_code <= 599 else None
    return UpstreamError(message=error_text(value), code=code, status=status)


def status_failure(
    status: int,
    body: str,
    *,
    reason: str = "",
    retry_after: str | None = None,
    redact: Callable[[str], str] | None = None,
) -> AdapterError:
    """The failure an upstream's non-2xx answer means (see the table above). ``body``: the
    start of the response body; ``reason``: the reason phrase; ``retry_after``: the
    ``Retry-After`` header (a 429's message names it); ``redact`` is applied to the
    upstream's text before it is cut to :data:`MAX_ERROR_MESSAGE`."""
    try:
        parsed = parse_error(orjson.loads(body))
    except orjson.JSONDecodeError:
        parsed = UpstreamError()
    said = parsed.message or _plain_text(body) or reason or "no message"
    said = _clip(said if redact is None else redact(said), MAX_ERROR_MESSAGE)
    if status in CLIENT_ERROR_STATUSES:
        return AdapterError(parsed.code or "invalid_request", said, status=status)
    detail = f"the provider answered HTTP {status}: {said}"
    if status == 429:
        wait = _seconds(retry_after)
        if wait is not None:
            detail = f"{detail} (retry after {wait} s)"
        return AdapterError("upstream_rate_limited", detail, retryable=True)
    if status in (401, 403):
        return AdapterError("upstream_unauthorized", detail, retryable=True)
    if status == 404:
        return AdapterError("upstream_not_found", detail, retryable=True)
    if 400 <= status < 600:
        code = "upstream_5xx" if status >= 500 else "upstream_4xx"
        return AdapterError(code, detail, retryable=True)
    return AdapterError("upstream_bad_response", detail, retryable=True)


def error_event_failure(value: Any, what: str) -> AdapterError:
    """The failure an ``{"error": ...}`` event or line in a 2xx stream means: the client's
    error when the body names a client's-error status (vLLM, llama.cpp: ``code: 400``) or
    code ``context_length_exceeded`` -- code, message and status as for an HTTP answer --
    else ``upstream_error`` (retryable), the message prefixed with ``what``. The message is
    not cut (:func:`post_stream` redacts, then cuts it)."""
    parsed = parse_error(value)
    said = parsed.message or f"an error {what} without a message"
    if parsed.status in CLIENT_ERROR_STATUSES or parsed.code == "context_length_exceeded":
        status = parsed.status if parsed.status in CLIENT_ERROR_STATUSES else 400
        return AdapterError(parsed.code or "invalid_request", said, status=status)
    return AdapterError(
        "upstream_error", f"the provider sent an error {what}: {said}", retryable=True
    )


_REDACTED_PLACE: Final = "<provider>"
_REDACTED_SECRET: Final = "<redacted>"
_SECRET_HEADERS: Final = frozenset({"authorization", "proxy-authorization", "api-key", "x-api-key"})
_STANDARD_SEGMENTS: Final = frozenset({"", "v1", "api", "chat", "completions"})
"""Path segments every provider of a kind shares: a path made of these alone is no secret."""


@attrs.frozen
class Redactor:
    """Removes from text what locates the provider -- its URL (with and without credentials
    or query), origin, ``host:port``, host, and every leading part of its path that is more
    than the standard ``/v1/chat/completions`` or ``/api/chat`` -- and the node's
    credentials (``Authorization`` and API-key header values, the URL's user info). A bare
    port number is left alone: it cannot be told apart from any other number."""

    _secrets: re.Pattern[str] | None
    _places: re.Pattern[str] | None

    @classmethod
    def for_request(cls, url: str, headers: Mapping[str, str]) -> Redactor:
        secrets: set[str] = set()
        for name, value in headers.items():
            if name.lower() in _SECRET_HEADERS and value.strip():
                secrets.add(value.strip())
                token = value.strip().partition(" ")[2].strip()
                if token:
                    secrets.add(token)
        places = {url.rstrip("/")}
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            parsed = None
        if parsed is not None:
            userinfo = parsed.userinfo.decode("ascii", errors="replace")
            for secret in (userinfo, urllib.parse.unquote(userinfo), parsed.password):
                if secret:
                    secrets.add(secret)
            host = parsed.host
            port = parsed.port or {"http": 80, "https": 443}.get(parsed.scheme)
            netloc = parsed.netloc.decode("ascii", errors="replace")
            bracketed = f"[{host}]" if ":" in host else host
            origin = f"{parsed.scheme}://{netloc}"
            places |= {
                display_url(url).rstrip("/"),
                str(parsed).rstrip("/"),
                origin,
                netloc,
                host,
                f"{bracketed}:{port}",
            }
            for path in {parsed.path, parsed.raw_path.decode("ascii", errors="replace")}:
                segments = path.split("?", 1)[0].split("/")[1:]
                for end in range(1, len(segments) + 1):
                    prefix = "/" + "/".join(segments[:end])
                    places.add(origin + prefix)  # the base URL, whatever its suffix
                    if not set(segments[:end]) <= _STANDARD_SEGMENTS:
                        places.add(prefix)
        return cls(_alternation(secrets, names=False), _alternation(places, names=True))

    def __call__(self, text: str) -> str:
        if self._secrets is not None:
            text = self._secrets.sub(_REDACTED_SECRET, text)
        if self._places is not None:
            text = self._places.sub(_REDACTED_PLACE, text)
        return text


def _alternation(literals: set[str], *, names: bool) -> re.Pattern[str] | None:
    """One pattern matching any of ``literals``, longest first. ``names``: case-insensitive,
    and a literal must not be followed by a character that would make it part of a longer
    name (``10.0.0.5`` in ``10.0.0.55``, ``/team`` in ``/teams``) nor, when it starts with one,
    be preceded by one. Secrets are matched anywhere, exactly."""
    alternatives = []
    for literal in sorted((x for x in literals if x), key=len, reverse=True):
        if names:
            before = r"(?<![\w.-])" if literal[0].isalnum() else ""
            alternatives.append(rf"{before}{re.escape(literal)}(?![\w-])")
        else:
            alternatives.append(re.escape(literal))
    if not alternatives:
        return None
    return re.compile("|".join(alternatives), re.IGNORECASE if names else 0)


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
    :class:`AdapterError`; every AdapterError leaving the block (the caller's too) has its
    message passed through a :class:`Redactor` for this request. Read lines with
    :func:`response_lines`, which closes the iterator when left early.
    """
    where = display_url(url)
    redact = Redactor.for_request(url, headers)
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
                raise await _status_error(response, where, redact)
            yield response
    except AdapterError as exc:
        exc.message = _clip(redact(exc.message), MAX_MESSAGE)
        exc.args = (exc.message,)
        raise
    except httpx.TimeoutException as exc:
        raise _transport_failure(
            "upstream_unreachable",
            f"the request to the provider timed out ({type(exc).__name__})",
            where,
            exc,
        ) from None
    except httpx.TransportError as exc:
        if started:
            raise _transport_failure(
                "upstream_disconnected",
                f"the connection to the provider broke mid-response ({type(exc).__name__})",
                where,
                exc,
            ) from None
        raise _transport_failure(
            "upstream_unreachable",
            f"cannot connect to the provider ({type(exc).__name__})",
            where,
            exc,
        ) from None
    except httpx.DecodingError as exc:
        raise _transport_failure(
            "upstream_bad_response",
            f"cannot decode the provider's response ({type(exc).__name__})",
            where,
            exc,
        ) from None


def _transport_failure(code: str, message: str, where: str, exc: Exception) -> AdapterError:
    """A retryable failure whose message names no address: the exception's own text (which
    may: ``Connect call failed ('10.0.0.5', 8000)``) goes to the log only, with the URL."""
    log.info("%s: %s: %s", where, message, _describe(exc))
    return AdapterError(code, message, retryable=True)


@asynccontextmanager
async def response_lines(response: httpx.Response) -> AsyncIterator[AsyncIterator[str]]:
    """``response.aiter_lines()``, finished properly however the block is left."""
    async with finished(response, response.aiter_lines()) as lines:
        yield lines


@asynccontextmanager
async def finished(
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


async def _status_error(response: httpx.Response, where: str, redact: Redactor) -> AdapterError:
    status = response.status_code
    raw = bytearray()
    async with finished(response, response.aiter_bytes()) as chunks:
        async for chunk in chunks:
            raw += chunk
            if len(raw) >= MAX_ERROR_BODY:
                break
    text = bytes(raw[:MAX_ERROR_BODY]).decode("utf-8", errors="replace")
    # The log names the provider (``where``) but not what the body may echo of the key.
    log.info("%s answered HTTP %d: %s", where, status, _clip(" ".join(redact(text).split()), 500))
    return status_failure(
        status,
        text,
        reason=response.reason_phrase,
        retry_after=response.headers.get("retry-after"),
        redact=redact,
    )


def _plain_text(body: str) -> str:
    """A non-JSON error body as a message: its text on one line, or nothing for an HTML page
    (a proxy's error page says no more than the reason phrase)."""
    text = " ".join(body.split())
    return "" if text.startswith("<") else text


def _seconds(value: str | None) -> int | None:
    """A ``Retry-After`` in seconds (its HTTP-date form is ignored)."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value.strip())


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
