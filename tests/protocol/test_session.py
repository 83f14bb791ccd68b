"""The session state machine, rule by rule, with no event loop (h11's test_connection.py is
the model): what each side may send in which state, per run and per tunnel."""

from __future__ import annotations

import pytest

from dispatcher import wire
from dispatcher import wire as p

HELLO = p.Hello(protocol=p.PROTOCOL_VERSION, node_id="n")
WELCOME = p.Welcome(protocol=p.PROTOCOL_VERSION, generation=1, heartbeat_interval=5.0)


def open_edge(
    recent_runs: int = p.RECENT_RUNS, max_abandoned: int = p.MAX_ABANDONED
) -> p.EdgeProtocol:
    edge = p.EdgeProtocol(recent_runs=recent_runs, max_abandoned=max_abandoned)
    assert edge.receive(HELLO) is p.ACCEPTED
    edge.send(WELCOME)
    assert edge.state is p.State.OPEN
    return edge


def open_node() -> p.NodeProtocol:
    node = p.NodeProtocol()
    node.send(HELLO)
    assert node.receive(WELCOME) is p.ACCEPTED
    assert node.state is p.State.OPEN
    assert node.generation == 1
    return node


def error(verdict: p.Verdict) -> str:
    assert isinstance(verdict, p.ProtocolError), verdict
    return str(verdict)


def test_wire_is_the_protocol_package() -> None:
    assert wire.RunDelta is p.RunDelta
    assert wire.ProtocolError is p.ProtocolError
    assert wire.decode is p.decode
    assert set(wire.__all__) == set(p.__all__)
    for name in p.__all__:
        assert getattr(wire, name) is getattr(p, name)


# --------------------------------------------------------------------------- handshake


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        (p.Pong(nonce=1), "expected hello, got 'pong'"),
        (p.RunDelta(run_id="r", seq=0), "expected hello, got 'run.delta'"),
        (p.TunnelData("t", b"x"), "expected hello, got a binary frame"),
        (
            p.Hello(protocol=99, node_id="n"),
            "protocol version 99 is not supported (this edge speaks 3): run the same "
            "trio-dispatcher release on the edges and their nodes",
        ),
    ],
)
def test_edge_wants_a_hello_first(first: p.Frame, reason: str) -> None:
    edge = p.EdgeProtocol()
    assert error(edge.receive(first)) == reason
    assert edge.state is p.State.FAILED


def test_edge_before_its_welcome() -> None:
    edge = p.EdgeProtocol()
    assert edge.receive(HELLO) is p.ACCEPTED
    assert edge.hello == HELLO
    assert edge.state is p.State.AWAITING_WELCOME
    with pytest.raises(p.LocalProtocolError, match="'ping' while awaiting welcome"):
        edge.send(p.Ping(nonce=1))
    assert error(edge.receive(p.Pong(nonce=1))) == "'pong' before the edge's welcome"


def test_edge_may_not_send_node_messages_or_a_second_welcome() -> None:
    edge = open_edge()
    with pytest.raises(p.LocalProtocolError, match="not the edge's to send"):
        edge.send(p.Pong(nonce=1))
    with pytest.raises(p.LocalProtocolError):
        edge.send(WELCOME)


@pytest.mark.parametrize("message", [HELLO, WELCOME, p.Ping(nonce=1), p.RunCancel(run_id="r")])
def test_edge_refuses_what_a_node_may_not_send_when_open(message: p.Message) -> None:
    edge = open_edge()
    assert error(edge.receive(message)) == f"unexpected {message.TYPE!r} message from a node"


def test_control_messages_and_draining() -> None:
    edge = open_edge()
    assert edge.receive(p.Pong(nonce=3)) is p.ACCEPTED
    assert edge.receive(p.Capacity(provider_id="p", model="m", slots=2)) is p.ACCEPTED
    assert [edge.node_draining] == [False]
    assert edge.receive(p.NodeDraining(grace=1.0)) is p.ACCEPTED
    assert edge.receive(p.NodeDraining(grace=1.0)) is p.ACCEPTED
    assert edge.node_draining
    edge.send(p.EdgeDraining(grace=2.0))
    assert edge.edge_draining


# --------------------------------------------------------------------------- runs


def test_a_run_seq_0_1_2_then_one_terminal() -> None:
    edge = open_edge()
    edge.send(p.RunRequest(run_id="r", provider_id="p", model="m", served_model="m", body={}))
    assert edge.next_seq("r") == 0
    events: list[p.RunEvent] = [
        p.RunStarted(run_id="r", seq=0),
        p.RunDelta(run_id="r", seq=1, text="a"),
        p.RunUsage(run_id="r", seq=2, usage=p.Usage(prompt_tokens=1, completion_tokens=1)),
        p.RunCompleted(run_id="r", seq=3),
    ]
    for seq, event in enumerate(events):
        assert edge.next_seq("r") == seq
        assert edge.receive(event) is p.ACCEPTED
    assert edge.next_seq("r") is None
    assert error(edge.receive(p.RunDelta(run_id="r", seq=4))) == (
        "event 'run.delta' for run 'r' after its terminal event"
    )


def request(run_id: str) -> p.RunRequest:
    return p.RunRequest(run_id=run_id, provider_id="p", model="m", served_model="m", body={})


@pytest.mark.parametrize(
    ("seqs", "reason"),
    [
        ([0, 2], "has seq 2, expected 1"),
        ([0, 1, 1], "has seq 1, expected 2"),
        ([1], "has seq 1, expected 0"),
        ([-1], "has seq -1, expected 0"),
        ([0, 0], "has seq 0, expected 1"),
    ],
)
def test_seq_gaps_and_repeats_are_violations(seqs: list[int], reason: str) -> None:
    edge = open_edge()
    edge.send(request("r"))
    *good, bad = seqs
    for seq in good:
        assert edge.receive(p.RunDelta(run_id="r", seq=seq)) is p.ACCEPTED
    assert error(edge.receive(p.RunDelta(run_id="r", seq=bad))) == (
        f"event 'run.delta' for run 'r' {reason}"
    )


def test_a_run_not_given_is_a_violation_and_leaves_no_state() -> None:
    edge = open_edge()
    reason = error(edge.receive(p.RunCompleted(run_id="x", seq=0)))
    assert reason == "event 'run.completed' for run 'x', which this session was not given"
    assert edge.known_runs() == set()


def test_the_first_violation_is_final() -> None:
    edge = open_edge()
    edge.send(request("r"))
    first = edge.receive(p.RunDelta(run_id="r", seq=5))
    assert isinstance(first, p.ProtocolError)
    assert edge.receive(p.RunDelta(run_id="r", seq=0)) is first
    assert edge.receive(p.Pong(nonce=1)) is first
    assert edge.state is p.State.FAILED
    edge.send(p.RunCancel(run_id="r"))  # the driver may still post while tearing down


def test_late_events_of_a_run_the_edge_ended_are_tolerated() -> None:
    edge = open_edge()
    edge.send(request("r"))
    assert edge.receive(p.RunStarted(run_id="r", seq=0)) is p.ACCEPTED
    edge.send(p.RunCancel(run_id="r"))
    assert edge.close_run("r") is None
    for late in (p.RunDelta(run_id="r", seq=1), p.RunCancelled(run_id="r", seq=99)):
        assert isinstance(edge.receive(late), p.Tolerated)
    assert edge.state is p.State.OPEN


def test_a_run_closed_after_its_terminal_stays_strict() -> None:
    edge = open_edge()
    edge.send(request("r"))
    assert edge.receive(p.RunCompleted(run_id="r", seq=0)) is p.ACCEPTED
    edge.close_run("r")
    assert "after its terminal" in error(edge.receive(p.RunDelta(run_id="r", seq=1)))


def test_runs_ended_early_are_remembered_until_their_terminal_however_many() -> None:
    """The regression: 5,000 clients leaving at once ended more runs than the finished-run
    memory holds, the edge forgot some while the node was still streaming them, and the
    node's next delta closed the whole session as a protocol error."""
    edge = open_edge(recent_runs=2)
    for run_id in "abcde":
        edge.send(request(run_id))
    for run_id in "abcde":
        assert edge.close_run(run_id) is None  # ended early: kept, past recent_runs
    assert edge.known_runs() == set("abcde")
    for run_id in "abcde":
        assert isinstance(edge.receive(p.RunDelta(run_id=run_id, seq=0)), p.Tolerated)
    assert isinstance(edge.receive(p.RunCancelled(run_id="a", seq=1)), p.Tolerated)
    # Its terminal arrived: anything more for it is a violation.
    assert "after its terminal" in error(edge.receive(p.RunDelta(run_id="a", seq=2)))


def test_finished_runs_are_remembered_within_a_bound() -> None:
    edge = open_edge(recent_runs=2)
    for run_id in "abc":
        edge.send(request(run_id))
        assert edge.receive(p.RunCompleted(run_id=run_id, seq=0)) is p.ACCEPTED
    assert edge.close_run("a") is None
    assert edge.close_run("b") is None
    assert edge.close_run("c") == "a"  # forgotten: the oldest finished one
    assert edge.close_run("c") is None  # closing twice is harmless
    assert edge.known_runs() == {"b", "c"}
    assert "after its terminal" in error(edge.receive(p.RunDelta(run_id="b", seq=1)))


def test_runs_ended_early_are_remembered_within_their_own_bound() -> None:
    edge = open_edge(max_abandoned=2)
    for run_id in "abc":
        edge.send(request(run_id))
    assert edge.close_run("a") is None
    assert edge.close_run("b") is None
    assert edge.close_run("c") == "a"  # a node ignoring that many cancels: oldest forgotten
    assert edge.known_runs() == {"b", "c"}
    assert isinstance(edge.receive(p.RunDelta(run_id="b", seq=0)), p.Tolerated)
    assert "was not given" in error(edge.receive(p.RunDelta(run_id="a", seq=0)))


def test_run_ids_are_used_once() -> None:
    edge = open_edge()
    edge.send(request("r"))
    with pytest.raises(p.LocalProtocolError, match="already used"):
        edge.send(request("r"))
    edge.close_run("r")
    with pytest.raises(p.LocalProtocolError, match="already used"):
        edge.send(request("r"))


def test_after_close_everything_is_tolerated() -> None:
    edge = open_edge()
    edge.send(request("r"))
    edge.close()
    assert edge.state is p.State.CLOSED
    assert isinstance(edge.receive(p.RunDelta(run_id="r", seq=7)), p.Tolerated)
    assert isinstance(edge.receive(HELLO), p.Tolerated)
    edge.send(request("s"))  # dropped by the driver
    assert edge.known_runs() == {"r"}


# --------------------------------------------------------------------------- tunnels


def tunnel(tunnel_id: str = "t") -> p.TunnelRequest:
    return p.TunnelRequest(tunnel_id=tunnel_id, provider_id="p", method="POST", path="/v1/x")


def test_a_tunnel_start_body_end() -> None:
    edge = open_edge()
    edge.send(tunnel())
    assert edge.receive(p.TunnelStart(tunnel_id="t", status=200)) is p.ACCEPTED
    assert edge.receive(p.TunnelData("t", b"abc")) is p.ACCEPTED
    assert edge.receive(p.TunnelData("t", b"")) is p.ACCEPTED
    assert edge.receive(p.TunnelEnd(tunnel_id="t")) is p.ACCEPTED


def test_a_tunnel_may_end_without_starting() -> None:
    edge = open_edge()
    edge.send(tunnel())
    assert edge.receive(p.TunnelEnd(tunnel_id="t", error="unknown_provider: p")) is p.ACCEPTED


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([p.TunnelData("t", b"x")], "tunnel 't': body frame before tunnel.start"),
        (
            [p.TunnelStart(tunnel_id="t", status=200), p.TunnelStart(tunnel_id="t", status=200)],
            "tunnel 't': tunnel.start after the response started or ended",
        ),
        (
            [p.TunnelEnd(tunnel_id="t"), p.TunnelData("t", b"x")],
            "tunnel 't': body frame after tunnel.end",
        ),
        (
            [p.TunnelEnd(tunnel_id="t"), p.TunnelEnd(tunnel_id="t")],
            "tunnel 't': a second tunnel.end",
        ),
        (
            [p.TunnelData("u", b"x")],
            "binary frame for no open tunnel: 'u' was not given to this session",
        ),
        (
            [p.TunnelStart(tunnel_id="u", status=200)],
            "'tunnel.start' for no open tunnel: 'u' was not given to this session",
        ),
    ],
)
def test_tunnel_order_violations(frames: list[p.Frame], reason: str) -> None:
    edge = open_edge()
    edge.send(tunnel())
    *good, bad = frames
    for frame in good:
        assert edge.receive(frame) is p.ACCEPTED
    assert error(edge.receive(bad)) == reason


def test_late_frames_of_a_tunnel_the_edge_ended_are_tolerated() -> None:
    edge = open_edge()
    edge.send(tunnel())
    assert edge.receive(p.TunnelStart(tunnel_id="t", status=200)) is p.ACCEPTED
    edge.send(p.TunnelCancel(tunnel_id="t"))
    edge.close_tunnel("t")
    assert isinstance(edge.receive(p.TunnelData("t", b"x")), p.Tolerated)
    assert isinstance(edge.receive(p.TunnelEnd(tunnel_id="t", error="cancelled")), p.Tolerated)


def test_a_tunnel_closed_after_its_end_stays_strict() -> None:
    edge = open_edge()
    edge.send(tunnel())
    assert edge.receive(p.TunnelEnd(tunnel_id="t")) is p.ACCEPTED
    edge.close_tunnel("t")
    assert error(edge.receive(p.TunnelEnd(tunnel_id="t"))) == "tunnel 't': a second tunnel.end"


# --------------------------------------------------------------------------- the node's half


def test_node_wants_a_welcome_after_its_hello() -> None:
    node = p.NodeProtocol()
    with pytest.raises(p.LocalProtocolError, match="before hello"):
        node.send(p.Pong(nonce=1))
    node.send(HELLO)
    with pytest.raises(p.LocalProtocolError, match="before the welcome"):
        node.send(p.Pong(nonce=1))
    assert error(node.receive(p.Ping(nonce=1))) == "expected welcome, got 'ping'"


def test_node_refuses_another_protocol_version() -> None:
    node = p.NodeProtocol()
    node.send(HELLO)
    welcome = p.Welcome(protocol=1, generation=1, heartbeat_interval=1.0)
    verdict = node.receive(welcome)
    assert isinstance(verdict, p.UnsupportedVersion)  # reconnecting cannot help
    assert error(verdict) == (
        "protocol version 1 is not supported (this node speaks 3): run the same "
        "trio-dispatcher release on the edges and their nodes"
    )
    assert node.welcome is None
    assert node.generation is None


def test_edge_refuses_another_protocol_version_as_unsupported() -> None:
    edge = p.EdgeProtocol()
    verdict = edge.receive(p.Hello(protocol=99, node_id="n"))
    assert isinstance(verdict, p.UnsupportedVersion)
    assert edge.hello is None
    assert edge.receive(HELLO) is verdict  # final


def test_node_keeps_the_welcome() -> None:
    node = open_node()
    assert node.welcome == WELCOME
    assert node.is_idle()
    assert node.receive(tunnel()) is p.ACCEPTED
    assert node.receive(request("r")) is p.ACCEPTED
    assert (node.running(), node.open_tunnels(), node.is_idle()) == ({"r"}, {"t"}, False)
    node.send(p.RunFailed(run_id="r", seq=0, code="x", message="y"))
    node.send(p.TunnelEnd(tunnel_id="t"))
    assert (node.running(), node.open_tunnels(), node.is_idle()) == (set(), set(), True)


def test_node_sends_seq_in_order_and_one_terminal() -> None:
    node = open_node()
    assert node.receive(request("r")) is p.ACCEPTED
    node.send(p.RunStarted(run_id="r", seq=0))
    with pytest.raises(p.LocalProtocolError, match="seq 2, expected 1"):
        node.send(p.RunDelta(run_id="r", seq=2))
    node.send(p.RunDelta(run_id="r", seq=1))
    node.send(p.RunCompleted(run_id="r", seq=2))
    assert node.running() == set()
    with pytest.raises(p.LocalProtocolError, match="not running here"):
        node.send(p.RunDelta(run_id="r", seq=3))
    # A cancel crossing the terminal is late, not wrong.
    assert isinstance(node.receive(p.RunCancel(run_id="r")), p.Tolerated)


def test_node_refuses_a_duplicate_run_and_edge_only_messages_from_the_edge() -> None:
    node = open_node()
    assert node.receive(request("r")) is p.ACCEPTED
    assert error(node.receive(request("r"))) == "run.request for run 'r', which is running"
    node = open_node()
    assert error(node.receive(p.Pong(nonce=1))) == "unexpected 'pong' message from the edge"


def test_node_tunnel_order() -> None:
    node = open_node()
    assert node.receive(tunnel()) is p.ACCEPTED
    with pytest.raises(p.LocalProtocolError, match=r"body frame before tunnel\.start"):
        node.send(p.TunnelData("t", b"x"))
    node.send(p.TunnelStart(tunnel_id="t", status=200))
    with pytest.raises(p.LocalProtocolError, match=r"a second tunnel\.start"):
        node.send(p.TunnelStart(tunnel_id="t", status=200))
    assert node.receive(p.TunnelCredit(tunnel_id="t", bytes=10)) is p.ACCEPTED
    node.send(p.TunnelData("t", b"x"))
    node.send(p.TunnelEnd(tunnel_id="t"))
    assert isinstance(node.receive(p.TunnelCancel(tunnel_id="t")), p.Tolerated)
    with pytest.raises(p.LocalProtocolError, match="not open"):
        node.send(p.TunnelEnd(tunnel_id="t"))
