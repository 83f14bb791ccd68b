"""Builders shared by the admission tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dispatcher.admission import (
    Admit,
    Candidate,
    Decision,
    Reject,
)


def cand(
    node: str = "node-a",
    provider: str = "ollama-1",
    *,
    model: str = "m",
    generation: int = 1,
    slots: int = 1,
    long: int = 0,
    window: int | None = None,
    caps: Iterable[str] = (),
) -> Candidate:
    return Candidate(
        node_id=node,
        generation=generation,
        provider_id=provider,
        provider_type="ollama",
        adapter="ollama",
        model=model,
        served_model=f"{model}:served",
        capabilities=frozenset(caps),
        slots=slots,
        long_context_slots=long,
        context_window=window,
        node_label=node.upper(),
    )


def admits(decisions: Sequence[Decision]) -> list[Admit]:
    return [d for d in decisions if isinstance(d, Admit)]


def rejects(decisions: Sequence[Decision]) -> list[Reject]:
    return [d for d in decisions if isinstance(d, Reject)]


def only_admit(decisions: Sequence[Decision]) -> Admit:
    assert len(decisions) == 1, decisions
    decision = decisions[0]
    assert isinstance(decision, Admit), decision
    return decision


def only_reject(decisions: Sequence[Decision]) -> Reject:
    assert len(decisions) == 1, decisions
    decision = decisions[0]
    assert isinstance(decision, Reject), decision
    return decision
