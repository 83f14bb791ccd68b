"""Failure-aware selection in the sans-IO core, one rule at a time, in virtual time."""

from __future__ import annotations

import pytest

from dispatcher.admission import (
    AdmissionCore,
    Candidate,
    CandidateKey,
    CandidateStatistics,
    Needs,
    Policy,
    PolicySnapshot,
    _core,
    _health,
)

from .helpers import cand, only_admit

A = cand("node-a")
B = cand("node-b")


def core_with(*candidates: Candidate, policy: Policy | None = None) -> AdmissionCore:
    core = AdmissionCore(PolicySnapshot(default=policy or Policy()))
    core.node_joined(candidates, 0.0)
    return core


def health(core: AdmissionCore, key: CandidateKey = A.key) -> CandidateStatistics:
    return core.statistics().candidates[key]


def eject(core: AdmissionCore, key: CandidateKey, now: float) -> None:
    """Two consecutive failures: the default ``eject_after_failures``."""
    assert core.report_failure(key, now) == []
    core.report_failure(key, now)
    assert health(core, key).health == "ejected"


# --------------------------------------------------------------------------- defaults


def test_defaults() -> None:
    policy = Policy()
    assert (policy.eject_after_failures, policy.eject_base_s, policy.eject_max_s) == (2, 5, 300)
    assert [policy.cool_down(n) for n in range(1, 9)] == [5, 10, 20, 40, 80, 160, 300, 300]
    assert Policy(eject_base_s=5, eject_max_s=3).cool_down(1) == 3
    assert Policy(eject_max_s=1e300).cool_down(10_000) == 5 * 2.0**60  # no overflow
    with pytest.raises(ValueError, match="eject_after_failures"):
        Policy(eject_after_failures=-1)


def test_a_new_candidate_is_healthy() -> None:
    stats = health(core_with(A))
    assert (stats.health, stats.consecutive_failures, stats.ejections) == ("healthy", 0, 0)
    assert (stats.ejected_until, stats.probe_in_flight) == (None, False)


# --------------------------------------------------------------------------- ejection


def test_consecutive_failures_eject_for_the_base_cool_down() -> None:
    core = core_with(A, B)
    assert core.report_failure(A.key, 1.0) == []
    assert (health(core).health, health(core).consecutive_failures) == ("healthy", 1)
    assert core.report_failure(A.key, 2.0) == []
    stats = health(core)
    assert (stats.health, stats.consecutive_failures, stats.ejections) == ("ejected", 2, 1)
    assert stats.ejected_until == 7.0
    assert core.statistics().ejections == 1
    assert core.next_deadline() == 7.0


def test_a_success_in_between_resets_the_count() -> None:
    core = core_with(A)
    core.report_failure(A.key, 1.0)
    core.report_success(A.key, 2.0)
    core.report_failure(A.key, 3.0)
    assert (health(core).health, health(core).consecutive_failures) == ("healthy", 1)


def test_the_threshold_is_configurable() -> None:
    core = core_with(A, policy=Policy(eject_after_failures=1, eject_base_s=2))
    core.report_failure(A.key, 1.0)
    assert (health(core).health, health(core).ejected_until) == ("ejected", 3.0)


def test_an_ejected_candidate_is_not_chosen_while_a_healthy_one_can_serve() -> None:
    """The soak's failure: the idle failing candidate is the least loaded one."""
    core = core_with(A, cand("node-b", slots=2))
    eject(core, A.key, 0.0)
    assert only_admit(core.submit(0, "m", Needs(), 1.0)).candidate.node_id == "node-b"
    assert only_admit(core.submit(1, "m", Needs(), 1.0)).candidate.node_id == "node-b"
    assert core.submit(2, "m", Needs(), 1.0) == []  # node-a is idle but ejected: wait for b
    assert health(core, B.key).in_use == 2
    assert health(core).in_use == 0


def test_an_ejected_candidate_with_a_busy_healthy_one_takes_nobody_on_release() -> None:
    core = core_with(A, B)
    slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id  # on node-a (ties: a first)
    only_admit(core.submit(1, "m", Needs(), 0.0))
    eject(core, A.key, 1.0)
    assert core.submit(2, "m", Needs(), 1.0) == []
    assert core.release(slot, 2.0) == []  # room on node-a, but node-b can serve waiter 2
    assert core.is_queued(2)


def test_failures_while_ejected_are_counted_but_do_not_extend_the_cool_down() -> None:
    core = core_with(A)
    eject(core, A.key, 0.0)
    core.report_failure(A.key, 3.0)
    stats = health(core)
    assert (stats.consecutive_failures, stats.ejections, stats.ejected_until) == (3, 1, 5.0)


# --------------------------------------------------------------------------- probing


def test_the_end_of_the_cool_down_makes_it_probing_one_request_at_a_time() -> None:
    core = core_with(cand("node-a", slots=4), B)
    eject(core, A.key, 0.0)
    assert core.tick(4.9) == []
    assert core.tick(5.0) == []
    stats = health(core)
    assert (stats.health, stats.ejected_until, stats.probe_in_flight) == ("probing", None, False)
    probe = only_admit(core.submit(0, "m", Needs(), 6.0))
    assert probe.candidate.node_id == "node-a"  # least loaded
    assert health(core).probe_in_flight
    assert only_admit(core.submit(1, "m", Needs(), 6.0)).candidate.node_id == "node-b"
    assert core.submit(2, "m", Needs(), 6.0) == []  # node-a has 3 free slots, but one probe
    assert health(core).in_use == 1


def test_slots_taken_while_ejected_are_not_probes() -> None:
    core = core_with(cand("node-a", slots=2))  # one candidate: every request falls back
    eject(core, A.key, 0.0)
    first = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    second = only_admit(core.submit(1, "m", Needs(), 0.0)).slot_id
    assert core.submit(2, "m", Needs(), 1.0) == []
    assert core.submit(3, "m", Needs(), 1.0) == []
    assert core.next_deadline() == 5.0
    assert core.tick(5.0) == []  # probing, but full
    assert only_admit(core.release(first, 6.0)).waiter_id == 2  # the probe
    assert core.release(second, 6.0) == []  # room, but the probe is in flight
    assert core.is_queued(3)


def test_a_cool_down_ending_admits_the_oldest_waiter_that_can_probe() -> None:
    core = core_with(A, B)
    a_slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id  # node-a
    b_slot = only_admit(core.submit(1, "m", Needs(), 0.0)).slot_id  # node-b
    eject(core, A.key, 0.0)
    assert core.submit(2, "m", Needs(), 1.0) == []
    assert core.submit(3, "m", Needs(), 1.0) == []
    assert core.release(a_slot, 2.0) == []  # node-a is free but ejected
    admit = only_admit(core.tick(5.0))
    assert (admit.waiter_id, admit.candidate.node_id, admit.queued_for) == (2, "node-a", 4.0)
    assert health(core).probe_in_flight
    assert only_admit(core.release(b_slot, 6.0)).waiter_id == 3


def test_a_waiter_due_when_a_cool_down_ends_times_out_first() -> None:
    core = core_with(A, B, policy=Policy(queue_timeout_s=5))
    a_slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    only_admit(core.submit(1, "m", Needs(), 0.0))
    core.release(a_slot, 0.0)  # node-a free, node-b busy
    eject(core, A.key, 0.0)  # until 5
    assert core.submit(3, "m", Needs(), 0.0) == []  # due at 5
    assert core.submit(4, "m", Needs(), 0.5) == []  # due at 5.5
    decisions = core.tick(5.0)
    assert [(d.waiter_id, type(d).__name__) for d in decisions] == [(3, "Reject"), (4, "Admit")]


def test_a_probe_success_makes_it_healthy_and_admits_waiters() -> None:
    core = core_with(cand("node-a", slots=3))
    eject(core, A.key, 0.0)
    core.tick(5.0)
    probe = only_admit(core.submit(0, "m", Needs(), 5.0))
    assert core.submit(1, "m", Needs(), 5.0) == []
    assert core.submit(2, "m", Needs(), 5.0) == []
    admits = core.report_success(probe.candidate.key, 6.0)
    assert [a.waiter_id for a in admits] == [1, 2]
    stats = health(core)
    assert (stats.health, stats.consecutive_failures, stats.ejections) == ("healthy", 0, 0)
    assert not stats.probe_in_flight


def test_a_probe_failure_ejects_again_with_a_doubled_cool_down() -> None:
    core = core_with(A, B)
    eject(core, A.key, 0.0)
    now = 0.0
    for expected in (10.0, 20.0, 40.0):
        now = core.next_deadline() or 0.0
        core.tick(now)
        assert health(core).health == "probing"
        core.report_failure(A.key, now)  # one failure is enough while probing
        assert (health(core).health, health(core).ejected_until) == ("ejected", now + expected)
    assert health(core).ejections == 4
    assert core.statistics().ejections == 4


def test_the_cool_down_stops_growing_at_the_max() -> None:
    core = core_with(A, policy=Policy(eject_base_s=5, eject_max_s=12))
    eject(core, A.key, 0.0)
    for expected in (10.0, 12.0, 12.0):
        now = core.next_deadline() or 0.0
        core.tick(now)
        core.report_failure(A.key, now)
        assert health(core).ejected_until == now + expected


def test_a_probe_released_without_a_report_lets_another_probe_go() -> None:
    core = core_with(cand("node-a", slots=2))
    eject(core, A.key, 0.0)
    core.tick(5.0)
    probe = only_admit(core.submit(0, "m", Needs(), 5.0))
    assert core.submit(1, "m", Needs(), 5.0) == []
    admit = only_admit(core.release(probe.slot_id, 6.0))  # e.g. the client went away
    assert admit.waiter_id == 1
    assert health(core).probe_in_flight


def test_a_draining_probe_is_still_in_flight() -> None:
    core = core_with(cand("node-a", slots=2), policy=Policy(drain_timeout_s=3))
    eject(core, A.key, 0.0)
    core.tick(5.0)
    probe = only_admit(core.submit(0, "m", Needs(), 5.0))
    assert core.submit(1, "m", Needs(), 5.0) == []
    assert core.begin_drain(probe.slot_id, 5.0) == []
    assert health(core).probe_in_flight
    assert only_admit(core.tick(8.0)).waiter_id == 1  # the drain expired: the next probe


def test_a_success_while_ejected_makes_it_healthy_at_once() -> None:
    core = core_with(A, B)
    a_slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    only_admit(core.submit(1, "m", Needs(), 0.0))
    core.release(a_slot, 0.0)  # node-a free, node-b busy
    eject(core, A.key, 1.0)
    assert core.submit(2, "m", Needs(), 1.0) == []
    assert only_admit(core.report_success(A.key, 2.0)).candidate.node_id == "node-a"
    assert health(core).health == "healthy"
    assert core.next_deadline() is None  # the cool-down's end is gone
    assert core.tick(5.0) == []
    assert health(core).health == "healthy"


# --------------------------------------------------------------------------- fallback


def test_when_every_capable_candidate_is_ejected_they_still_serve() -> None:
    """Never strand a group: the one whose cool-down ends first goes first."""
    core = core_with(A, B)
    eject(core, B.key, 0.0)
    eject(core, A.key, 1.0)
    admit = only_admit(core.submit(0, "m", Needs(), 2.0))
    assert admit.candidate.node_id == "node-b"  # ejected until 5, node-a until 6
    assert only_admit(core.submit(1, "m", Needs(), 2.0)).candidate.node_id == "node-a"
    assert core.submit(2, "m", Needs(), 2.0) == []


def test_fallback_is_per_request_an_exclusion_of_the_healthy_one_falls_back() -> None:
    core = core_with(A, B)
    eject(core, A.key, 0.0)
    retry = Needs(exclude=frozenset({B.key}))
    assert only_admit(core.submit(0, "m", retry, 1.0, requeue=True)).candidate.node_id == ("node-a")
    assert only_admit(core.submit(1, "m", Needs(), 1.0)).candidate.node_id == "node-b"


def test_fallback_when_the_only_capable_candidate_is_ejected() -> None:
    core = core_with(A, cand("node-b", caps={"vision"}))
    eject(core, B.key, 0.0)
    assert only_admit(core.submit(0, "m", Needs(vision=True), 1.0)).candidate.node_id == ("node-b")


def test_ejecting_the_last_healthy_candidate_lets_waiters_fall_back() -> None:
    core = core_with(A, B)
    eject(core, A.key, 0.0)
    only_admit(core.submit(0, "m", Needs(), 0.0))  # node-b, the healthy one
    assert core.submit(1, "m", Needs(), 0.0) == []  # node-a is free but ejected
    core.report_failure(B.key, 1.0)
    admit = only_admit(core.report_failure(B.key, 1.0))
    assert (admit.waiter_id, admit.candidate.node_id) == (1, "node-a")


def test_the_last_healthy_candidate_leaving_lets_waiters_fall_back() -> None:
    core = core_with(A, B)
    eject(core, A.key, 0.0)
    only_admit(core.submit(0, "m", Needs(), 0.0))  # node-b
    assert core.submit(1, "m", Needs(), 0.0) == []
    admit = only_admit(core.node_left("node-b", 1, 1.0))
    assert (admit.waiter_id, admit.candidate.node_id) == (1, "node-a")


def test_a_waiter_with_a_probing_candidate_does_not_fall_back() -> None:
    core = core_with(A, B)
    eject(core, A.key, 0.0)
    eject(core, B.key, 1.0)
    core.tick(5.0)  # node-a probing, node-b ejected until 6
    only_admit(core.submit(0, "m", Needs(), 5.0))  # the probe, on node-a
    assert core.submit(1, "m", Needs(), 5.0) == []  # node-b is free, but node-a may recover
    assert only_admit(core.report_failure(A.key, 5.5)).candidate.node_id == "node-b"


# --------------------------------------------------------------------------- identity


def test_health_survives_a_reconnect() -> None:
    core = core_with(A, B)
    eject(core, A.key, 0.0)
    core.node_left("node-a", 1, 1.0)
    a2 = cand("node-a", generation=2)
    core.node_joined([a2], 2.0)
    stats = health(core, a2.key)
    assert (stats.health, stats.consecutive_failures, stats.ejected_until) == ("ejected", 2, 5.0)
    assert only_admit(core.submit(0, "m", Needs(), 3.0)).candidate.node_id == "node-b"
    core.tick(5.0)
    assert health(core, a2.key).health == "probing"


def test_a_superseding_generation_keeps_the_health() -> None:
    core = core_with(A)
    core.report_failure(A.key, 0.0)
    a2 = cand("node-a", generation=2)
    core.node_joined([a2], 1.0)
    assert health(core, a2.key).consecutive_failures == 1
    core.report_failure(A.key, 2.0)  # a failure of the old session still counts
    assert health(core, a2.key).health == "ejected"


def test_a_failure_reported_after_the_node_left_counts() -> None:
    core = core_with(A)
    core.report_failure(A.key, 0.0)
    core.node_left("node-a", 1, 1.0)
    core.report_failure(A.key, 1.0)  # node lost, reported after the registry said so
    core.node_joined([cand("node-a", generation=2)], 2.0)
    assert health(core, cand("node-a", generation=2).key).health == "ejected"


def test_a_probe_voided_by_the_node_leaving_lets_the_next_session_probe() -> None:
    core = core_with(A)
    eject(core, A.key, 0.0)
    core.tick(5.0)
    only_admit(core.submit(0, "m", Needs(), 5.0))
    core.node_left("node-a", 1, 6.0)
    a2 = cand("node-a", generation=2)
    core.node_joined([a2], 7.0)
    assert not health(core, a2.key).probe_in_flight
    assert only_admit(core.submit(1, "m", Needs(), 7.0)).candidate == a2


def test_reports_for_unknown_nodes_or_groups_are_ignored() -> None:
    core = core_with(A)
    for key in (cand("node-z").key, cand(model="other").key):
        assert core.report_failure(key, 0.0) == []
        assert core.report_failure(key, 0.0) == []
        assert core.report_success(key, 0.0) == []
    assert core.next_deadline() is None
    assert core.statistics().ejections == 0


def test_a_healthy_identity_that_left_is_forgotten() -> None:
    core = core_with(A)
    core.report_failure(A.key, 0.0)
    core.node_left("node-a", 1, 1.0)
    core.report_success(A.key, 1.0)
    core.node_joined([cand("node-a", generation=2)], 2.0)
    assert health(core, cand("node-a", generation=2).key).consecutive_failures == 0


# --------------------------------------------------------------------------- policy


def test_zero_threshold_never_ejects() -> None:
    core = core_with(A, policy=Policy(eject_after_failures=0))
    for _ in range(5):
        core.report_failure(A.key, 0.0)
    assert (health(core).health, health(core).consecutive_failures) == ("healthy", 0)


def test_turning_ejection_off_restores_the_group_and_admits_waiters() -> None:
    core = core_with(A, B)
    a_slot = only_admit(core.submit(0, "m", Needs(), 0.0)).slot_id
    only_admit(core.submit(1, "m", Needs(), 0.0))
    core.release(a_slot, 0.0)  # node-a free, node-b busy
    eject(core, A.key, 0.0)
    assert core.submit(2, "m", Needs(), 0.0) == []
    off = PolicySnapshot(default=Policy(eject_after_failures=0))
    assert only_admit(core.set_policy(off, 1.0)).candidate.node_id == "node-a"
    assert health(core).health == "healthy"
    assert core.next_deadline() is None


# --------------------------------------------------------------------------- bounded memory


def test_ejections_total_counts_every_ejection() -> None:
    core = core_with(A)
    eject(core, A.key, 0.0)
    core.report_success(A.key, 1.0)
    eject(core, A.key, 2.0)
    stats = health(core)
    assert (stats.ejections, stats.ejections_total) == (1, 2)
    assert core.statistics().ejections == 2


def test_a_reconnect_that_announces_it_again_keeps_its_record() -> None:
    core = core_with(A)
    eject(core, A.key, 0.0)
    core.report_success(A.key, 1.0)  # healthy, nothing to remember but the total
    a2 = cand("node-a", generation=2)
    core.node_joined([a2], 2.0)  # supersedes generation 1
    assert health(core, a2.key).ejections_total == 1


def test_a_departed_identity_with_nothing_to_remember_starts_again() -> None:
    core = core_with(A)
    eject(core, A.key, 0.0)
    core.report_success(A.key, 1.0)
    core.node_left("node-a", 1, 2.0)
    a2 = cand("node-a", generation=2)
    core.node_joined([a2], 3.0)
    assert health(core, a2.key).ejections_total == 0


def test_a_first_failure_for_a_group_no_node_serves_is_ignored() -> None:
    core = AdmissionCore(PolicySnapshot(groups={"m": Policy()}))
    core.node_joined([A], 0.0)
    core.node_left("node-a", 1, 1.0)
    for _ in range(3):
        assert core.report_failure(A.key, 1.0) == []
    core.node_joined([cand("node-a", generation=2)], 2.0)
    assert health(core, cand("node-a", generation=2).key).consecutive_failures == 0


def test_departed_identities_are_remembered_up_to_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_health, "HEALTH_MEMORY", 2)
    nodes = [cand(f"node-{n}") for n in "abc"]
    core = core_with(*nodes)
    eject(core, nodes[0].key, 0.0)  # ejected until 5: a cool-down the core waits for
    for node in nodes[1:]:
        core.report_failure(node.key, 0.0)
    assert core.next_deadline() == 5.0
    for node in nodes:  # a leaves first, so it is forgotten first
        core.node_left(node.node_id, 1, 1.0)
    assert core.next_deadline() is None  # forgotten: nothing to wait for
    back = [cand(f"node-{n}", generation=2) for n in "abc"]
    core.node_joined(back, 2.0)
    assert [health(core, c.key).consecutive_failures for c in back] == [0, 1, 1]
    assert health(core, back[0].key).health == "healthy"


def test_departed_nodes_are_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_core, "NODE_MEMORY", 2)
    core = core_with(*(cand(f"node-{n}", generation=5) for n in "abc"))
    for n in "abc":
        core.node_left(f"node-{n}", 5, 1.0)
    # b and c are remembered: their departed session's announcement is stale
    assert core.node_joined([cand("node-b", generation=5)], 2.0) == []
    assert not core.knows_model("m")
    # a, the first to leave, is forgotten: the core takes any generation of it as new
    core.node_joined([cand("node-a", generation=4)], 3.0)
    assert set(core.statistics().candidates) == {cand("node-a", generation=4).key}
