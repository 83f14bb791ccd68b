"""The runner: every run is a task with its own cancel scope in one nursery, keyed by run id.

::

    async with open_runner(send, adapters=adapters) as runner:
        runner.start(run_request)          # run.started, run.delta..., run.usage, terminal
        runner.cancel(run_id, "client gone")

Guarantees:

* every run that ends -- completed, failed, cancelled, adapter bug -- emits exactly one
  terminal event, and nothing after it; events carry ``seq`` 0, 1, 2... per run;
* ``run.usage`` precedes ``run.completed`` (and ``run.failed`` when anything is known);
  ``run.cancelled`` carries the partial usage. When the adapter never reported usage the
  runner estimates it (:func:`~nodes.adapters.base.estimate_tokens`: the larger of the word
  count and characters / 4, for the generated text and for the prompt's messages) and marks
  it ``estimated``; reported usage is sent as reported (``estimated`` only when the adapter
  said so);
* leaving the ``async with`` block (the connection is gone) cancels every run and sends
  nothing more; the adapters' lifetimes (one pooled HTTP client per provider, its
  connections reused by run after run) last as long as the block, around every run;
* one writer task sends all runs' events, so sends never interleave; it serves runs in turn.
  Fewer frames per stream (:mod:`nodes.coalesce`): what a run has ready when the writer
  takes it goes out coalesced -- consecutive text as one ``run.delta`` -- and nothing waits
  for more. The first piece of a burst is never held back: ``out.delta()`` on an idle writer
  lets it run (and take what is there) before the adapter goes on; while the writer is
  sending, ``out.delta()`` is only a cancel point (a schedule point every
  :data:`MAX_UNYIELDED_PIECES` pieces), so what the adapter has ready -- the rest of one upstream
  read -- queues behind the send in flight and leaves as one frame. Unsent text is bounded
  per run (:data:`MAX_PENDING_CHARS`): past it, ``out.delta()`` waits for the connection;
* ``out.tool_calls()`` becomes its own ``run.delta`` with ``tool_calls`` (split only when
  over :data:`MAX_DELTA_CHARS`), in order with the text around it: tool-call deltas are
  never merged with text or with each other, and count towards the unsent bound. They do not
  count towards the estimated completion tokens;
* a request's ``route`` picks the adapter's work: ``embeddings`` its ``embed``
  (:class:`~nodes.adapters.base.Embedder`), ``chat``, ``responses`` and ``messages`` its
  ``run``; another route, or ``embeddings`` on an adapter that does not embed, fails the run
  with code ``unsupported_route`` (retryable: another provider may serve it).
  ``out.embeddings()`` becomes ``run.embeddings`` events of at most
  :data:`~dispatcher.wire.MAX_EMBEDDINGS_CHARS` of vectors each (a vector over it fails the
  run, ``embedding_too_large``); an embeddings run completes only with exactly one vector per
  input (:func:`~dispatcher.wire.embedding_inputs`), else it fails
  (``upstream_bad_response``, retryable). Its estimated usage counts the inputs.

A :class:`~nodes.adapters.base.DropConnection` raised by an adapter is not a run outcome: it
propagates out of the block (cancelling every run, sending nothing) for the agent to drop the
connection.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import attrs
import orjson
import trio

from dispatcher import wire
from nodes.adapters.base import (
    Adapter,
    AdapterError,
    DropConnection,
    Embedder,
    RefusingAdapter,
    estimate_prompt_tokens,
    open_adapters,
)
from nodes.coalesce import MAX_DELTA_CHARS as MAX_DELTA_CHARS
from nodes.coalesce import EventFactory as _EventFactory
from nodes.coalesce import RunPieces

log = logging.getLogger("nodes.runner")

Send = Callable[[wire.NodeMessage], Awaitable[None]]
"""Sends one message to the edge (serialized by the caller; only the writer task calls it)."""
SendMany = Callable[[Sequence[wire.NodeMessage]], Awaitable[None]]
"""Sends messages to the edge in order, at once (one socket write over the websocket)."""


def one_by_one(send: Send) -> SendMany:
    """A :data:`SendMany` over a :data:`Send`: each message its own send."""

    async def send_many(messages: Sequence[wire.NodeMessage]) -> None:
        for message in messages:
            await send(message)

    return send_many


MAX_PENDING_CHARS: Final = 64 * 1024
"""Unsent text per run (characters) beyond which ``out.delta()`` waits for the connection."""
MAX_UNYIELDED_PIECES: Final = 64
"""Pieces a run may add in a row, while the writer is sending, before ``out.delta()`` is a
schedule point again (a bound on how long an adapter with everything ready runs on)."""


@attrs.frozen
class RunnerStatistics:
    active_runs: int
    """Runs started and not yet finished (their terminal event not yet sent)."""
    runs_waiting_to_send: int
    """Runs with events queued for the connection."""


@attrs.define(eq=False)
class _Run:
    run_id: str
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    pieces: RunPieces = attrs.field()
    queued: bool = False
    unyielded: int = 0
    """Pieces added since this run's adapter last let others run."""
    ignoring_cancel: bool = False
    terminal_sent: trio.Event = attrs.Factory(trio.Event)
    drained: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)
    reported: tuple[int, int, bool, int, int, int] | None = None
    """The adapter's last ``out.usage()``, as it gave it (made a :class:`~dispatcher.wire.
    Usage` only when one is needed: :meth:`reported_usage`)."""
    _reported_usage: wire.Usage | None = None
    text_pushed: bool = False
    """Text was pushed (what the runner's estimate counts)."""
    content_pushed: bool = False
    """A delta (text or tool calls) was pushed: a usage reported after it waits for the end."""
    finish_reason: str = "stop"
    stop_sequence: str | None = None
    vectors_expected: int = 0
    """An ``embeddings`` run's inputs: the vectors it must answer."""
    vectors_sent: int = 0
    _reported_from: tuple[int, int, bool, int, int, int] | None = None

    @pieces.default
    def _pieces(self) -> RunPieces:
        return RunPieces(self.run_id)

    def reported_usage(self) -> wire.Usage | None:
        """The usage the adapter last reported, clamped (:func:`clamped_usage`)."""
        reported = self.reported
        if reported is None:
            return None
        usage = self._reported_usage
        if usage is None or self._reported_from is not reported:
            prompt, completion, estimated, cached, cache_write, reasoning = reported
            usage = self._reported_usage = clamped_usage(
                prompt,
                completion,
                estimated=estimated,
                cached_tokens=cached,
                cache_write_tokens=cache_write,
                reasoning_tokens=reasoning,
            )
            self._reported_from = reported
        return usage


@attrs.define(eq=False)
class _Output:
    """The :class:`~nodes.adapters.base.RunOutput` the runner gives one run's adapter."""

    _runner: Runner
    _run: _Run

    async def delta(self, text: str) -> None:
        run = self._run
        # A cancelled run emits nothing more: check before taking the text.
        await trio.lowlevel.checkpoint_if_cancelled()
        if not text:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        run.text_pushed = run.content_pushed = True
        pieces, runner = run.pieces, self._runner
        pieces.add_text(text)
        if not run.queued:
            runner._queue(run)
        if (
            runner._writing
            and pieces.size <= MAX_PENDING_CHARS
            and run.unyielded < MAX_UNYIELDED_PIECES
        ):
            # A send is in flight: the piece joins what waits behind it; no schedule point
            # (:meth:`_wait_drained`'s last case, without a call per token).
            run.unyielded += 1
            return
        await self._wait_drained()

    async def tool_calls(self, calls: Sequence[Mapping[str, Any]]) -> None:
        run = self._run
        await trio.lowlevel.checkpoint_if_cancelled()
        frames = tool_call_frames(calls)
        if not frames:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        run.content_pushed = True
        for frame, size in frames:
            self._runner._push(run, _tool_call_delta(run.run_id, frame), size=size)
        await self._wait_drained()

    async def embeddings(self, vectors: Sequence[str]) -> None:
        run = self._run
        await trio.lowlevel.checkpoint_if_cancelled()
        if run.vectors_sent + len(vectors) > run.vectors_expected:
            raise AdapterError(
                "upstream_bad_response",
                f"the upstream answered more than {run.vectors_expected} embeddings for "
                f"{run.vectors_expected} inputs",
                retryable=True,
            )
        if not vectors:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        run.content_pushed = True
        for first, batch, size in embeddings_frames(vectors):
            index = run.vectors_sent + first
            self._runner._push(run, _embeddings_event(run.run_id, index, batch), size=size)
        run.vectors_sent += len(vectors)
        await self._wait_drained()

    async def _wait_drained(self) -> None:
        """After this run added a piece (which woke the writer if it was idle)."""
        run, runner = self._run, self._runner
        if run.pieces.size > MAX_PENDING_CHARS:
            while run.pieces.size > MAX_PENDING_CHARS:
                await run.drained.park()
            run.unyielded = 0
        elif not runner._writing:
            # The first piece of a burst: the writer runs and takes it before we go on.
            await runner._writer_woke.park()
            run.unyielded = 0
        elif run.unyielded >= MAX_UNYIELDED_PIECES:
            await trio.lowlevel.cancel_shielded_checkpoint()
            run.unyielded = 0
        else:
            # A send is in flight: the piece joins what waits behind it; no schedule point.
            run.unyielded += 1

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
        run = self._run
        # Kept as given (an adapter may report at every token): made a Usage when needed.
        run.reported = (
            prompt_tokens,
            completion_tokens,
            estimated,
            cached_tokens,
            cache_write_tokens,
            reasoning_tokens,
        )
        if not (estimated or run.content_pushed):
            # Counted before the first content: the first run.delta carries it (no frame of
            # its own), so the edge's answer can start with the run's own count (Anthropic's
            # message_start) rather than its estimate. The run's usage is still its last.
            run.pieces.first_delta_usage = run.reported_usage()

    def finish(self, reason: str, *, stop_sequence: str | None = None) -> None:
        self._run.finish_reason = reason
        self._run.stop_sequence = stop_sequence

    def ignore_cancel(self) -> None:
        self._run.ignoring_cancel = True


class Runner:
    """Runs requests on adapters. Create with :func:`open_runner`."""

    def __init__(
        self, nursery: trio.Nursery, send_many: SendMany, adapters: Mapping[str, Adapter]
    ) -> None:
        self._nursery = nursery
        self._send_many = send_many
        self._adapters = adapters
        self._runs: dict[str, _Run] = {}
        self._ready: collections.deque[_Run] = collections.deque()
        self._wakeup = trio.lowlevel.ParkingLot()
        self._writing = False
        """The writer is taking or sending (not parked waiting for work)."""
        self._writer_woke = trio.lowlevel.ParkingLot()
        """Adapters that added a piece while the writer was idle, until it runs."""
        self._closed = False

    def start(self, request: wire.RunRequest) -> None:
        """Start a run in its own cancel scope. The session's protocol machine refuses a
        second ``run.request`` for a running run before it gets here (the edge gives an id
        once); starting one anyway is ``wire.LocalProtocolError``, a bug of the caller, and
        the running one goes on."""
        if self._closed:
            raise RuntimeError("the runner is closed")
        run_id = request.run_id
        if run_id in self._runs:
            raise wire.LocalProtocolError(f"run {run_id!r} is already running")
        adapter = self._adapters.get(request.provider_id) or RefusingAdapter(
            "unknown_provider", f"this node has no provider {request.provider_id!r}"
        )
        run = self._runs[run_id] = _Run(run_id)
        if request.route == "embeddings":
            run.vectors_expected = len(wire.embedding_inputs(request.body))
        self._nursery.start_soon(self._run, run, adapter, request, name=f"run {run_id}")

    def cancel(self, run_id: str, reason: str = "") -> None:
        """Cancel a run (it answers ``run.cancelled``). Unknown or finished ids are ignored."""
        run = self._runs.get(run_id)
        if run is None:
            log.debug("run %s: run.cancel for no active run, ignored", run_id)
            return
        if run.ignoring_cancel:
            log.info("run %s: run.cancel ignored (ignore_cancel is set)", run_id)
            return
        run.scope.cancel(reason=f"run.cancel: {reason}" if reason else "run.cancel")

    def statistics(self) -> RunnerStatistics:
        return RunnerStatistics(active_runs=len(self._runs), runs_waiting_to_send=len(self._ready))

    # ----------------------------------------------------------------------- internals

    def _push(self, run: _Run, item: _EventFactory, *, size: int = 0) -> None:
        run.pieces.add_event(item, size=size)
        self._queue(run)

    def _queue(self, run: _Run) -> None:
        """``run`` has pieces for the writer."""
        if not run.queued:
            run.queued = True
            self._ready.append(run)
            self._wakeup.unpark_all()

    async def _write_loop(self) -> None:
        try:
            while True:
                while not self._ready:
                    self._writing = False
                    await self._wakeup.park()
                self._writing = True
                self._writer_woke.unpark_all()
                run = self._ready.popleft()
                run.queued = False
                frames = run.pieces.take()
                run.drained.unpark_all()
                await self._send_many(frames)  # what the run had ready: one socket write
                if frames and isinstance(frames[-1], wire.TERMINAL_EVENTS):  # nothing follows it
                    run.terminal_sent.set()
        finally:
            self._writing = False
            self._writer_woke.unpark_all()

    async def _run(self, run: _Run, adapter: Adapter, request: wire.RunRequest) -> None:
        run_id = run.run_id
        try:
            self._push(run, lambda seq: wire.RunStarted(run_id=run_id, seq=seq))
            terminal = await self._execute(run, adapter, request)
            if terminal is not wire.RunCancelled:
                usage = self._usage_event(run, request, required=terminal is wire.RunCompleted)
                if usage is not None:
                    self._push(run, usage)
            self._push(run, self._terminal_event(run, request, terminal))
            await run.terminal_sent.wait()
        finally:
            if self._runs.get(run_id) is run:
                del self._runs[run_id]

    async def _execute(
        self, run: _Run, adapter: Adapter, request: wire.RunRequest
    ) -> type[wire.RunCompleted] | type[wire.RunCancelled] | AdapterError:
        """Run the adapter; say how the run ended (a failure as an AdapterError)."""
        try:
            with run.scope:
                await _perform(adapter, request, _Output(self, run))
            if (
                request.route == "embeddings"
                and not run.scope.cancelled_caught
                and run.vectors_sent != run.vectors_expected
            ):
                raise AdapterError(
                    "upstream_bad_response",
                    f"the upstream answered {run.vectors_sent} embeddings for "
                    f"{run.vectors_expected} inputs",
                    retryable=True,
                )
        except DropConnection:
            raise
        except AdapterError as exc:
            if run.scope.cancel_called:
                return wire.RunCancelled
            log.info(
                "run %s failed: %s%s: %s",
                run.run_id,
                exc.code,
                "" if exc.status is None else f" (upstream HTTP {exc.status})",
                exc.message,
            )
            return exc
        except Exception as exc:
            if run.scope.cancel_called:
                return wire.RunCancelled
            log.exception("run %s: adapter %s crashed", run.run_id, type(adapter).__name__)
            return AdapterError("internal", f"{type(exc).__name__}: {exc}", retryable=False)
        if run.scope.cancelled_caught:
            return wire.RunCancelled
        return wire.RunCompleted

    def _usage(self, run: _Run, request: wire.RunRequest) -> wire.Usage:
        """What the adapter last reported (estimated only if it said so), else the runner's
        own estimate (``estimated=True``)."""
        reported = run.reported_usage()
        if reported is not None:
            return reported
        return wire.Usage(
            prompt_tokens=estimate_prompt_tokens(request.body),
            completion_tokens=run.pieces.generated_tokens(),
            estimated=True,
        )

    def _usage_event(
        self, run: _Run, request: wire.RunRequest, *, required: bool
    ) -> _EventFactory | None:
        if not required and run.reported is None and not run.text_pushed:
            return None
        usage = self._usage(run, request)
        return lambda seq: wire.RunUsage(run_id=run.run_id, seq=seq, usage=usage)

    def _terminal_event(
        self,
        run: _Run,
        request: wire.RunRequest,
        outcome: type[wire.RunCompleted] | type[wire.RunCancelled] | AdapterError,
    ) -> _EventFactory:
        run_id = run.run_id
        if isinstance(outcome, AdapterError):
            error = outcome
            return lambda seq: wire.RunFailed(
                run_id=run_id,
                seq=seq,
                code=error.code,
                message=error.message,
                retryable=error.retryable,
                status=error.status,
            )
        if outcome is wire.RunCancelled:
            usage = self._usage(run, request)
            return lambda seq: wire.RunCancelled(run_id=run_id, seq=seq, usage=usage)
        reason, sequence = run.finish_reason, run.stop_sequence
        return lambda seq: wire.RunCompleted(
            run_id=run_id, seq=seq, finish_reason=reason, stop_sequence=sequence
        )


def clamped_usage(
    prompt_tokens: int,
    completion_tokens: int,
    *,
    estimated: bool = False,
    cached_tokens: int = 0,
    cache_write_tokens: int = 0,
    reasoning_tokens: int = 0,
) -> wire.Usage:
    """An adapter's counts as the run's :class:`~dispatcher.wire.Usage`, each part within
    its total (never negative; the cache reads first, then the cache writes, within the
    prompt; the reasoning within the completion): an engine's odd breakdown never makes a
    count the edge would refuse."""
    cached = min(max(0, cached_tokens), max(0, prompt_tokens))
    return wire.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        estimated=estimated,
        cached_tokens=cached,
        cache_write_tokens=min(max(0, cache_write_tokens), max(0, prompt_tokens) - cached),
        reasoning_tokens=min(max(0, reasoning_tokens), max(0, completion_tokens)),
    )


CHAT_ROUTES: Final[frozenset[wire.RouteName]] = frozenset(wire.NORMALIZED_ROUTES)
"""The routes an adapter's ``run`` serves: a chat body (the edge translates the Responses and
Messages APIs to one)."""


async def _perform(adapter: Adapter, request: wire.RunRequest, out: _Output) -> None:
    """The adapter's work for the request's route, or ``unsupported_route``."""
    if request.route in CHAT_ROUTES:
        await adapter.run(request, out)
    elif request.route == "embeddings" and isinstance(adapter, Embedder):
        await adapter.embed(request, out)
    else:
        raise AdapterError(
            "unsupported_route",
            f"this node's {request.provider_id!r} provider does not serve {request.route!r}",
            retryable=True,
        )


def embeddings_frames(vectors: Sequence[str]) -> list[tuple[int, tuple[str, ...], int]]:
    """``vectors`` as the ``vectors`` of ``run.embeddings`` events of at most
    :data:`~dispatcher.wire.MAX_EMBEDDINGS_CHARS` each: (the first one's position in
    ``vectors``, the batch, its size in characters). Raises ``embedding_too_large`` for a
    vector over it alone."""
    frames: list[tuple[int, tuple[str, ...], int]] = []
    first, size = 0, 0
    for position, vector in enumerate(vectors):
        if len(vector) > wire.MAX_EMBEDDINGS_CHARS:
            raise AdapterError(
                "embedding_too_large",
                f"a vector of {len(vector) * 3 // 16} dimensions is over what one frame of the "
                "node's connection carries",
            )
        if position > first and size + len(vector) > wire.MAX_EMBEDDINGS_CHARS:
            frames.append((first, tuple(vectors[first:position]), size))
            first, size = position, 0
        size += len(vector)
    if len(vectors) > first:
        frames.append((first, tuple(vectors[first:]), size))
    return frames


def _embeddings_event(run_id: str, index: int, vectors: tuple[str, ...]) -> _EventFactory:
    return lambda seq: wire.RunEmbeddings(run_id=run_id, seq=seq, index=index, vectors=vectors)


def tool_call_frames(
    calls: Sequence[Mapping[str, Any]],
) -> list[tuple[tuple[wire.JSONObject, ...], int]]:
    """``calls`` (OpenAI tool-call deltas) as the ``tool_calls`` of one ``run.delta`` frame,
    or of several when they are over :data:`MAX_DELTA_CHARS` of JSON: a call whose
    ``function.arguments`` is that long continues in argument-only deltas of the same
    ``index``. Each frame comes with its size in characters. Raises ``TypeError`` for
    anything that is not JSON."""
    frames: list[tuple[tuple[wire.JSONObject, ...], int]] = []
    current: list[wire.JSONObject] = []
    size = 0
    for call in calls:
        for piece in _split_call(call):
            piece_size = len(orjson.dumps(piece))
            if current and size + piece_size > MAX_DELTA_CHARS:
                frames.append((tuple(current), size))
                current, size = [], 0
            current.append(piece)
            size += piece_size
    if current:
        frames.append((tuple(current), size))
    return frames


def _tool_call_delta(run_id: str, calls: tuple[wire.JSONObject, ...]) -> _EventFactory:
    return lambda seq: wire.RunDelta(run_id=run_id, seq=seq, tool_calls=calls)


def _split_call(call: Mapping[str, Any]) -> list[wire.JSONObject]:
    copied: dict[str, Any] = dict(call)
    function = copied.get("function")
    if not isinstance(function, Mapping):
        return [copied]
    copied["function"] = dict(function)
    arguments = function.get("arguments")
    if not isinstance(arguments, str) or len(arguments) <= MAX_DELTA_CHARS:
        return [copied]
    copied["function"]["arguments"] = arguments[:MAX_DELTA_CHARS]
    pieces: list[wire.JSONObject] = [copied]
    for start in range(MAX_DELTA_CHARS, len(arguments), MAX_DELTA_CHARS):
        piece = arguments[start : start + MAX_DELTA_CHARS]
        pieces.append({"index": call.get("index", 0), "function": {"arguments": piece}})
    return pieces


@asynccontextmanager
async def open_runner(
    send: Send, *, adapters: Mapping[str, Adapter], send_many: SendMany | None = None
) -> AsyncIterator[Runner]:
    """A :class:`Runner` whose runs live inside this block. ``adapters`` maps provider ids
    to adapters (see :func:`nodes.adapters.build_adapters`); a request for another provider
    fails with code ``unknown_provider``. The adapters that have a lifetime (the HTTP
    adapters' pooled clients) are opened for the block (:func:`~nodes.adapters.base.
    open_adapters`; adapters already opened by the caller stay as they are) and closed after
    the last run ended. Leaving the block cancels every run; nothing more is sent.
    ``send_many``, when given, sends what a run has ready at once (else each message is
    ``send``'s)."""
    async with open_adapters(adapters) as opened, trio.open_nursery() as nursery:
        runner = Runner(nursery, send_many or one_by_one(send), opened)
        nursery.start_soon(runner._write_loop, name="runner writer")
        try:
            yield runner
        finally:
            runner._closed = True
            nursery.cancel_scope.cancel(reason="runner closed")
