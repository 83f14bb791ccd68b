r"""The tenants' limits on Redis (>= 7): :class:`RedisLimits`, a
:class:`~dispatcher.store.seam.LimitStore` several edges share, opened by
:func:`open_redis_limits`, speaking through :mod:`.redis_link` (our pipelined RESP2
connection: two Trio task steps per command, where coredis took six and ~5x the CPU).

* Every decision is one Lua script on the server (``limits_redis.lua``), atomic: admitting a
  request checks and takes its budgets, its place in flight, its request in the minute window
  and its estimate in the token window at once, with the same answers (and the same
  :class:`~dispatcher.store.seam.Refusal`: limit, message, ``Retry-After``, ``x-ratelimit-*``
  headers) as :class:`~dispatcher.store.limits.LimitCounters`, the reference.
* A place in flight is a lease of :attr:`RedisLimits.hold_lease` seconds, renewed every
  :attr:`RedisLimits.renew_every` seconds while this edge holds the request (the store's
  renewer task): the holds of an edge that died come back (and what they reserved of the
  budgets) within a lease.
* The clocks are the server's (``TIME``): the edges' own do not matter. ``clock``/``wall``
  given to :func:`open_redis_limits` replace them (the tests' seam: the contract suite moves
  its own clocks).
* :meth:`~RedisLimits.settle`, :meth:`~RedisLimits.release` and :meth:`~RedisLimits.spend`
  never block: they are posted to the store's writer, a task in the nursery of
  :func:`open_redis_limits`, which runs this edge's operations in the order they were posted
  (an admission waits for the writes posted before it: an edge sees its own releases) and
  retries a write that failed (each is idempotent on the server, keyed by request and attempt,
  by request for a release, by an id of its own for a spend). A settle and its request's
  release posted one after the other run as one script.
* An admission is sent by its caller, not the writer: alone when no write is waiting (the
  wire already holds everything posted before it); with the one write waiting a finish or a
  release of its tenant (one client's requests back to back: the previous request's end),
  that write's arguments ride in the admission's own script, which runs it first; with
  other writes waiting, they and the admission go as one pipeline. The admit path is one
  round trip and two task steps, and a request's end costs no round trip, and at one client
  no script and no task step, of its own. For that, the writer holds writes with no awaited
  operation behind them up to :data:`WRITE_LINGER` seconds before it sends them itself: a
  release reaches the server, and other edges, at most that much later
  (:meth:`RedisLimits.flush` does not wait). Posting a write wakes no task: the idle
  writer's scope gets the write's deadline, and an admission that carries it clears that.
  A carried write whose admission fails is written again on its own.
* What it costs (``nox -s bench -- store``): the script reads the tenant's hash once and
  writes it once, a settle or a release does not move the windows (only an admission and a
  read need them moved, and only while their oldest request is past the window: one
  ``ZRANGE`` that also gives the headers their oldest request), a finish reads and writes
  its hold once, and an answer is one string of fields, not an array to parse: 20 Redis
  calls for an admission carrying its tenant's previous finish. An admission's command is
  joined from parts encoded once (the script and the tenant's key, the limits, a carried
  write when it was posted): only the request's own arguments are encoded on its path.
* :meth:`~RedisLimits.spent` and :meth:`~RedisLimits.in_flight` are synchronous: they answer
  what the server last told this edge, plus this edge's writes not yet acknowledged. Other
  edges' spend shows from this edge's next operation on that tenant: eventually consistent.

When the server does not answer (down, unreachable, or past :attr:`RedisLimits.command_timeout`
for one command), an awaited operation (:meth:`~RedisLimits.admit`) raises
:class:`~dispatcher.store.seam.StoreUnreachable`, and a write is retried. The edge's guard
(:mod:`.limits_guard`) then :meth:`~RedisLimits.suspend`\ s the store until a
:meth:`~RedisLimits.ping` answers: meanwhile the writes are parked in order (at most
:data:`PARK_LIMIT`, beyond which the oldest are given up) instead of each waiting out its
tries, an awaited operation fails at once, and an admission whose caller left before it ran
is skipped; :meth:`~RedisLimits.resume` puts the parked writes back in front, so a long outage
leaves no backlog of retries between the server's return and the next admission.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.resources
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Final, Literal, cast

import attrs
import trio

from ..config import Limits
from .limits import (
    CONCURRENCY_RETRY_AFTER,
    month_start,
    periods,
    rate_headers,
    refusal_message,
    seconds_to_next,
)
from .redis_link import (
    RedisLink,
    RedisLinkError,
    RedisReplyError,
    Submitted,
    open_redis_link,
)
from .resp import Arg, EncodedArgs, Reply, ReplyError, encode_args, join_command
from .seam import Hold, LimitName, RateHeaders, Refusal, Spent, StoreUnreachable, UsageLedger

__all__ = [
    "HOLD_LEASE",
    "RedisHeld",
    "RedisLimits",
    "RedisLimitsStatistics",
    "open_redis_limits",
]

log = logging.getLogger("dispatcher.store.limits_redis")

HOLD_LEASE: Final = 60.0
"""Seconds a place in flight is held without its edge renewing it."""
PIPELINE: Final = 64
"""The most operations the writer sends in one pipeline (one round trip)."""
WRITE_ATTEMPTS: Final = 6
"""Tries of one write before it is given up (and counted in the statistics)."""
CLOSE_TIMEOUT: Final = 5.0
"""Seconds a closing store waits for its writer to write what was posted."""
COMMAND_TIMEOUT: Final = 2.0
"""Seconds one command may take before it counts as failed (a write is then tried again)."""
PARK_LIMIT: Final = 100_000
"""Writes kept while the store is suspended; beyond, the oldest are given up (counted)."""
WRITE_LINGER: Final = 0.005
"""Seconds the writer holds writes (settles, releases) for the next admission to carry: at
one client, a request's end then costs the edge and the server no round trip and no script
of its own (the client's next request is on the edge by then)."""
_ENCODED_KEEP: Final = 1024
"""Tenants' keys and limits kept encoded for admissions (beyond, the memory starts over)."""
_ERRORS: Final = (RedisReplyError, RedisLinkError, OSError, trio.TooSlowError)
_UNREACHABLE: Final = (RedisLinkError, OSError, trio.TooSlowError)
"""The errors that say the server is not answering (not that it refused one command)."""

_SCRIPT: Final = (
    importlib.resources.files(__package__).joinpath("limits_redis.lua").read_text("utf-8")
)


@attrs.define(eq=False, slots=True)
class RedisHeld:
    """An admitted request's reservation (a :class:`~dispatcher.store.seam.Reservation`)."""

    hold: Hold
    headers: RateHeaders
    settled: set[int] = attrs.field(factory=set, repr=False)
    """The attempts this edge settled it for (the server keeps its own, for every edge)."""
    released: bool = False


@attrs.frozen(kw_only=True)
class RedisLimitsStatistics:
    pending: int
    """Operations posted and not yet written."""
    retried: int
    """Writes tried again after an error."""
    lost: int
    """Writes given up: after :data:`WRITE_ATTEMPTS` tries, beyond :data:`PARK_LIMIT`, or
    still parked when the store closed."""
    parked: int = 0
    """Writes held back while the store is suspended (written when it resumes)."""


@attrs.frozen
class _Seen:
    """A tenant's state as the server last answered it."""

    in_flight: int = 0
    day: str = ""
    day_tokens: int = 0
    day_usd: float = 0.0
    month: str = ""
    month_tokens: int = 0
    month_usd: float = 0.0


@attrs.frozen
class _Delta:
    """A posted write as the tenant's view counts it until the server acknowledges it."""

    seq: int
    in_flight: int = 0
    day: str = ""
    month: str = ""
    tokens: int = 0
    usd: float = 0.0


_Kind = Literal["admit", "settle", "release", "finish", "spend", "renew", "read", "barrier"]
"""(``finish``: a settle and its request's release, posted one after the other, written as one
script: :meth:`RedisLimits.release`.)"""


@attrs.define(eq=False, slots=True)
class _Op:
    seq: int
    kind: _Kind
    tenant_id: str
    args: list[str]
    """The clocks when it was posted (empty: the server's when it runs), the arguments."""
    hold: Hold | None = None
    done: trio.Event | None = None
    """Set when an awaited operation (admit, read) has its answer."""
    answer: list[str] | BaseException | None = None
    sent: bool = False
    """It went to the server (its script may have run there)."""
    alone: bool = False
    """Its pipeline failed it: it goes again the one-at-a-time way, with its retries."""
    abandoned: bool = False
    """Its caller left before the answer: not run if it had not started, and a hold it got is
    released at once."""
    carry: EncodedArgs | None = None
    """A write an admission may carry (:meth:`RedisLimits._carriable`): its operation and
    arguments, encoded when it was posted (not while an admission waits)."""

    def left(self) -> bool:
        """:attr:`abandoned`, read after an await (when it may have changed)."""
        return self.abandoned


class _Parked:
    """What :meth:`RedisLimits._execute` answers for a write it parked."""


_PARKED: Final = _Parked()


def _failure(kind: str, error: BaseException) -> str:
    """What went wrong with one command, for a log line or a caller's error (the link names
    the host and port it could not reach, never the URL's password)."""
    if isinstance(error, trio.TooSlowError):
        return f"{kind}: no answer within the command timeout"
    return f"{kind}: {type(error).__name__}: {error}"


def _strings(reply: Reply) -> list[str] | None:
    """A script's answer as its fields (the script sends them as one string, separated by
    spaces: one bulk to read, where a list of them costs a parse per field); None if the
    reply is not one (an error reply)."""
    if isinstance(reply, bytes):
        return reply.decode().split(" ")
    return None


def _decimal(value: float | None) -> str:
    return "" if value is None else repr(value)


def _limit_strings(limits: Limits) -> tuple[str, ...]:
    """A key's limits as the admission script reads them (ARGV[8] to ARGV[14])."""
    return (
        _decimal(limits.rpm),
        _decimal(limits.tpm),
        _decimal(limits.max_concurrent),
        _decimal(limits.budget_tokens_day),
        _decimal(limits.budget_usd_day),
        _decimal(limits.budget_tokens_month),
        _decimal(limits.budget_usd_month),
    )


@attrs.define(eq=False)
class RedisLimits:
    """Tenants' limits in Redis (see the module docstring). Open it with
    :func:`open_redis_limits`."""

    client: RedisLink
    prefix: str = "dispatcher:limits:"
    hold_lease: float = HOLD_LEASE
    renew_every: float | None = None
    """Seconds between renewals of this edge's leases (None: a third of the lease)."""
    clock: Callable[[], float] | None = None
    """The monotonic clock the scripts use instead of the server's (tests)."""
    wall: Callable[[], float] | None = None
    """Unix time the scripts use instead of the server's (tests)."""
    command_timeout: float = COMMAND_TIMEOUT
    """Seconds one command may take before it counts as failed."""
    on_unreachable: Callable[[str], None] | None = None
    """Told (what failed) when a write finds the server not answering: the edge's guard
    (:mod:`.limits_guard`) starts an outage, which suspends the store, so a write alone --
    no admission asking -- is enough for an outage to be seen."""
    admit_bounded_by: float | None = None
    """Seconds within which every :meth:`admit`'s caller has a deadline of its own (the
    edge's guard sets it): when no more than :attr:`command_timeout`, an admission sent by its
    caller opens no timeout scope of its own (it would cost as much as the rest of sending
    the command)."""
    _queue: collections.deque[_Op] = attrs.field(init=False, factory=collections.deque)
    _urgent: trio.Event = attrs.field(init=False, factory=trio.Event)
    """Set when something in the queue must not wait out :data:`WRITE_LINGER` (an awaited
    operation, a suspension's change, closing): reset when the writer goes idle."""
    _flush_at: float = attrs.field(init=False, default=math.inf)
    """When the writes waiting must go (``trio.current_time()``; inf: none waits): set by the
    first write posted to an empty queue, a linger later, and back to inf when an admission
    carries or takes them. Writes wake no task: the idle writer's scope has this deadline."""
    _idle: trio.CancelScope | None = attrs.field(init=False, default=None)
    """The writer's scope while it waits for :attr:`_urgent` or :attr:`_flush_at`."""
    linger: float = attrs.field(init=False, default=WRITE_LINGER)
    """Seconds the writer holds writes for an admission to carry (:data:`WRITE_LINGER`)."""
    _seq: int = attrs.field(init=False, default=0)
    _seen: dict[str, _Seen] = attrs.field(init=False, factory=dict)
    _seen_seq: dict[str, int] = attrs.field(init=False, factory=dict)
    """The operation whose answer :attr:`_seen` holds, per tenant."""
    _deltas: dict[str, collections.deque[_Delta]] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)
    _live: dict[str, RedisHeld] = attrs.field(init=False, factory=dict)
    """This edge's admitted requests not yet released: the leases it renews."""
    _retried: int = attrs.field(init=False, default=0)
    _lost: int = attrs.field(init=False, default=0)
    _running: list[_Op] = attrs.field(init=False, factory=list)
    """The operations the writer runs now (taken off the queue: one, or a pipeline)."""
    _flights: collections.deque[tuple[list[_Op], Submitted | BaseException]] = attrs.field(
        init=False, factory=collections.deque
    )
    """Pipelines written, their replies not yet handled (:meth:`_receiver`)."""
    _flown: trio.Event = attrs.field(init=False, factory=trio.Event)
    _all_landed: trio.Event = attrs.field(init=False, factory=trio.Event)
    _suspension: trio.Event = attrs.field(init=False, factory=trio.Event)
    """Set while suspended (:meth:`suspend`): it also ends a retry's wait."""
    _parked: collections.deque[_Op] = attrs.field(init=False, factory=collections.deque)
    _overflowed: bool = attrs.field(init=False, default=False)
    _heads: dict[str, EncodedArgs] = attrs.field(init=False, factory=dict)
    """Per tenant: ``EVALSHA``, the script's SHA1, 1, the tenant's key (encoded)."""
    _limit_args: dict[Limits, EncodedArgs] = attrs.field(init=False, factory=dict)
    """Per tenant's limits: their arguments of an admission (encoded)."""

    # -- the LimitStore ----------------------------------------------------------------

    async def admit(self, hold: Hold) -> RedisHeld | Refusal:
        """One script on the server decides; this edge's writes posted before go first.

        With nothing waiting to be written the caller sends its script itself (the wire
        already holds everything posted before it) and takes its answer from the link:
        two scheduler turns, where the writer's way costs five. Otherwise, or when the
        script must be loaded, it goes through the writer in its turn."""
        answer: list[str] | None = None
        if not (self._running or self.suspended or self._closed):
            if not self._queue:
                answer = await self._admit_now(hold)
            elif self.client.connected:
                carried = self._carriable(hold)
                if carried is not None:
                    answer = await self._admit_now(hold, carried)
                elif self._only_writes():
                    answer = await self._admit_behind_writes(hold, self._admit_args(hold))
        if answer is None:
            args = self._admit_args(hold)
            op = self._post("admit", hold.tenant_id, args, hold=hold, awaited=True)
            answer = await self._answer(op)
        decision = _decision(hold, answer)
        if isinstance(decision, RedisHeld):
            self._live[hold.request_id] = decision
        return decision

    def settle(self, reservation: RedisHeld, attempt: int, tokens: int, usd: float) -> None:
        if attempt in reservation.settled:
            return
        reservation.settled.add(attempt)
        hold = reservation.hold
        self._post(
            "settle",
            hold.tenant_id,
            [hold.request_id, str(attempt), str(tokens), repr(float(usd))],
            spend=(tokens, usd, None),
        )

    def release(self, reservation: RedisHeld, *, answered: bool) -> None:
        if reservation.released:
            return
        reservation.released = True
        if self._live.get(reservation.hold.request_id) is reservation:
            del self._live[reservation.hold.request_id]
        hold = reservation.hold
        answered_arg = "1" if answered else "0"
        last = self._queue[-1] if self._queue else None
        if (
            last is not None
            and last.kind == "settle"
            and last.tenant_id == hold.tenant_id
            and last.args[3] == hold.request_id
        ):
            # Its settle is still waiting for the writer: one script does both.
            last.seq = self._delta(hold.tenant_id, flying=-1)
            last.kind = "finish"
            last.args = [*last.args[:2], "finish", *last.args[3:], answered_arg]
            last.carry = encode_args(*last.args[2:])
            return
        op = self._post("release", hold.tenant_id, [hold.request_id, answered_arg], flying=-1)
        op.carry = encode_args(*op.args[2:])

    def spend(self, tenant_id: str, tokens: int, usd: float) -> None:
        self._spend(tenant_id, tokens, usd, None)

    def spent(self, tenant_id: str) -> Spent:
        """What the server last answered for the tenant, with this edge's unacknowledged
        writes (eventually consistent with other edges' spend)."""
        day, month = periods(self._wall())
        seen = self._seen.get(tenant_id, _Seen())
        tokens_day = seen.day_tokens if seen.day == day else 0
        usd_day = seen.day_usd if seen.day == day else 0.0
        tokens_month = seen.month_tokens if seen.month == month else 0
        usd_month = seen.month_usd if seen.month == month else 0.0
        for delta in self._deltas.get(tenant_id, ()):
            if delta.day == day:
                tokens_day += delta.tokens
                usd_day += delta.usd
            if delta.month == month:
                tokens_month += delta.tokens
                usd_month += delta.usd
        return Spent(tokens_day, usd_day, tokens_month, usd_month)

    def in_flight(self, tenant_id: str) -> int:
        """Places in flight as the server last answered, less this edge's releases since."""
        seen = self._seen.get(tenant_id, _Seen())
        return seen.in_flight + sum(delta.in_flight for delta in self._deltas.get(tenant_id, ()))

    async def seed(self, ledger: UsageLedger) -> None:
        """Seeds the counters from the ledger once per month for all edges: the first edge
        to set the month's marker key does it; the others (and restarts) find the counters
        kept. A ledger that cannot be read leaves the month to the next try. (An edge that
        dies while seeding leaves the month under-counted.)"""
        wall = self._wall()
        day, month = periods(wall)
        marker = f"{self.prefix}seeded:{month}"
        try:
            with trio.fail_after(self.command_timeout):
                first = await self.client.call("SET", marker, "1", "NX", "EX", 40 * 86400)
        except _ERRORS as error:
            raise StoreUnreachable(_failure("seed", error)) from error
        if not first:
            return
        since = month_start(wall)
        try:
            groups = await ledger.billable_spend(since)
        except BaseException:
            # Not seeded after all: the next edge to start (or this one's next try) seeds.
            with trio.move_on_after(self.command_timeout, shield=True):
                with contextlib.suppress(*_ERRORS):
                    await self.client.call("DEL", marker)
            raise
        for group in groups:
            if group.key is None or group.day is None or not group.day.startswith(month):
                continue
            tokens = group.prompt_tokens + group.completion_tokens
            at = wall if group.day == day else since  # an earlier day counts in the month
            self._spend(group.key, tokens, group.cost_usd, at)
        await self.flush()

    # -- beyond the Protocol -----------------------------------------------------------

    async def flush(self) -> None:
        """Wait until every operation posted before the call is written (or given up, or
        parked while the store is suspended)."""
        if self._queue or self._running or self._flights:
            await self._answer(self._post("barrier", "", [], awaited=True))

    async def refresh(self, tenant_id: str) -> None:
        """Read the tenant's state from the server (other edges' spend included)."""
        await self._answer(self._post("read", tenant_id, [], awaited=True))

    def statistics(self) -> RedisLimitsStatistics:
        return RedisLimitsStatistics(
            pending=len(self._queue)
            + len(self._running)
            + sum(len(batch) for batch, _ in self._flights),
            retried=self._retried,
            lost=self._lost,
            parked=len(self._parked),
        )

    async def ping(self) -> None:
        """Whether the server answers now (within :attr:`command_timeout`), past the queue
        of posted operations: raises :class:`~dispatcher.store.seam.StoreUnreachable` if
        not."""
        try:
            with trio.fail_after(self.command_timeout):
                await self.client.call("PING")
        except _ERRORS as error:
            raise StoreUnreachable(_failure("ping", error)) from error

    def suspend(self) -> None:
        """The server is known not to answer: from now on writes are parked (in order), not
        tried, and an awaited operation fails at once, until :meth:`resume`."""
        self._suspension.set()
        self._urgent.set()

    def resume(self) -> None:
        """The server answers again: the parked writes go first, in the order posted."""
        if not self.suspended:
            return
        self._overflowed = False
        self._suspension = trio.Event()
        self._queue.extendleft(reversed(self._parked))
        self._parked.clear()
        self._urgent.set()

    @property
    def suspended(self) -> bool:
        return self._suspension.is_set()

    # -- internals ---------------------------------------------------------------------

    def _wall(self) -> float:
        return self.wall() if self.wall is not None else time.time()

    def _spend(self, tenant_id: str, tokens: int, usd: float, at: float | None) -> None:
        args = [uuid.uuid4().hex, str(tokens), repr(float(usd)), _decimal(at)]
        self._post("spend", tenant_id, args, spend=(tokens, usd, at))

    def _post(
        self,
        kind: _Kind,
        tenant_id: str,
        args: list[str],
        *,
        hold: Hold | None = None,
        awaited: bool = False,
        flying: int = 0,
        spend: tuple[int, float, float | None] | None = None,
    ) -> _Op:
        if self._closed:
            raise trio.ClosedResourceError("the Redis limit store is closed")
        args = [*self._clocks(), kind, *args]
        if flying or spend is not None:
            seq = self._delta(tenant_id, flying=flying, spend=spend)
        else:
            self._seq += 1
            seq = self._seq
        op = _Op(seq, kind, tenant_id, args, hold, trio.Event() if awaited else None)
        self._queue.append(op)
        if awaited:
            self._urgent.set()
        else:
            self._arm()
        return op

    def _arm(self) -> None:
        """A write waits: the writer sends it a linger from now, unless an admission carries
        it first (the first write waiting sets the time; no task is woken)."""
        if self._flush_at == math.inf:
            self._flush_at = trio.current_time() + self.linger
            if self._idle is not None:
                self._idle.deadline = self._flush_at

    def _disarm(self) -> None:
        """An admission took every write waiting: nothing for the writer to send."""
        self._flush_at = math.inf
        if self._idle is not None:
            self._idle.deadline = math.inf

    def _delta(
        self,
        tenant_id: str,
        *,
        flying: int = 0,
        spend: tuple[int, float, float | None] | None = None,
    ) -> int:
        """A new operation's number, with what it changes in the tenant's view until the
        server acknowledges it."""
        self._seq += 1
        tokens, usd, at = spend if spend is not None else (0, 0.0, None)
        day, month = periods(self._wall() if at is None else at)
        delta = _Delta(self._seq, flying, day, month, tokens, usd)
        self._deltas.setdefault(tenant_id, collections.deque()).append(delta)
        return self._seq

    async def _answer(self, op: _Op) -> list[str]:
        assert op.done is not None
        try:
            await op.done.wait()
        except BaseException:
            op.abandoned = True  # not run if not started; a hold it gets is released
            raise
        if isinstance(op.answer, BaseException):
            raise op.answer
        assert op.answer is not None
        return op.answer

    def _clocks(self) -> list[str]:
        if self.clock is None or self.wall is None:
            return ["", ""]
        return [repr(float(self.clock())), repr(float(self.wall()))]

    def _key(self, op: _Op) -> str:
        return self._key_of(op.tenant_id)

    def _key_of(self, tenant_id: str) -> str:
        """The tenant's base key (its hash tag: one cluster slot for all its keys)."""
        return f"{self.prefix}{{{tenant_id}}}"

    async def _run(self, op: _Op) -> list[str]:
        keys = [self._key(op)]
        op.sent = True
        with trio.fail_after(self.command_timeout):
            answer = await self.client.evalsha(_SCRIPT, keys, op.args)
        strings = _strings(answer)
        assert strings is not None, answer
        return strings

    def _own_args(self, hold: Hold) -> list[str]:
        """An admission's own arguments (after the clocks and the operation, before its
        limits)."""
        return [
            hold.request_id,
            str(hold.tokens),
            repr(float(hold.usd)),
            repr(float(self.hold_lease)),
        ]

    def _admit_args(self, hold: Hold) -> list[str]:
        """An admission's arguments (after the clocks and the operation)."""
        return [*self._own_args(hold), *_limit_strings(hold.limits)]

    def _admit_command(self, hold: Hold, carried: _Op | None) -> bytes:
        """The EVALSHA of an admission (:meth:`_admit_args`; then ``carried``'s operation
        and arguments), from parts encoded once: the script and the tenant's key, the
        limits (a few per edge); only the request's own arguments are encoded per call."""
        head = self._heads.get(hold.tenant_id)
        if head is None:
            if len(self._heads) >= _ENCODED_KEEP:
                self._heads.clear()
            sha = self.client.script_sha(_SCRIPT)
            head = encode_args("EVALSHA", sha, 1, self._key_of(hold.tenant_id))
            self._heads[hold.tenant_id] = head
        limits = hold.limits
        tail = self._limit_args.get(limits)
        if tail is None:
            if len(self._limit_args) >= _ENCODED_KEEP:
                self._limit_args.clear()
            tail = self._limit_args[limits] = encode_args(*_limit_strings(limits))
        own = encode_args(*self._clocks(), "admit", *self._own_args(hold))
        if carried is None:
            return join_command(head, own, tail)
        carry = carried.carry if carried.carry is not None else encode_args(*carried.args[2:])
        return join_command(head, own, tail, carry)

    async def _admit_now(self, hold: Hold, carried: _Op | None = None) -> list[str] | None:
        """:meth:`admit`'s own way (see there): the script's answer, or None if the server
        lacks the script (the writer then loads it). ``carried``: the one write waiting
        (:meth:`_carriable`), taken off the queue and run first by the same script; written
        again on its own if the admission fails. A caller that leaves after its script
        may have been sent, or an answer lost, releases what it may hold: releasing a
        request the server does not hold does nothing."""
        self._seq += 1
        seq = self._seq
        command = self._admit_command(hold, carried)
        if carried is not None:
            self._queue.clear()
            self._disarm()  # the writer is not woken for it
        try:
            bound = self.admit_bounded_by
            if bound is not None and bound <= self.command_timeout:
                # The caller's deadline comes first (the edge's guard's).
                reply = await self.client.call_encoded(command)
            else:
                with trio.fail_after(self.command_timeout):
                    reply = await self.client.call_encoded(command)
        except RedisReplyError as error:
            self._again_alone(carried)
            if error.code == "NOSCRIPT":
                return None
            raise StoreUnreachable(f"admit: the server refused it: {error}") from error
        except _ERRORS as error:
            self._again_alone(carried)
            if isinstance(error, _UNREACHABLE) and self.on_unreachable is not None:
                self.on_unreachable(_failure("admit", error))
            self._release_unknown(hold)
            raise StoreUnreachable(_failure("admit", error)) from error
        except BaseException:
            self._again_alone(carried)
            self._release_unknown(hold)
            raise
        answer = _strings(reply)
        assert answer is not None, reply
        self._see(hold.tenant_id, answer, seq)
        self._acknowledge(hold.tenant_id, seq)
        return answer

    def _carriable(self, hold: Hold) -> _Op | None:
        """The one write waiting, if the admission of ``hold`` may run it first in its own
        script: a finish or a release of the same tenant, on the same clocks."""
        queue = self._queue
        if len(queue) != 1:
            return None
        write = queue[0]
        if (
            write.kind in ("finish", "release")
            and write.tenant_id == hold.tenant_id
            and not write.alone
            and write.args[:2] == self._clocks()
        ):
            return write
        return None

    def _only_writes(self) -> bool:
        """Whether the queue holds only writes that may go in a pipeline now (no awaited
        operation, barrier or write going again alone), at most :data:`PIPELINE` - 1."""
        queue = self._queue
        if len(queue) >= PIPELINE:
            return False
        return all(op.done is None and not op.alone for op in queue)

    async def _admit_behind_writes(self, hold: Hold, args: list[str]) -> list[str]:
        """:meth:`admit`'s way when writes wait (see there): they and the admission go as one
        pipeline, written by the caller at once (the link is connected: no scheduler turn
        between taking them off the queue and the wire), their replies handled by the
        receiver, as the writer's pipelines are."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._seq += 1
        args = [*self._clocks(), "admit", *args]
        op = _Op(self._seq, "admit", hold.tenant_id, args, hold, trio.Event())
        batch = [*self._queue, op]
        self._queue.clear()
        self._disarm()  # the writer is not woken for them
        sent = await self._submit(batch)
        self._flights.append((batch, sent))
        self._flown.set()
        return await self._answer(op)

    def _release_unknown(self, hold: Hold) -> None:
        """An admission whose answer never came: a hold it may have taken goes at once,
        not at its lease's end."""
        if not self._closed:
            self._post("release", hold.tenant_id, [hold.request_id, "0"])

    async def _renewer(self) -> None:
        """Renews this edge's leases: its requests keep their places while it lives."""
        every = self.renew_every if self.renew_every is not None else self.hold_lease / 3
        while True:
            await trio.sleep(every)
            tenants: dict[str, list[str]] = {}
            for request_id, held in self._live.items():
                tenants.setdefault(held.hold.tenant_id, []).append(request_id)
            for tenant_id, request_ids in tenants.items():
                self._post("renew", tenant_id, [repr(float(self.hold_lease)), *request_ids])

    async def _writer(self) -> None:
        """Sends the posted operations in order: those queued together as one pipeline,
        written at once, without waiting for the replies of the pipelines before (Redis
        runs one connection's commands in order, so an admission still follows this edge's
        own releases); :meth:`_receiver` handles the replies. A barrier, an operation going
        again alone, and everything while the store is suspended wait for the pipelines in
        flight, then go one at a time; while suspended, writes are parked and awaited
        operations fail at once."""
        queue = self._queue
        while True:
            if not queue:
                self._flush_at = math.inf
            if not queue or not (
                self._urgent.is_set()
                or self._suspension.is_set()
                or trio.current_time() >= self._flush_at
            ):
                # Nothing, or writes only: the next admission may carry them (see the module
                # docstring); they go when they have waited a linger (the scope's deadline).
                self._urgent = trio.Event()  # (set only if nothing was queued: no hurry)
                with trio.CancelScope(deadline=self._flush_at) as self._idle:
                    await self._urgent.wait()
                self._idle = None
                continue
            op = queue.popleft()
            if op.abandoned:
                continue  # its caller left before it ran (an admission: nothing held)
            if op.done is None and self._suspension.is_set():
                self._park(op)
                continue
            batch = self._running = [op]
            try:
                if op.kind == "barrier" or op.alone or self._suspension.is_set():
                    await self._landed()
                    # Writes of the landed pipelines sent back to go alone were posted
                    # before this one: they go first.
                    earlier = 0
                    while earlier < len(queue) and queue[earlier].seq < op.seq:
                        earlier += 1
                    if earlier:
                        queue.insert(earlier, op)
                        continue
                    if not queue:
                        self._flush_at = math.inf  # a write posted from here lingers anew
                    answer = await self._execute(op)
                    self._finish(op, answer)
                    continue
                while (
                    queue
                    and len(batch) < PIPELINE
                    and queue[0].kind != "barrier"
                    and not queue[0].alone
                ):
                    follower = queue.popleft()
                    if not follower.abandoned:
                        batch.append(follower)
                if not queue:
                    self._flush_at = math.inf  # a write posted from here lingers anew
                sent = await self._submit(batch)
            finally:
                self._running = []
            self._flights.append((batch, sent))
            self._flown.set()

    async def _landed(self) -> None:
        """Wait until every pipeline in flight has its replies handled."""
        while self._flights:
            self._all_landed = trio.Event()
            await self._all_landed.wait()

    async def _receiver(self) -> None:
        """Handles the pipelines' replies, in the order they were sent."""
        flights = self._flights
        while True:
            if not flights:
                self._all_landed.set()
                self._flown = trio.Event()
                await self._flown.wait()
                continue
            batch, sent = flights[0]
            answers = await self._pipeline_answers(batch, sent)
            flights.popleft()
            again = [op for op, answer in zip(batch, answers, strict=True) if answer is None]
            for op in again:
                op.alone = True
            self._queue.extendleft(reversed(again))  # first, in their order, one at a time
            if again:
                self._arm()
            for op, answer in zip(batch, answers, strict=True):
                if answer is not None:
                    self._finish(op, answer)

    async def _submit(self, batch: list[_Op]) -> Submitted | BaseException:
        """Write ``batch``'s scripts as one pipeline (or the error that kept them from the
        wire)."""
        sha = self.client.script_sha(_SCRIPT)
        commands: list[list[Arg]] = [["EVALSHA", sha, 1, self._key(op), *op.args] for op in batch]
        for op in batch:
            op.sent = True
        try:
            with trio.fail_after(self.command_timeout):
                return await self.client.submit(commands)
        except _ERRORS as error:
            return error

    def _finish(self, op: _Op, answer: list[str] | BaseException | _Parked) -> None:
        """What an operation's answer does: parked, acknowledged, told to its caller; an
        admission's hold whose caller left (or whose answer was lost) is released."""
        if isinstance(answer, _Parked):
            self._park(op)
            return
        if op.sent:  # (one failed at once acknowledges nothing: parked writes precede it)
            self._acknowledge(op.tenant_id, op.seq)
        if op.done is not None:
            op.answer = answer
            op.done.set()
        if op.kind != "admit" or self._closed:
            return
        assert op.hold is not None
        if isinstance(answer, BaseException) and op.sent:
            # The script may have run and its answer been lost (a command past its
            # deadline): a hold it took goes at once, not at its lease's end. (Releasing
            # a request the server does not hold does nothing.)
            self._post("release", op.tenant_id, [op.hold.request_id, "0"])
        elif isinstance(answer, list) and op.left() and answer[2] == "held":
            self.release(RedisHeld(op.hold, ()), answered=False)

    def _again_alone(self, write: _Op | None) -> None:
        """A write an admission carried, whose admission failed (it may or may not have run:
        it is idempotent on the server), goes again on its own, in the order posted
        (:meth:`_writer` puts a write going alone behind those posted before it)."""
        if write is None:
            return
        if self._closed:  # (the writer is gone)
            self._lost += 1
            return
        write.alone = True
        self._queue.appendleft(write)
        self._urgent.set()

    def _park(self, op: _Op) -> None:
        """Keep a write until :meth:`resume` (the oldest goes beyond :data:`PARK_LIMIT`)."""
        self._parked.append(op)
        if len(self._parked) > PARK_LIMIT:
            oldest = self._parked.popleft()
            self._give_up(oldest, "the server was down with too many writes waiting")

    def _give_up(self, op: _Op, why: str) -> None:
        self._lost += 1
        self._acknowledge(op.tenant_id, op.seq)
        if not self._overflowed:  # once per suspension, not once per write
            self._overflowed = True
            log.error("limit store: writes given up (%s), the oldest first", why)

    async def _pipeline_answers(
        self, batch: list[_Op], sent: Submitted | BaseException
    ) -> list[list[str] | BaseException | None]:
        """Each script's answer of a pipeline, in order, or None for a write to go again the
        one-at-a-time way (:meth:`_execute`: loaded, retried, parked) -- one the server
        answered with an error (NOSCRIPT after a restart, WRONGTYPE), or every write of a
        pipeline that failed (each is idempotent on the server). An admission of a failed
        pipeline gets the error (a hold it may have taken is released: :meth:`_finish`)."""
        replies: list[Reply] | None = None
        error: BaseException
        if isinstance(sent, BaseException):
            error = sent
        else:
            try:
                with trio.fail_after(self.command_timeout):
                    replies = await sent.replies()
            except _ERRORS as failed:
                error = failed
        if replies is None:
            if isinstance(error, _UNREACHABLE) and self.on_unreachable is not None:
                self.on_unreachable(_failure("pipeline", error))
            return [
                StoreUnreachable(_failure(op.kind, error)) if op.done is not None else None
                for op in batch
            ]
        answers: list[list[str] | BaseException | None] = []
        for op, reply in zip(batch, replies, strict=True):
            answer = _strings(reply)
            if answer is not None:
                self._see(op.tenant_id, answer, op.seq)
                answers.append(answer)
            elif op.done is not None and not (
                isinstance(reply, ReplyError) and reply.code == "NOSCRIPT"
            ):
                answers.append(StoreUnreachable(f"{op.kind}: the server refused it: {reply!r}"))
            else:
                answers.append(None)
        return answers

    async def _execute(self, op: _Op) -> list[str] | BaseException | _Parked:
        """A write is tried again (it is idempotent on the server) unless the store is
        suspended (it is then parked); an awaited operation's error goes to its caller."""
        if op.kind == "barrier":
            return []
        if self._suspension.is_set():
            return StoreUnreachable(f"limit store: {op.kind} not sent: the server is not answering")
        for attempt in range(WRITE_ATTEMPTS):
            try:
                answer = await self._run(op)
            except _ERRORS as error:
                if op.done is not None:
                    return StoreUnreachable(_failure(op.kind, error))
                if isinstance(error, _UNREACHABLE) and self.on_unreachable is not None:
                    self.on_unreachable(_failure(op.kind, error))
                if self._suspension.is_set():
                    return _PARKED
                if attempt + 1 == WRITE_ATTEMPTS:
                    self._lost += 1
                    log.exception(
                        "limit store: %s of %s given up after %d tries",
                        op.kind,
                        op.tenant_id,
                        WRITE_ATTEMPTS,
                    )
                    return error
                self._retried += 1
                log.warning(
                    "limit store: %s of %s failed, retrying: %s",
                    op.kind,
                    op.tenant_id,
                    _failure(op.kind, error),
                )
                with trio.move_on_after(0.05 * 2**attempt):
                    await self._suspension.wait()  # suspended: parked, not tried again
                if self._suspension.is_set():
                    return _PARKED
                continue
            self._see(op.tenant_id, answer, op.seq)
            return answer
        raise AssertionError("unreachable")

    def _close_parked(self) -> None:
        """Closing while suspended: the parked writes are given up (counted, logged once)."""
        parked, self._parked = self._parked, collections.deque()
        if parked:
            self._lost += len(parked)
            log.error(
                "limit store: %d writes given up: the server did not answer before the store "
                "closed (settles, releases and spends of this edge's requests not counted in "
                "Redis)",
                len(parked),
            )

    def _see(self, tenant_id: str, answer: list[str], seq: int) -> None:
        """Keep the tenant's snapshot of an answer, unless a later operation's is kept
        already (an admission sent by its caller is answered before the writer handles the
        replies of the pipelines sent before it)."""
        if self._seen_seq.get(tenant_id, 0) > seq:
            return
        self._seen_seq[tenant_id] = seq
        in_flight, day, day_tokens, day_usd, month, month_tokens, month_usd = answer[-7:]
        self._seen[tenant_id] = _Seen(
            int(in_flight),
            day,
            int(float(day_tokens)),
            float(day_usd),
            month,
            int(float(month_tokens)),
            float(month_usd),
        )

    def _acknowledge(self, tenant_id: str, seq: int) -> None:
        deltas = self._deltas.get(tenant_id)
        while deltas and deltas[0].seq <= seq:
            deltas.popleft()
        if deltas is not None and not deltas:
            del self._deltas[tenant_id]


def _decision(hold: Hold, answer: list[str]) -> RedisHeld | Refusal:
    """The admit script's answer: ``now, wall, held|refused, limit, used, retry_after,
    requests, oldest request, charged, oldest charge`` then the snapshot."""
    now, wall = float(answer[0]), float(answer[1])
    outcome, limit, used, retry = answer[2:6]
    requests, oldest_request, charged, oldest_charge = answer[6:10]
    headers = rate_headers(
        hold.limits,
        now,
        int(requests),
        float(oldest_request) if oldest_request else None,
        int(float(charged)),
        float(oldest_charge) if oldest_charge else None,
    )
    if outcome == "held":
        return RedisHeld(hold, headers)
    name = cast(LimitName, limit)
    message, retry_after = _refusal(hold, name, used, float(retry), wall)
    return Refusal(name, message, retry_after, headers)


def _refusal(
    hold: Hold, name: LimitName, used: str, retry: float, wall: float
) -> tuple[str, float]:
    """The message and ``Retry-After`` of a refusal, as :class:`LimitCounters` gives them."""
    spent: float = float(used)
    if name.startswith("budget_"):
        if "tokens" in name:
            spent = int(spent)
        return refusal_message(hold.limits, name, spent, 0), seconds_to_next(
            wall, month=name.endswith("_month")
        )
    if name == "max_concurrent":
        return refusal_message(hold.limits, name, spent, 0), CONCURRENCY_RETRY_AFTER
    return refusal_message(hold.limits, name, spent, hold.tokens), retry


@asynccontextmanager
async def open_redis_limits(
    url: str,
    *,
    prefix: str = "dispatcher:limits:",
    hold_lease: float = HOLD_LEASE,
    renew_every: float | None = None,
    clock: Callable[[], float] | None = None,
    wall: Callable[[], float] | None = None,
    command_timeout: float = COMMAND_TIMEOUT,
) -> AsyncIterator[RedisLimits]:
    """The limit store on the Redis at ``url`` (``redis://host:port/db``), with its writer
    running until the block is left; leaving it writes what was posted (at most
    :data:`CLOSE_TIMEOUT` seconds). A place in flight is a lease of ``hold_lease`` seconds,
    renewed every ``renew_every`` (a third of the lease by default) while the request is held.
    ``clock`` and ``wall`` (both or neither) replace the server's clocks: for tests only,
    where every edge must share them. A command past ``command_timeout`` seconds counts as
    failed."""
    if (clock is None) != (wall is None):
        raise ValueError("give both clock and wall, or neither (the server's TIME)")
    # Lazily connected: a Redis down at start is an outage for the edge's guard, not a crash.
    async with open_redis_link(url, connect_timeout=command_timeout, lazy=True) as client:
        store = RedisLimits(
            client, prefix, hold_lease, renew_every, clock, wall, command_timeout=command_timeout
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store._writer)
            nursery.start_soon(store._receiver)
            nursery.start_soon(store._renewer)
            try:
                yield store
            finally:
                with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
                    await store.flush()
                store._closed = True
                nursery.cancel_scope.cancel()
                store._close_parked()
