"""The tenants' limits (:class:`~dispatcher.store.limits.LimitCounters`) under arbitrary
arrivals, settles (retried ones too), releases, reloads and the passing of time (a Hypothesis
state machine, no event loop). A model of the windows, kept by the test
from what was admitted and billed, checks every decision:

* no more than ``rpm`` admissions in any window; a refusal for ``rpm`` only when full;
* what a window holds of tokens, plus an admitted estimate, never exceeds ``tpm`` unless
  the window was empty; a refusal for ``tpm`` only when the estimate did not fit;
* never more than ``max_concurrent`` in flight; a refusal for it only when full;
* ``Retry-After`` is never negative, and admitting after it passes is never refused for
  the same rate limit by the same state;
* the ``x-ratelimit-remaining-*`` headers agree with the model.
"""

from __future__ import annotations

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from dispatcher.store.limits import WINDOW, Held, LimitCounters
from dispatcher.store.seam import Hold, Refusal
from dispatcher.tenants import Limits, Tenant

WALL = 1_800_000_000.0


@attrs.define
class Charge:
    at: float
    tokens: int


class LimiterMachine(RuleBasedStateMachine):
    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.limiter = LimitCounters()
        self.now = 0.0
        self.admitted: list[float] = []
        self.charges: dict[str, Charge] = {}
        self.open: set[str] = set()
        self.count = 0
        self.tenant = Tenant(id="t", name="t")

    @initialize(
        rpm=st.none() | st.integers(1, 5),
        tpm=st.none() | st.integers(1, 200),
        concurrent=st.none() | st.integers(1, 4),
    )
    def configure(self, rpm: int | None, tpm: int | None, concurrent: int | None) -> None:
        self.reload(rpm, tpm, concurrent)

    @rule(
        rpm=st.none() | st.integers(1, 5),
        tpm=st.none() | st.integers(1, 200),
        concurrent=st.none() | st.integers(1, 4),
    )
    def reload(self, rpm: int | None, tpm: int | None, concurrent: int | None) -> None:
        self.tenant = Tenant(
            id="t", name="t", limits=Limits(rpm=rpm, tpm=tpm, max_concurrent=concurrent)
        )

    # -- the model --------------------------------------------------------------------

    def in_window(self) -> list[float]:
        return [at for at in self.admitted if at > self.now - WINDOW]

    def window_tokens(self) -> int:
        return sum(c.tokens for c in self.charges.values() if c.at > self.now - WINDOW)

    # -- rules ------------------------------------------------------------------------

    def hold(self, request_id: str, estimate: int) -> Hold:
        return Hold(request_id, self.tenant.id, self.tenant.limits, estimate, 0.0)

    @rule(target=tickets, estimate=st.integers(0, 150))
    def admit(self, estimate: int) -> Held | None:
        self.count += 1
        limits = self.tenant.limits
        requests, tokens, flying = len(self.in_window()), self.window_tokens(), len(self.open)
        decision = self.limiter.admit(
            self.hold(f"r{self.count}", estimate), now=self.now, wall=WALL
        )
        if isinstance(decision, Refusal):
            assert decision.retry_after >= 0
            if decision.limit == "rpm":
                assert limits.rpm is not None
                assert requests >= limits.rpm
            elif decision.limit == "tpm":
                assert limits.tpm is not None
                assert tokens > 0
                assert tokens + estimate > limits.tpm
            else:
                assert decision.limit == "max_concurrent"
                assert limits.max_concurrent is not None
                assert flying >= limits.max_concurrent
            return None
        if limits.rpm is not None:
            assert requests < limits.rpm
        if limits.tpm is not None:
            assert tokens == 0 or tokens + estimate <= limits.tpm
        if limits.max_concurrent is not None:
            assert flying < limits.max_concurrent
        self.admitted.append(self.now)
        self.charges[decision.hold.request_id] = Charge(self.now, estimate)
        self.open.add(decision.hold.request_id)
        headers = dict(decision.headers)
        if limits.rpm is not None:
            left = max(0, limits.rpm - len(self.in_window()))
            assert headers[b"x-ratelimit-remaining-requests"] == str(left).encode()
        if limits.tpm is not None:
            left = max(0, limits.tpm - self.window_tokens())
            assert headers[b"x-ratelimit-remaining-tokens"] == str(left).encode()
        return decision

    @rule(
        ticket=tickets,
        tokens=st.integers(0, 200),
        attempt=st.integers(1, 3),
    )
    def settle(self, ticket: Held | None, tokens: int, attempt: int) -> None:
        """One attempt's billable row; a second settle of the same attempt (a retry) is no
        change."""
        if ticket is None:
            return
        charge = self.charges[ticket.hold.request_id]
        if attempt not in ticket.settled:
            charge.tokens = tokens + (charge.tokens if ticket.settled else 0)
        self.limiter.settle(ticket, attempt, tokens, 0.0, now=self.now, wall=WALL)

    @rule(ticket=consumes(tickets), answered=st.booleans())
    def release(self, ticket: Held | None, answered: bool) -> None:
        if ticket is None or ticket.hold.request_id not in self.open:
            return
        if not ticket.settled and not answered:
            self.charges[ticket.hold.request_id].tokens = 0
        self.open.discard(ticket.hold.request_id)
        self.limiter.release(ticket, answered=answered, now=self.now, wall=WALL)

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 7.0, 30.0, 59.0, 60.0, 61.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: bool(self.tenant.limits.rpm or self.tenant.limits.tpm))
    @rule(estimate=st.integers(0, 150))
    def retry_after_is_honest(self, estimate: int) -> None:
        """After ``Retry-After``, the same request is not refused for the same rate limit
        (when nothing else was admitted meanwhile)."""
        probe = self.limiter.admit(self.hold("probe", estimate), now=self.now, wall=WALL)
        if isinstance(probe, Held):
            self.limiter.release(probe, answered=False, now=self.now, wall=WALL)
            self.admitted.append(self.now)
            self.charges[f"probe-{self.count}"] = Charge(self.now, 0)
            return
        if probe.limit not in ("rpm", "tpm"):
            return
        self.now += probe.retry_after
        again = self.limiter.admit(self.hold("probe-again", estimate), now=self.now, wall=WALL)
        if isinstance(again, Refusal):
            assert again.limit != probe.limit, (probe, again)
        else:
            self.limiter.release(again, answered=False, now=self.now, wall=WALL)
            self.admitted.append(self.now)
            self.charges[f"probe-again-{self.count}"] = Charge(self.now, 0)

    @invariant()
    def in_flight_is_what_is_open(self) -> None:
        assert self.limiter.in_flight("t") == len(self.open)


TestLimiterMachine = LimiterMachine.TestCase
