"""One streamed POST of an HTTP adapter (``ollama``, ``openai``) to its provider
(:func:`post_stream`, :func:`post_chunks`): the body out as JSON on the provider's pooled
client, the 2xx answer streamed back, and every failure -- a non-2xx answer, the transport's
errors, the caller's own -- an :class:`~nodes.adapters.base.AdapterError` (mapped as
:mod:`nodes.adapters._upstream_errors` says) that names no provider.

No message names the provider: messages are composed without its URL, and every
:class:`~nodes.adapters.base.AdapterError` leaving :func:`post_stream` -- also those the
caller raises inside the block, e.g. about a body it could not parse -- has the provider's URL,
origin, ``host:port``, host and base path and the node's credentials removed
(:class:`~nodes.upstream.redact.Redactor`); the upstream's text may quote any of them. The
node's own log keeps the URL (INFO, logger ``nodes.adapters.http``).

A run still owns *its* request: the response stream lives inside :func:`post_stream`'s block,
in the run's cancel scope. Leaving the block early -- cancelled, or an error -- closes the
response before the body's end, and the pool closes such a connection instead of taking it
back, so no later run can read what was left of another's answer. Leaving it normally
(the adapter saw its last event) first reads the rest of the body, briefly and bounded
(:func:`nodes.upstream.client.finished`), so that the connection goes back to the pool.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final

import httpx  # noqa: ASYNC127  (the project depends on httpx; see pyproject.toml)
import orjson

from nodes.adapters._upstream_errors import (
    MAX_ERROR_MESSAGE,
    clip,
    loads_object,
    status_failure,
)
from nodes.adapters.base import AdapterError
from nodes.upstream.client import Response, UpstreamPool, finished, request_target
from nodes.upstream.redact import Redactor, shown_url

MAX_ERROR_BODY: Final = 64 * 1024
"""How much of an error response's body is read to find the upstream's message."""
_MAX_MESSAGE: Final = MAX_ERROR_MESSAGE + 200
"""Characters of any AdapterError message leaving :func:`post_stream`. Text is cut only after
it was redacted: a cut through an address would leave a part no redaction recognises."""

log = logging.getLogger("nodes.adapters.http")


@asynccontextmanager
async def post_stream(
    client: UpstreamPool,
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str],
) -> AsyncIterator[Response]:
    """POST ``body`` as JSON to ``url`` on ``client`` and give the streamed 2xx response.

    The response lives inside this block: leaving it early -- by an error, or cancelled --
    closes the response and its connection (the pool does not keep a connection whose answer
    was not read to its end); leaving it after :func:`~nodes.upstream.client.finished` read
    the body to its end returns the connection to the client's pool. A non-2xx status and
    every transport error (also those raised while the caller reads the body inside the
    block) come out as :class:`AdapterError`; every AdapterError leaving the block (the
    caller's too) has its message passed through a :class:`Redactor` for this request. Read
    the body with :func:`post_chunks`, which finishes the iterator however it is left.
    """
    where, redact = shown_url(url), Redactor.for_request(url, headers)
    started = False
    try:
        target = request_target(url)
        async with client.stream(
            "POST",
            target,
            [("content-type", "application/json"), *headers.items()],
            orjson.dumps(body),
        ) as response:
            started = True
            if not 200 <= response.status_code < 300:
                raise await _status_error(response, where, redact)
            yield response
    except AdapterError as exc:
        exc.message = clip(redact(exc.message), _MAX_MESSAGE)
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
async def post_chunks(
    client: UpstreamPool, url: str, body: Mapping[str, Any], *, headers: Mapping[str, str]
) -> AsyncIterator[AsyncIterator[bytes]]:
    """:func:`post_stream`, its response's body as it arrives (``aiter_bytes``: decoded if
    the upstream compressed it), finished properly however the block is left. Split it with
    :class:`~nodes.upstream.lines.LineSplitter` or :class:`~nodes.upstream.lines.SSEDecoder`:
    a whole read at a time."""
    async with (
        post_stream(client, url, body, headers=headers) as response,
        finished(response, response.aiter_bytes()) as chunks,
    ):
        yield chunks


MAX_JSON_ANSWER: Final = 256 * 1024 * 1024
"""The largest whole JSON answer :func:`post_json` reads (an embeddings answer of 2,048
vectors of 3,072 floats is about 130 MB)."""


async def post_json(
    client: UpstreamPool,
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str],
    what: str = "an answer",
) -> dict[str, Any]:
    """:func:`post_chunks`, its whole 2xx answer read as one JSON object (at most
    :data:`MAX_JSON_ANSWER` bytes, else ``upstream_bad_response``); failures as
    :func:`post_stream`'s."""
    raw = bytearray()
    async with post_chunks(client, url, body, headers=headers) as chunks:
        async for chunk in chunks:
            raw += chunk
            if len(raw) > MAX_JSON_ANSWER:
                raise AdapterError(
                    "upstream_bad_response",
                    f"the provider's answer is over {MAX_JSON_ANSWER} bytes",
                    retryable=True,
                )
        return loads_object(bytes(raw), what)


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
    log.info("%s answered HTTP %d: %s", where, status, clip(" ".join(redact(text).split()), 500))
    return status_failure(
        status,
        text,
        reason=response.reason_phrase,
        retry_after=response.headers.get("retry-after"),
        redact=redact,
    )


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
