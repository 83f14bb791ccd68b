"""Node identity is bound to the credential: holding *a* node token does not make you every
node. A connection claiming a live node's id with another credential is refused (4004) and
the live session -- its streams included -- goes on; the same credential supersedes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import attrs
import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.config import EdgeConfig, NodeSettings, NodeToken
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.link.session import (
    Authenticated,
    NodeCredential,
    Refused,
    authenticate,
)
from dispatcher.paths.runs import RunSpec
from dispatcher.shared.transport import ConnectionClosed, memory_connection_pair
from nodes.agent import dial_edge, serve_node, serve_node_session
from nodes.config import default_node_config

from .fakes import ScriptedNode, connect, hello, wait_until

TOKEN_A = "token-of-node-a"
TOKEN_B = "token-of-node-b"
BOUND = "token-bound-to-gpu"
BODY = {"model": "m", "messages": [{"role": "user", "content": "secret prompt"}]}


@pytest.fixture
async def dispatcher(autojump_clock: trio.testing.MockClock) -> AsyncIterator[Dispatcher]:
    config = EdgeConfig(
        local_node=False,
        nodes=NodeSettings(
            tokens=(TOKEN_A, TOKEN_B, NodeToken(value=BOUND, ids=("gpu-*",))),
            hello_timeout=3,
        ),
    )
    async with open_dispatcher(config) as d:
        yield d


async def closed_with(node: ScriptedNode) -> ConnectionClosed:
    with trio.fail_after(60):
        while True:
            try:
                await node.receive()
            except ConnectionClosed as exc:
                return exc


async def claim(d: Dispatcher, greeting: wire.Hello) -> ConnectionClosed:
    """Connect a node that sends ``greeting``; it must be refused. How it was closed."""
    edge_end, node_end = memory_connection_pair()
    await d.attach_node(edge_end)
    node = ScriptedNode(node_end)
    await node.send(greeting)
    return await closed_with(node)


async def test_takeover_with_another_token_is_refused_and_the_stream_goes_on(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    victim = await connect(dispatcher, hello("node-a", token=TOKEN_A))
    generation = dispatcher.registry.sessions["node-a"].generation
    events: list[wire.RunEvent] = []
    refused: list[ConnectionClosed] = []
    async with trio.open_nursery() as nursery:

        async def client() -> None:
            async with dispatcher.open_run(RunSpec(model="m", body=BODY)) as run:
                async for event in run:
                    events.append(event)

        nursery.start_soon(client)
        request = await victim.receive_run()
        await victim.emit(request.run_id, ("run.started", {}), ("run.delta", {"text": "one "}))
        await wait_until(lambda: len(events) == 2)

        # Mid-stream, the holder of another valid token claims the victim's id.
        refused.append(await claim(dispatcher, hello("node-a", token=TOKEN_B)))

        for seq, (kind, fields) in enumerate(
            [("run.delta", {"text": "two"}), ("run.completed", {})], start=2
        ):
            cls = {c.TYPE: c for c in wire.MESSAGE_TYPES}[kind]
            await victim.send(cls(run_id=request.run_id, seq=seq, **fields))
    (closed,) = refused
    assert closed.code == 4004
    assert closed.reason == "node id 'node-a' is in use by another credential"
    assert [type(e) for e in events] == [
        wire.RunStarted,
        wire.RunDelta,
        wire.RunDelta,
        wire.RunCompleted,
    ]
    assert "".join(e.text for e in events if isinstance(e, wire.RunDelta)) == "one two"
    session = dispatcher.registry.sessions["node-a"]
    assert session.generation == generation
    assert session.is_open

    # The next client's prompt goes to the victim, not to the impostor.
    async with trio.open_nursery() as nursery:

        async def answer() -> None:
            request = await victim.receive_run()
            assert request.body["messages"][0]["content"] == "secret prompt"
            await victim.emit(request.run_id, ("run.completed", {}))

        nursery.start_soon(answer)
        async with dispatcher.open_run(RunSpec(model="m", body=BODY)) as run:
            last = [event async for event in run][-1]
    assert isinstance(last, wire.RunCompleted)


async def test_takeover_refusal_is_logged_without_the_token(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    await connect(dispatcher, hello("node-a", token=TOKEN_A))
    await claim(dispatcher, hello("node-a", token=TOKEN_B))
    assert "node id 'node-a' is in use by another credential" in caplog.text
    assert TOKEN_A not in caplog.text
    assert TOKEN_B not in caplog.text


async def test_reconnect_with_the_same_token_supersedes(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    old = await connect(dispatcher, hello("node-a", token=TOKEN_A))
    async with dispatcher.open_run(RunSpec(model="m", body=BODY)) as run:
        await old.receive_run()
        new = await connect(dispatcher, hello("node-a", token=TOKEN_A))
        assert new.welcome is not None
        assert old.welcome is not None
        assert new.welcome.generation > old.welcome.generation
        events = [event async for event in run]
    assert isinstance(events[-1], wire.RunFailed)
    assert events[-1].code == "stale_generation"
    assert (await closed_with(old)).code == 4002
    assert dispatcher.registry.sessions["node-a"].generation == new.welcome.generation
    async with trio.open_nursery() as nursery:

        async def answer() -> None:
            request = await new.receive_run()
            await new.emit(request.run_id, ("run.completed", {}))

        nursery.start_soon(answer)
        async with dispatcher.open_run(RunSpec(model="m", body=BODY)) as run:
            assert isinstance([event async for event in run][-1], wire.RunCompleted)


async def test_a_bound_token_may_claim_only_its_ids(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    await connect(dispatcher, hello("gpu-1", token=BOUND))
    closed = await claim(dispatcher, hello("cpu-1", token=BOUND))
    assert (closed.code, closed.reason) == (4001, "node token not allowed for node id 'cpu-1'")
    assert "cpu-1" not in dispatcher.registry.sessions
    # A plain (any id) token is another credential: it cannot take gpu-1 over either.
    closed = await claim(dispatcher, hello("gpu-1", token=TOKEN_A))
    assert closed.code == 4004
    assert dispatcher.registry.sessions["gpu-1"].is_open


async def test_the_id_is_free_again_once_its_session_left(
    dispatcher: Dispatcher, autojump_clock: trio.testing.MockClock
) -> None:
    first = await connect(dispatcher, hello("node-a", token=TOKEN_A))
    await first.conn.aclose()
    await wait_until(lambda: "node-a" not in dispatcher.registry.sessions)
    await connect(dispatcher, hello("node-a", token=TOKEN_B))
    assert "node-a" in dispatcher.registry.sessions


def test_authenticate() -> None:
    allowed = ("plain", NodeCredential("bound", ("gpu-*", "tpu-[0-9]")))
    assert authenticate(None, "x", ()) == Authenticated(None)
    assert authenticate("anything", "x", ()) == Authenticated(None)
    assert authenticate(None, "x", allowed) == Refused("missing node token")
    assert authenticate("wrong", "x", allowed) == Refused("invalid node token")
    assert authenticate("", "x", allowed) == Refused("invalid node token")
    plain = authenticate("plain", "anything-at-all", allowed)
    bound = authenticate("bound", "gpu-7", allowed)
    assert isinstance(plain, Authenticated)
    assert isinstance(bound, Authenticated)
    assert plain.credential is not None
    assert plain.credential != bound.credential
    assert "plain" not in plain.credential  # a digest, never the token
    assert authenticate("bound", "tpu-3", allowed) == bound
    assert authenticate("bound", "GPU-7", allowed) == Refused(
        "node token not allowed for node id 'GPU-7'"
    )
    assert authenticate("bound", "tpu-x", allowed) == Refused(
        "node token not allowed for node id 'tpu-x'"
    )
    # An empty configured token matches nothing, not even an empty one.
    assert authenticate("", "x", ("",)) == Refused("invalid node token")
    # The same token listed twice, plain and bound: one credential, the union of its ids.
    twice = ("t", NodeCredential("t", ("a",)))
    assert authenticate("t", "b", twice) == authenticate("t", "a", twice)


# -- open edges and the in-process node ------------------------------------------------


async def test_open_edge_has_no_identity_guarantee(autojump_clock: trio.testing.MockClock) -> None:
    """Documented: with no node tokens, any connection may supersede any node id."""
    async with open_dispatcher(EdgeConfig(local_node=False)) as d:
        old = await connect(d, hello("node-a"))
        await connect(d, hello("node-a"))
        assert (await closed_with(old)).code == 4002


@pytest.mark.parametrize(
    ("tokens", "impostor_token", "code"),
    [
        ((), None, 4004),
        (("t0k3n",), "t0k3n", 4004),
        ((NodeToken(value="t0k3n", ids=("gpu-*",)),), "t0k3n", 4001),
    ],
    ids=["open-edge", "plain-token", "bound-token"],
)
async def test_the_in_process_node_needs_no_token_and_cannot_be_taken_over(
    autojump_clock: trio.testing.MockClock,
    tokens: tuple[str | NodeToken, ...],
    impostor_token: str | None,
    code: int,
) -> None:
    async with open_dispatcher(EdgeConfig(nodes=NodeSettings(tokens=tokens))) as d:
        assert await d.attach_local_node() == "local"
        body = {"model": "echo", "messages": [{"role": "user", "content": "hi there"}]}
        async with d.open_run(RunSpec(model="echo", body=body)) as run:
            text = "".join([e.text async for e in run if isinstance(e, wire.RunDelta)])
        assert text == "hi there"
        generation = d.registry.sessions["local"].generation
        closed = await claim(d, hello("local", token=impostor_token))
        assert closed.code == code
        assert d.registry.sessions["local"].generation == generation
        assert d.registry.sessions["local"].is_open


async def test_attach_local_node_raises_when_its_id_is_held(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as d:
        await connect(d, hello("local"))
        with pytest.raises(RuntimeError, match="ended before it registered"):
            await d.attach_local_node()
        assert d.registry.sessions["local"].is_open


async def test_takeover_over_real_websockets_leaves_the_victims_stream_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The real node agent on both sides, over real websockets: the impostor's session ends
    with 4004 (transient for the agent: it would retry, not stop), the victim's stream goes
    on to its end."""
    caplog.set_level("INFO")
    config = EdgeConfig(port=0, local_node=False, nodes=NodeSettings(tokens=(TOKEN_A, TOKEN_B)))
    async with open_dispatcher(config) as d, trio.open_nursery() as nursery:
        server: Server = await nursery.start(d.serve)
        url = f"ws://127.0.0.1:{server.address.port}/v1/nodes/connect"
        victim = attrs.evolve(default_node_config("gpu-1"), edge_url=url, token=TOKEN_A)
        await nursery.start(serve_node, victim)
        generation = d.registry.sessions["gpu-1"].generation
        words = "the victim keeps streaming to the very end"
        body = {
            "model": "echo",
            "messages": [{"role": "user", "content": words}],
            "echo": {"token_delay": 0.05},
        }
        text = ""
        last: wire.RunEvent | None = None
        async with d.open_run(RunSpec(model="echo", body=body)) as run:
            async for event in run:
                if isinstance(event, wire.RunDelta):
                    if not text:
                        impostor = attrs.evolve(victim, token=TOKEN_B)
                        with trio.fail_after(10):
                            async with dial_edge(impostor) as conn:
                                # Returns (the session ended), does not raise NodeRejected.
                                await serve_node_session(conn, impostor)
                    text += event.text
                last = event
        assert isinstance(last, wire.RunCompleted)
        assert text == words
        assert d.registry.sessions["gpu-1"].generation == generation
        nursery.cancel_scope.cancel()
    assert "refused: node id 'gpu-1' is in use by another credential" in caplog.text
    assert "(code 4004)" in caplog.text  # the impostor agent's side: a transient close
