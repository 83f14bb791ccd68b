"""The usage row builder: each column read from where it comes -- the request, the attempt,
the dispatch result (the chosen candidate's facts, forwarded), the counts."""

from __future__ import annotations

import time

import attrs
import pytest
import trio
import trio.testing

from dispatcher.admission import Candidate
from dispatcher.gate.accounting import Attempted, Counts, usage_row
from dispatcher.gate.pool import DispatchRequest, DispatchResult

from ..admission.helpers import cand


@attrs.frozen
class _Request:
    dispatch: DispatchRequest
    request_id: str = "req-1"
    attribution: str | None = "key-1"
    client_request_id: str | None = "client-7"


CANDIDATE = attrs.evolve(cand("n1", "vllm-1", generation=3), path="tunnel", node_label="")


def _result(candidate: Candidate = CANDIDATE) -> DispatchResult:
    return DispatchResult(
        chosen=candidate,
        run_id=None,
        session_id="s-1",
        context_class="long",
        queue_reason="queued",
        queue_wait=0.25,
    )


async def test_every_column_comes_from_its_source(autojump_clock: trio.testing.MockClock) -> None:
    await trio.sleep(10)
    attempt = Attempted(
        number=2,
        result=_result(),
        path="tunnel",
        outcome="completed",
        committed=True,
        ttft=0.5,
        started_at=trio.current_time() - 1.5,
    )
    row = usage_row(
        _Request(DispatchRequest(model="m", body={}, route="/v1/responses")),
        attempt,
        Counts(11, 22, "reported", cached_tokens=5, cache_write_tokens=3, reasoning_tokens=7),
    )
    assert attrs.asdict(row) == {
        "request_id": "req-1",
        "attempt": 2,
        "model_group": "m",
        "served_model": "m:served",
        "provider_id": "vllm-1",
        "node_id": "n1",
        "path": "tunnel",
        "attribution": "key-1",
        "prompt_tokens": 11,
        "completion_tokens": 22,
        "usage_source": "reported",
        "outcome": "completed",
        "billable_to": "client",
        "queue_wait_s": 0.25,
        "ttft_s": 0.5,
        "duration_s": 1.5,
        "ended_at": row.ended_at,
        "client_request_id": "client-7",
        "route": "/v1/responses",
        "cost_usd": None,  # priced by the tenants' recorder, after the row is built
        "cached_tokens": 5,
        "cache_write_tokens": 3,
        "reasoning_tokens": 7,
    }
    assert row.ended_at == pytest.approx(time.time(), abs=600)  # unix time, not trio's clock


def test_the_result_shows_the_chosen_candidates_facts() -> None:
    result = _result()
    assert (result.node_id, result.model_group, result.served_model) == ("n1", "m", "m:served")
    assert (result.provider_id, result.provider_type, result.adapter) == (
        "vllm-1",
        "ollama",
        "ollama",
    )
    assert result.path == "tunnel"
    assert result.candidate == CANDIDATE.key
    assert result.node_label == "n1"  # no label: the node's id
    labelled = _result(attrs.evolve(CANDIDATE, node_label="GPU box"))
    assert labelled.node_label == "GPU box"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        result.node_id = "n2"  # type: ignore[assignment]
