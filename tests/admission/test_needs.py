from __future__ import annotations

from typing import Any

import pytest

from dispatcher.admission import (
    Candidate,
    CandidateIdentity,
    CandidateKey,
    Needs,
    needs_from_body,
)
from dispatcher.wire import ModelInfo, ProviderInfo

from .helpers import cand


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_plain_body_needs_nothing() -> None:
    needs = needs_from_body(body())
    assert needs == Needs(estimated_tokens=1)
    assert needs.capabilities == frozenset()


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"functions": [{"name": "f"}]},
    ],
)
def test_tools_or_functions_need_tools(extra: dict[str, Any]) -> None:
    assert needs_from_body(body(**extra)).tools


def test_empty_tools_need_nothing() -> None:
    assert not needs_from_body(body(tools=[])).tools


TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": TOOLS, "tool_choice": "none"},
        {"functions": [{"name": "f"}], "function_call": "none"},
    ],
)
def test_tool_choice_none_does_not_need_tools(extra: dict[str, Any]) -> None:
    needs = needs_from_body(body(**extra))
    assert not needs.tools
    assert needs.unfit(cand(caps=())) is None  # a candidate without tools can serve it


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": TOOLS, "tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"tools": TOOLS, "tool_choice": None},
        {"tools": TOOLS, "function_call": "none"},  # the legacy switch is for functions
        {"functions": [{"name": "f"}], "tool_choice": "none"},
        {"tools": TOOLS, "tool_choice": "none", "functions": [{"name": "f"}]},
    ],
)
def test_any_other_tool_choice_needs_tools(extra: dict[str, Any]) -> None:
    needs = needs_from_body(body(**extra))
    assert needs.tools
    assert needs.unfit(cand(caps=())) == "node-a/ollama-1: lacks capability 'tools'"


@pytest.mark.parametrize(
    ("kind", "json"), [("json_object", True), ("json_schema", True), ("text", False)]
)
def test_response_format(kind: str, json: bool) -> None:
    assert needs_from_body(body(response_format={"type": kind})).json is json


@pytest.mark.parametrize("part", ["image_url", "input_image"])
def test_image_parts_need_vision(part: str) -> None:
    content = [{"type": "text", "text": "what is this"}, {"type": part, part: {"url": "x"}}]
    needs = needs_from_body({"messages": [{"role": "user", "content": content}]})
    assert needs.vision
    assert needs.capabilities == {"vision"}


def test_estimate_is_chars_over_four_plus_max_tokens() -> None:
    messages = [
        {"role": "system", "content": "a" * 10},
        {"role": "user", "content": [{"type": "text", "text": "b" * 7}]},
    ]
    assert needs_from_body({"messages": messages}).estimated_tokens == 5  # ceil(17 / 4)
    assert needs_from_body({"messages": messages, "max_tokens": 100}).estimated_tokens == 105
    assert (
        needs_from_body({"messages": messages, "max_completion_tokens": 50}).estimated_tokens == 55
    )


def test_malformed_body_never_raises() -> None:
    weird: dict[str, Any] = {
        "messages": [None, 3, {"content": [None, {"type": "image_url"}, {"text": 5}]}],
        "response_format": "json_object",
        "max_tokens": True,
    }
    needs = needs_from_body(weird)
    assert needs == Needs(vision=True)
    assert needs_from_body({"messages": "nope", "max_tokens": -4}) == Needs()


def test_session_id_is_passed_through() -> None:
    assert needs_from_body(body(), session_id="s1").session_id == "s1"


def test_reasons_name_the_candidate() -> None:
    candidate = cand("node-a", "ollama-1", window=4096, caps={"json"})
    assert Needs(tools=True).unfit(candidate) == "node-a/ollama-1: lacks capability 'tools'"
    assert (
        Needs(estimated_tokens=9000).unfit(candidate)
        == "node-a/ollama-1: context window 4096 < 9000 estimated tokens"
    )
    assert Needs(json=True, estimated_tokens=4096).unfit(candidate) is None
    assert Needs(exclude=frozenset({candidate.key})).unfit(candidate) == (
        "node-a/ollama-1: already failed for this request"
    )
    assert Needs().unfit(candidate, "long") == (
        "node-a/ollama-1: no long-context slots for a long request (0 estimated tokens)"
    )
    assert Needs(predicate=lambda c: "too slow").unfit(candidate) == "node-a/ollama-1: too slow"


def test_exclusion_matches_any_generation_but_nothing_else() -> None:
    old = cand("node-a", "ollama-1", generation=1)
    needs = Needs(exclude=frozenset({old.key}))
    assert needs.unfit(cand("node-a", "ollama-1", generation=7)) == (
        "node-a/ollama-1: already failed for this request"
    )
    assert needs.unfit(cand("node-a", "ollama-2")) is None  # another provider
    assert needs.unfit(cand("node-b", "ollama-1")) is None  # another node
    assert needs.unfit(cand("node-a", "ollama-1", model="other")) is None  # another group
    assert needs == Needs(exclude=frozenset({old.key}))  # the derived set is not compared
    assert old.key.identity == old.identity == CandidateIdentity("node-a", "ollama-1", "m")


def test_a_raising_predicate_is_a_reason() -> None:
    def boom(_: object) -> str | None:
        raise ValueError("nope")

    assert (
        Needs(predicate=boom).unfit(cand()) == "node-a/ollama-1: predicate raised ValueError: nope"
    )


def test_candidate_from_hello_info() -> None:
    provider = ProviderInfo(
        id="vllm-1",
        type="vllm",
        adapter="openai",
        path="tunnel",
        models=(
            ModelInfo(
                name="llama",
                served_name="meta/llama-3",
                slots=8,
                long_context_slots=2,
                context_window=32768,
                capabilities=("tools", "json"),
            ),
        ),
    )
    candidate = Candidate.from_info(
        node_id="n1", generation=3, provider=provider, model=provider.models[0], node_label="box"
    )
    assert candidate.key == CandidateKey("n1", 3, "vllm-1", "llama")
    assert candidate.path == "tunnel"
    assert candidate.capabilities == {"tools", "json"}
    assert (candidate.slots, candidate.long_context_slots, candidate.context_window) == (
        8,
        2,
        32768,
    )
    assert candidate.served_model == "meta/llama-3"
