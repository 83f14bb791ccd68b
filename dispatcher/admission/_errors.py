"""Why a request got no slot. Each error carries the HTTP status it maps to.

::

    DispatcherError (dispatcher.errors)
    AdmissionError          .status .code .retry_after
     +-- UnknownModel         404  model_not_found
     +-- ModelUnavailable     503  model_unavailable      (.retry_after)
     +-- NoCapableCandidate   400  no_capable_candidate   (.reasons: one per candidate)
     +-- QueueFull            429  queue_full             (.retry_after)
     +-- QueueTimeout         503  queue_timeout          (.retry_after)

:func:`error_for` is the one place a core :class:`~._core.Reject` becomes an exception.
"""

from __future__ import annotations

from ..errors import DispatcherError
from ._core import Reject


class AdmissionError(DispatcherError, status=503, code="admission_error"):
    """The request got no slot. ``str()`` is a message fit for the client."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        reasons: tuple[str, ...] = (),
        only_excluded: bool = False,
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.reasons = reasons
        self.only_excluded = only_excluded
        """``NoCapableCandidate`` only: every candidate was excluded by the request itself
        (each already failed for it), none refused for what the request needs."""


class UnknownModel(
    AdmissionError, status=404, error_type="invalid_request_error", code="model_not_found"
):
    """No node serves the model and the config does not name it."""


class ModelUnavailable(AdmissionError, status=503, code="model_unavailable"):
    """No node serves the model now, and one may soon: a node served it within the linger
    (``model_linger_s``; it may be restarting), or the client's key names it (503,
    ``Retry-After``)."""


class NoCapableCandidate(
    AdmissionError, status=400, error_type="invalid_request_error", code="no_capable_candidate"
):
    """Every candidate failed the request's needs; ``reasons`` says why, one per candidate.
    Raised before any slot or queue position was taken."""


class QueueFull(AdmissionError, status=429, error_type="invalid_request_error", code="queue_full"):
    """The model group's queue is at its limit (429, ``Retry-After``)."""


class QueueTimeout(AdmissionError, status=503, code="queue_timeout"):
    """The request waited in the queue for its whole queue timeout (503, ``Retry-After``)."""


_BY_CAUSE: dict[str, type[AdmissionError]] = {
    "unknown_model": UnknownModel,
    "model_unavailable": ModelUnavailable,
    "no_capable_candidate": NoCapableCandidate,
    "queue_full": QueueFull,
    "timeout": QueueTimeout,
}


def error_for(reject: Reject) -> AdmissionError:
    """The exception a rejection means."""
    return _BY_CAUSE[reject.cause](
        reject.message,
        retry_after=reject.retry_after,
        reasons=reject.reasons,
        only_excluded=reject.only_excluded,
    )
