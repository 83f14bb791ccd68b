"""Embeddings on the wire: ``run.request.route``, ``run.embeddings`` through the codec, the
vectors' encoding, the inputs of a body, and the state machines' rule that a run's vectors
continue one another (the fuzz tests drive the same rule at random)."""

from __future__ import annotations

import base64
import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher import wire as p
from tests.protocol.test_session import error, open_edge, open_node


def give(edge: p.EdgeProtocol, run_id: str = "r", route: p.RouteName = "embeddings") -> None:
    body = {"model": "m", "input": ["a", "b", "c"]}
    edge.send(
        p.RunRequest(
            run_id=run_id, provider_id="p", model="m", served_model="m", body=body, route=route
        )
    )


def embeddings(run_id: str, seq: int, index: int, count: int) -> p.RunEmbeddings:
    return p.RunEmbeddings(
        run_id=run_id, seq=seq, index=index, vectors=(p.encode_vector([1.0]),) * count
    )


def test_run_request_route_round_trips_and_defaults_to_chat() -> None:
    request = p.RunRequest(
        run_id="r", provider_id="p", model="m", served_model="s", body={"input": "hi"}
    )
    assert request.route == "chat"
    decoded = p.decode(p.encode(request))
    assert decoded == request
    embed = p.RunRequest(
        run_id="r", provider_id="p", model="m", served_model="s", body={}, route="embeddings"
    )
    assert p.decode(p.encode(embed)) == embed


def test_run_embeddings_round_trips() -> None:
    event = p.RunEmbeddings(
        run_id="r", seq=1, index=2, vectors=(p.encode_vector([0.5, -1.0]), "AAAAAA==")
    )
    assert p.decode(p.encode(event)) == event
    assert p.RunEmbeddings in p.RUN_EVENT_TYPES
    assert not p.is_terminal(event)


@pytest.mark.parametrize(
    "frame",
    [
        '{"type": "run.embeddings", "run_id": "r", "seq": 1, "index": 0, "vectors": [[0.5]]}',
        '{"type": "run.embeddings", "run_id": "r", "seq": 1, "vectors": []}',
        '{"type": "run.request", "run_id": "r", "provider_id": "p", "model": "m",'
        ' "served_model": "m", "body": {}, "route": "dance"}',
    ],
)
def test_malformed_embeddings_messages_are_protocol_errors(frame: str) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=64))
def test_vectors_round_trip_as_little_endian_float32(values: list[float]) -> None:
    text = p.encode_vector(values)
    assert p.decode_vector(text) == values
    assert base64.b64decode(text) == struct.pack(f"<{len(values)}f", *values)


def test_a_vector_is_float32() -> None:
    (value,) = p.decode_vector(p.encode_vector([0.1]))
    assert value != 0.1
    assert math.isclose(value, 0.1, rel_tol=1e-7)


@pytest.mark.parametrize(
    ("text", "says"),
    [("not base64!", "Non-base64|Only base64"), ("AAA=", "not a whole"), ("AAAAAAA=", "5 bytes")],
)
def test_decode_vector_refuses_what_is_no_float32(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        p.decode_vector(text)


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ([], []),
        (None, []),
        (5, []),
    ],
)
def test_embedding_inputs(value: object, inputs: list[object]) -> None:
    body = {} if value is None else {"input": value}
    assert p.embedding_inputs(body) == inputs


# --------------------------------------------------------------------------- the edge's half


def test_the_edge_accepts_vectors_that_continue_the_run() -> None:
    edge = open_edge()
    give(edge)
    assert edge.receive(p.RunStarted(run_id="r", seq=0)) is p.ACCEPTED
    assert edge.receive(embeddings("r", 1, 0, 2)) is p.ACCEPTED
    assert edge.receive(embeddings("r", 2, 2, 0)) is p.ACCEPTED
    assert edge.receive(embeddings("r", 3, 2, 1)) is p.ACCEPTED
    assert (
        edge.receive(
            p.RunUsage(run_id="r", seq=4, usage=p.Usage(prompt_tokens=3, completion_tokens=0))
        )
        is p.ACCEPTED
    )
    assert edge.receive(p.RunCompleted(run_id="r", seq=5)) is p.ACCEPTED
    assert edge.next_seq("r") is None


@pytest.mark.parametrize("index", [1, -1])
def test_the_edge_fails_a_gap_or_a_repeat(index: int) -> None:
    edge = open_edge()
    give(edge)
    assert edge.receive(p.RunStarted(run_id="r", seq=0)) is p.ACCEPTED
    assert edge.receive(embeddings("r", 1, 0, 1)) is p.ACCEPTED
    verdict = edge.receive(embeddings("r", 2, 1 + index, 1))
    assert error(verdict) == (
        f"run.embeddings for run 'r' starts at vector {1 + index}, expected 1"
    )
    assert edge.state is p.State.FAILED


def test_each_run_counts_its_own_vectors_and_a_given_again_id_starts_over() -> None:
    edge = open_edge(recent_runs=0)
    give(edge, "a")
    give(edge, "b")
    for run_id in ("a", "b"):
        assert edge.receive(p.RunStarted(run_id=run_id, seq=0)) is p.ACCEPTED
    assert edge.receive(embeddings("a", 1, 0, 2)) is p.ACCEPTED
    assert edge.receive(embeddings("b", 1, 0, 1)) is p.ACCEPTED
    assert edge.receive(embeddings("a", 2, 2, 1)) is p.ACCEPTED
    assert edge.receive(p.RunCompleted(run_id="a", seq=3)) is p.ACCEPTED
    edge.close_run("a")
    edge.close_run("b")  # ended early: its late vectors are tolerated, not judged
    assert isinstance(edge.receive(embeddings("b", 2, 7, 1)), p.Tolerated)
    give(edge, "a")  # forgotten (recent_runs=0): the id may come again, from vector 0
    assert edge.receive(p.RunStarted(run_id="a", seq=0)) is p.ACCEPTED
    assert edge.receive(embeddings("a", 1, 0, 1)) is p.ACCEPTED


# --------------------------------------------------------------------------- the node's half


def test_the_node_may_not_send_a_gap() -> None:
    node = open_node()
    assert (
        node.receive(
            p.RunRequest(run_id="r", provider_id="p", model="m", served_model="m", body={})
        )
        is p.ACCEPTED
    )
    node.send(p.RunStarted(run_id="r", seq=0))
    node.send(embeddings("r", 1, 0, 2))
    assert node.next_vector("r") == 2
    with pytest.raises(p.LocalProtocolError, match="starts at vector 3, not 2"):
        node.send(embeddings("r", 2, 3, 1))
    node.send(embeddings("r", 2, 2, 1))
    node.send(p.RunCompleted(run_id="r", seq=3))
    assert node.next_vector("r") == 0
    assert node.is_idle()
