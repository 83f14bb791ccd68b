"""Cached, cache-written and reasoning tokens as the edge shows and records them (issue #25):
each front end's usage object in its own convention -- chat completions'
``prompt_tokens_details.cached_tokens`` and ``completion_tokens_details.reasoning_tokens``,
Responses' ``input_tokens_details`` and ``output_tokens_details``, Messages'
``cache_read_input_tokens`` and ``cache_creation_input_tokens`` beside an ``input_tokens``
that counts neither -- and the usage row's counts from a run's or a tunnel's usage, each part
within its total whatever a node says."""

from __future__ import annotations

from typing import Any

import attrs
import orjson
import pytest

from dispatcher import wire
from dispatcher.api.anthropic._answer import EventWriter, message_body
from dispatcher.api.openai._answer import usage_object
from dispatcher.api.responses._answer import Turn
from dispatcher.api.responses._request import parse_responses_request
from dispatcher.gate.accounting import Counts, counts_so_far, tunnel_counts
from dispatcher.gate.pool import DispatchRequest

USAGE = wire.Usage(
    prompt_tokens=1000,
    completion_tokens=300,
    cached_tokens=600,
    cache_write_tokens=100,
    reasoning_tokens=250,
)
ODD = wire.Usage(
    prompt_tokens=10, completion_tokens=4, cached_tokens=25, cache_write_tokens=5,
    reasoning_tokens=-3,
)  # fmt: skip
"""What a node must not be trusted with: parts beyond their totals, a negative part."""


def _head(usage: wire.Usage) -> list[wire.RunEvent]:
    return [
        wire.RunDelta(run_id="r", seq=0, text="hello"),
        wire.RunUsage(run_id="r", seq=1, usage=usage),
        wire.RunCompleted(run_id="r", seq=2, finish_reason="stop"),
    ]


# ------------------------------------------------------------------ chat completions


def test_chat_usage_has_the_details_openai_answers() -> None:
    assert usage_object(USAGE) == {
        "prompt_tokens": 1000,
        "completion_tokens": 300,
        "total_tokens": 1300,
        "prompt_tokens_details": {"cached_tokens": 600},
        "completion_tokens_details": {"reasoning_tokens": 250},
    }
    assert usage_object(None)["prompt_tokens_details"] == {"cached_tokens": 0}
    odd = usage_object(ODD)
    assert odd["prompt_tokens_details"] == {"cached_tokens": 10}
    assert odd["completion_tokens_details"] == {"reasoning_tokens": 0}


# ------------------------------------------------------------------ Responses


def _response_usage(usage: wire.Usage) -> Any:
    turn = Turn(parse_responses_request(b'{"model": "m", "input": "hi"}'), None)
    for event in _head(usage):
        turn.feed(event)
    return turn.response()["usage"]


def test_responses_usage_has_its_details() -> None:
    assert _response_usage(USAGE) == {
        "input_tokens": 1000,
        "input_tokens_details": {"cached_tokens": 600},
        "output_tokens": 300,
        "output_tokens_details": {"reasoning_tokens": 250},
        "total_tokens": 1300,
    }
    odd = _response_usage(ODD)
    assert (odd["input_tokens_details"], odd["output_tokens_details"]) == (
        {"cached_tokens": 10},
        {"reasoning_tokens": 0},
    )


# ------------------------------------------------------------------ Messages


ANTHROPIC_USAGE = {
    "input_tokens": 300,  # 1000 - 600 read - 100 written
    "cache_creation_input_tokens": 100,
    "cache_read_input_tokens": 600,
    "output_tokens": 300,
}


def test_messages_usage_in_anthropics_convention() -> None:
    body = message_body(message_id="msg_r", model="m", head=_head(USAGE), input_estimate=3)
    assert body["usage"] == ANTHROPIC_USAGE
    odd = message_body(message_id="msg_r", model="m", head=_head(ODD), input_estimate=3)
    assert odd["usage"] == {
        "input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 10,
        "output_tokens": 4,
    }


def _events(data: bytes) -> list[tuple[str, Any]]:
    found = []
    for block in data.decode().split("\n\n"):
        if block:
            name, payload = block.split("\n", 1)
            found.append(
                (name.removeprefix("event: "), orjson.loads(payload.removeprefix("data: ")))
            )
    return found


def test_the_messages_stream_says_them_at_its_start_and_its_end() -> None:
    """``message_start`` carries the input usage (the run's own count when it came before
    the first content, as the runner sends it), ``message_delta`` the whole usage."""
    writer = EventWriter(message_id="msg_r", model="m", input_estimate=3)
    first = wire.RunDelta(run_id="r", seq=0, text="hi", usage=USAGE)
    start = _events(writer.start([first]))
    assert start[0][1]["message"]["usage"] == {**ANTHROPIC_USAGE, "output_tokens": 0}
    out: list[bytes] = []
    for event in _head(USAGE)[1:]:
        writer.render(event, out)
    (delta,) = [data for name, data in _events(b"".join(out)) if name == "message_delta"]
    assert delta["usage"] == ANTHROPIC_USAGE


# ------------------------------------------------------------------ the usage row's counts


@attrs.frozen
class _Request:
    dispatch: DispatchRequest = attrs.field(
        factory=lambda: DispatchRequest(model="m", body={"messages": []})
    )
    request_id: str = "req-1"
    attribution: str | None = None
    client_request_id: str | None = None


@attrs.frozen
class _Run:
    usage: wire.Usage | None
    text_chars: int = 0
    finished: bool = True

    def when_settled(self, callback: Any) -> None:
        callback()


@attrs.frozen
class _Tunnel:
    usage: wire.Usage | None


@pytest.mark.parametrize("counts", [counts_so_far, lambda r, run: tunnel_counts(r, run)])
def test_the_rows_counts_carry_the_parts(counts: Any) -> None:
    assert counts(_Request(), _Run(USAGE)) == Counts(
        1000, 300, "reported", cached_tokens=600, cache_write_tokens=100, reasoning_tokens=250
    )
    estimated = attrs.evolve(USAGE, estimated=True)
    assert counts(_Request(), _Run(estimated)).usage_source == "estimated"
    # A node's odd parts never make a row the ledger would refuse.
    assert counts(_Request(), _Run(ODD)) == Counts(
        10, 4, "reported", cached_tokens=10, cache_write_tokens=0, reasoning_tokens=0
    )
    half = wire.Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=7, cache_write_tokens=5)
    assert counts(_Request(), _Run(half)).cache_write_tokens == 3
