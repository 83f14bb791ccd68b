"""Hostile input, untrusted nodes (#10): what nodes announce cannot grow the edge for good.

A node may announce hundreds of models and reconnect with new names each time. Once the
last candidate of a model no config names has left (and nobody waits for it), admission has
no group for it and ``/metrics`` has no series naming it or its node; once the linger has
passed too (``model_linger_s``: until then the core remembers when each left, at most
``MODEL_MEMORY`` of them), the admission core is back to its size before (within what it
remembers of departed nodes: their newest generation, a few hundred bytes each, at most
``NODE_MEMORY`` of them).
"""

from __future__ import annotations

import gc
import sys
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType

import attrs
import pytest
import trio
import trio.testing
from prometheus_client import generate_latest

from dispatcher import wire
from dispatcher.admission import (
    MODEL_LINGER_S,
    Admission,
    AdmissionCore,
    CandidateKey,
    ModelUnavailable,
    Needs,
    Policy,
    PolicySnapshot,
    UnknownModel,
    open_admission,
)
from dispatcher.admission._core import MODEL_MEMORY
from dispatcher.config import EdgeConfig, QueuePolicySettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.gate.pool import DispatchRequest
from dispatcher.observe.metrics import UNKNOWN_MODEL, Metrics

from ..admission.helpers import cand
from .fakes import ScriptedNode, connect, hello, wait_until

SHORT = {"class": "short"}

NODES = 20
MODELS_PER_NODE = 500
DEPARTED_NODE_BYTES = 512
"""A generous bound of what the core keeps per departed node (see the module docstring)."""


def many_models(node_id: str, models: list[str]) -> wire.Hello:
    """A hello announcing every one of ``models`` on one provider."""
    provider = wire.ProviderInfo(
        id="p1",
        type="echo",
        adapter="echo",
        models=tuple(wire.ModelInfo(name=m, served_name=m, slots=1) for m in models),
    )
    return attrs.evolve(hello(node_id), providers=(provider,))


def deep_size(root: object) -> int:
    """Bytes of everything reachable from ``root``, not counting code, types and modules
    (shared with the rest of the process)."""
    skip = (type, ModuleType, FunctionType, BuiltinFunctionType, MethodType)
    seen: set[int] = set()
    stack = [root]
    size = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        size += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return size


async def one_request(dispatcher: Dispatcher, node: ScriptedNode, model: str) -> None:
    """A completed request for ``model`` as the API layer counts it: admitted through the
    pool (queue-wait series), run on ``node``, counted under its metric label."""

    async def node_side() -> None:
        request = await node.receive_run()
        await node.emit(
            request.run_id,
            ("run.started", {}),
            ("run.delta", {"text": "hi"}),
            ("run.completed", {"finish_reason": "stop"}),
        )

    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node_side)
        async with dispatcher.open_dispatch(DispatchRequest(model=model, body=body)) as dispatch:
            assert dispatch.run is not None
            events = [event async for event in dispatch.run]
        assert isinstance(events[-1], wire.RunCompleted)
    dispatcher.metrics.count_request(dispatcher.metric_model_label(model), "completed")


async def admit(dispatcher: Dispatcher, model: str) -> None:
    """Ask admission for a slot of ``model`` (and give it back)."""
    async with dispatcher.admission.open_slot(model, Needs()):
        pass


def series_naming(text: str, word: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#") and word in line]


async def test_nodes_with_many_models_leave_no_groups_series_or_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EdgeConfig(local_node=False, models={"m": QueuePolicySettings()})
    async with open_dispatcher(config) as dispatcher:
        core = dispatcher.admission._core
        steady = await connect(dispatcher, hello("steady", model="m"))
        await one_request(dispatcher, steady, "m")
        groups_before = set(dispatcher.admission.statistics().groups)
        gc.collect()
        size_before = deep_size(core)
        sizes: list[int] = []
        for round_ in range(2):  # the second round: the same nodes, all new names
            nodes = []
            for n in range(NODES):
                names = [f"hostile-{round_}-{n}-{j}" for j in range(MODELS_PER_NODE)]
                nodes.append(await connect(dispatcher, many_models(f"hostile-node-{n}", names)))
            stats = dispatcher.admission.statistics()
            assert len(stats.groups) == len(groups_before) + NODES * MODELS_PER_NODE
            for n in range(0, NODES, 5):
                await one_request(dispatcher, nodes[n], f"hostile-{round_}-{n}-7")
            during = dispatcher.metrics.render().decode()
            assert f'model="hostile-{round_}-5-7"' in during
            assert len(series_naming(during, "dispatcher_requests_total")) >= 5
            assert len(series_naming(during, "hostile-")) > NODES * MODELS_PER_NODE

            for node in nodes:
                await node.conn.aclose()
            await wait_until(lambda: set(dispatcher.registry.sessions) == {"steady"})

            stats = dispatcher.admission.statistics()
            assert set(stats.groups) == groups_before
            assert {key.node_id for key in stats.candidates} == {"steady"}
            assert not dispatcher.admission.knows_model(f"hostile-{round_}-5-7")
            after = dispatcher.metrics.render().decode()
            assert series_naming(after, "hostile") == []
            assert 'model="m"' in after  # the configured model keeps its series
            # For the linger a request for one of them is a retryable 503, not a 404: the
            # core remembers when each left (at most MODEL_MEMORY), and forgets it after.
            assert len(core._gone_groups) == min(NODES * MODELS_PER_NODE, MODEL_MEMORY)
            with pytest.raises(ModelUnavailable):
                await admit(dispatcher, f"hostile-{round_}-5-7")
            async with trio.open_nursery() as pinging:  # the steady node stays
                pinging.start_soon(steady.answer_pings)
                await trio.sleep(MODEL_LINGER_S)
                pinging.cancel_scope.cancel()
            await one_request(dispatcher, steady, "m")  # an input: the core forgets them
            assert not core._gone_groups
            with pytest.raises(UnknownModel):
                await admit(dispatcher, f"hostile-{round_}-5-7")
            gc.collect()
            sizes.append(deep_size(core))
        assert sizes[0] <= size_before + NODES * DEPARTED_NODE_BYTES, (size_before, sizes)
        assert sizes[1] <= sizes[0] + NODES * 64, sizes  # reconnecting costs nothing more


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name{labels}`` in an exposition, or None if it has none."""
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, number = line.rpartition(" ")
        metric, _, rest = series.partition("{")
        if metric == name and sorted(filter(None, rest.rstrip("}").split(","))) == want:
            return float(number)
    return None


async def test_candidate_health_is_exported(autojump_clock: trio.testing.MockClock) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as dispatcher:
        node = await connect(dispatcher, hello("n1", model="m"))
        assert node.welcome is not None
        key = CandidateKey("n1", node.welcome.generation, "p1", "m")
        labels = {"node": "n1", "provider": "p1", "model": "m"}

        def render() -> str:
            return dispatcher.metrics.render().decode()

        text = render()
        assert value(text, "dispatcher_candidate_health", **labels, state="healthy") == 1
        assert value(text, "dispatcher_candidate_health", **labels, state="ejected") == 0
        assert value(text, "dispatcher_candidate_health", **labels, state="probing") == 0
        assert value(text, "dispatcher_candidate_consecutive_failures", **labels) == 0
        assert value(text, "dispatcher_candidate_ejections_total", **labels) == 0
        assert value(text, "dispatcher_ejections_total") == 0

        dispatcher.admission.report_failure(key)
        dispatcher.admission.report_failure(key)  # the default threshold: ejected
        text = render()
        assert value(text, "dispatcher_candidate_health", **labels, state="healthy") == 0
        assert value(text, "dispatcher_candidate_health", **labels, state="ejected") == 1
        assert value(text, "dispatcher_candidate_consecutive_failures", **labels) == 2
        assert value(text, "dispatcher_candidate_ejections_total", **labels) == 1
        assert value(text, "dispatcher_ejections_total") == 1

        await trio.sleep(5)  # the first cool-down: probing
        # The admission driver wakes at the same instant; let it carry out the cool-down's end.
        await trio.testing.wait_all_tasks_blocked()
        text = render()
        assert value(text, "dispatcher_candidate_health", **labels, state="probing") == 1
        dispatcher.admission.report_success(key)
        text = render()
        assert value(text, "dispatcher_candidate_health", **labels, state="healthy") == 1
        assert value(text, "dispatcher_candidate_consecutive_failures", **labels) == 0
        assert value(text, "dispatcher_candidate_ejections_total", **labels) == 1

        await node.conn.aclose()
        await wait_until(lambda: not dispatcher.registry.sessions)
        text = render()
        assert series_naming(text, 'node="n1"') == []
        assert value(text, "dispatcher_ejections_total") == 1  # the edge's own history stays


async def test_model_series_go_with_the_model_and_unknown_stays() -> None:
    admission = Admission(PolicySnapshot(groups={"configured": Policy()}))
    metrics = Metrics(admission)
    admission.node_joined([cand(model="served")])
    for model in ("served", "configured", UNKNOWN_MODEL):
        metrics.observe_admission(model, "short", 0.5)
        metrics.count_request(model, "completed")
    metrics.count_request("served", "failed")
    text = metrics.render().decode()
    for model in ("served", "configured", UNKNOWN_MODEL):
        assert value(text, "dispatcher_requests_total", model=model, outcome="completed") == 1
        assert value(text, "dispatcher_queue_wait_seconds_count", model=model, **SHORT) == 1
    assert value(text, "dispatcher_requests_total", model="served", outcome="failed") == 1

    admission.node_left("node-a", 1)  # no node serves it, no config names it
    text = metrics.render().decode()
    assert series_naming(text, 'model="served"') == []
    for model in ("configured", UNKNOWN_MODEL):
        assert value(text, "dispatcher_requests_total", model=model, outcome="completed") == 1
        assert value(text, "dispatcher_queue_wait_seconds_count", model=model, **SHORT) == 1

    metrics.count_request("served", "client_gone")  # a request that ended just after
    assert series_naming(metrics.render().decode(), 'model="served"') == []

    # Without a scrape: a new model label lets go of the ones that went away first.
    admission.node_joined([cand("node-b", model="short-lived")])
    metrics.count_request("short-lived", "completed")
    admission.node_left("node-b", 1)
    metrics.count_request("next", "completed")
    unpruned = generate_latest(metrics.registry).decode()  # what render() would prune
    assert series_naming(unpruned, "short-lived") == []
    assert value(unpruned, "dispatcher_requests_total", model="next", outcome="completed") == 1


def test_waiting_requests_keep_their_model_known() -> None:
    """Between its last candidate leaving and its last waiter ending, a model is still known
    (a node may join): its series stay. Sans-IO: the core alone."""
    core = AdmissionCore()
    core.node_joined([cand()], 0.0)
    core.submit(1, "m", Needs(), 0.0)
    assert core.submit(2, "m", Needs(), 0.0) == []
    core.node_left("node-a", 1, 1.0)
    assert core.knows_model("m")
    core.cancel(2, 2.0)
    assert not core.knows_model("m")


async def test_affinity_series_per_group_with_it_on_and_gone_with_the_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``dispatcher_affinity_total{model, result}``: six series per group with affinity on
    (issue #26), read from admission's counters at each scrape; none for a group with it
    off; none once the group is gone."""
    policy = PolicySnapshot(default=Policy(affinity=True), groups={"plain": Policy()})
    async with open_admission(policy) as admission:
        metrics = Metrics(admission)
        admission.node_joined([cand("a", model="served"), cand("b", model="served")])
        admission.node_joined([cand("c", model="plain")])
        for needs in (Needs(affinity_key="k"), Needs(affinity_key="k"), Needs()):
            async with admission.open_slot("served", needs):
                pass
        async with admission.open_slot("plain", Needs(affinity_key="k")):
            pass
        text = metrics.render().decode()
        labels = {"model": "served"}
        assert value(text, "dispatcher_affinity_total", **labels, result="hit") == 2
        assert value(text, "dispatcher_affinity_total", **labels, result="unkeyed") == 1
        assert value(text, "dispatcher_affinity_total", **labels, result="busy") == 0
        found = series_naming(text, "dispatcher_affinity_total{")
        assert len(found) == 6
        assert all('model="served"' in line for line in found)  # not "plain": off there
        admission.node_left("a", 1)
        admission.node_left("b", 1)
        text = metrics.render().decode()
        assert series_naming(text, "dispatcher_affinity_total{") == []
