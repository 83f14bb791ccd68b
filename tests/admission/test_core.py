"""Unit tests of the sans-IO admission core, one rule at a time."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from dispatcher.admission import (
    MODEL_LINGER_S,
    AdmissionCore,
    Candidate,
    Needs,
    Policy,
    PolicySnapshot,
    Share,
    _core,
)
from dispatcher.admission._policy import UNAVAILABLE_RETRY_AFTER_S

from .helpers import admits, cand, only_admit, only_reject, rejects

LONG = Needs(estimated_tokens=5000)


def core_with(
    *candidates: Candidate, policy: Policy | None = None, aliases: Mapping[str, str] | None = None
) -> AdmissionCore:
    core = AdmissionCore(PolicySnapshot(default=policy or Policy(), aliases=aliases or {}))
    core.node_joined(candidates, 0.0)
    return core


def depth(core: AdmissionCore, group: str = "m") -> int:
    groups = core.statistics().groups
    return groups[group].depth if group in groups else 0


# --------------------------------------------------------------------------- unknown models


def test_unknown_model_is_rejected_at_submit() -> None:
    core = AdmissionCore()
    reject = only_reject(core.submit(1, "nope", Needs(), 0.0))
    assert reject.cause == "unknown_model"
    assert reject.retry_after is None
    assert "nope" in reject.message
    assert not core.is_queued(1)


def test_alias_resolves_to_its_group() -> None:
    core = core_with(cand(), aliases={"fast": "m"})
    admit = only_admit(core.submit(1, "fast", Needs(), 0.0))
    assert admit.candidate.model == "m"


def test_group_known_by_policy_waits_for_a_node() -> None:
    core = AdmissionCore(PolicySnapshot(groups={"m": Policy(queue_timeout_s=10)}))
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert depth(core) == 1
    admit = only_admit(core.node_joined([cand()], 3.0))
    assert (admit.waiter_id, admit.reason, admit.queued_for) == (1, "queued", 3.0)


def test_alias_target_is_a_known_group() -> None:
    core = AdmissionCore(PolicySnapshot(aliases={"fast": "m"}))
    assert core.submit(1, "m", Needs(), 0.0) == []


def test_configured_group_that_had_candidates_waits_after_they_left() -> None:
    core = AdmissionCore(PolicySnapshot(groups={"m": Policy()}))
    core.node_joined([cand()], 0.0)
    core.node_left("node-a", 1, 1.0)
    assert core.submit(1, "m", Needs(), 2.0) == []
    assert core.is_queued(1)
    assert only_reject(core.tick(32.0)).cause == "timeout"
    assert "m" in core.statistics().groups


def test_unconfigured_group_is_dropped_with_its_last_candidate() -> None:
    core = core_with(cand(), cand("node-b", model="other"))
    assert core.knows_model("m")
    assert core.node_left("node-a", 1, 1.0) == []
    assert "m" not in core.statistics().groups
    assert not core.knows_model("m")
    # unavailable (a node may come back) for the linger, then unknown
    assert only_reject(core.submit(1, "m", Needs(), 2.0)).cause == "model_unavailable"
    assert only_reject(core.submit(2, "m", Needs(), 1.0 + MODEL_LINGER_S)).cause == (
        "unknown_model"
    )
    assert set(core.statistics().groups) == {"other"}


@pytest.mark.parametrize("end", ["timeout", "cancel"])
def test_unconfigured_group_without_candidates_lives_while_someone_waits(end: str) -> None:
    core = core_with(cand())
    only_admit(core.submit(1, "m", Needs(), 0.0))
    assert core.submit(2, "m", Needs(), 0.0) == []
    assert core.node_left("node-a", 1, 1.0) == []
    assert core.submit(3, "m", Needs(), 2.0) == []  # still known: a node may join
    assert depth(core) == 2
    core.cancel(2, 3.0)
    assert core.knows_model("m")
    if end == "timeout":
        assert only_reject(core.tick(32.0)).cause == "timeout"
    else:
        assert core.cancel(3, 4.0) == []
    assert "m" not in core.statistics().groups
    # the linger counts from its last candidate leaving (at 1), not its last waiter
    assert only_reject(core.submit(4, "m", Needs(), 40.0)).cause == "model_unavailable"
    assert only_reject(core.submit(5, "m", Needs(), 61.0)).cause == "unknown_model"


def test_a_superseding_session_that_drops_a_model_drops_its_group() -> None:
    core = core_with(cand(), cand(model="other"))
    core.node_joined([cand(generation=2)], 1.0)
    assert set(core.statistics().groups) == {"m"}


def test_a_group_the_policy_no_longer_names_is_dropped_when_empty() -> None:
    core = AdmissionCore(PolicySnapshot(groups={"m": Policy(), "k": Policy()}))
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert core.submit(2, "k", Needs(), 0.0) == []
    core.cancel(2, 0.0)
    assert set(core.statistics().groups) == {"m", "k"}  # named: kept while empty
    core.set_policy(PolicySnapshot(), 1.0)
    assert set(core.statistics().groups) == {"m"}  # kept by its waiter
    assert core.knows_model("m")
    assert not core.knows_model("k")
    core.cancel(1, 2.0)
    assert core.statistics().groups == {}


def test_an_alias_keeps_its_target_known() -> None:
    core = core_with(cand(), aliases={"fast": "m"})
    core.node_left("node-a", 1, 1.0)
    assert core.knows_model("fast")
    assert core.knows_model("m")
    assert core.submit(1, "fast", Needs(), 2.0) == []


# ------------------------------------------------------------------ models no node serves now


def test_a_model_whose_node_left_is_unavailable_for_the_linger_then_unknown() -> None:
    """Its only node restarting: a retryable 503 (with Retry-After), not a 404, while a node
    that served it may come back; after the linger, 404 as for a name never seen."""
    core = core_with(cand(), aliases={})
    core.node_left("node-a", 1, 10.0)
    just_left = only_reject(core.submit(1, "m", Needs(), 10.5))
    assert "until less than a second ago" in just_left.message
    reject = only_reject(core.submit(2, "m", Needs(), 22.4))
    assert (reject.cause, reject.retry_after) == ("model_unavailable", UNAVAILABLE_RETRY_AFTER_S)
    assert reject.message == (
        "no node serves model 'm' right now (a node served it until 12 s ago); retry shortly"
    )
    assert not core.is_queued(2)
    assert only_reject(core.submit(3, "m", Needs(), 69.99)).cause == "model_unavailable"
    assert only_reject(core.submit(4, "m", Needs(), 70.0)).cause == "unknown_model"


def test_the_linger_is_the_policys() -> None:
    core = AdmissionCore(PolicySnapshot(model_linger_s=5.0, unavailable_retry_after_s=3.0))
    core.node_joined([cand()], 0.0)
    core.node_left("node-a", 1, 1.0)
    assert only_reject(core.submit(1, "m", Needs(), 5.9)).retry_after == 3.0
    assert only_reject(core.submit(2, "m", Needs(), 6.0)).cause == "unknown_model"
    off = AdmissionCore(PolicySnapshot(model_linger_s=0))
    off.node_joined([cand()], 0.0)
    off.node_left("node-a", 1, 1.0)
    assert only_reject(off.submit(1, "m", Needs(), 1.0)).cause == "unknown_model"


def test_a_model_that_comes_back_is_served_and_lingers_again_from_its_next_leave() -> None:
    core = core_with(cand())
    core.node_left("node-a", 1, 1.0)
    core.node_joined([cand(generation=2)], 5.0)
    only_admit(core.submit(1, "m", Needs(), 6.0))
    core.node_left("node-a", 2, 50.0)
    assert only_reject(core.submit(2, "m", Needs(), 100.0)).cause == "model_unavailable"
    assert only_reject(core.submit(3, "m", Needs(), 110.0)).cause == "unknown_model"


def test_a_model_the_tenants_own_key_names_is_unavailable_while_no_node_serves_it() -> None:
    """Named exactly by the requesting tenant's allowed models though no node ever served
    it: 503, whatever the time. Another tenant's list changes nothing (a key learns nothing
    of the others' models), nor does a name nobody's list has: 404."""
    core = AdmissionCore(PolicySnapshot(tenant_models={"team": {"gpt-x"}}))
    team, other = Share(tenant="team"), Share(tenant="other")
    reject = only_reject(core.submit(1, "gpt-x", Needs(), 1e6, share=team))
    assert (reject.cause, reject.message) == (
        "model_unavailable",
        "no node serves model 'gpt-x' right now (your key's allowed models name it); retry shortly",
    )
    assert only_reject(core.submit(2, "gpt-x", Needs(), 1e6, share=other)).cause == (
        "unknown_model"
    )
    assert only_reject(core.submit(3, "gpt-x", Needs(), 1e6)).cause == "unknown_model"
    assert only_reject(core.submit(4, "gpt-y", Needs(), 1e6, share=team)).cause == ("unknown_model")
    assert not core.knows_model("gpt-x")  # no group: /metrics and /v1/models as before
    assert core.statistics().rejections["model_unavailable"] == 1


def test_a_reload_that_unnames_a_served_model_keeps_its_linger() -> None:
    core = AdmissionCore(PolicySnapshot(groups={"m": Policy()}))
    core.node_joined([cand()], 0.0)
    core.node_left("node-a", 1, 1.0)  # kept: the policy names it
    core.set_policy(PolicySnapshot(), 2.0)  # dropped now; its node left at 1
    assert only_reject(core.submit(1, "m", Needs(), 60.9)).cause == "model_unavailable"
    assert only_reject(core.submit(2, "m", Needs(), 61.0)).cause == "unknown_model"


def test_departed_models_are_remembered_up_to_a_bound_and_the_linger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_core, "MODEL_MEMORY", 2)
    core = core_with(*(cand(f"node-{m}", model=m) for m in "abc"))
    for m in "abc":
        core.node_left(f"node-{m}", 1, 1.0)
    # b and c are remembered; a, the first to go, is forgotten at once
    assert [only_reject(core.submit(m, m, Needs(), 2.0)).cause for m in "abc"] == [
        "unknown_model",
        "model_unavailable",
        "model_unavailable",
    ]
    assert list(core._gone_groups) == ["b", "c"]
    core.tick(61.0)  # any input forgets what is past the linger
    assert not core._gone_groups


# --------------------------------------------------------------------------- capability


def test_no_capable_candidate_names_every_candidate_and_takes_nothing() -> None:
    core = core_with(
        cand("node-a", "ollama-1", window=4096, caps={"tools"}),
        cand("node-b", "vllm-1", caps={"vision"}),
    )
    reject = only_reject(core.submit(1, "m", Needs(tools=True, estimated_tokens=9000), 0.0))
    assert reject.cause == "no_capable_candidate"
    assert reject.reasons == (
        "node-a/ollama-1: context window 4096 < 9000 estimated tokens",
        "node-b/vllm-1: lacks capability 'tools'",
    )
    assert "node-b/vllm-1: lacks capability 'tools'" in reject.message
    stats = core.statistics()
    assert stats.waiting == 0
    assert stats.in_use == 0
    assert stats.rejections["no_capable_candidate"] == 1


def test_capable_candidate_is_chosen_over_an_incapable_free_one() -> None:
    core = core_with(cand("node-a"), cand("node-b", caps={"vision"}))
    admit = only_admit(core.submit(1, "m", Needs(vision=True), 0.0))
    assert admit.candidate.node_id == "node-b"


def test_capable_but_busy_candidate_means_queueing() -> None:
    core = core_with(cand("node-a"), cand("node-b", caps={"tools"}))
    only_admit(core.submit(1, "m", Needs(tools=True), 0.0))
    assert core.submit(2, "m", Needs(tools=True), 0.0) == []
    assert depth(core) == 1


def test_excluded_candidates_are_not_used() -> None:
    a, b = cand("node-a"), cand("node-b")
    core = core_with(a, b)
    admit = only_admit(core.submit(1, "m", Needs(exclude=frozenset({a.key})), 0.0))
    assert admit.candidate.node_id == "node-b"
    reject = only_reject(core.submit(2, "m", Needs(exclude=frozenset({a.key, b.key})), 0.0))
    assert reject.reasons == (
        "node-a/ollama-1: already failed for this request",
        "node-b/ollama-1: already failed for this request",
    )


def test_exclusion_holds_when_the_node_rejoins_as_a_new_generation() -> None:
    """Recovery excludes the failed attempt's key (generation 1); the node reconnects as
    generation 2 while the retry waits: it must not be admitted there."""
    a1, b = cand("node-a", generation=1), cand("node-b")
    core = core_with(a1, b)
    busy = only_admit(core.submit(0, "m", Needs(), 0.0))
    assert busy.candidate.node_id == "node-a"
    only_admit(core.submit(1, "m", Needs(), 0.0))  # node-b is full as well
    retry = Needs(exclude=frozenset({a1.key}))
    assert core.submit(2, "m", retry, 1.0, requeue=True) == []
    assert core.node_joined([cand("node-a", generation=2)], 2.0) == []  # a1's slot is void
    assert core.is_queued(2)
    assert only_admit(core.submit(3, "m", Needs(), 2.0)).candidate.generation == 2
    reject = only_reject(core.node_left("node-b", 1, 3.0))
    assert (reject.waiter_id, reject.cause) == (2, "no_capable_candidate")
    assert reject.reasons == ("node-a/ollama-1: already failed for this request",)


def test_exclusion_of_an_older_generation_applies_at_submit() -> None:
    core = core_with(cand("node-a", generation=2))
    old = cand("node-a", generation=1).key
    reject = only_reject(core.submit(0, "m", Needs(exclude=frozenset({old})), 0.0))
    assert reject.reasons == ("node-a/ollama-1: already failed for this request",)


def test_predicate_rejects_candidates() -> None:
    core = core_with(cand("node-a"), cand("node-b"))
    needs = Needs(predicate=lambda c: None if c.node_id == "node-b" else "not b")
    assert only_admit(core.submit(1, "m", needs, 0.0)).candidate.node_id == "node-b"


def test_last_capable_candidate_leaving_rejects_its_waiters() -> None:
    core = core_with(cand("node-a"), cand("node-b", caps={"tools"}))
    only_admit(core.submit(1, "m", Needs(tools=True), 0.0))
    assert core.submit(2, "m", Needs(tools=True), 0.0) == []
    assert only_admit(core.submit(3, "m", Needs(), 0.0)).candidate.node_id == "node-a"
    reject = only_reject(core.node_left("node-b", 1, 1.0))
    assert (reject.waiter_id, reject.cause) == (2, "no_capable_candidate")
    assert reject.reasons == ("node-a/ollama-1: lacks capability 'tools'",)


def test_waiters_keep_waiting_when_the_group_has_no_candidate_left() -> None:
    core = core_with(cand())
    only_admit(core.submit(1, "m", Needs(tools=False), 0.0))
    assert core.submit(2, "m", Needs(), 0.0) == []
    assert core.node_left("node-a", 1, 1.0) == []
    assert core.is_queued(2)
    assert only_admit(core.node_joined([cand(generation=2)], 2.0)).waiter_id == 2


def test_joining_incapable_node_into_empty_group_rejects_waiters() -> None:
    core = AdmissionCore(PolicySnapshot(groups={"m": Policy()}))
    assert core.submit(1, "m", Needs(vision=True), 0.0) == []
    reject = only_reject(core.node_joined([cand()], 1.0))
    assert reject.cause == "no_capable_candidate"


# --------------------------------------------------------------------------- queue limits


def test_queue_full_is_immediate_with_retry_after() -> None:
    core = core_with(cand(), policy=Policy(max_queue=2, retry_after_s=7))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert core.submit(2, "m", Needs(), 0.0) == []
    reject = only_reject(core.submit(3, "m", Needs(), 0.0))
    assert (reject.cause, reject.retry_after) == ("queue_full", 7)
    assert not core.is_queued(3)
    assert depth(core) == 2


def test_max_queue_counts_both_classes() -> None:
    core = core_with(cand(slots=2, long=1), policy=Policy(max_queue=2, long_context_tokens=1000))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    only_admit(core.submit(1, "m", LONG, 0.0))
    assert core.submit(2, "m", Needs(), 0.0) == []
    assert core.submit(3, "m", LONG, 0.0) == []
    assert only_reject(core.submit(4, "m", Needs(), 0.0)).cause == "queue_full"


def test_timeout_at_exactly_the_deadline() -> None:
    core = core_with(cand(), policy=Policy(queue_timeout_s=30, retry_after_s=2))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    assert core.submit(1, "m", Needs(), 5.0) == []
    assert core.next_deadline() == 35.0
    assert core.tick(34.999) == []
    reject = only_reject(core.tick(35.0))
    assert (reject.waiter_id, reject.cause, reject.retry_after) == (1, "timeout", 2)
    assert core.next_deadline() is None
    assert depth(core) == 0


def test_a_due_waiter_times_out_instead_of_taking_a_late_slot() -> None:
    core = core_with(cand(), policy=Policy(queue_timeout_s=10))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    assert core.submit(1, "m", Needs(), 0.0) == []
    decisions = core.release(slot, 10.0)  # no tick happened at 10: release sees it first
    assert [d.waiter_id for d in rejects(decisions)] == [1]
    assert admits(decisions) == []


def test_zero_max_queue_never_queues() -> None:
    core = core_with(cand(), policy=Policy(max_queue=0))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    assert only_reject(core.submit(1, "m", Needs(), 0.0)).cause == "queue_full"


# --------------------------------------------------------------------------- FIFO


def test_release_admits_the_oldest_waiter() -> None:
    core = core_with(cand())
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    for waiter in (1, 2, 3):
        assert core.submit(waiter, "m", Needs(), float(waiter)) == []
    admit = only_admit(core.release(slot, 10.0))
    assert (admit.waiter_id, admit.reason, admit.queued_for) == (1, "queued", 9.0)
    assert only_admit(core.release(admit.slot_id, 11.0)).waiter_id == 2


def test_a_waiter_that_cannot_use_the_slot_does_not_block_the_next() -> None:
    core = core_with(cand("node-a", window=100), cand("node-b", window=10_000))
    slot_a = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    only_admit(core.submit(1, "m", Needs(), 0.0))
    assert core.submit(2, "m", Needs(estimated_tokens=500), 0.0) == []  # only node-b fits
    assert core.submit(3, "m", Needs(), 0.0) == []
    admit = only_admit(core.release(slot_a, 1.0))
    assert admit.waiter_id == 3
    assert core.is_queued(2)


def test_capability_queues_do_not_block_each_other() -> None:
    core = core_with(cand("node-a", caps={"vision"}), cand("node-b"))
    only_admit(core.submit(0, "m", Needs(vision=True), 0.0))
    slot_b = only_admit(core.submit(1, "m", Needs(), 0.0)).slot_id
    assert core.submit(2, "m", Needs(vision=True), 0.0) == []
    assert core.submit(3, "m", Needs(), 0.0) == []
    assert only_admit(core.release(slot_b, 1.0)).waiter_id == 3
    assert core.is_queued(2)


def test_fifo_is_per_class() -> None:
    core = core_with(cand(slots=2, long=1), policy=Policy(long_context_tokens=1000))
    short_slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    long_slot = only_admit(core.submit(1, "m", LONG, 0.0)).slot_id
    assert core.submit(2, "m", LONG, 0.0) == []
    assert core.submit(3, "m", Needs(), 0.0) == []
    assert only_admit(core.release(short_slot, 1.0)).waiter_id == 3
    assert only_admit(core.release(long_slot, 1.0)).waiter_id == 2


def test_requeued_waiters_go_first_and_are_never_refused_for_a_full_queue() -> None:
    core = core_with(cand(), policy=Policy(max_queue=1))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert core.submit(2, "m", Needs(), 0.0, requeue=True) == []
    assert core.submit(3, "m", Needs(), 0.0, requeue=True) == []
    admit = only_admit(core.release(slot, 1.0))
    assert (admit.waiter_id, admit.reason) == (2, "requeued")
    assert only_admit(core.release(admit.slot_id, 1.0)).waiter_id == 3


def test_requeued_immediate_admission_says_requeued() -> None:
    core = core_with(cand())
    assert only_admit(core.submit(0, "m", Needs(), 0.0, requeue=True)).reason == "requeued"


# --------------------------------------------------------------------------- classes


def test_class_limits_partition_the_slots() -> None:
    core = core_with(cand(slots=4, long=1), policy=Policy(long_context_tokens=1000))
    for waiter in range(3):
        assert only_admit(core.submit(waiter, "m", Needs(), 0.0)).request_class == "short"
    assert core.submit(3, "m", Needs(), 0.0) == []  # the 4th slot is kept for long prompts
    assert only_admit(core.submit(4, "m", LONG, 0.0)).request_class == "long"
    assert core.submit(5, "m", LONG, 0.0) == []
    stats = core.statistics().candidates[cand().key]
    assert (stats.total, stats.in_use, stats.long_total, stats.long_in_use) == (4, 4, 1, 1)


def test_long_request_cannot_take_short_slots() -> None:
    core = core_with(cand(slots=4, long=1), policy=Policy(long_context_tokens=1000))
    only_admit(core.submit(0, "m", LONG, 0.0))
    assert core.submit(1, "m", LONG, 0.0) == []
    assert depth(core) == 1


def test_threshold_is_inclusive() -> None:
    core = core_with(cand(slots=2, long=1), policy=Policy(long_context_tokens=1000))
    assert (
        only_admit(core.submit(0, "m", Needs(estimated_tokens=999), 0.0)).request_class == "short"
    )
    assert (
        only_admit(core.submit(1, "m", Needs(estimated_tokens=1000), 0.0)).request_class == "long"
    )


def test_long_request_needs_a_candidate_with_long_slots() -> None:
    core = core_with(
        cand("node-a", slots=4),
        cand("node-b", slots=4, long=2),
        policy=Policy(long_context_tokens=1000),
    )
    assert only_admit(core.submit(0, "m", LONG, 0.0)).candidate.node_id == "node-b"
    core = core_with(cand("node-a", slots=4), policy=Policy(long_context_tokens=1000))
    reject = only_reject(core.submit(0, "m", LONG, 0.0))
    assert reject.cause == "no_capable_candidate"
    assert "no long-context slots" in reject.reasons[0]


def test_without_classes_every_slot_serves_everyone() -> None:
    core = core_with(cand(slots=2, long=0))
    only_admit(core.submit(0, "m", LONG, 0.0))
    only_admit(core.submit(1, "m", Needs(estimated_tokens=10**6), 0.0))
    assert core.statistics().candidates[cand().key].long_total == 0


def test_per_candidate_cap_lowers_announced_slots() -> None:
    core = core_with(cand(slots=8), policy=Policy(per_candidate_cap=2))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    only_admit(core.submit(1, "m", Needs(), 0.0))
    assert core.submit(2, "m", Needs(), 0.0) == []
    assert core.statistics().candidates[cand().key].total == 2


def test_per_candidate_cap_keeps_the_long_reservation() -> None:
    core = core_with(
        cand(slots=8, long=1), policy=Policy(per_candidate_cap=3, long_context_tokens=1000)
    )
    stats = core.statistics().candidates[cand().key]
    assert (stats.total, stats.long_total) == (3, 1)


# --------------------------------------------------------------------------- selection


def test_least_loaded_candidate_wins() -> None:
    core = core_with(cand("node-a", slots=4), cand("node-b", slots=2))
    nodes = [only_admit(core.submit(i, "m", Needs(), 0.0)).candidate.node_id for i in range(6)]
    # loads as fractions of each candidate's slots; ties go round-robin
    assert nodes.count("node-a") == 4
    assert nodes.count("node-b") == 2
    assert nodes[:2] in (["node-a", "node-b"], ["node-b", "node-a"])


def pin(node: str) -> Needs:
    """Needs that only ``node`` can meet (to place load by hand)."""
    return Needs(predicate=lambda c: None if c.node_id == node else "pinned elsewhere")


def test_load_is_the_fraction_of_slots_occupied() -> None:
    # node-a: 3 of 8 slots held (0.375); node-b: 1 of 2 (0.5). By count node-b would look
    # less loaded; by fraction node-a is, and wins.
    core = core_with(cand("node-a", slots=8), cand("node-b", slots=2))
    for i in range(3):
        only_admit(core.submit(i, "m", pin("node-a"), 0.0))
    only_admit(core.submit(3, "m", pin("node-b"), 0.0))
    assert only_admit(core.submit(4, "m", Needs(), 0.0)).candidate.node_id == "node-a"


def test_draining_slots_count_as_load() -> None:
    core = core_with(cand("node-a", slots=4), cand("node-b", slots=4))
    a1 = only_admit(core.submit(0, "m", pin("node-a"), 0.0))
    only_admit(core.submit(1, "m", pin("node-a"), 0.0))
    only_admit(core.submit(2, "m", pin("node-b"), 0.0))
    # node-a: 1 in use + 1 draining = 2 of 4; node-b: 1 of 4. Draining is still load.
    core.begin_drain(a1.slot_id, 0.0)
    assert only_admit(core.submit(3, "m", Needs(), 0.0)).candidate.node_id == "node-b"
    # Once node-a's drain is confirmed it is the less loaded one (1 of 4 against 2 of 4).
    core.confirm_drain(a1.slot_id, 0.0)
    assert only_admit(core.submit(4, "m", Needs(), 0.0)).candidate.node_id == "node-a"


def test_ties_are_broken_round_robin() -> None:
    core = core_with(cand("node-a", slots=10), cand("node-b", slots=10), cand("node-c", slots=10))
    seen = []
    for i in range(6):
        admit = only_admit(core.submit(i, "m", Needs(), 0.0))
        seen.append(admit.candidate.node_id)
        core.release(admit.slot_id, 0.0)
    assert seen == ["node-a", "node-b", "node-c", "node-a", "node-b", "node-c"]


def test_session_prefers_its_last_node_when_it_has_a_free_slot() -> None:
    core = core_with(cand("node-a", slots=4), cand("node-b", slots=4))
    first = only_admit(core.submit(0, "m", Needs(session_id="s"), 0.0))
    node = first.candidate.node_id
    # The other node is now less loaded, but the session sticks.
    assert only_admit(core.submit(1, "m", Needs(session_id="s"), 0.0)).candidate.node_id == node
    assert only_admit(core.submit(2, "m", Needs(session_id="s"), 0.0)).candidate.node_id == node
    other = only_admit(core.submit(3, "m", Needs(), 0.0)).candidate.node_id
    assert other != node


def test_session_falls_back_when_its_node_is_full() -> None:
    core = core_with(cand("node-a"), cand("node-b"))
    node = only_admit(core.submit(0, "m", Needs(session_id="s"), 0.0)).candidate.node_id
    admit = only_admit(core.submit(1, "m", Needs(session_id="s"), 0.0))
    assert admit.candidate.node_id != node


# --------------------------------------------------------------------------- nodes


def test_node_joining_admits_waiters_at_once() -> None:
    core = core_with(cand("node-a"))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert core.submit(2, "m", Needs(), 0.0) == []
    decisions = core.node_joined([cand("node-b", slots=2)], 1.0)
    assert [(a.waiter_id, a.candidate.node_id) for a in admits(decisions)] == [
        (1, "node-b"),
        (2, "node-b"),
    ]


def test_node_left_voids_its_slots() -> None:
    core = core_with(cand("node-a", slots=2))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    draining = only_admit(core.submit(1, "m", Needs(), 0.0)).slot_id
    core.begin_drain(draining, 0.0)
    core.node_left("node-a", 1, 1.0)
    assert core.slot_state(slot) is None
    assert core.release(slot, 2.0) == []
    assert core.confirm_drain(draining, 2.0) == []
    assert core.statistics().candidates == {}
    assert core.next_deadline() is None


def test_new_generation_supersedes_the_old_one() -> None:
    core = core_with(cand("node-a", generation=1))
    old_slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    assert core.submit(1, "m", Needs(), 0.0) == []
    admit = only_admit(core.node_joined([cand("node-a", generation=2)], 1.0))
    assert (admit.waiter_id, admit.candidate.generation) == (1, 2)
    assert core.slot_state(old_slot) is None
    assert core.release(old_slot, 2.0) == []  # void: frees nothing
    assert list(core.statistics().candidates) == [cand("node-a", generation=2).key]


def test_stale_generation_is_never_admitted() -> None:
    core = core_with(cand("node-a", generation=2))
    core.node_joined([cand("node-a", generation=1, provider="old")], 1.0)
    assert [k.generation for k in core.statistics().candidates] == [2]
    core.node_left("node-a", 2, 2.0)
    core.node_joined([cand("node-a", generation=2)], 3.0)  # left already: ignored
    assert core.statistics().candidates == {}
    assert core.capacity_changed(cand("node-a", generation=1).key, 5, 0, 4.0) == []


def test_node_left_for_a_stale_generation_keeps_the_current_one() -> None:
    core = core_with(cand("node-a", generation=2))
    core.node_left("node-a", 1, 1.0)
    assert only_admit(core.submit(0, "m", Needs(), 1.0)).candidate.generation == 2


def test_rejoin_with_same_key_updates_in_place() -> None:
    core = core_with(cand(slots=1))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert only_admit(core.node_joined([cand(slots=2)], 1.0)).waiter_id == 1
    assert core.slot_state(slot) == "in_use"


# --------------------------------------------------------------------------- capacity


def test_capacity_increase_admits_waiters() -> None:
    core = core_with(cand(slots=1))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert only_admit(core.capacity_changed(cand().key, 2, 0, 1.0)).waiter_id == 1


def test_capacity_decrease_keeps_admitted_slots_and_admits_nobody_until_below() -> None:
    core = core_with(cand(slots=3))
    slots = [only_admit(core.submit(i, "m", Needs(), 0.0)).slot_id for i in range(3)]
    assert core.capacity_changed(cand().key, 1, 0, 1.0) == []
    assert core.statistics().candidates[cand().key].in_use == 3
    assert core.submit(3, "m", Needs(), 1.0) == []
    assert core.release(slots[0], 2.0) == []
    assert core.release(slots[1], 2.0) == []
    assert only_admit(core.release(slots[2], 2.0)).waiter_id == 3


def test_losing_long_slots_rejects_long_waiters_it_was_the_last_home_for() -> None:
    core = core_with(cand(slots=2, long=1), policy=Policy(long_context_tokens=1000))
    only_admit(core.submit(0, "m", LONG, 0.0))
    assert core.submit(1, "m", LONG, 0.0) == []
    reject = only_reject(core.capacity_changed(cand().key, 2, 0, 1.0))
    assert (reject.waiter_id, reject.cause) == (1, "no_capable_candidate")


# --------------------------------------------------------------------------- draining


def test_draining_slot_stays_occupied_until_confirmed() -> None:
    core = core_with(cand(), policy=Policy(drain_timeout_s=5))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert core.begin_drain(slot, 1.0) == []
    assert core.slot_state(slot) == "draining"
    stats = core.statistics().candidates[cand().key]
    assert (stats.in_use, stats.draining) == (0, 1)
    assert core.next_deadline() == 6.0
    assert only_admit(core.confirm_drain(slot, 2.0)).waiter_id == 1
    assert core.confirm_drain(slot, 2.0) == []
    assert core.release(slot, 2.0) == []


def test_drain_deadline_frees_the_slot() -> None:
    core = core_with(cand(), policy=Policy(drain_timeout_s=5, queue_timeout_s=100))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    assert core.submit(1, "m", Needs(), 0.0) == []
    core.begin_drain(slot, 1.0)
    assert core.tick(5.9) == []
    assert only_admit(core.tick(6.0)).waiter_id == 1
    assert core.statistics().drains_expired == 1


def test_confirmation_overtaking_begin_drain_frees_the_slot() -> None:
    core = core_with(cand())
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    core.confirm_drain(slot, 1.0)
    assert core.slot_state(slot) is None
    assert core.begin_drain(slot, 1.0) == []
    assert core.next_deadline() is None


def test_release_is_idempotent() -> None:
    core = core_with(cand(slots=2))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    core.release(slot, 0.0)
    core.release(slot, 0.0)
    core.release(12345, 0.0)
    assert core.statistics().in_use == 0


# --------------------------------------------------------------------------- policy


def test_set_policy_does_not_disturb_admitted_requests() -> None:
    core = core_with(cand(slots=4))
    slots = [only_admit(core.submit(i, "m", Needs(), 0.0)).slot_id for i in range(4)]
    assert core.set_policy(PolicySnapshot(default=Policy(per_candidate_cap=1)), 1.0) == []
    assert all(core.slot_state(s) == "in_use" for s in slots)
    assert core.submit(4, "m", Needs(), 1.0) == []
    for slot in slots[:3]:
        assert core.release(slot, 2.0) == []
    assert only_admit(core.release(slots[3], 2.0)).waiter_id == 4


def test_set_policy_opening_capacity_admits_waiters() -> None:
    core = core_with(cand(slots=4), policy=Policy(per_candidate_cap=1))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert only_admit(core.set_policy(PolicySnapshot(), 1.0)).waiter_id == 1


def test_set_policy_keeps_queued_deadlines() -> None:
    core = core_with(cand(), policy=Policy(queue_timeout_s=10))
    only_admit(core.submit(0, "m", Needs(), 0.0))
    assert core.submit(1, "m", Needs(), 0.0) == []
    core.set_policy(PolicySnapshot(default=Policy(queue_timeout_s=100)), 1.0)
    assert core.next_deadline() == 10.0
    assert core.submit(2, "m", Needs(), 2.0) == []
    assert only_reject(core.tick(10.0)).waiter_id == 1
    assert core.next_deadline() == 102.0


def test_set_policy_reclassifies_queued_waiters() -> None:
    core = core_with(cand(slots=2, long=1), policy=Policy(long_context_tokens=1000))
    only_admit(core.submit(0, "m", LONG, 0.0))
    assert core.submit(1, "m", LONG, 0.0) == []
    assert core.statistics().groups["m"].long == 1
    admit = only_admit(core.set_policy(PolicySnapshot(), 1.0))  # no classes: a free slot
    assert (admit.waiter_id, admit.request_class) == (1, "short")


# --------------------------------------------------------------------------- waiters


def test_cancel_removes_the_waiter() -> None:
    core = core_with(cand())
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    assert core.submit(1, "m", Needs(), 0.0) == []
    assert core.submit(2, "m", Needs(), 0.0) == []
    core.cancel(1, 1.0)
    assert depth(core) == 1
    assert not core.is_queued(1)
    assert only_admit(core.release(slot, 2.0)).waiter_id == 2
    assert core.cancel(1, 2.0) == []  # unknown now: no-op
    assert core.statistics().cancellations == 1


def test_a_queued_waiter_id_cannot_be_reused() -> None:
    core = core_with(cand())
    only_admit(core.submit(0, "m", Needs(), 0.0))
    assert core.submit(1, "m", Needs(), 0.0) == []
    with pytest.raises(ValueError, match="already queued"):
        core.submit(1, "m", Needs(), 0.0)


def test_statistics_count_admissions_and_rejections() -> None:
    core = core_with(cand(), policy=Policy(max_queue=1, queue_timeout_s=1))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    core.submit(1, "m", Needs(), 0.0)
    core.submit(2, "m", Needs(), 0.0)
    core.submit(3, "x", Needs(), 0.0)
    core.submit(4, "m", Needs(tools=True), 0.0)
    core.release(slot, 0.5)
    core.submit(5, "m", Needs(), 0.5)
    core.tick(2.0)
    stats = core.statistics()
    assert stats.admissions == {"immediate": 1, "queued": 1, "requeued": 0}
    assert stats.rejections == {
        "queue_full": 1,
        "timeout": 1,
        "no_capable_candidate": 1,
        "unknown_model": 1,
        "model_unavailable": 0,
    }


def test_time_never_goes_backwards() -> None:
    core = core_with(cand(), policy=Policy(queue_timeout_s=10))
    only_admit(core.submit(0, "m", Needs(), 5.0))
    assert core.submit(1, "m", Needs(), 1.0) == []  # treated as 5.0
    assert core.next_deadline() == 15.0


def test_many_cancelled_waiters_are_compacted() -> None:
    core = core_with(cand(), policy=Policy(max_queue=10_000))
    slot = only_admit(core.submit(-1, "m", Needs(), 0.0)).slot_id
    for i in range(2000):
        core.submit(i, "m", Needs(), 0.0)
    for i in range(1999):
        core.cancel(i, 0.0)
    assert depth(core) == 1
    assert only_admit(core.release(slot, 1.0)).waiter_id == 1999
    assert core.next_deadline() is None


def test_a_waiter_due_when_a_drain_expires_times_out_first() -> None:
    core = core_with(cand(), policy=Policy(queue_timeout_s=4, drain_timeout_s=3))
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    assert core.submit(1, "m", Needs(), 0.0) == []  # due at 4
    assert core.submit(2, "m", Needs(), 1.0) == []  # due at 5
    core.begin_drain(slot, 1.0)  # expires at 4
    decisions = core.tick(4.0)
    assert [(d.waiter_id, type(d).__name__) for d in decisions] == [(1, "Reject"), (2, "Admit")]
