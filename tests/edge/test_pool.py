"""Provider-pool dispatch: what was chosen, the prepare hooks, and the path per candidate."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

from dispatcher import wire
from dispatcher.admission import Share
from dispatcher.config import EdgeConfig, QueuePolicySettings
from dispatcher.edge import open_dispatcher
from dispatcher.gate.pool import DispatchRequest
from dispatcher.paths.runs import RunSpec

from .fakes import connect, hello

BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}


class HookFailed(Exception):
    pass


async def test_dispatch_result_reports_what_was_chosen(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EdgeConfig(local_node=False, admission=QueuePolicySettings(long_context_tokens=50))
    async with open_dispatcher(config) as d:
        announce = attrs.evolve(
            hello("n1"),
            label="GPU box",
            providers=(
                wire.ProviderInfo(
                    id="vllm-1",
                    type="openai",
                    adapter="openai",
                    models=(
                        wire.ModelInfo(
                            name="m", served_name="llama-3-8b", slots=2, long_context_slots=1
                        ),
                    ),
                ),
            ),
        )
        node = await connect(d, announce)
        request = DispatchRequest(model="m", body=BODY, session_id="s-1")
        async with d.open_dispatch(request) as dispatch:
            sent = await node.receive_run()
            result = dispatch.result
            assert dispatch.run is not None
            assert result.run_id == dispatch.run.run_id == sent.run_id
            assert (result.node_id, result.node_label) == ("n1", "GPU box")
            assert (result.provider_id, result.provider_type, result.adapter) == (
                "vllm-1",
                "openai",
                "openai",
            )
            assert (result.model_group, result.served_model) == ("m", "llama-3-8b")
            assert sent.served_model == "llama-3-8b"
            assert (result.path, result.session_id) == ("normalized", "s-1")
            assert result.context_class == "long"  # ~100 estimated tokens >= 50
            assert (result.queue_reason, result.queue_wait) == ("immediate", 0)
            await node.emit(sent.run_id, ("run.completed", {}))


async def test_prepare_run_rewrites_the_spec_for_the_chosen_candidate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as d:
        node = await connect(d, hello("n1"))

        async def prepare(candidate: Any, spec: RunSpec) -> RunSpec:
            return attrs.evolve(spec, body={**spec.body, "temperature": 0.25})

        d.pool.prepare_run = prepare
        async with d.open_dispatch(DispatchRequest(model="m", body=BODY)):
            sent = await node.receive_run()
            assert sent.body["temperature"] == 0.25
            await node.emit(sent.run_id, ("run.completed", {}))


async def test_an_error_in_prepare_run_releases_the_slot_and_sends_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as d:
        node = await connect(d, hello("n1", slots=1))

        async def prepare(candidate: Any, spec: RunSpec) -> RunSpec:
            raise HookFailed(candidate.node_id)

        d.pool.prepare_run = prepare
        with pytest.raises(HookFailed):
            async with d.open_dispatch(DispatchRequest(model="m", body=BODY)):
                pytest.fail("dispatched although the hook failed")
        stats = d.admission.statistics()
        assert (stats.in_use, stats.draining, stats.waiting) == (0, 0, 0)
        with trio.move_on_after(1):
            message = await node.receive()
            pytest.fail(f"the node was sent {message}")
        # The slot really is free again: the next request is admitted at once.
        d.pool.prepare_run = None
        async with d.open_dispatch(DispatchRequest(model="m", body=BODY)) as dispatch:
            assert dispatch.result.queue_reason == "immediate"
            sent = await node.receive_run()
            await node.emit(sent.run_id, ("run.completed", {}))


async def test_an_error_in_prepare_tunnel_releases_the_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_dispatcher(EdgeConfig(local_node=False)) as d:
        announce = attrs.evolve(
            hello("n1"),
            providers=(
                wire.ProviderInfo(
                    id="vllm",
                    type="openai",
                    adapter="openai",
                    path="tunnel",
                    models=(wire.ModelInfo(name="m", served_name="m", slots=1),),
                ),
            ),
        )
        await connect(d, announce)

        async def prepare(candidate: Any, request: DispatchRequest) -> DispatchRequest:
            assert candidate.path == "tunnel"
            raise HookFailed("tunnel hook")

        d.pool.prepare_tunnel = prepare
        with pytest.raises(HookFailed):
            async with d.open_dispatch(DispatchRequest(model="m", body=BODY)):
                pytest.fail("a tunnel was opened although the hook failed")
        stats = d.admission.statistics()
        assert (stats.in_use, stats.draining, stats.waiting) == (0, 0, 0)


async def test_the_request_share_reaches_admission(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``DispatchRequest.share`` places a queued request: with the one slot held, a band-1
    request queued after a band-0 one gets the slot first."""
    async with open_dispatcher(EdgeConfig(local_node=False)) as d:
        node = await connect(d, hello("n1", slots=1))
        order: list[str] = []

        async def dispatch(name: str, share: Share) -> None:
            async with d.open_dispatch(DispatchRequest(model="m", body=BODY, share=share)):
                order.append(name)  # leaving cancels the run: the slot drains, then frees

        async with trio.open_nursery() as nursery:
            nursery.start_soon(node.answer_pings)  # reads (and drops) what the edge sends
            async with d.open_dispatch(DispatchRequest(model="m", body=BODY)):
                nursery.start_soon(dispatch, "low", Share(tenant="a", priority=0))
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(dispatch, "high", Share(tenant="b", priority=1))
                await trio.testing.wait_all_tasks_blocked()
                assert d.admission.statistics().waiting == 2
            await trio.sleep(30)
            assert order == ["high", "low"]
            nursery.cancel_scope.cancel()
