"""Admission: per-model-group queues with bounded slots across a pool of candidates.

Two layers (see ``docs/admission.md``):

* :class:`AdmissionCore`, a synchronous sans-IO state machine: inputs carry ``now`` and
  return :data:`Decision` lists (:class:`Admit`, :class:`Reject`);
* :class:`Admission`, the Trio layer: ``async with admission.open_slot(model, needs) as
  slot`` parks until admitted, raises an :class:`AdmissionError` when rejected, and gives
  the slot back on exit.

The gate reports each attempt's outcome (``report_success`` / ``report_failure``): a
candidate that keeps failing is ejected for a growing cool-down, then probed with one
request (see "Failure-aware selection" in ``docs/admission.md``). Each request may carry a
:class:`Share` (tenant, priority band, weight): queued requests are served by band, then
weighted fair between tenants, then FIFO (see "Fairness"). A group whose policy turns
``affinity`` on sends each request with an affinity key to the candidate its key ranks
first (rendezvous hashing), within a bounded load and a bounded wait (see "Affinity").
"""

from ._affinity import AFFINITY_RESULTS as AFFINITY_RESULTS
from ._affinity import AffinityResult as AffinityResult
from ._affinity import rendezvous_rank as rendezvous_rank
from ._candidates import CAPABILITIES as CAPABILITIES
from ._candidates import Candidate as Candidate
from ._candidates import CandidateIdentity as CandidateIdentity
from ._candidates import CandidateKey as CandidateKey
from ._candidates import Needs as Needs
from ._candidates import Predicate as Predicate
from ._candidates import RequestClass as RequestClass
from ._candidates import needs_from_body as needs_from_body
from ._core import ADMIT_REASONS as ADMIT_REASONS
from ._core import REJECT_CAUSES as REJECT_CAUSES
from ._core import AdmissionCore as AdmissionCore
from ._core import AdmissionStatistics as AdmissionStatistics
from ._core import Admit as Admit
from ._core import AdmitReason as AdmitReason
from ._core import CandidateStatistics as CandidateStatistics
from ._core import Decision as Decision
from ._core import GroupStatistics as GroupStatistics
from ._core import Reject as Reject
from ._core import RejectCause as RejectCause
from ._core import SlotId as SlotId
from ._core import WaiterId as WaiterId
from ._errors import AdmissionError as AdmissionError
from ._errors import ModelUnavailable as ModelUnavailable
from ._errors import NoCapableCandidate as NoCapableCandidate
from ._errors import QueueFull as QueueFull
from ._errors import QueueTimeout as QueueTimeout
from ._errors import UnknownModel as UnknownModel
from ._errors import error_for as error_for
from ._fair import DEFAULT_SHARE as DEFAULT_SHARE
from ._fair import Share as Share
from ._health import HEALTH_STATES as HEALTH_STATES
from ._health import HealthState as HealthState
from ._policy import MODEL_LINGER_S as MODEL_LINGER_S
from ._policy import Policy as Policy
from ._policy import PolicySnapshot as PolicySnapshot
from ._queue import Admission as Admission
from ._queue import Slot as Slot
from ._queue import open_admission as open_admission
