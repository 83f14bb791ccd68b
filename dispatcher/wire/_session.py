"""The session state machine: what each side may send, and when. Sans-IO (no Trio, no I/O),
in the shape of h11's ``Connection``: the driver feeds every message it decodes to
``receive()`` and every message it is about to send to ``send()``, and carries out what the
machine decides.

Two halves, one per side, each tracking both directions:

* :class:`EdgeProtocol` -- the edge's side of one node connection (``dispatcher.link.session``
  and ``dispatcher.link.registry`` drive it);
* :class:`NodeProtocol` -- the node's side (for ``nodes.agent``).

Session states (:class:`State`), the same on both sides::

    AWAITING_HELLO --hello--> AWAITING_WELCOME --welcome--> OPEN --close()--> CLOSED
          \\                        \\                        \\
           +------ a peer's violation (the first ProtocolError) ---> FAILED

Draining is a flag in ``OPEN`` (``node_draining``, ``edge_draining``), not a state: work
already given finishes under the same rules.

Per run (``run.request`` registers the run; the edge chose its id):

* a run event is for a run given to *this* session;
* ``seq`` is 0 for the run's first event and grows by exactly 1 (no gap, no repeat);
* exactly one terminal event (``run.completed`` / ``run.failed`` / ``run.cancelled``), last;
  an event after it is a violation;
* an ``embeddings`` run's ``run.embeddings`` continue one another: each one's ``index`` is
  the number of vectors the run sent before it (no gap, no repeat);
* once the edge ended a run before its terminal (``close_run``: the client left and
  ``run.cancel`` was sent), the node's late events for it are *expected*:
  :class:`Tolerated`, for the last ``recent_runs`` such runs (bounded memory). A run that
  was closed after its terminal stays remembered too, so an event after its end is still a
  violation until it is forgotten.

Per tunnel (``tunnel.request`` registers it): ``tunnel.start`` at most once and before any
body frame, exactly one ``tunnel.end``, nothing after it; late frames for a tunnel the edge
ended early are tolerated, as for runs. Flow control (``window`` and ``tunnel.credit``)
is *not* here: the edge's tunnel route owns the buffer the credit protects
(``dispatcher.paths.tunnel._Route``).

A tunnel's request body sent as binary frames (``tunnel.request.body_size`` > 0, then that
many bytes, each frame at most ``MAX_TUNNEL_CHUNK``): the edge may send, and the node
accepts, exactly the bytes announced, for a tunnel still open -- one byte more is a
violation; a negative ``body_size``, or one beside a text ``body``, too. Body frames for a
tunnel the node already ended (it refused it, or the upstream failed early) crossed that end:
tolerated. The edge's body frames of a tunnel it never gave, or past the announced size,
are :class:`LocalProtocolError`.

``receive()`` returns :data:`ACCEPTED`, a :class:`Tolerated`, or a :class:`ProtocolError`
(returned, not raised) whose text is the reason to close the session with; it never raises.
After the first ``ProtocolError`` the machine is ``FAILED`` and returns that same error for
anything more. ``send()`` raises :class:`LocalProtocolError` for what *this* side may not
send (a bug here); after ``close()`` or a failure it accepts anything (the driver is
tearing down and drops it).

The per-event path of the edge is one ``isinstance``, one dict lookup and two int compares.
"""

from __future__ import annotations

import collections
import enum
from typing import Final, TypeAlias, TypeVar

import attrs

from . import _messages as m
from ._errors import LocalProtocolError, ProtocolError, UnsupportedVersion
from ._messages import (
    MAX_TUNNEL_CHUNK,
    PROTOCOL_VERSION,
    Message,
    RunEvent,
    TunnelData,
)

RECENT_RUNS: Final = 4096
"""How many finished run ids a session remembers (an event after a run's terminal is then
reported as such, and the id cannot be given again)."""
RECENT_TUNNELS: Final = 4096
"""As :data:`RECENT_RUNS`, for finished tunnels."""
MAX_ABANDONED: Final = 65536
"""How many runs (and, apart, tunnels) the edge may have ended early -- the client left --
whose end the node has not sent yet. They are remembered until that end arrives, however
many the edge ends at once: a node still streaming a run it was just told to cancel is late,
not wrong. Past this bound (a node ignoring that many cancels) the oldest is forgotten."""

_RUN_EVENTS: Final = (
    m.RunDelta,
    m.RunEmbeddings,
    m.RunStarted,
    m.RunUsage,
    m.RunCompleted,
    m.RunFailed,
    m.RunCancelled,
)
"""For ``isinstance``, the commonest first."""
_TERMINAL: Final = m.TERMINAL_EVENT_TYPES
_TUNNEL_FRAMES: Final = (TunnelData, m.TunnelStart, m.TunnelEnd)
_EDGE_MESSAGES: Final = m.EDGE_MESSAGE_TYPES

_TERMINATED: Final = -1
"""A run's "next seq" once its terminal event arrived (never matches: seq must be >= 0)."""

# A tunnel's phase.
_AWAITING_START: Final = 0
_STARTED: Final = 1
_ENDED: Final = 2


class State(enum.Enum):
    AWAITING_HELLO = "awaiting hello"
    AWAITING_WELCOME = "awaiting welcome"
    OPEN = "open"
    CLOSED = "closed"
    """This side ended the session (:meth:`EdgeProtocol.close`); frames still in flight are
    tolerated."""
    FAILED = "failed"
    """The peer broke the protocol; see ``error``."""


_OPEN: Final = State.OPEN
"""``State.OPEN`` as a module global: an enum member lookup costs more than the check."""


@attrs.frozen
class Accepted:
    """The message is legal here; the machine's state has advanced."""


@attrs.frozen
class Tolerated:
    """The message is not the peer's fault but there is nothing to route it to: a late event
    for a run or tunnel this side ended early (the node's cancel confirmation), or a frame in
    flight after this side closed the session. Drop it (a late ``run.usage`` / terminal or
    ``tunnel.end`` may settle what the ended run left behind)."""

    reason: str


ACCEPTED: Final = Accepted()
_Greeting = TypeVar("_Greeting", m.Hello, m.Welcome)
Verdict: TypeAlias = Accepted | Tolerated | ProtocolError
Frame: TypeAlias = Message | TunnelData
"""What a decoder yields: a text frame's message, or a binary tunnel body frame."""


def _describe(message: Frame) -> str:
    return "a binary frame" if isinstance(message, TunnelData) else repr(message.TYPE)


def _upload_fault(message: m.TunnelRequest) -> str | None:
    """What is wrong with a ``tunnel.request``'s body fields, if anything."""
    if message.body_size < 0:
        return f"tunnel.request for {message.tunnel_id!r} with body_size {message.body_size}"
    if message.body_size and message.body:
        return f"tunnel.request for {message.tunnel_id!r} with both a body and a body_size"
    return None


def _upload_frame(uploads: dict[str, int], data: TunnelData) -> str | None:
    """Count a request body frame against its tunnel's announced size; what is wrong with
    it, if anything (the tunnel is open)."""
    size = len(data.data)
    left = uploads.get(data.tunnel_id, 0)
    if size > MAX_TUNNEL_CHUNK:
        return f"tunnel {data.tunnel_id!r}: a request body frame of {size} bytes"
    if size > left:
        return (
            f"tunnel {data.tunnel_id!r}: {size} request body bytes with {left} left of what "
            "its tunnel.request announced"
        )
    if size == left:
        uploads.pop(data.tunnel_id, None)
    else:
        uploads[data.tunnel_id] = left - size
    return None


def _claim(table: dict[str, int], ended: _Ended, kind: str, key: str, first: int) -> None:
    """The edge gives ``key`` (a ``kind`` id: run or tunnel) to this session: its state
    begins at ``first``. An id may be given once per session."""
    if key in table or key in ended:
        raise LocalProtocolError(f"{kind} id {key!r} was already used on this session")
    table[key] = first


def _remember(memory: collections.OrderedDict[str, None], key: str, limit: int) -> str | None:
    """Add ``key`` to a bounded memory; return the oldest id it forgot, if any."""
    memory[key] = None
    if len(memory) > limit:
        return memory.popitem(last=False)[0]
    return None


@attrs.define(eq=False)
class _Ended:
    """What one side remembers of the runs (or tunnels) it stopped routing: those *finished*
    (their end arrived: anything more is a violation), the most recent ``recent`` of them,
    and those *abandoned* before their end (the node's late frames are tolerated until that
    end arrives), at most ``max_abandoned``."""

    recent: int
    max_abandoned: int
    finished: collections.OrderedDict[str, None] = attrs.field(factory=collections.OrderedDict)
    abandoned: collections.OrderedDict[str, None] = attrs.field(factory=collections.OrderedDict)

    def __contains__(self, key: str) -> bool:
        return key in self.finished or key in self.abandoned

    def retire(self, table: dict[str, int], key: str, finished: int) -> str | None:
        """Move ``key`` out of the open ``table``: finished if its state was ``finished``,
        else abandoned. Returns the id forgotten to keep the memory bounded, if any."""
        state = table.pop(key, None)
        if state is None:
            return None
        if state == finished:
            return _remember(self.finished, key, self.recent)
        return _remember(self.abandoned, key, self.max_abandoned)

    def late(self, key: str, *, end: bool) -> bool | None:
        """A frame for ``key``, which is not open: True if tolerated (abandoned; its ``end``
        makes it finished), False if it came after the end, None if never seen."""
        if key in self.abandoned:
            if end:
                del self.abandoned[key]
                _remember(self.finished, key, self.recent)
            return True
        return False if key in self.finished else None

    def keys(self) -> set[str]:
        return {*self.finished, *self.abandoned}

    def clear(self) -> None:
        self.finished.clear()
        self.abandoned.clear()


@attrs.define(eq=False)
class _Half:
    state: State = State.AWAITING_HELLO
    error: ProtocolError | None = None
    """The first violation of the peer, once ``state`` is ``FAILED``."""
    node_draining: bool = False
    edge_draining: bool = False

    def _fail(self, reason: str, kind: type[ProtocolError] = ProtocolError) -> ProtocolError:
        self.state = State.FAILED
        self.error = kind(reason)
        return self.error

    def _over(self) -> Verdict | None:
        """The verdict for anything received once the session is over, else None."""
        if self.state is State.FAILED:
            assert self.error is not None
            return self.error
        if self.state is State.CLOSED:
            return Tolerated("the session is over")
        return None

    def _greeting(self, message: Frame, kind: type[_Greeting], then: State) -> Verdict:
        """Judge the peer's first message: a ``kind`` (hello or welcome) in this protocol's
        version moves the session to ``then``."""
        if not isinstance(message, kind):
            return self._fail(f"expected {kind.TYPE}, got {_describe(message)}")
        if message.protocol != PROTOCOL_VERSION:
            this_side = "edge" if kind is m.Hello else "node"
            return self._fail(
                f"protocol version {message.protocol} is not supported "
                f"(this {this_side} speaks {PROTOCOL_VERSION}): run the same trio-dispatcher "
                "release on the edges and their nodes",
                UnsupportedVersion,
            )
        self.state = then
        return ACCEPTED


@attrs.define(eq=False)
class EdgeProtocol(_Half):
    """The edge's half of one node session."""

    recent_runs: int = RECENT_RUNS
    recent_tunnels: int = RECENT_TUNNELS
    max_abandoned: int = MAX_ABANDONED
    hello: m.Hello | None = None
    """The node's ``hello``, once received."""
    _runs: dict[str, int] = attrs.field(factory=dict)
    """Open runs: the next ``seq`` expected, or ``_TERMINATED``."""
    _ended_runs: _Ended = attrs.field(init=False)
    """Runs the edge stopped routing (see :class:`_Ended`)."""
    _vectors: dict[str, int] = attrs.field(factory=dict)
    """Open runs that sent ``run.embeddings``: the ``index`` the next one must carry."""
    _tunnels: dict[str, int] = attrs.field(factory=dict)
    _ended_tunnels: _Ended = attrs.field(init=False)
    _uploads: dict[str, int] = attrs.field(factory=dict)
    """Open tunnels' request body bytes still to send (``tunnel.request.body_size``)."""

    def __attrs_post_init__(self) -> None:
        self._ended_runs = _Ended(self.recent_runs, self.max_abandoned)
        self._ended_tunnels = _Ended(self.recent_tunnels, self.max_abandoned)

    # ------------------------------------------------------------------ what the node sends

    def receive(self, message: Frame) -> Verdict:
        """Judge one message (or binary frame) the node sent. Never raises."""
        if isinstance(message, _RUN_EVENTS) and self.state is _OPEN:
            run_id = message.run_id
            seq = message.seq
            expected = self._runs.get(run_id)
            if expected == seq and seq >= 0:
                kind = type(message)
                if kind is m.RunEmbeddings:
                    assert isinstance(message, m.RunEmbeddings)
                    return self._embeddings(message)
                if kind in _TERMINAL:
                    self._runs[run_id] = _TERMINATED
                    if self._vectors:
                        self._vectors.pop(run_id, None)
                else:
                    self._runs[run_id] = seq + 1
                return ACCEPTED
            return self._unexpected_run_event(message, expected)
        return self._receive_other(message)

    def _embeddings(self, event: m.RunEmbeddings) -> Verdict:
        """A ``run.embeddings`` in its turn: it must continue the run's vectors."""
        run_id = event.run_id
        sent = self._vectors.get(run_id, 0)
        if event.index != sent:
            return self._fail(
                f"run.embeddings for run {run_id!r} starts at vector {event.index}, expected {sent}"
            )
        self._vectors[run_id] = sent + len(event.vectors)
        self._runs[run_id] = event.seq + 1
        return ACCEPTED

    def _unexpected_run_event(self, event: RunEvent, expected: int | None) -> Verdict:
        what = f"event {event.TYPE!r} for run {event.run_id!r}"
        if expected is None:
            tolerated = self._ended_runs.late(event.run_id, end=type(event) in _TERMINAL)
            if tolerated is None:
                return self._fail(f"{what}, which this session was not given")
            if tolerated:
                return Tolerated(f"run {event.run_id!r} was ended here")
            expected = _TERMINATED
        if expected == _TERMINATED:
            return self._fail(f"{what} after its terminal event")
        return self._fail(f"{what} has seq {event.seq}, expected {expected}")

    def _receive_other(self, message: Frame) -> Verdict:
        state = self.state
        if state is State.OPEN:
            if isinstance(message, _TUNNEL_FRAMES):
                return self._tunnel_frame(message)
            if isinstance(message, m.Pong | m.Capacity):
                return ACCEPTED
            if isinstance(message, m.NodeDraining):
                self.node_draining = True
                return ACCEPTED
            return self._fail(f"unexpected {_describe(message)} message from a node")
        over = self._over()
        if over is not None:
            return over
        if state is State.AWAITING_HELLO:
            verdict = self._greeting(message, m.Hello, State.AWAITING_WELCOME)
            if isinstance(message, m.Hello) and verdict is ACCEPTED:
                self.hello = message
            return verdict
        return self._fail(f"{_describe(message)} before the edge's welcome")

    def _tunnel_frame(self, message: TunnelData | m.TunnelStart | m.TunnelEnd) -> Verdict:
        tunnel_id = message.tunnel_id
        phase = self._tunnels.get(tunnel_id)
        if phase is None:
            tolerated = self._ended_tunnels.late(tunnel_id, end=isinstance(message, m.TunnelEnd))
            if tolerated is None:
                what = "binary frame" if isinstance(message, TunnelData) else repr(message.TYPE)
                return self._fail(
                    f"{what} for no open tunnel: {tunnel_id!r} was not given to this session"
                )
            if tolerated:
                return Tolerated(f"tunnel {tunnel_id!r} was ended here")
            phase = _ENDED
        where = f"tunnel {tunnel_id!r}"
        if isinstance(message, TunnelData):
            if phase == _AWAITING_START:
                return self._fail(f"{where}: body frame before tunnel.start")
            if phase == _ENDED:
                return self._fail(f"{where}: body frame after tunnel.end")
            return ACCEPTED
        if isinstance(message, m.TunnelStart):
            if phase != _AWAITING_START:
                return self._fail(f"{where}: tunnel.start after the response started or ended")
            self._tunnels[tunnel_id] = _STARTED
            return ACCEPTED
        if phase == _ENDED:
            return self._fail(f"{where}: a second tunnel.end")
        self._tunnels[tunnel_id] = _ENDED
        return ACCEPTED

    # ------------------------------------------------------------------ what the edge sends

    def send(self, message: Message | TunnelData) -> None:
        """Record a message (or a request body frame) the edge is sending (call before it is
        written: the node may answer a ``run.request`` at once). Raises
        :class:`LocalProtocolError` if the edge may not send it now."""
        state = self.state
        if state is State.CLOSED or state is State.FAILED:
            return
        if isinstance(message, TunnelData):
            if state is not State.OPEN or message.tunnel_id not in self._tunnels:
                raise LocalProtocolError(
                    f"a request body frame for tunnel {message.tunnel_id!r}, which is not open"
                )
            fault = _upload_frame(self._uploads, message)
            if fault is not None:
                raise LocalProtocolError(fault)
            return
        if not isinstance(message, _EDGE_MESSAGES):
            raise LocalProtocolError(f"{message.TYPE!r} is not the edge's to send")
        if state is State.AWAITING_WELCOME and isinstance(message, m.Welcome):
            self.state = State.OPEN
            return
        if state is not State.OPEN or isinstance(message, m.Welcome):
            raise LocalProtocolError(f"cannot send {message.TYPE!r} while {state.value}")
        if isinstance(message, m.RunRequest):
            _claim(self._runs, self._ended_runs, "run", message.run_id, 0)
        elif isinstance(message, m.TunnelRequest):
            fault = _upload_fault(message)
            if fault is not None:
                raise LocalProtocolError(fault)
            _claim(self._tunnels, self._ended_tunnels, "tunnel", message.tunnel_id, _AWAITING_START)
            if message.body_size:
                self._uploads[message.tunnel_id] = message.body_size
        elif isinstance(message, m.EdgeDraining):
            self.edge_draining = True

    def close_run(self, run_id: str) -> str | None:
        """The edge stopped routing this run (its subscription closed). Before its terminal
        event, the node's events for it are tolerated until that terminal arrives, however
        many runs are ended at once. Returns the id of a run forgotten to keep the memory
        bounded (see :data:`MAX_ABANDONED`), if any."""
        self._vectors.pop(run_id, None)
        return self._ended_runs.retire(self._runs, run_id, _TERMINATED)

    def close_tunnel(self, tunnel_id: str) -> str | None:
        """As :meth:`close_run`, for a tunnel (tolerated until its end when closed before)."""
        self._uploads.pop(tunnel_id, None)
        return self._ended_tunnels.retire(self._tunnels, tunnel_id, _ENDED)

    def close(self) -> None:
        """The edge ended the session: what still arrives is tolerated, what is still sent
        is dropped by the driver."""
        if self.state is not State.FAILED:
            self.state = State.CLOSED
        self._vectors.clear()
        self._ended_runs.clear()
        self._ended_tunnels.clear()
        self._uploads.clear()

    # ------------------------------------------------------------------ introspection

    def next_seq(self, run_id: str) -> int | None:
        """The ``seq`` the next event of an open run must carry; None for a run that is not
        open or whose terminal arrived."""
        expected = self._runs.get(run_id)
        return None if expected is None or expected == _TERMINATED else expected

    def known_runs(self) -> set[str]:
        """Every run id the machine holds state for (open or recently ended)."""
        return {*self._runs, *self._ended_runs.keys()}

    def known_tunnels(self) -> set[str]:
        return {*self._tunnels, *self._ended_tunnels.keys()}

    def body_left(self, tunnel_id: str) -> int:
        """Request body bytes the edge has still to send on an open tunnel."""
        return self._uploads.get(tunnel_id, 0)


@attrs.define(eq=False)
class NodeProtocol(_Half):
    """The node's half of its session with the edge."""

    welcome: m.Welcome | None = None
    """The edge's ``welcome``, once received."""
    _runs: dict[str, int] = attrs.field(factory=dict)
    """Runs the edge gave and whose terminal was not sent yet: the next ``seq`` to send."""
    _vectors: dict[str, int] = attrs.field(factory=dict)
    """Running runs that sent ``run.embeddings``: the ``index`` the next one must carry."""
    _tunnels: dict[str, int] = attrs.field(factory=dict)
    """Tunnels the edge gave and whose ``tunnel.end`` was not sent yet: their phase."""
    _uploads: dict[str, int] = attrs.field(factory=dict)
    """Open tunnels' request body bytes the edge has still to send."""

    # ------------------------------------------------------------------ what the edge sends

    def receive(self, message: Frame) -> Verdict:
        """Judge one message (or binary frame) the edge sent. Never raises."""
        state = self.state
        if state is State.OPEN:
            return self._receive_open(message)
        over = self._over()
        if over is not None:
            return over
        if state is State.AWAITING_HELLO:
            return self._fail(f"{_describe(message)} before this node's hello")
        verdict = self._greeting(message, m.Welcome, State.OPEN)
        if isinstance(message, m.Welcome) and verdict is ACCEPTED:
            self.welcome = message
        return verdict

    def _receive_open(self, message: Frame) -> Verdict:
        if isinstance(message, m.RunRequest):
            return self._given(self._runs, message.run_id, 0, "run", "running")
        if isinstance(message, m.TunnelRequest):
            fault = _upload_fault(message)
            if fault is not None:
                return self._fail(fault)
            verdict = self._given(
                self._tunnels, message.tunnel_id, _AWAITING_START, "tunnel", "open"
            )
            if verdict is ACCEPTED and message.body_size:
                self._uploads[message.tunnel_id] = message.body_size
            return verdict
        if isinstance(message, TunnelData) and message.tunnel_id in self._tunnels:
            fault = _upload_frame(self._uploads, message)
            return ACCEPTED if fault is None else self._fail(fault)
        if isinstance(message, m.RunCancel | m.TunnelCancel | m.TunnelCredit | TunnelData):
            # For a run or tunnel that just ended here they are late, not wrong.
            known = self._runs if isinstance(message, m.RunCancel) else self._tunnels
            key = message.run_id if isinstance(message, m.RunCancel) else message.tunnel_id
            if key in known:
                return ACCEPTED
            return Tolerated(f"{_describe(message)} for {key!r}, which is not running here")
        if isinstance(message, m.Ping | m.Demand):
            return ACCEPTED
        if isinstance(message, m.EdgeDraining):
            self.edge_draining = True
            return ACCEPTED
        return self._fail(f"unexpected {_describe(message)} message from the edge")

    def _given(self, table: dict[str, int], key: str, first: int, kind: str, busy: str) -> Verdict:
        """The edge gives a run or tunnel: legal unless one with that id is still ``busy``
        here (a finished id may come again: the edge chose it for a new session's work)."""
        if key in table:
            return self._fail(f"{kind}.request for {kind} {key!r}, which is {busy}")
        table[key] = first
        return ACCEPTED

    # ------------------------------------------------------------------ what the node sends

    def send(self, message: Frame) -> None:
        """Record a message (or binary frame) the node is sending. Raises
        :class:`LocalProtocolError` if the node may not send it now."""
        state = self.state
        if state is State.CLOSED or state is State.FAILED:
            return
        if state is State.AWAITING_HELLO:
            if not isinstance(message, m.Hello):
                raise LocalProtocolError(f"cannot send {_describe(message)} before hello")
            self.state = State.AWAITING_WELCOME
            return
        if state is State.AWAITING_WELCOME:
            raise LocalProtocolError(f"cannot send {_describe(message)} before the welcome")
        if isinstance(message, _RUN_EVENTS):
            self._send_run_event(message)
        elif isinstance(message, _TUNNEL_FRAMES):
            self._send_tunnel_frame(message)
        elif isinstance(message, m.NodeDraining):
            self.node_draining = True
        elif not isinstance(message, m.Pong | m.Capacity):
            raise LocalProtocolError(f"{message.TYPE!r} is not the node's to send")

    def _send_run_event(self, message: RunEvent) -> None:
        where = f"{message.TYPE!r} for run {message.run_id!r}"
        expected = self._runs.get(message.run_id)
        if expected is None:
            raise LocalProtocolError(f"{where}, which is not running here")
        if message.seq != expected:
            raise LocalProtocolError(f"{where} with seq {message.seq}, expected {expected}")
        if isinstance(message, m.RunEmbeddings):
            sent = self._vectors.get(message.run_id, 0)
            if message.index != sent:
                raise LocalProtocolError(f"{where} starts at vector {message.index}, not {sent}")
            self._vectors[message.run_id] = sent + len(message.vectors)
        if type(message) in _TERMINAL:
            del self._runs[message.run_id]
            self._vectors.pop(message.run_id, None)
        else:
            self._runs[message.run_id] = expected + 1

    def _send_tunnel_frame(self, message: TunnelData | m.TunnelStart | m.TunnelEnd) -> None:
        phase = self._tunnels.get(message.tunnel_id)
        where = f"tunnel {message.tunnel_id!r}"
        if phase is None:
            raise LocalProtocolError(f"{_describe(message)} for {where}, which is not open")
        if isinstance(message, m.TunnelStart):
            if phase != _AWAITING_START:
                raise LocalProtocolError(f"{where}: a second tunnel.start")
            self._tunnels[message.tunnel_id] = _STARTED
        elif isinstance(message, TunnelData):
            if phase != _STARTED:
                raise LocalProtocolError(f"{where}: body frame before tunnel.start")
        else:
            del self._tunnels[message.tunnel_id]
            self._uploads.pop(message.tunnel_id, None)

    def close(self) -> None:
        if self.state is not State.FAILED:
            self.state = State.CLOSED

    # ------------------------------------------------------------------ introspection

    @property
    def generation(self) -> int | None:
        """The session's generation, from the edge's ``welcome``."""
        return None if self.welcome is None else self.welcome.generation

    def next_seq(self, run_id: str) -> int | None:
        """The ``seq`` this node's next event for ``run_id`` must carry (None: not running)."""
        return self._runs.get(run_id)

    def next_vector(self, run_id: str) -> int:
        """The ``index`` this node's next ``run.embeddings`` for ``run_id`` must carry."""
        return self._vectors.get(run_id, 0)

    def running(self) -> set[str]:
        """The runs the edge gave whose terminal event this node has not sent."""
        return set(self._runs)

    def open_tunnels(self) -> set[str]:
        """The tunnels the edge gave whose ``tunnel.end`` this node has not sent."""
        return set(self._tunnels)

    def body_left(self, tunnel_id: str) -> int:
        """Request body bytes the edge has still to send on an open tunnel."""
        return self._uploads.get(tunnel_id, 0)

    def is_idle(self) -> bool:
        """No run and no tunnel is waiting for this node's answer."""
        return not self._runs and not self._tunnels
