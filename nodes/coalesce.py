"""Fewer frames per stream: what the node has ready for a run or a tunnel, as few websocket
frames as the protocol allows. Sans-IO: plain data in, messages out; the runner
(:mod:`nodes.runner`) and the tunnel writer (:mod:`nodes.tunnel`) decide *when* to take.

Runs, :class:`RunPieces`: a run's unsent pieces in order -- text, and events waiting for
their ``seq`` (``run.started``, tool-call deltas, ``run.usage``, the terminal event).
:meth:`RunPieces.take` turns everything pending into messages, numbering them with the run's
next ``seq``\\ s: consecutive text becomes one ``run.delta`` (its texts concatenated, split only
past :data:`MAX_DELTA_CHARS`); an event is never merged, so a tool-call delta stays its own
``run.delta`` in order with the text around it, and nothing crosses ``run.started`` or the
terminal event. A ``run.delta`` with any text is what the protocol allows; the client sees
the same concatenated text, in fewer SSE events.

Tunnels, :func:`take_body`: the body bytes buffered for a tunnel, as one binary frame of at
most :data:`~dispatcher.wire.MAX_TUNNEL_CHUNK` bytes and the credit the edge granted.

Neither waits for more: the callers take what is ready when the connection can take a frame,
so the first piece of a stream goes out as soon as the connection is free, and only what
piles up behind a send in flight is merged.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Final

import attrs

from dispatcher import wire
from dispatcher.shared.tokens import TokenEstimator

MAX_DELTA_CHARS: Final = 64 * 1024
"""Most text in one coalesced ``run.delta`` frame (well under ``wire.MAX_FRAME_SIZE`` even
when every character needs a JSON escape)."""

EventFactory = Callable[[int], wire.NodeMessage]
"""A run event waiting for its ``seq``."""


@attrs.define(eq=False)
class RunPieces:
    """One run's unsent pieces, and its next ``seq``."""

    run_id: str
    next_seq: int = 0
    size: int = 0
    """Characters pending: text, plus the size given with each event."""
    first_delta_usage: wire.Usage | None = None
    """A usage counted before any content: the next ``run.delta`` made carries it."""
    generated: TokenEstimator = attrs.Factory(TokenEstimator)
    """The text taken so far, estimated (fed a ``run.delta``'s text at a time: the estimate
    is the same however the text is split)."""
    _pending: collections.deque[str | EventFactory] = attrs.Factory(collections.deque)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add_text(self, text: str) -> None:
        self._pending.append(text)
        self.size += len(text)

    def add_event(self, event: EventFactory, *, size: int = 0) -> None:
        self._pending.append(event)
        self.size += size

    def take(self) -> list[wire.NodeMessage]:
        """Everything pending, as messages with consecutive ``seq``; consecutive text
        coalesced into one ``run.delta``."""
        messages: list[wire.NodeMessage] = []
        text: list[str] = []
        for item in self._pending:
            if isinstance(item, str):
                text.append(item)
                continue
            if text:
                self._add_deltas(messages, text)
                text = []
            message = item(self._seq())
            if self.first_delta_usage is not None and isinstance(message, wire.RunDelta):
                message = attrs.evolve(message, usage=self.first_delta_usage)
                self.first_delta_usage = None
            messages.append(message)
        if text:
            self._add_deltas(messages, text)
        self._pending.clear()
        self.size = 0
        return messages

    def _add_deltas(self, messages: list[wire.NodeMessage], text: list[str]) -> None:
        joined = text[0] if len(text) == 1 else "".join(text)
        self.generated.add(joined)
        for start in range(0, len(joined), MAX_DELTA_CHARS):
            piece = joined[start : start + MAX_DELTA_CHARS]
            usage, self.first_delta_usage = self.first_delta_usage, None
            messages.append(
                wire.RunDelta(run_id=self.run_id, seq=self._seq(), text=piece, usage=usage)
            )

    def generated_tokens(self) -> int:
        """The estimated tokens of all the text added, taken or not."""
        pending = "".join(item for item in self._pending if isinstance(item, str))
        if not pending:
            return self.generated.tokens
        estimator = copy.copy(self.generated)
        estimator.add(pending)
        return estimator.tokens

    def _seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq


def take_body(pending: bytearray, credit: int) -> bytes:
    """The next body frame of a tunnel: as much of ``pending`` as fits in one frame and in
    ``credit``, removed from ``pending`` (empty when either is)."""
    size = min(len(pending), credit, wire.MAX_TUNNEL_CHUNK)
    if size <= 0:
        return b""
    data = bytes(pending[:size])
    del pending[:size]
    return data
