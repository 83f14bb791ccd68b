"""The adapter seam: what an engine adapter implements and what the runner gives it.

An :class:`Adapter` runs one request and reports through a :class:`RunOutput`::

    class MyAdapter:
        async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
            async for piece in upstream(request.body):
                await out.delta(piece.text)          # a cancel point; may wait (backpressure)
                await out.tool_calls(piece.tool_calls)   # OpenAI-shaped tool-call deltas
                out.usage(piece.prompt_tokens, piece.completion_tokens)
            out.finish("stop")

The runner turns that into wire events (``run.started``, ``run.delta``..., ``run.usage``, then
exactly one terminal event).

An adapter that can embed (its ``AdapterSpec.routes`` has ``"embeddings"``: the node's hello
announces it) is an :class:`Embedder` too: a request whose ``route`` is ``"embeddings"`` (an
OpenAI embeddings body) goes to its ``embed``, which reports one vector per input
(:func:`dispatcher.wire.embedding_inputs`), in order, each encoded with
:func:`dispatcher.wire.encode_vector`::

    async def embed(self, request: wire.RunRequest, out: RunOutput) -> None:
        answer = await upstream_embed(request.body)
        out.usage(answer.prompt_tokens, 0)
        await out.embeddings([wire.encode_vector(v) for v in answer.vectors])

The runner refuses (``unsupported_route``, retryable) a route its adapter does not serve.

Errors:

* :class:`AdapterError` -- an upstream failure with a code: ``run.failed`` with that code,
  message, ``retryable`` flag and (for the client's own errors) the upstream's ``status``;
* any other ``Exception`` -- a bug: ``run.failed`` code ``internal``, not retryable, logged;
* :class:`DropConnection` -- fault injection only: the node's whole connection is dropped;
* cancellation (``run.cancel``) arrives as ``trio.Cancelled`` at the adapter's next
  checkpoint; the adapter's HTTP request or child process dies with its cancel scope.

An adapter that holds something across runs (the HTTP adapters: a pooled client per
provider) has a lifetime, :class:`HasLifetime`: ``async with adapter.open() as live`` holds it
and gives the adapter to run with inside the block. :func:`open_adapters` opens every adapter
of a node that has one, for as long as its block lasts (``nodes.runner.open_runner`` enters
it around its runs); adapters without one (``echo``, ``cli``) are used as they are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AsyncExitStack,
    asynccontextmanager,
    nullcontext,
)
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar, runtime_checkable

import attrs

from dispatcher import wire
from dispatcher.shared.tokens import TokenEstimator as TokenEstimator
from dispatcher.shared.tokens import estimate_prompt_tokens as estimate_prompt_tokens
from dispatcher.shared.tokens import estimate_tokens as estimate_tokens
from dispatcher.shared.tokens import message_text as message_text

if TYPE_CHECKING:
    from nodes.config import ProviderConfig

_K = TypeVar("_K")
_V = TypeVar("_V")
_W = TypeVar("_W")


class AdapterError(Exception):
    """An upstream failure, reported as ``run.failed`` with ``code``, ``message``,
    ``retryable`` (may another attempt, on this or another candidate, succeed?) and
    ``status``.

    ``status`` is the upstream's HTTP status, set only when that answer says the *request*
    is wrong -- the client's error (400, 413, 415, 422), never retryable: the edge relays the
    status to the client and does not try another candidate. Failures that are the node's or
    the provider's problem (a bad key, a wrong model name, an outage) leave it None.

    ``message`` may reach the client (in the edge's error body): it must not name the
    provider's URL, host, port or base path, nor carry the node's credentials.
    """

    def __init__(
        self, code: str, message: str, *, retryable: bool = False, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.status = status


class DropConnection(Exception):
    """Drop the node's whole edge connection at once (a fault-injection knob of ``echo``).

    Not a run outcome: no terminal event is sent for any run; the agent aborts the
    connection (close code 1011) and reconnects as after any connection loss.
    """


class RunOutput(Protocol):
    """What a running adapter reports to. Provided by the runner, one per run."""

    async def delta(self, text: str) -> None:
        """Emit generated text. Always a cancel point (a cancelled run raises
        ``trio.Cancelled`` here). A schedule point when the connection is idle (the piece
        goes out at once); while a send is in flight, the piece joins the unsent ones and
        the adapter goes on with what it has ready (a schedule point every so many pieces):
        pending pieces are coalesced into one ``run.delta`` frame. Waits when too much text
        is still unsent (the connection is slower than the adapter)."""

    async def tool_calls(self, calls: Sequence[Mapping[str, Any]]) -> None:
        """Emit tool-call deltas in OpenAI's streaming shape: ``{"index": i, "id"?: ...,
        "type"?: "function", "function": {"name"?: ..., "arguments"?: "<a JSON piece>"}}``.
        The first delta of a call (per ``index``) carries ``id``, ``type`` and the function
        ``name``; later ones add ``arguments`` pieces, which the client concatenates. Sent as
        one ``run.delta`` with ``tool_calls`` (never merged with other deltas, in order with
        the text); a checkpoint that may wait like :meth:`delta`. Set the finish reason
        ``"tool_calls"`` yourself."""

    async def embeddings(self, vectors: Sequence[str]) -> None:
        """Emit the next vectors of an ``embeddings`` run, in input order, each encoded with
        :func:`dispatcher.wire.encode_vector`; one call or several. A cancel point; waits
        like :meth:`delta` when the connection is slower. More vectors than the request has
        inputs fail the run (``upstream_bad_response``), and so does a run that completes
        with fewer."""

    def usage(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        estimated: bool = False,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
        reasoning_tokens: int = 0,
    ) -> None:
        """Record the latest known usage (totals so far, not increments). ``estimated``: the
        adapter estimated (part of) it, e.g. with :func:`estimate_tokens`, because the engine
        did not count; the usage then travels as ``Usage.estimated``. The breakdowns are
        OpenAI's (:class:`dispatcher.wire.Usage`): ``cached_tokens`` and
        ``cache_write_tokens`` are part of ``prompt_tokens`` (read from, written to a prompt
        cache), ``reasoning_tokens`` part of ``completion_tokens``; the runner clamps each to
        its total."""

    def finish(self, reason: str, *, stop_sequence: str | None = None) -> None:
        """Set the finish reason ``run.completed`` will carry (default ``"stop"``), and the
        stop sequence that ended the text when the engine says which."""

    def ignore_cancel(self) -> None:
        """Fault injection: ``run.cancel`` is ignored for this run, which runs to its natural
        end. (A lost connection still cancels it.)"""


class Adapter(Protocol):
    async def run(self, request: wire.RunRequest, out: RunOutput) -> None: ...


@runtime_checkable
class Embedder(Protocol):
    """An adapter that embeds: it runs ``embeddings`` requests (an OpenAI embeddings body)."""

    async def embed(self, request: wire.RunRequest, out: RunOutput) -> None: ...


EMBEDDING_ROUTES: Final[tuple[wire.RouteName, ...]] = (*wire.NORMALIZED_ROUTES, "embeddings")
"""The routes of an adapter that embeds (its ``AdapterSpec.routes``)."""


@runtime_checkable
class HasLifetime(Protocol):
    """An adapter that holds something across runs (a pooled HTTP client): ``open()``'s
    block holds it and gives the adapter to run with while it lasts. The adapter itself
    still runs outside that block, each run holding what it needs for itself."""

    def open(self) -> AbstractAsyncContextManager[Adapter]: ...


def open_adapters(
    adapters: Mapping[str, Adapter],
) -> AbstractAsyncContextManager[dict[str, Adapter]]:
    """``adapters`` (provider id -> adapter) with every one that has a lifetime
    (:class:`HasLifetime`) opened for this block, in order, and closed in reverse order when
    it is left; the others as they are. The opened ones have no lifetime of their own, so
    opening the result again changes nothing."""
    return open_each(adapters, _open_adapter)


def _open_adapter(adapter: Adapter) -> AbstractAsyncContextManager[Adapter]:
    return adapter.open() if isinstance(adapter, HasLifetime) else nullcontext(adapter)


@asynccontextmanager
async def open_each(
    items: Mapping[_K, _V], open_one: Callable[[_V], AbstractAsyncContextManager[_W]]
) -> AsyncIterator[dict[_K, _W]]:
    """``items`` with each value replaced by what ``open_one`` opens for it, for this block:
    opened in order, closed in reverse order when the block is left (or when a later one
    fails to open). What :func:`open_adapters` and :func:`nodes.tunnel.open_tunnel_pools`
    share."""
    async with AsyncExitStack() as stack:
        yield {key: await stack.enter_async_context(open_one(item)) for key, item in items.items()}


def vector_of(value: Any, where: str) -> str:
    """An embedding from an upstream's JSON as ``run.embeddings`` carries it: a list of
    numbers encoded (:func:`dispatcher.wire.encode_vector`), a base64 string (OpenAI's
    ``encoding_format: "base64"``) as it is once it proved to be float32 values; anything
    else is ``upstream_bad_response`` naming ``where``."""
    if isinstance(value, str):
        try:
            wire.decode_vector(value)
        except ValueError:
            pass
        else:
            return value
    elif isinstance(value, list) and all(
        type(item) is float or type(item) is int for item in value
    ):
        return wire.encode_vector(value)
    raise AdapterError(
        "upstream_bad_response",
        f"the upstream's {where} is not a list of numbers or base64 float32 values",
        retryable=True,
    )


@attrs.frozen
class RefusingAdapter:
    """An adapter whose every run fails, retryably (another candidate may serve it), with
    ``code`` and ``message``: it stands in for what this node cannot run."""

    code: str
    message: str

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        raise AdapterError(self.code, self.message, retryable=True)

    async def embed(self, request: wire.RunRequest, out: RunOutput) -> None:
        raise AdapterError(self.code, self.message, retryable=True)


AdapterFactory = Callable[["ProviderConfig"], Adapter]
"""Builds the adapter for one configured provider."""
