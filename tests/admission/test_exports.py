"""Pins the public surface of ``dispatcher.admission``."""

from __future__ import annotations

import dispatcher.admission

PUBLIC = {
    "ADMIT_REASONS",
    "AFFINITY_RESULTS",
    "AffinityResult",
    "CAPABILITIES",
    "DEFAULT_SHARE",
    "HEALTH_STATES",
    "MODEL_LINGER_S",
    "REJECT_CAUSES",
    "Admission",
    "AdmissionCore",
    "AdmissionError",
    "AdmissionStatistics",
    "Admit",
    "AdmitReason",
    "Candidate",
    "CandidateIdentity",
    "CandidateKey",
    "CandidateStatistics",
    "Decision",
    "GroupStatistics",
    "HealthState",
    "ModelUnavailable",
    "Needs",
    "NoCapableCandidate",
    "Policy",
    "PolicySnapshot",
    "Predicate",
    "QueueFull",
    "QueueTimeout",
    "Reject",
    "RejectCause",
    "RequestClass",
    "Share",
    "Slot",
    "SlotId",
    "UnknownModel",
    "WaiterId",
    "error_for",
    "needs_from_body",
    "open_admission",
    "rendezvous_rank",
}


def test_public_names() -> None:
    names = {name for name in vars(dispatcher.admission) if not name.startswith("_")}
    assert names == PUBLIC
