"""What the HTTP adapters (``ollama``, ``openai``) share: one pooled client per provider and
its lifetime, timeouts, one streamed POST with upstream errors mapped to
:class:`~nodes.adapters.base.AdapterError`, an SSE decoder, and option parsing.

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

Connections are reused. Each provider gets one pooled client, a
:class:`~nodes.adapters._client.Pool` (:func:`open_client`; our own small HTTP/1.1 client:
httpx's per-request and per-chunk work was most of a run's CPU, see that module): at most
as many connections as the provider has slots (the sum of its models' ``slots``,
:func:`pool_size`), all of them kept alive, and every client of the process shares one TLS
context per distinct TLS setting (:func:`tls_context`: building one loads the CA bundle,
~50 ms of CPU). Its lifetime is lexical: an adapter is an
:class:`HTTPAdapter`, whose :meth:`~HTTPAdapter.open` block holds the client and gives the
adapter bound to it; ``nodes.adapters.open_adapters`` (entered by ``nodes.runner.open_runner``)
opens every adapter that has such a block for as long as the runs live. A run used without
it (``adapter.run()`` called directly) opens a client of its own, closed with the run.

A run still owns *its* request: the response stream lives inside :func:`post_stream`'s block,
in the run's cancel scope. Leaving the block early -- cancelled, or an error -- closes the
response before the body's end, and the pool closes such a connection instead of taking it
back, so no later run can read what was left of another's answer. Leaving it normally
(the adapter saw its last event) first reads the rest of the body, briefly and bounded
(:data:`REUSE_WAIT`, :data:`REUSE_MAX_BYTES`: normally only the end of the chunked body, already
on the way), so that the connection goes back to the pool.
"""

from __future__ import annotations

import abc
import functools
import logging
import math
import os
import re
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol, TypeVar

import attrs
import httpx  # noqa: ASYNC127  (the project depends on httpx; see pyproject.toml)
import orjson
import trio

from dispatcher import wire
from nodes.adapters._client import Pool, Response, Target
from nodes.adapters.base import Adapter, AdapterError, RunOutput
from nodes.config import OptionsError, ProviderConfig

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
REUSE_WAIT: Final = 0.05
"""How long a response left normally (its last event seen) may take to end its body before
its connection is closed instead of reused (a provider lingering after its last event)."""
REUSE_MAX_BYTES: Final = 64 * 1024
"""How much of a body left normally is read, at most, to reach its end and reuse the
connection."""

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


def parse_options(
    raw: Mapping[str, Any], parsers: Mapping[str, Callable[[str, Any], Any]], *, kind: str
) -> dict[str, Any]:
    """An HTTP adapter's ``options`` table as its options class's fields: ``timeouts``
    (:func:`split_timeouts`), and each other key parsed by its entry in ``parsers``, which
    takes the key and the value and raises :class:`OptionsError`; a key with no entry is an
    ``unknown <kind> option``."""
    timeouts, rest = split_timeouts(raw)
    fields: dict[str, Any] = {"timeouts": timeouts}
    for key, value in rest.items():
        parse = parsers.get(key)
        if parse is None:
            raise OptionsError(key, f"unknown {kind} option")
        fields[key] = parse(key, value)
    return fields


# --------------------------------------------------------------------------- pooled clients


def tls_context() -> ssl.SSLContext:
    """The TLS context for the node's HTTP clients under today's setting: httpx's default
    (``verify=True``, trusting the environment): the CA file ``SSL_CERT_FILE`` names, else
    the directory ``SSL_CERT_DIR`` names, else certifi's bundle. Built once per distinct
    setting and shared (clients never change it: :class:`~nodes.adapters._client.Pool` only
    wraps connections with it)."""
    return _tls_context(
        os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
    )


@functools.cache
def _tls_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    if cafile is not None:
        return ssl.create_default_context(cafile=cafile)
    if capath is not None:
        return ssl.create_default_context(capath=capath)
    return httpx.create_ssl_context(verify=True, trust_env=False)  # certifi's bundle


def pool_size(provider: ProviderConfig) -> int:
    """How many upstream connections a provider needs at most: its slots, the sum of its
    models' ``slots`` (long-context slots are among them); 1 for a provider with no model."""
    return max(1, sum(model.slots for model in provider.models))


@asynccontextmanager
async def open_client(timeouts: HTTPTimeouts, *, max_connections: int) -> AsyncIterator[Pool]:
    """A pooled client (:class:`~nodes.adapters._client.Pool`), closed (every connection
    with it) when the block is left: at most ``max_connections`` connections, all of them
    kept alive between requests, the shared :func:`tls_context`, proxies from the
    environment, no redirects followed. A request that finds every connection busy waits
    for one, up to the connect timeout."""
    async with Pool(
        connect=timeouts.connect,
        read=timeouts.read,
        write=WRITE_TIMEOUT,
        max_connections=max_connections,
        tls_context=tls_context(),
    ) as client:
        yield client


RunOn = Callable[[Pool, wire.RunRequest, RunOutput], Awaitable[None]]
"""An HTTP adapter's run, on the client it is given."""


@attrs.frozen
class PooledAdapter:
    """An HTTP adapter bound to its provider's open client (what :meth:`HTTPAdapter.open`
    gives). It has no lifetime of its own: opening the adapters again leaves it as it is."""

    _run_on: RunOn
    _client: Pool = attrs.field(repr=False)

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        await self._run_on(self._client, request, out)


class HasTimeouts(Protocol):
    """An HTTP adapter's options: they carry its timeouts."""

    @property
    def timeouts(self) -> HTTPTimeouts: ...


@attrs.frozen(kw_only=True)
class HTTPAdapter(abc.ABC):
    """What the HTTP adapters share: where they post, and a lifetime holding the provider's
    pooled client (:meth:`open`). A subclass gives its own ``options`` (with a default) and
    :meth:`run_on`."""

    url: str
    """The full URL the adapter posts to."""
    options: HasTimeouts
    connections: int = 1
    """The size of the provider's connection pool: its slots (:func:`pool_size`)."""

    @abc.abstractmethod
    async def run_on(self, client: Pool, request: wire.RunRequest, out: RunOutput) -> None:
        """Run ``request`` with requests on ``client``."""

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Adapter]:
        """The provider's pooled client for this block, and this adapter bound to it."""
        async with open_client(self.options.timeouts, max_connections=self.connections) as client:
            yield PooledAdapter(self.run_on, client)

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        """One run outside :meth:`open` (the runner always opens its adapters): on a client
        of its own, closed with the run -- correct, but nothing is reused."""
        async with self.open() as adapter:
            await adapter.run(request, out)


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
    (:func:`post_stream` redacts, then cuts it). Bytes are read as UTF-8, a malformed
    sequence replaced (as a text decoder would)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        if isinstance(text, bytes):
            return loads_object(text.decode("utf-8", errors="replace"), what)
        raise AdapterError(
            "upstream_bad_response",
            f"the upstream sent {what} that is not JSON: {str(text)!r}",
            retryable=True,
        ) from None
    if not isinstance(value, dict):
        raise AdapterError(
            "upstream_bad_response",
            f"the upstream sent {what} that is not a JSON object: {_text(text)!r}",
            retryable=True,
        )
    return value


def _text(text: str | bytes) -> str:
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


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
        """The redactor for a request to ``url`` with ``headers``: built once per URL and
        secret header values, then shared (a tunnel's URL and key are the same on every
        request to a provider; building one parses the URL and compiles two patterns)."""
        secrets = tuple(
            sorted(
                value.strip()
                for name, value in headers.items()
                if name.lower() in _SECRET_HEADERS and value.strip()
            )
        )
        return _redactor(url, secrets)

    @classmethod
    def _build(cls, url: str, header_secrets: tuple[str, ...]) -> Redactor:
        secrets: set[str] = set()
        for value in header_secrets:
            secrets.add(value)
            token = value.partition(" ")[2].strip()
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


@functools.lru_cache(maxsize=256)
def _redactor(url: str, header_secrets: tuple[str, ...]) -> Redactor:
    return Redactor._build(url, header_secrets)


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
    client: Pool,
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str],
) -> AsyncIterator[Response]:
    """POST ``body`` as JSON to ``url`` on ``client`` and give the streamed 2xx response.

    The response lives inside this block: leaving it early -- by an error, or cancelled --
    closes the response and its connection (the pool does not keep a connection whose answer
    was not read to its end); leaving it after :func:`finished` read the body to its end
    returns the connection to the client's pool. A non-2xx status and every transport error
    (also those raised while the caller reads the body inside the block) come out as
    :class:`AdapterError`; every AdapterError leaving the block (the caller's too) has its
    message passed through a :class:`Redactor` for this request. Read the body with
    :func:`post_chunks`, which finishes the iterator however it is left.
    """
    where, redact = shown_url(url), Redactor.for_request(url, headers)
    started = False
    try:
        target = request_target(url)
        async with client.stream(
            "POST", target, [("content-type", "application/json"), *headers.items()], dumps(body)
        ) as response:
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


@functools.lru_cache(maxsize=256)
def request_target(url: str) -> Target:
    """``url`` parsed (by httpx's rules) for the client: the same for every request to a
    provider's path, so worked out once (httpx's URL parsing was a tenth of a pooled run's
    CPU)."""
    return Target.from_url(httpx.URL(url))


@functools.lru_cache(maxsize=256)
def shown_url(url: str) -> str:
    """:func:`display_url`, worked out once per URL (it parses the URL: a tenth of a
    tunnel's CPU when its log line computed it at every request)."""
    return display_url(url)


def _transport_failure(code: str, message: str, where: str, exc: Exception) -> AdapterError:
    """A retryable failure whose message names no address: the exception's own text (which
    may: ``Connect call failed ('10.0.0.5', 8000)``) goes to the log only, with the URL."""
    log.info("%s: %s: %s", where, message, _describe(exc))
    return AdapterError(code, message, retryable=True)


@asynccontextmanager
async def post_chunks(
    client: Pool, url: str, body: Mapping[str, Any], *, headers: Mapping[str, str]
) -> AsyncIterator[AsyncIterator[bytes]]:
    """:func:`post_stream`, its response's body as it arrives (``aiter_bytes``: decoded if
    the upstream compressed it), finished properly however the block is left. Split it with
    :class:`LineSplitter` or :class:`SSEDecoder`: a whole read at a time."""
    async with (
        post_stream(client, url, body, headers=headers) as response,
        finished(response, response.aiter_bytes()) as chunks,
    ):
        yield chunks


@asynccontextmanager
async def finished(
    response: Response, iterator: AsyncIterator[_T]
) -> AsyncIterator[AsyncIterator[_T]]:
    """``iterator`` (one of the response's body iterators), finished when the block is left.

    Left normally (the caller has what it wanted), the rest of the body is read first, for
    at most :data:`REUSE_WAIT` and :data:`REUSE_MAX_BYTES`: a response read to its end gives
    its connection back to the pool. Left by an error or cancelled, nothing more is read.
    Either way the response is closed: unless its body was read to the end, its connection
    is closed when the request's block is left (the iterators are plain objects, not async
    generators: nothing is left suspended to finalize).
    """
    try:
        yield iterator
        with trio.move_on_after(REUSE_WAIT):
            await _read_to_end(iterator)
    finally:
        await response.aclose()  # no checkpoint: runs when cancelled too


async def _read_to_end(iterator: AsyncIterator[Any]) -> None:
    """Read what is left, up to :data:`REUSE_MAX_BYTES` (characters for text iterators). A
    failure is no failure of the request, whose answer is complete: the connection is just
    not reused."""
    size = 0
    try:
        async for piece in iterator:
            size += len(piece)
            if size > REUSE_MAX_BYTES:
                return
    except Exception as exc:  # the body's end broke: closing the response drops the connection
        log.debug("reading the rest of a finished response failed: %s", _describe(exc))


async def _status_error(response: Response, where: str, redact: Redactor) -> AdapterError:
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


class LineSplitter:
    """A body's lines, from its bytes as they arrive: :meth:`feed` gives the lines each piece
    completes (without their ends: ``\\n``, ``\\r\\n`` or a lone ``\\r``, as httpx's
    ``aiter_lines`` splits), :meth:`flush` the unterminated last one. Works on whole reads
    (one ``split`` per read), not byte by byte nor through a text decoder."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._rest + data if self._rest else data
        tail = b""
        if b"\r" in buffer:
            if buffer.endswith(b"\r"):  # maybe the first half of a \r\n
                buffer, tail = buffer[:-1], b"\r"
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buffer.split(b"\n")
        self._rest = lines.pop() + tail
        return lines

    def flush(self) -> bytes | None:
        """The last line, if the body did not end with an end of line."""
        rest, self._rest = self._rest.removesuffix(b"\r"), b""
        return rest or None


class SSEDecoder:
    """Server-sent events from a body's bytes: :meth:`feed` each piece of the body as it
    arrives; it returns the ``data`` of every event the piece completed (an event's
    ``data:`` lines joined by newlines, ended by a blank line), :meth:`flush` the last one
    at the end of the body. Comments, ``event:``, ``id:`` and ``retry:`` fields are
    ignored."""

    __slots__ = ("_data", "_lines")

    def __init__(self) -> None:
        self._lines = LineSplitter()
        self._data: list[bytes] = []

    def feed(self, piece: bytes) -> list[bytes]:
        events: list[bytes] = []
        data = self._data
        for line in self._lines.feed(piece):
            if not line:
                if data:
                    events.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data.clear()
            elif line.startswith(b"data"):
                self._field(line)
        return events

    def _field(self, line: bytes) -> None:
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value[1:] if value.startswith(b" ") else value)

    def flush(self) -> bytes | None:
        """The pending event's data at the end of the stream (None if there is none)."""
        last = self._lines.flush()
        if last is not None and last.startswith(b"data"):
            self._field(last)
        if not self._data:
            return None
        data = b"\n".join(self._data)
        self._data.clear()
        return data
