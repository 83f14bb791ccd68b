"""The session state machine under Hypothesis (issue #11, acceptance 4).

* :class:`HostileNode`: a ``RuleBasedStateMachine`` drives the edge's half with whatever a
  hostile node may send -- run events for any run with any seq, tunnel frames in any order,
  any message of the protocol, arbitrary bytes through the codec -- while the edge gives and
  ends runs and tunnels. Every verdict is checked against a small reference model; the
  machine never raises, never holds state for a run or tunnel it was not given, and its first
  ``ProtocolError`` is final.
* :class:`HostileEdge`: the same for the node's half: whatever a hostile edge may send -- a
  welcome in any version, run and tunnel requests with fresh or reused ids, cancels and
  credits for anything, node-only messages, arbitrary bytes through the codec -- while the
  node answers what it was given in order. Every verdict is checked against a reference
  model; a version mismatch is an ``UnsupportedVersion``; the node never holds state for a
  run or tunnel whose request it did not accept, and its first ``ProtocolError`` is final.
* :func:`test_two_halves_accept_legal_traffic`: the edge's and the node's halves talk to each
  other (through the codec, in both directions, interleaved as Hypothesis likes): everything
  legal is accepted, and only what is late (an event for a run the edge ended, a cancel for
  a run the node finished) is tolerated.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import attrs
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from dispatcher import wire as p
from tests.test_wire import message_strategy

RECENT = 3
"""A small memory, so that forgetting finished runs and tunnels is exercised."""
ABANDONED = 4
"""A small bound on runs (tunnels) ended before their end, so that forgetting them is
exercised too."""
HELLO = p.Hello(protocol=p.PROTOCOL_VERSION, node_id="n")
WELCOME = p.Welcome(protocol=p.PROTOCOL_VERSION, generation=1, heartbeat_interval=5.0)
RUN_KINDS = (
    p.RunStarted,
    p.RunDelta,
    p.RunEmbeddings,
    p.RunUsage,
    p.RunCompleted,
    p.RunFailed,
    p.RunCancelled,
)
USAGE = p.Usage(prompt_tokens=1, completion_tokens=1)
VECTOR = p.encode_vector([0.5, -0.25])


def run_event(kind: type[Any], run_id: str, seq: int, index: int = 0) -> p.RunEvent:
    """An event of ``kind``; a ``run.embeddings`` starts at vector ``index`` and carries
    ``index % 3`` vectors (none, one or two)."""
    if kind is p.RunEmbeddings:
        return p.RunEmbeddings(run_id=run_id, seq=seq, index=index, vectors=(VECTOR,) * (index % 3))
    if kind is p.RunUsage:
        return p.RunUsage(run_id=run_id, seq=seq, usage=USAGE)
    if kind is p.RunFailed:
        return p.RunFailed(run_id=run_id, seq=seq, code="x", message="y")
    event: p.RunEvent = kind(run_id=run_id, seq=seq)
    return event


def mostly(usual: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``usual`` four times in five, else ``rare`` (so sessions live long enough to matter)."""
    return st.integers(0, 4).flatmap(lambda n: rare if n == 0 else usual)


@attrs.define
class ModelRun:
    next_seq: int = 0
    terminal: bool = False
    vectors: int = 0
    """Vectors its ``run.embeddings`` carried so far: the next one's ``index``."""


@attrs.define
class ModelTunnel:
    started: bool = False
    ended: bool = False
    body_left: int = 0
    """Request body bytes the edge announced and has not sent yet."""


@attrs.define
class ModelEnded:
    """What the edge must remember of the runs (tunnels) it stopped routing: the last RECENT
    finished ones, and every one ended before its end until that end arrives (at most
    ABANDONED, oldest forgotten first)."""

    finished: list[str] = attrs.Factory(list)
    abandoned: list[str] = attrs.Factory(list)

    def close(self, key: str, *, finished: bool) -> str | None:
        """The edge closed ``key``; returns the id the machine must say it forgot."""
        memory, limit = (self.finished, RECENT) if finished else (self.abandoned, ABANDONED)
        memory.append(key)
        return memory.pop(0) if len(memory) > limit else None

    def late(self, key: str, *, end: bool) -> bool | None:
        if key in self.abandoned:
            if end:
                self.abandoned.remove(key)
                self.close(key, finished=True)
            return True
        return False if key in self.finished else None


class HostileNode(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sessions = 0
        self.fresh()

    def fresh(self) -> None:
        """A new session: a new machine, an empty model."""
        self.sessions += 1
        self.edge = p.EdgeProtocol(
            recent_runs=RECENT, recent_tunnels=RECENT, max_abandoned=ABANDONED
        )
        self.ids = itertools.count()
        self.given_runs: set[str] = set()
        self.given_tunnels: set[str] = set()
        self.runs: dict[str, ModelRun] = {}
        self.ended_runs = ModelEnded()
        self.tunnels: dict[str, ModelTunnel] = {}
        self.ended_tunnels = ModelEnded()
        self.failure: p.ProtocolError | None = None
        self.draining = False
        """The model: the node said node.draining (one way: nothing undoes it)."""

    @initialize(handshake=mostly(st.just(True), st.just(False)))
    def start(self, handshake: bool) -> None:
        self.handshake(handshake)

    def handshake(self, handshake: bool) -> None:
        self.open = handshake
        if handshake:
            assert self.edge.receive(HELLO) is p.ACCEPTED
            self.edge.send(WELCOME)

    @rule(handshake=mostly(st.just(True), st.just(False)))
    def node_reconnects_after_its_violation(self, handshake: bool) -> None:
        """The violation closed the session; the node dials again (a new machine)."""
        if self.failure is None:
            return
        self.fresh()
        self.handshake(handshake)

    # ------------------------------------------------------------------ the edge's moves

    @rule()
    def edge_gives_a_run(self) -> None:
        if not self.open or self.failure is not None:
            return
        run_id = f"run-{next(self.ids)}"
        self.edge.send(
            p.RunRequest(run_id=run_id, provider_id="p", model="m", served_model="m", body={})
        )
        self.given_runs.add(run_id)
        self.runs[run_id] = ModelRun()

    @rule(data=st.data())
    def edge_ends_a_run(self, data: st.DataObject) -> None:
        if not self.runs:
            return
        run_id = data.draw(st.sampled_from(sorted(self.runs)))
        run = self.runs.pop(run_id)
        forgotten = self.edge.close_run(run_id)
        assert forgotten == self.ended_runs.close(run_id, finished=run.terminal)

    @rule(data=st.data())
    def edge_sends_request_body_bytes(self, data: st.DataObject) -> None:
        """Legal for an open tunnel up to what its request announced; anything more, or for
        a tunnel not open here, is the edge's own bug (LocalProtocolError)."""
        if not self.open or self.failure is not None:
            return
        known = sorted(self.given_tunnels) or ["never-given"]
        tunnel_id = data.draw(st.sampled_from(known))
        tunnel = self.tunnels.get(tunnel_id)
        left = tunnel.body_left if tunnel is not None else 0
        size = data.draw(mostly(st.integers(0, left), st.integers(0, left + 3)))
        frame = p.TunnelData(tunnel_id, b"u" * size)
        if tunnel is None or size > left:
            try:
                self.edge.send(frame)
            except p.LocalProtocolError:
                return
            raise AssertionError("body bytes past the announced size were let through")
        self.edge.send(frame)
        tunnel.body_left -= size
        assert self.edge.body_left(tunnel_id) == tunnel.body_left

    @rule(body_size=mostly(st.just(0), st.integers(1, 9)))
    def edge_gives_a_tunnel(self, body_size: int) -> None:
        if not self.open or self.failure is not None:
            return
        tunnel_id = f"tun-{next(self.ids)}"
        self.edge.send(
            p.TunnelRequest(
                tunnel_id=tunnel_id, provider_id="p", method="POST", path="/", body_size=body_size
            )
        )
        self.given_tunnels.add(tunnel_id)
        self.tunnels[tunnel_id] = ModelTunnel(body_left=body_size)

    @rule(data=st.data())
    def edge_ends_a_tunnel(self, data: st.DataObject) -> None:
        if not self.tunnels:
            return
        tunnel_id = data.draw(st.sampled_from(sorted(self.tunnels)))
        tunnel = self.tunnels.pop(tunnel_id)
        forgotten = self.edge.close_tunnel(tunnel_id)
        assert forgotten == self.ended_tunnels.close(tunnel_id, finished=tunnel.ended)

    # ------------------------------------------------------------------ the node's frames

    def ids_of(self, given: set[str]) -> st.SearchStrategy[str]:
        """Mostly an id the edge gave (open or ended), sometimes any other."""
        others = st.just("stranger") | st.text(max_size=4)
        if not given:
            return others
        return mostly(st.sampled_from(sorted(given)), others)

    @precondition(lambda self: self.given_runs)
    @rule(data=st.data(), kind=st.sampled_from(RUN_KINDS))
    def node_sends_a_run_event(self, data: st.DataObject, kind: type[Any]) -> None:
        run_id = data.draw(self.ids_of(self.given_runs))
        run = self.runs.get(run_id)
        near = run.next_seq if run is not None else 0
        seq = data.draw(mostly(st.just(near), st.sampled_from([near - 1, near + 1, -1, 0])))
        vectors = run.vectors if run is not None else 0
        index = data.draw(mostly(st.just(vectors), st.sampled_from([vectors - 1, vectors + 1])))
        self.feed(run_event(kind, run_id, seq, index))

    @precondition(lambda self: self.given_tunnels)
    @rule(data=st.data(), kind=st.sampled_from(["start", "data", "end"]))
    def node_sends_a_tunnel_frame(self, data: st.DataObject, kind: str) -> None:
        tunnel_id = data.draw(self.ids_of(self.given_tunnels))
        frame: p.Frame
        if kind == "start":
            frame = p.TunnelStart(tunnel_id=tunnel_id, status=200)
        elif kind == "data":
            frame = p.TunnelData(tunnel_id, data.draw(st.binary(max_size=8)))
        else:
            frame = p.TunnelEnd(tunnel_id=tunnel_id)
        self.feed(frame)

    @rule(message=st.sampled_from(p.MESSAGE_TYPES).flatmap(message_strategy))
    def node_sends_any_message(self, message: p.Message) -> None:
        self.feed(message)

    @rule(frame=st.binary(max_size=64) | st.text(max_size=64))
    def node_sends_any_frame(self, frame: bytes | str) -> None:
        try:
            message = p.decode_binary(frame) if isinstance(frame, bytes) else p.decode(frame)
        except p.ProtocolError:
            return  # the codec's refusal is the session's one error; nothing reaches the machine
        self.feed(message)

    # ------------------------------------------------------------------ judging

    def feed(self, message: p.Frame) -> None:
        verdict = self.edge.receive(message)  # must not raise
        assert isinstance(verdict, p.Accepted | p.Tolerated | p.ProtocolError)
        event(f"{type(message).__name__}: {type(verdict).__name__}")
        if self.failure is not None:
            assert verdict is self.failure, "the first violation is final"
            self.fresh()  # the session was closed for it; the node dials again
            self.handshake(True)
            return
        expected = self.predict(message)
        if expected is p.ProtocolError:
            assert isinstance(verdict, p.ProtocolError), (message, verdict)
            assert str(verdict)
            self.failure = verdict
        else:
            assert isinstance(verdict, expected), (message, verdict)

    def predict(self, message: p.Frame) -> type[Any]:
        """The reference model: which verdict ``message`` deserves now (and its effect)."""
        if not self.open:
            if isinstance(message, p.Hello) and message.protocol == p.PROTOCOL_VERSION:
                self.edge.send(WELCOME)  # the driver answers; the model follows
                self.open = True
                return p.Accepted
            return p.ProtocolError
        if isinstance(message, RUN_KINDS):
            run = self.runs.get(message.run_id)
            if run is None:
                late = self.ended_runs.late(
                    message.run_id, end=isinstance(message, p.TERMINAL_EVENTS)
                )
                return p.Tolerated if late else p.ProtocolError
            if run.terminal or message.seq != run.next_seq:
                return p.ProtocolError
            if isinstance(message, p.RunEmbeddings):
                if message.index != run.vectors:
                    return p.ProtocolError
                run.vectors += len(message.vectors)
            run.next_seq += 1
            run.terminal = isinstance(message, p.TERMINAL_EVENTS)
            return p.Accepted
        if isinstance(message, p.TunnelData | p.TunnelStart | p.TunnelEnd):
            tunnel = self.tunnels.get(message.tunnel_id)
            if tunnel is None:
                late = self.ended_tunnels.late(
                    message.tunnel_id, end=isinstance(message, p.TunnelEnd)
                )
                if late is None:
                    return p.ProtocolError
                if late:
                    return p.Tolerated
                tunnel = ModelTunnel(started=True, ended=True)
            if tunnel.ended:
                return p.ProtocolError
            if isinstance(message, p.TunnelStart):
                if tunnel.started:
                    return p.ProtocolError
                tunnel.started = True
            elif isinstance(message, p.TunnelEnd):
                tunnel.ended = True
            elif not tunnel.started:
                return p.ProtocolError
            return p.Accepted
        if isinstance(message, p.NodeDraining):
            self.draining = True
            return p.Accepted
        if isinstance(message, p.Pong | p.Capacity):
            return p.Accepted
        return p.ProtocolError

    @invariant()
    def draining_is_what_the_node_said(self) -> None:
        assert self.edge.node_draining == self.draining

    @invariant()
    def no_state_for_what_was_not_given(self) -> None:
        assert self.edge.known_runs() <= self.given_runs
        assert self.edge.known_tunnels() <= self.given_tunnels
        assert len(self.edge.known_runs()) <= len(self.runs) + RECENT + ABANDONED

    @invariant()
    def failed_means_failed(self) -> None:
        assert (self.edge.state is p.State.FAILED) == (self.failure is not None)
        assert self.edge.error is self.failure


TestHostileNode = HostileNode.TestCase
TestHostileNode.settings = settings(settings(), stateful_step_count=60)


# --------------------------------------------------------------------------- hostile edge


class HostileEdge(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fresh()

    def fresh(self) -> None:
        """A new session: a new machine, an empty model."""
        self.node = p.NodeProtocol()
        self.hello_sent = False
        self.open = False
        self.requested_runs: set[str] = set()
        """Every run id a ``run.request`` fed to the machine named (accepted or not)."""
        self.requested_tunnels: set[str] = set()
        self.runs: dict[str, int] = {}
        """The model: runs running on the node, and the seq of their next event."""
        self.vectors: dict[str, int] = {}
        """The model: the next ``run.embeddings`` index of the runs that sent some."""
        self.tunnels: dict[str, bool] = {}
        """The model: tunnels open on the node, and whether they started."""
        self.body_left: dict[str, int] = {}
        """The model: open tunnels' request body bytes announced and not received yet."""
        self.failure: p.ProtocolError | None = None
        self.edge_draining = False
        """The model: the edge said edge.draining (one way)."""

    @initialize(steps=mostly(st.just(2), st.sampled_from([0, 1])))
    def start(self, steps: int) -> None:
        self.handshake(steps)

    def handshake(self, steps: int) -> None:
        """The node's hello (``steps`` >= 1) and the edge's welcome (2)."""
        if steps >= 1:
            self.node.send(HELLO)
            self.hello_sent = True
        if steps >= 2:
            assert self.node.receive(WELCOME) is p.ACCEPTED
            self.open = True

    @rule(steps=mostly(st.just(2), st.sampled_from([0, 1])))
    def node_reconnects_after_the_violation(self, steps: int) -> None:
        """The node closed the session for the violation and dials again (a new machine)."""
        if self.failure is None:
            return
        self.fresh()
        self.handshake(steps)

    # ------------------------------------------------------------------ the edge's frames

    def ids_of(self, known: set[str]) -> st.SearchStrategy[str]:
        """Mostly an id the edge used before (running or ended), sometimes a new one."""
        fresh = st.text(max_size=4) | st.sampled_from(["r", "t", "stranger"])
        if not known:
            return fresh
        return mostly(st.sampled_from(sorted(known)), fresh)

    @rule(version=mostly(st.just(p.PROTOCOL_VERSION), st.integers(-1, 3)))
    def edge_welcomes(self, version: int) -> None:
        """Legal once, after the hello; a violation before it, or again."""
        self.feed(p.Welcome(protocol=version, generation=3, heartbeat_interval=5.0))

    @rule(data=st.data())
    def edge_gives_a_run(self, data: st.DataObject) -> None:
        run_id = data.draw(self.ids_of(self.requested_runs))
        self.feed(
            p.RunRequest(run_id=run_id, provider_id="p", model="m", served_model="m", body={})
        )

    @rule(
        data=st.data(),
        body_size=mostly(st.just(0), st.integers(-1, 12)),
        body=mostly(st.just(""), st.just("{}")),
    )
    def edge_gives_a_tunnel(self, data: st.DataObject, body_size: int, body: str) -> None:
        tunnel_id = data.draw(self.ids_of(self.requested_tunnels))
        self.feed(
            p.TunnelRequest(
                tunnel_id=tunnel_id,
                provider_id="p",
                method="POST",
                path="/",
                body=body,
                body_size=body_size,
            )
        )

    @rule(data=st.data())
    def edge_cancels_a_run(self, data: st.DataObject) -> None:
        self.feed(p.RunCancel(run_id=data.draw(self.ids_of(self.requested_runs))))

    @rule(data=st.data(), kind=st.sampled_from(["credit", "cancel", "data"]))
    def edge_sends_a_tunnel_frame(self, data: st.DataObject, kind: str) -> None:
        tunnel_id = data.draw(self.ids_of(self.requested_tunnels))
        frame: p.Frame
        if kind == "credit":
            frame = p.TunnelCredit(tunnel_id=tunnel_id, bytes=data.draw(st.integers(-2, 9)))
        elif kind == "cancel":
            frame = p.TunnelCancel(tunnel_id=tunnel_id)
        else:
            frame = p.TunnelData(tunnel_id, data.draw(st.binary(max_size=8)))
        self.feed(frame)

    @rule(
        message=mostly(
            st.sampled_from(p.EDGE_MESSAGE_TYPES), st.sampled_from(p.NODE_MESSAGE_TYPES)
        ).flatmap(message_strategy)
    )
    def edge_sends_any_message(self, message: p.Message) -> None:
        self.feed(message)

    @rule(frame=st.binary(max_size=64) | st.text(max_size=64))
    def edge_sends_any_frame(self, frame: bytes | str) -> None:
        try:
            message = p.decode_binary(frame) if isinstance(frame, bytes) else p.decode(frame)
        except p.ProtocolError:
            return  # the codec's refusal is the session's one error; nothing reaches the machine
        self.feed(message)

    # ------------------------------------------------------------------ the node's answers

    @precondition(lambda self: self.runs and self.failure is None)
    @rule(data=st.data(), kind=st.sampled_from(RUN_KINDS))
    def node_answers_a_run(self, data: st.DataObject, kind: type[Any]) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.runs)))
        seq = self.runs[run_id]
        assert self.node.next_seq(run_id) == seq
        index = self.vectors.get(run_id, 0)
        assert self.node.next_vector(run_id) == index
        message = run_event(kind, run_id, seq, index)
        self.node.send(message)  # legal: must not raise
        if kind in p.TERMINAL_EVENTS:
            del self.runs[run_id]
            self.vectors.pop(run_id, None)
        else:
            self.runs[run_id] = seq + 1
        if isinstance(message, p.RunEmbeddings):
            self.vectors[run_id] = index + len(message.vectors)

    @precondition(lambda self: self.runs and self.failure is None)
    @rule(data=st.data(), off=st.sampled_from([-1, 1]))
    def node_may_not_skip_a_vector(self, data: st.DataObject, off: int) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.runs)))
        seq, index = self.runs[run_id], self.vectors.get(run_id, 0) + off
        with pytest.raises(p.LocalProtocolError, match="starts at vector"):
            self.node.send(p.RunEmbeddings(run_id=run_id, seq=seq, index=index))
        assert self.node.next_seq(run_id) == seq  # refused: nothing changed

    @precondition(lambda self: self.tunnels and self.failure is None)
    @rule(data=st.data(), end=st.booleans())
    def node_answers_a_tunnel(self, data: st.DataObject, end: bool) -> None:
        tunnel_id = data.draw(st.sampled_from(sorted(self.tunnels)))
        if end:
            self.node.send(p.TunnelEnd(tunnel_id=tunnel_id))
            del self.tunnels[tunnel_id]
            self.body_left.pop(tunnel_id, None)
        elif self.tunnels[tunnel_id]:
            self.node.send(p.TunnelData(tunnel_id, b"body"))
        else:
            self.node.send(p.TunnelStart(tunnel_id=tunnel_id, status=200))
            self.tunnels[tunnel_id] = True

    # ------------------------------------------------------------------ judging

    def feed(self, message: p.Frame) -> None:
        if isinstance(message, p.RunRequest):
            self.requested_runs.add(message.run_id)
        elif isinstance(message, p.TunnelRequest):
            self.requested_tunnels.add(message.tunnel_id)
        verdict = self.node.receive(message)  # must not raise
        assert isinstance(verdict, p.Accepted | p.Tolerated | p.ProtocolError)
        event(f"{type(message).__name__}: {type(verdict).__name__}")
        if self.failure is not None:
            assert verdict is self.failure, "the first violation is final"
            return
        expected = self.predict(message)
        if issubclass(expected, p.ProtocolError):
            assert type(verdict) is expected, (message, verdict)
            assert str(verdict)
            self.failure = verdict
        else:
            assert isinstance(verdict, expected), (message, verdict)

    def predict(self, message: p.Frame) -> type[Any]:
        """The reference model: which verdict ``message`` deserves now (and its effect)."""
        if not self.open:
            if not self.hello_sent or not isinstance(message, p.Welcome):
                return p.ProtocolError
            if message.protocol != p.PROTOCOL_VERSION:
                return p.UnsupportedVersion
            self.open = True
            return p.Accepted
        if isinstance(message, p.RunRequest):
            if message.run_id in self.runs:
                return p.ProtocolError
            self.runs[message.run_id] = 0
            self.vectors.pop(message.run_id, None)
            return p.Accepted
        if isinstance(message, p.TunnelRequest):
            if message.tunnel_id in self.tunnels or message.body_size < 0:
                return p.ProtocolError
            if message.body_size and message.body:
                return p.ProtocolError
            self.tunnels[message.tunnel_id] = False
            self.body_left[message.tunnel_id] = message.body_size
            return p.Accepted
        if isinstance(message, p.TunnelData) and message.tunnel_id in self.tunnels:
            left = self.body_left[message.tunnel_id]
            if len(message.data) > min(left, p.MAX_TUNNEL_CHUNK):
                return p.ProtocolError
            self.body_left[message.tunnel_id] = left - len(message.data)
            return p.Accepted
        if isinstance(message, p.RunCancel):
            return p.Accepted if message.run_id in self.runs else p.Tolerated
        if isinstance(message, p.TunnelCancel | p.TunnelCredit | p.TunnelData):
            return p.Accepted if message.tunnel_id in self.tunnels else p.Tolerated
        if isinstance(message, p.EdgeDraining):
            self.edge_draining = True
            return p.Accepted
        if isinstance(message, p.Ping | p.Demand):
            return p.Accepted
        return p.ProtocolError  # a second welcome, or any node -> edge message

    @invariant()
    def draining_is_what_the_edge_said(self) -> None:
        assert self.node.edge_draining == self.edge_draining

    @invariant()
    def no_state_for_what_was_not_given(self) -> None:
        assert self.node.running() <= self.requested_runs
        assert self.node.open_tunnels() <= self.requested_tunnels
        if self.failure is None:
            assert self.node.running() == set(self.runs)
            assert self.node.open_tunnels() == set(self.tunnels)
            for tunnel_id, left in self.body_left.items():
                assert self.node.body_left(tunnel_id) == left
            assert self.node.is_idle() == (not self.runs and not self.tunnels)

    @invariant()
    def failed_means_failed(self) -> None:
        assert (self.node.state is p.State.FAILED) == (self.failure is not None)
        assert self.node.error is self.failure
        if self.open and self.failure is None:
            assert self.node.state is p.State.OPEN
            assert self.node.generation in (1, 3)


TestHostileEdge = HostileEdge.TestCase
TestHostileEdge.settings = settings(settings(), stateful_step_count=60)


# --------------------------------------------------------------------------- two halves


@attrs.define
class Pair:
    """An edge half and a node half joined by two in-order queues of encoded frames."""

    edge: p.EdgeProtocol = attrs.Factory(p.EdgeProtocol)
    node: p.NodeProtocol = attrs.Factory(p.NodeProtocol)
    to_node: collections.deque[str | bytes] = attrs.Factory(collections.deque)
    to_edge: collections.deque[str | bytes] = attrs.Factory(collections.deque)
    ids: itertools.count[int] = attrs.Factory(itertools.count)
    edge_runs: set[str] = attrs.Factory(set)
    """Runs the edge routes (not ended on its side)."""
    edge_ended: set[str] = attrs.Factory(set)
    """Runs the edge ended before their terminal: the node's events for them are late."""
    node_runs: dict[str, bool] = attrs.Factory(dict)
    """Runs running on the node: whether the edge asked to cancel."""
    node_tunnels: dict[str, bool] = attrs.Factory(dict)
    """Tunnels open on the node: whether they started."""
    edge_tunnels: set[str] = attrs.Factory(set)
    tolerated: int = 0

    def edge_sends(self, message: p.EdgeMessage | p.TunnelData) -> None:
        self.edge.send(message)
        if isinstance(message, p.TunnelData):
            self.to_node.append(p.encode_tunnel_data(message.tunnel_id, message.data))
        else:
            self.to_node.append(p.encode(message))

    def node_sends(self, message: p.Frame) -> None:
        self.node.send(message)
        if isinstance(message, p.TunnelData):
            self.to_edge.append(p.encode_tunnel_data(message.tunnel_id, message.data))
        else:
            self.to_edge.append(p.encode(message))

    def deliver_to_node(self) -> None:
        frame = self.to_node.popleft()
        message = p.decode_binary(frame) if isinstance(frame, bytes) else p.decode(frame)
        verdict = self.node.receive(message)
        late = (p.RunCancel, p.TunnelCancel, p.TunnelCredit, p.TunnelData)
        if isinstance(message, late) and isinstance(verdict, p.Tolerated):
            self.tolerated += 1  # it crossed the run's (or tunnel's) end
            return
        assert verdict is p.ACCEPTED, (message, verdict)
        if isinstance(message, p.RunRequest):
            self.node_runs[message.run_id] = False
        elif isinstance(message, p.RunCancel):
            self.node_runs[message.run_id] = True
        elif isinstance(message, p.TunnelRequest):
            self.node_tunnels[message.tunnel_id] = False

    def deliver_to_edge(self) -> None:
        frame = self.to_edge.popleft()
        message = p.decode_binary(frame) if isinstance(frame, bytes) else p.decode(frame)
        verdict = self.edge.receive(message)
        if isinstance(message, RUN_KINDS) and message.run_id in self.edge_ended:
            assert isinstance(verdict, p.Tolerated), (message, verdict)
            self.tolerated += 1
            return
        assert verdict is p.ACCEPTED, (message, verdict)
        if isinstance(message, p.TERMINAL_EVENTS):
            # The run's consumer sees its end and closes its subscription.
            self.edge_runs.discard(message.run_id)
            self.edge.close_run(message.run_id)
        elif isinstance(message, p.TunnelEnd):
            self.edge_tunnels.discard(message.tunnel_id)
            self.edge.close_tunnel(message.tunnel_id)


@given(data=st.data())
def test_two_halves_accept_legal_traffic(data: st.DataObject) -> None:
    pair = Pair()
    pair.node_sends(HELLO)
    pair.deliver_to_edge()
    pair.edge_sends(WELCOME)
    pair.deliver_to_node()
    assert pair.edge.state is pair.node.state is p.State.OPEN
    moves = [
        "edge-run",
        "edge-cancel",
        "edge-tunnel",
        "edge-credit",
        "edge-body",
        "edge-ping",
        "node-event",
        "node-tunnel",
        "node-capacity",
        "node-drain",
        "to-node",
        "to-edge",
    ]
    for _ in range(data.draw(st.integers(0, 80), label="steps")):
        move = data.draw(st.sampled_from(moves))
        if move == "edge-run":
            run_id = f"run-{next(pair.ids)}"
            pair.edge_sends(
                p.RunRequest(run_id=run_id, provider_id="p", model="m", served_model="m", body={})
            )
            pair.edge_runs.add(run_id)
        elif move == "edge-cancel" and pair.edge_runs:
            run_id = data.draw(st.sampled_from(sorted(pair.edge_runs)))
            pair.edge_sends(p.RunCancel(run_id=run_id, reason="client left"))
            pair.edge_runs.discard(run_id)
            pair.edge.close_run(run_id)
            pair.edge_ended.add(run_id)
        elif move == "edge-tunnel":
            tunnel_id = f"tun-{next(pair.ids)}"
            body_size = data.draw(st.sampled_from([0, 0, 5, 70_000]))
            pair.edge_sends(
                p.TunnelRequest(
                    tunnel_id=tunnel_id,
                    provider_id="p",
                    method="POST",
                    path="/",
                    body_size=body_size,
                )
            )
            pair.edge_tunnels.add(tunnel_id)
        elif move == "edge-body" and pair.edge_tunnels:
            # The request body follows its tunnel.request in pieces of at most a chunk,
            # whether or not the node has ended the tunnel by now (then they are late).
            tunnel_id = data.draw(st.sampled_from(sorted(pair.edge_tunnels)))
            left = pair.edge.body_left(tunnel_id)
            if left:
                size = data.draw(st.integers(1, min(left, p.MAX_TUNNEL_CHUNK)))
                pair.edge_sends(p.TunnelData(tunnel_id, b"b" * size))
        elif move == "edge-credit" and pair.edge_tunnels:
            tunnel_id = data.draw(st.sampled_from(sorted(pair.edge_tunnels)))
            pair.edge_sends(p.TunnelCredit(tunnel_id=tunnel_id, bytes=8))
        elif move == "edge-ping":
            pair.edge_sends(p.Ping(nonce=next(pair.ids)))
        elif move == "node-event" and pair.node_runs:
            run_id = data.draw(st.sampled_from(sorted(pair.node_runs)))
            seq = pair.node.next_seq(run_id)
            assert seq is not None
            if pair.node_runs[run_id]:
                kind: type[Any] = p.RunCancelled  # it was asked to cancel: it confirms
            else:
                kind = data.draw(st.sampled_from(RUN_KINDS))
            pair.node_sends(run_event(kind, run_id, seq, pair.node.next_vector(run_id)))
            if kind in (p.RunCompleted, p.RunFailed, p.RunCancelled):
                del pair.node_runs[run_id]
        elif move == "node-tunnel" and pair.node_tunnels:
            tunnel_id = data.draw(st.sampled_from(sorted(pair.node_tunnels)))
            if not pair.node_tunnels[tunnel_id] and data.draw(st.booleans()):
                pair.node_sends(p.TunnelStart(tunnel_id=tunnel_id, status=200))
                pair.node_tunnels[tunnel_id] = True
            elif pair.node_tunnels[tunnel_id] and data.draw(st.booleans()):
                pair.node_sends(p.TunnelData(tunnel_id, b"body"))
            else:
                pair.node_sends(p.TunnelEnd(tunnel_id=tunnel_id))
                del pair.node_tunnels[tunnel_id]
        elif move == "node-capacity":
            pair.node_sends(p.Capacity(provider_id="p", model="m", slots=1))
        elif move == "node-drain":
            # From here the node refuses what it is given, but the edge's run.requests
            # that cross the message are still legal: the node answers them (run.failed).
            pair.node_sends(p.NodeDraining(grace=1.0))
            assert pair.node.node_draining
        elif move == "to-node" and pair.to_node:
            pair.deliver_to_node()
        elif move == "to-edge" and pair.to_edge:
            pair.deliver_to_edge()
    while pair.to_node or pair.to_edge:
        if pair.to_node:
            pair.deliver_to_node()
        if pair.to_edge:
            pair.deliver_to_edge()
    assert pair.edge.state is pair.node.state is p.State.OPEN
    assert pair.edge.node_draining == pair.node.node_draining
