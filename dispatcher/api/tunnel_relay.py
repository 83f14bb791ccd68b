"""The tunnel relay: answer a request through a tunnel, bytes as the provider sent them.

The OpenAI front end (:mod:`dispatcher.api.openai`) relays with :func:`relay` the answers of
its tunnel-only routes, ``POST /v1/completions`` and ``POST /v1/embeddings`` (only candidates
served through a tunnel can take them: :func:`~dispatcher.api.common.tunnel_only`; others are
rejected with 400), and of ``POST /v1/chat/completions`` when admission chose a tunnel
candidate; the Anthropic front end the answers of ``POST /v1/messages`` and the Responses
front end those of ``POST /v1/responses`` when admission chose a tunnel provider that declares
the route (native: the provider speaks the API itself). Each answer is in its route's dialect
(``tunnel_http.dialect_of``): its commit point, its usage and its error event after the
commit are the dialect's.

What the provider receives and what the client receives -- the header rules, the SSE filter,
usage sniffing -- and the pre-commit phase the gate runs inside its attempt (send the request,
await the start, read up to the commit point; a 5xx / 429 fails the attempt and the gate
recovers on another candidate) live in the core, :mod:`dispatcher.paths.tunnel_http`. The API
gives the gate what to relay of the client's request
(:meth:`dispatcher.api.common.ModelCall.gate_request`).

:func:`relay` is the relay phase of the committed answer: its head, then the rest. An SSE
response is streamed as it arrives; another body is answered whole (with ``Content-Length``)
up to :data:`~dispatcher.paths.tunnel_http.BUFFER_LIMIT` bytes, and streamed beyond. If an SSE
stream breaks off (or stalls) after the commit, an SSE error event ends it; if another
streamed body does, the connection is cut so the client sees the body is incomplete. The error
event is the dialect's (``SSEFilter.error_event``): OpenAI's ``data: {"error": ...}``,
Anthropic's ``event: error``, a Responses ``response.failed``.

The model's name: a ``"model"`` member holding the provider's served name reaches the client
with the name it asked for (``tunnel_http.ModelRewrite``, a byte-level substitution; the SSE
filter applies it to the events it passes on, :func:`_relay_body` to another body).

Usage: read from the JSON body or the stream's usage chunk as the provider sent them, and
reported once per tunnel (``Tunnel.on_usage``); an estimate when the provider reported none.
The gate's usage row of the attempt reads it from there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Final

import trio

from .. import wire
from ..errors import TunnelFailed
from ..gate.attempts import TunnelAnswer
from ..http import PeerGone, Responder
from ..paths.tunnel import Tunnel
from ..paths.tunnel_http import (
    BUFFER_LIMIT,
    USAGE_TAIL,
    SSEFilter,
    TokenCounts,
    TunnelHead,
    UsageReader,
    body_usage,
    client_headers,
    dialect_usage,
    tail_usage,
)
from ..shared.tokens import estimate_prompt_tokens
from .common import (
    SHUTDOWN_SEND_TIMEOUT,
    CutResponse,
    dispatch_headers,
)
from .seam import EdgeServices

log = logging.getLogger("dispatcher.api.tunnel")

# --------------------------------------------------------------------------- the relay


async def relay(
    edge: EdgeServices,
    answer: TunnelAnswer,
    request_body: dict[str, Any],
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
    *,
    read_usage: UsageReader | None = None,
    estimate: bool = True,
) -> str:
    """The relay phase of the committed tunnel ``answer``: send its head, then the rest of
    the response (``request_body`` is the client's parsed JSON body, for the usage estimate;
    ``read_usage`` reads a non-streamed answer's usage, its dialect's by default; without
    ``estimate``, an answer without usage counts 0 tokens, estimated);
    ``headers`` are the edge's own response headers (``x-dispatcher-node``, ``-provider`` and
    ``-queue-ms`` are added when missing). Returns the outcome for the metrics:
    ``completed``, ``upstream_error`` (the provider answered a non-2xx status, relayed as it
    is) or ``failed``; an error delivered to the client is marked on ``answer``."""
    tunnel = answer.tunnel
    head = answer.head
    usage: TokenCounts | None = None
    completion_estimate = 0
    names = {name.lower() for name, _ in headers}
    own = [
        *headers,
        *(h for h in dispatch_headers(answer.result, answer.attempts) if h[0] not in names),
    ]
    out_headers = client_headers(head.start.headers, own)
    stall = answer.stall_timeout
    try:
        if head.sse is not None:
            sse = head.sse
            try:
                outcome = await _relay_sse(
                    edge, tunnel, responder, out_headers, head, sse, stall, answer.delivered
                )
            finally:
                usage, completion_estimate = sse.usage, sse.events
            if outcome == "failed":
                answer.failed()
            return outcome
        usage = await _relay_body(tunnel, responder, out_headers, head, stall, read_usage)
        return "completed" if head.ok else "upstream_error"
    except CutResponse:
        answer.failed()
        raise
    except PeerGone:
        answer.client_gone()
        raise
    finally:
        if usage is not None and head.ok:
            tunnel.on_usage(usage)
        elif head.ok and estimate:
            tunnel.on_usage(
                wire.Usage(
                    prompt_tokens=estimate_prompt_tokens(request_body),
                    completion_tokens=completion_estimate,
                    estimated=True,
                )
            )
        else:
            tunnel.on_usage(_NO_USAGE)


_NO_USAGE: Final = wire.Usage(prompt_tokens=0, completion_tokens=0, estimated=True)


class _Pieces:
    """The rest of a tunnel's body, piece by piece (``b""`` at the clean end): TunnelFailed
    when it broke off, or when nothing came for ``stall`` seconds. One cancel scope for the
    whole relay, its deadline moved before each wait, rather than one per piece."""

    __slots__ = ("_scope", "_stall", "_tunnel")

    def __init__(self, tunnel: Tunnel, stall: float, scope: trio.CancelScope) -> None:
        self._tunnel = tunnel
        self._stall = stall
        self._scope = scope

    async def receive(self) -> bytes:
        self._scope.deadline = trio.current_time() + self._stall
        return await self._tunnel.receive_some()

    def stalled(self) -> TunnelFailed:
        return TunnelFailed(
            f"no output from the provider behind {self._tunnel.candidate.label} for "
            f"{self._stall:g} s",
            code="stall_timeout",
            retryable=False,
        )


async def _relay_sse(
    edge: EdgeServices,
    tunnel: Tunnel,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
    head: TunnelHead,
    sse: SSEFilter,
    stall: float,
    delivered: Callable[[], None],
) -> str:
    """Relay the rest of an event stream; ``delivered`` is called once the client has been
    sent the stream's ``data: [DONE]`` (it then has the whole answer)."""
    stream = await responder.start_stream(head.start.status, headers)
    outcome = "completed"
    with edge.stream_scope() as scope:
        try:
            if head.data:
                await stream.send(head.data)
                if sse.done:
                    delivered()
            if not head.complete:
                # the stall timeout applies to the waits for the provider, not to the
                # writes to the client (the server's write timeout is theirs)
                with trio.CancelScope() as waited:
                    pieces = _Pieces(tunnel, stall, waited)
                    while data := await pieces.receive():
                        out = sse.feed(data)
                        if out:
                            waited.deadline = math.inf
                            await stream.send(out)
                            if sse.done:
                                delivered()
                    waited.deadline = math.inf
                    rest = sse.finish()
                    if rest:
                        await stream.send(rest)
                if waited.cancelled_caught:
                    raise pieces.stalled()
        except TunnelFailed as exc:
            log.info("tunnel %s broke off mid-stream: %s", tunnel.tunnel_id, exc)
            # An unfinished event is dropped: our error event must not merge into it.
            await stream.send(sse.error_event(exc.message, exc.code))
            outcome = "failed"
    if scope.cancelled_caught:
        with trio.move_on_after(SHUTDOWN_SEND_TIMEOUT, shield=True):
            await stream.send(sse.error_event("the dispatcher is shutting down", "shutting_down"))
        outcome = "failed"
    return outcome


async def _relay_body(
    tunnel: Tunnel,
    responder: Responder,
    headers: Sequence[tuple[bytes, bytes]],
    head: TunnelHead,
    stall: float,
    read_usage: UsageReader | None,
) -> TokenCounts | None:
    """Relay a body that is not an event stream: whole when it fits in
    :data:`BUFFER_LIMIT`, streamed beyond. Returns its usage for a 2xx answer."""
    status, parse = head.start.status, head.ok
    reader = dialect_usage(head.dialect) if read_usage is None else read_usage
    parts: list[bytes] = [head.data] if head.data else []
    size = len(head.data)
    if not head.complete:
        with trio.CancelScope() as waited:
            pieces = _Pieces(tunnel, stall, waited)
            while size <= BUFFER_LIMIT:
                data = await pieces.receive()
                if not data:
                    break
                parts.append(data)
                size += len(data)
        if waited.cancelled_caught:
            raise pieces.stalled()
    rewrite = head.model_rewrite
    if size <= BUFFER_LIMIT:
        whole = b"".join(parts)
        await responder.respond(status, headers, rewrite(whole) if rewrite else whole)
        return body_usage(whole, reader) if parse else None
    # Too large to hold: stream it, keeping the tail (as the provider sent it) to find usage
    # in; the model's name is rewritten across the pieces.
    renamed = rewrite.stream() if rewrite else None
    stream = await responder.start_stream(status, headers)
    first = b"".join(parts)
    tail = first[-USAGE_TAIL:]
    await stream.send(renamed.feed(first) if renamed else first)
    del parts, first
    try:
        with trio.CancelScope() as waited:
            pieces = _Pieces(tunnel, stall, waited)
            while data := await pieces.receive():
                waited.deadline = math.inf
                tail = (tail + data)[-USAGE_TAIL:]
                out = renamed.feed(data) if renamed else data
                if out:
                    await stream.send(out)
        if waited.cancelled_caught:
            raise pieces.stalled()
    except TunnelFailed as exc:
        log.info("tunnel %s broke off mid-body, cutting the response: %s", tunnel.tunnel_id, exc)
        raise CutResponse(str(exc)) from exc
    if renamed is not None and (rest := renamed.finish()):
        await stream.send(rest)
    return tail_usage(tail, reader) if parse else None


__all__ = [
    "relay",
]
