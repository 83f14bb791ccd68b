"""Fair queueing between tenants, end to end: the key a request comes with decides its place
in admission's queue (``[[keys]]`` ``priority`` and ``weight`` -> ``admission.Share``), over
HTTP against a real edge on 127.0.0.1 with a scripted node of one slot, so the order in which
the node receives runs is the order admission chose."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import httpx
import trio

from dispatcher import wire
from dispatcher.config import KeySettings

from .fakes import ScriptedNode, connect, hello, wait_until
from .test_tenants_http import Edge, open_edge

NOISY = "sk-noisy"
QUIET = "sk-quiet"
URGENT = "sk-urgent"
KEYS = (
    KeySettings(id="noisy", key=NOISY),
    KeySettings(id="quiet", key=QUIET),
    KeySettings(id="urgent", key=URGENT, priority=10),
)


async def post(edge: Edge, key: str, tag: str, done: list[str]) -> None:
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": tag}]},
            headers={"authorization": f"Bearer {key}"},
        )
    assert response.status_code == 200, response.text
    done.append(tag)


async def serve_in_order(node: ScriptedNode, count: int) -> list[str]:
    """Answer ``count`` runs one at a time; the tags (each request's message) in the order
    the runs arrived."""
    order: list[str] = []
    for _ in range(count):
        run = await node.receive_run()
        messages = run.body["messages"]
        assert isinstance(messages, list)
        last = messages[-1]
        assert isinstance(last, dict)
        order.append(str(last["content"]))
        await node.emit(run.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))
    return order


async def queue_up(
    edge: Edge, node: ScriptedNode, arrivals: Sequence[tuple[str, str]], done: list[str]
) -> tuple[wire.RunRequest, list[str]]:
    """Hold the node's one slot with a first request, queue ``arrivals`` (key, tag) behind it
    in that order, then let the slot go: the order the queued ones were admitted in."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, edge, NOISY, "holder", done)
        holder = await node.receive_run()
        for queued, (key, tag) in enumerate(arrivals, start=1):
            nursery.start_soon(post, edge, key, tag, done)
            await wait_until(
                lambda n=queued: edge.dispatcher.admission.statistics().waiting == n, timeout=30
            )
        await node.emit(holder.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))
        order = await serve_in_order(node, len(arrivals))
    return holder, order


async def test_a_quiet_tenant_is_not_stuck_behind_a_noisy_ones_backlog() -> None:
    async with open_edge(*KEYS, local_node=False) as edge:
        node = await connect(edge.dispatcher, hello("n1", model="m", slots=1))
        done: list[str] = []
        arrivals = [(NOISY, f"noisy-{i}") for i in range(6)] + [(QUIET, "quiet-0")]
        _, order = await queue_up(edge, node, arrivals, done)
        await node.conn.aclose()
    # FIFO would serve quiet-0 last (7th); fair queueing serves it within the first round
    # of the two backlogged tenants.
    assert order.index("quiet-0") <= 1, order
    assert [tag for tag in order if tag.startswith("noisy")] == [f"noisy-{i}" for i in range(6)]
    assert sorted(done) == sorted(["holder", *(tag for _, tag in arrivals)])


async def test_a_higher_priority_key_goes_first() -> None:
    async with open_edge(*KEYS, local_node=False) as edge:
        node = await connect(edge.dispatcher, hello("n1", model="m", slots=1))
        done: list[str] = []
        arrivals = [(NOISY, "noisy-0"), (QUIET, "quiet-0"), (URGENT, "urgent-0")]
        _, order = await queue_up(edge, node, arrivals, done)
        await node.conn.aclose()
    assert order[0] == "urgent-0", order
    assert set(order[1:]) == {"noisy-0", "quiet-0"}


async def test_a_reload_changes_the_weight_of_new_arrivals() -> None:
    """Weights come from the key as admitted: after a reload gives ``quiet`` weight 3, the
    quiet tenant gets three slots for each of the noisy one's while both are backlogged."""
    async with open_edge(*KEYS, local_node=False) as edge:
        node = await connect(edge.dispatcher, hello("n1", model="m", slots=1))
        heavier = (
            KeySettings(id="noisy", key=NOISY),
            KeySettings(id="quiet", key=QUIET, weight=3.0),
            KeySettings(id="urgent", key=URGENT, priority=10),
        )
        edge.dispatcher.reload(attrs.evolve(edge.dispatcher.config, keys=heavier))
        done: list[str] = []
        arrivals = [(NOISY, f"noisy-{i}") for i in range(4)] + [
            (QUIET, f"quiet-{i}") for i in range(6)
        ]
        _, order = await queue_up(edge, node, arrivals, done)
        await node.conn.aclose()
    first_eight = order[:8]
    quiet = sum(tag.startswith("quiet") for tag in first_eight)
    noisy = len(first_eight) - quiet
    # 3:1 within one round (the tenants' starting points may differ by one admission)
    assert abs(quiet - 3 * noisy) <= 4, order
    assert quiet > noisy, order
