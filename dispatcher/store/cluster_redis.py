"""The edges of one cluster on Redis (>= 7): :class:`RedisCluster`, the
:class:`~dispatcher.store.seam.Cluster` of several edges sharing a Redis, opened by
:func:`open_redis_cluster` (the ``redis`` extra: ``coredis``).

* **Heartbeats.** Each edge writes its record (id, address, version, started, in flight, its
  latest reload) every ``heartbeat`` seconds, with an expiry of :data:`MISSED` heartbeats, by
  one script on the server's clock: an edge that dies (SIGKILL, a lost network) leaves the list
  within the expiry; one that closes cleanly deletes its record at once. Two processes given
  one id are told apart (each record holds its process's ``instance``): both log it.
* **The list** (:meth:`RedisCluster.edges`) is read from the server when asked, one script,
  which also forgets the expired records. When Redis does not answer it is the last list read,
  saying so.
* **Reloads.** :meth:`RedisCluster.publish_reload` publishes on a channel every edge
  subscribes to; each other edge runs its ``on_reload`` (its own config file, refused on its
  own when broken), then beats at once, so the list shows its reload's outcome.
* **Failures.** The heartbeat and the subscriber are tasks of the nursery of
  :func:`open_redis_cluster`: a Redis error is logged once per outage (and once when it is
  over) and retried; it never ends the edge.

Keys, under ``prefix`` (``dispatcher:cluster:``): ``edges`` (a hash, id -> record),
``expiry`` (a sorted set, id -> when its record expires, in the server's milliseconds), the
channel ``reload``.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, cast

import attrs
import coredis
import coredis.exceptions
import orjson
import trio

from ..shared.excgroups import leaves
from .cluster import EdgeIdentity, decode_record, encode_record, record_of
from .seam import EdgeList, EdgeReport

__all__ = [
    "HEARTBEAT",
    "MISSED",
    "RedisCluster",
    "open_redis_cluster",
]

log = logging.getLogger("dispatcher.store.cluster")

HEARTBEAT: Final = 5.0
"""Seconds between an edge's heartbeats."""
MISSED: Final = 3
"""Heartbeats an edge may miss before the others forget it."""
CALL_TIMEOUT: Final = 2.0
"""Seconds one heartbeat, listing or publish may take before it counts as failed."""
LEAVE_TIMEOUT: Final = 2.0
"""Seconds a closing edge tries to delete its record (else it expires)."""
RESUBSCRIBE_DELAY: Final = 1.0
"""Seconds before the reload subscription is tried again after it failed."""
_ERRORS: Final = (coredis.exceptions.RedisError, OSError, trio.TooSlowError)

# The server's clock, in milliseconds. Records past their expiry are forgotten by whoever
# looks next (a heartbeat or a listing).
_NOW_AND_FORGET: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(dead) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[1], id)
end
"""

_HEARTBEAT: Final = (
    _NOW_AND_FORGET
    + """
-- ARGV: id, instance, record (JSON), expiry in ms. Returns {now, the address of another
-- live process holding the same id, or ''}.
local other = ''
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local ok, previous = pcall(cjson.decode, old)
  if ok and type(previous) == 'table' and previous['instance'] ~= ARGV[2] then
    other = tostring(previous['address'] or '?')
  end
end
local record = cjson.decode(ARGV[3])
record['heard_ms'] = now
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(record))
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[1])
return {tostring(now), other}
"""
)

_LIST: Final = (
    _NOW_AND_FORGET
    + """
-- Returns {now, record...} of the live edges.
local out = {tostring(now)}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf')) do
  table.insert(out, redis.call('HGET', KEYS[1], id) or '')
end
return out
"""
)

_LEAVE: Final = """
-- ARGV: id, instance. Deletes the record if it is this process's.
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local ok, previous = pcall(cjson.decode, old)
  if ok and type(previous) == 'table' and previous['instance'] == ARGV[2] then
    redis.call('HDEL', KEYS[1], ARGV[1])
    redis.call('ZREM', KEYS[2], ARGV[1])
    return 1
  end
end
return 0
"""


def _where(url: str) -> str:
    """The server ``url`` names, without its password: for log lines and errors."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}"


def _reason(error: BaseException) -> str:
    return "; ".join(f"{type(leaf).__name__}: {leaf}" for leaf in leaves(error))


@attrs.define
class _Outage:
    """One background job's trouble with Redis, said once when it starts and once when it
    ends, not at every retry."""

    what: str
    where: str
    since: float | None = None

    def failed(self, error: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.warning(
                "cluster: %s on Redis at %s failed (retrying; logged again when it works): %s",
                self.what,
                self.where,
                _reason(error),
            )

    def worked(self) -> None:
        if self.since is not None:
            log.info(
                "cluster: %s on Redis at %s works again after %.1f s",
                self.what,
                self.where,
                time.monotonic() - self.since,
            )
            self.since = None


def _nothing_in_flight() -> EdgeReport:
    return EdgeReport(started_at=time.time(), in_flight=0)


@attrs.define(eq=False)
class RedisCluster:
    """The edges sharing one Redis (see the module docstring). Open it with
    :func:`open_redis_cluster`."""

    client: coredis.Redis[str]
    identity: EdgeIdentity
    heartbeat: float = HEARTBEAT
    prefix: str = "dispatcher:cluster:"
    where: str = "?"
    """The server, for log lines (no password)."""
    instance: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    """This process: two edges given one id are told apart by it."""
    _report: Callable[[], EdgeReport] = attrs.field(init=False, default=_nothing_in_flight)
    _on_reload: Callable[[], Awaitable[None]] | None = attrs.field(init=False, default=None)
    _bound: trio.Event = attrs.field(init=False, factory=trio.Event)
    _beat_now: trio.Event = attrs.field(init=False, factory=trio.Event)
    _last: EdgeList | None = attrs.field(init=False, default=None)
    _subscribed: bool = attrs.field(init=False, default=False)
    _shared_id_with: str | None = attrs.field(init=False, default=None)
    _scripts: dict[str, Any] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        for name, text in (("beat", _HEARTBEAT), ("list", _LIST), ("leave", _LEAVE)):
            self._scripts[name] = self.client.register_script(text)

    @property
    def edge_id(self) -> str:
        return self.identity.id

    @property
    def channel(self) -> str:
        return f"{self.prefix}reload"

    @property
    def _keys(self) -> list[str]:
        return [f"{self.prefix}edges", f"{self.prefix}expiry"]

    # -- the Cluster --------------------------------------------------------------------

    def bind(
        self, report: Callable[[], EdgeReport], on_reload: Callable[[], Awaitable[None]]
    ) -> None:
        self._report, self._on_reload = report, on_reload
        self._bound.set()

    def changed(self) -> None:
        self._beat_now.set()

    async def edges(self) -> EdgeList:
        """Read from the server; when it does not answer (within :data:`CALL_TIMEOUT`), the
        last list read (or this edge alone), with the error."""
        try:
            with trio.fail_after(CALL_TIMEOUT):
                answer = await self._run("list", [])
        except _ERRORS as error:
            reason = f"Redis at {self.where} did not answer: {_reason(error)}"
            last = self._last
            if last is not None:
                return attrs.evolve(last, error=reason)
            alone = record_of(self.identity, self._report(), 0.0)
            return EdgeList(edges=(alone,), as_of=time.time(), error=reason)
        now_ms = int(answer[0])
        records = [record for text in answer[1:] if (record := decode_record(text, now_ms))]
        self._last = EdgeList(
            edges=tuple(sorted(records, key=lambda record: record.id)), as_of=now_ms / 1000
        )
        return self._last

    async def publish_reload(self) -> int:
        message = orjson.dumps({"from": self.identity.id, "instance": self.instance}).decode()
        try:
            with trio.fail_after(CALL_TIMEOUT):
                receivers = await self.client.publish(self.channel, message)
        except _ERRORS as error:
            raise RuntimeError(
                f"cannot tell the other edges to reload: Redis at {self.where} did not "
                f"answer ({_reason(error)}); reload each edge on its own (SIGHUP)"
            ) from None
        # This edge's own subscription hears it too (and skips it).
        return max(0, receivers - (1 if self._subscribed else 0))

    # -- the heartbeat ------------------------------------------------------------------

    async def beat(self) -> None:
        """Write this edge's record once (raises Redis's errors)."""
        record = encode_record(self.identity, self.instance, self._report())
        expiry_ms = round(self.heartbeat * MISSED * 1000)
        _, other = await self._run(
            "beat", [self.identity.id, self.instance, record, str(expiry_ms)]
        )
        if other and other != self._shared_id_with:
            log.warning(
                "cluster: the edge id %r is also used by the edge at %s: the list shows one "
                "of them; give each edge its own store.edge_id",
                self.identity.id,
                other,
            )
        self._shared_id_with = other or None

    async def leave(self) -> bool:
        """Delete this edge's record (if it still is this process's); False if Redis did
        not answer (the record then expires)."""
        try:
            with trio.fail_after(LEAVE_TIMEOUT):
                await self._run("leave", [self.identity.id, self.instance])
        except _ERRORS as error:
            log.warning(
                "cluster: could not remove this edge from Redis at %s (it expires within "
                "%.0f s): %s",
                self.where,
                self.heartbeat * MISSED,
                _reason(error),
            )
            return False
        return True

    async def _heartbeats(self, task_status: trio.TaskStatus[None]) -> None:
        """Beat every :attr:`heartbeat` seconds, or at once when :meth:`changed`; started
        after the first try, whatever it gave."""
        outage = _Outage("the heartbeat", self.where)
        started = False
        while True:
            try:
                with trio.fail_after(CALL_TIMEOUT):
                    await self.beat()
            except _ERRORS as error:
                outage.failed(error)
            else:
                outage.worked()
            if not started:
                task_status.started()
                started = True
            with trio.move_on_after(self.heartbeat):
                await self._beat_now.wait()
            self._beat_now = trio.Event()

    async def _run(self, script: str, args: Sequence[str]) -> list[str]:
        answer = await self._scripts[script](keys=self._keys, args=list(args))
        if not isinstance(answer, list):
            return [str(answer)]
        return [str(item) for item in cast(Sequence[Any], answer)]

    # -- reloads ------------------------------------------------------------------------

    async def _subscriber(self) -> None:
        """Listen for reloads (once the edge is bound), resubscribing after any failure."""
        await self._bound.wait()
        outage = _Outage("the reload subscription", self.where)
        while True:
            try:
                async with self.client.pubsub(
                    channels=[self.channel], ignore_subscribe_messages=True, retry_policy=None
                ) as pubsub:
                    self._subscribed = True
                    outage.worked()
                    async for message in pubsub:
                        await self._heard(message.get("data"))
            except Exception as error:  # whatever it is, it must not end the edge
                outage.failed(error)
            finally:
                self._subscribed = False
            await trio.sleep(RESUBSCRIBE_DELAY)

    async def _heard(self, data: object) -> None:
        try:
            asked: Any = orjson.loads(data if isinstance(data, str | bytes) else "")
            sender, instance = str(asked["from"]), str(asked["instance"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("cluster: ignored a message on %s that is not a reload", self.channel)
            return
        if instance == self.instance or self._on_reload is None:
            return  # our own: this edge reloaded before it published
        log.info("cluster: the edge %s asked every edge to reload its config", sender)
        try:
            await self._on_reload()
        except Exception:  # the callback's failure is the edge's, not ours
            log.exception("cluster: the reload asked by %s failed", sender)
        self.changed()


@asynccontextmanager
async def open_redis_cluster(
    url: str,
    identity: EdgeIdentity,
    *,
    heartbeat: float = HEARTBEAT,
    prefix: str = "dispatcher:cluster:",
) -> AsyncIterator[RedisCluster]:
    """This edge among the others on the Redis at ``url``: its heartbeat (the first one
    tried before this returns) and its reload subscription run until the block is left;
    leaving it deletes this edge's record (at most :data:`LEAVE_TIMEOUT` seconds; else it
    expires after :data:`MISSED` heartbeats). Redis being down at start is logged, not
    raised: the heartbeat retries."""
    client: coredis.Redis[str] = coredis.Redis.from_url(url, decode_responses=True)
    async with client:
        cluster = RedisCluster(client, identity, heartbeat, prefix, _where(url))
        async with trio.open_nursery() as nursery:
            await nursery.start(cluster._heartbeats)
            nursery.start_soon(cluster._subscriber)
            try:
                yield cluster
            finally:
                nursery.cancel_scope.cancel(reason="the edge is leaving the cluster")
                with trio.move_on_after(LEAVE_TIMEOUT + 1, shield=True):
                    await cluster.leave()
