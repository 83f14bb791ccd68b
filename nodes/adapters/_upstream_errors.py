"""What an upstream's failure means to a run: an :class:`~nodes.adapters.base.AdapterError`
made of its non-2xx answer (:func:`status_failure`), of an ``{"error": ...}`` event or line in
a 2xx stream (:func:`error_event_failure`), or of a body that is no JSON object
(:func:`loads_object`). Pure: the HTTP adapters' streamed POST (:mod:`nodes.adapters._post`)
reads the answer and maps the transport's failures, these functions decide what it means.

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

(The last two rows, and an answer the client cannot read, are the transport's failures:
:func:`nodes.adapters._post.post_stream` maps them.)

The upstream's message and code are read from its error JSON (:func:`parse_error`: OpenAI's
``{"error": {"message", "type", "code", "param"}}``, Ollama's ``{"error": "..."}``, vLLM's and
llama.cpp's variants, ``{"detail": ...}``, ``{"message": ...}``), else the start of the body
text. A client's-error message is that text alone; the others read ``the provider answered
HTTP <status>: <text>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
import orjson

from nodes.adapters.base import AdapterError

MAX_ERROR_MESSAGE: Final = 1000
"""Characters of the upstream's message kept in an AdapterError message."""

CLIENT_ERROR_STATUSES: Final = frozenset({400, 413, 415, 422})
"""Upstream statuses that say the request itself is wrong: the client's error."""
CODE_ALIASES: Final[Mapping[str, str]] = {"exceed_context_size_error": "context_length_exceeded"}
"""Upstream error codes (or, without a code, types) renamed to OpenAI's: llama.cpp's server
answers a too-long prompt with type ``exceed_context_size_error``."""


def loads_object(text: str | bytes, what: str) -> dict[str, Any]:
    """A JSON object from the upstream, or ``upstream_bad_response`` quoting ``text`` whole
    (:func:`~nodes.adapters._post.post_stream` redacts, then cuts it). Bytes are read as
    UTF-8, a malformed sequence replaced (as a text decoder would)."""
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
    said = clip(said if redact is None else redact(said), MAX_ERROR_MESSAGE)
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
    not cut (:func:`~nodes.adapters._post.post_stream` redacts, then cuts it)."""
    parsed = parse_error(value)
    said = parsed.message or f"an error {what} without a message"
    if parsed.status in CLIENT_ERROR_STATUSES or parsed.code == "context_length_exceeded":
        status = parsed.status if parsed.status in CLIENT_ERROR_STATUSES else 400
        return AdapterError(parsed.code or "invalid_request", said, status=status)
    return AdapterError(
        "upstream_error", f"the provider sent an error {what}: {said}", retryable=True
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


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
