"""One connection to Redis, driven by Trio over the sans-IO :mod:`.resp`:
:func:`open_redis_link` opens a :class:`RedisLink`; :meth:`RedisLink.call` sends a command and
answers its reply, :meth:`RedisLink.call_many` sends several in one write (a pipeline),
:meth:`RedisLink.evalsha` runs a Lua script by its SHA1, loading it when the server lacks it.

How it runs (the hot path costs one scheduler turn of the caller and one of the reader):

* **Writes** are made by the caller, synchronously, on the non-blocking socket: a command is
  whole on the wire, or whole in the link's outgoing buffer, before the caller can be
  cancelled, so a cancelled caller never leaves half a command behind. When the socket's
  buffer is full the rest waits in the link's buffer and a flusher task (in the link's
  nursery, not in any caller's cancel scope) writes it when the socket is writable; later
  commands queue behind it, so the order on the wire is the order of the calls.
* **Replies** are read by one reader task per connection and handed FIFO to the waiting
  callers (a reply for a caller that was cancelled is read and dropped: the connection stays
  in step). Many tasks may call at once: their commands are pipelined.
* **Errors**: an error reply raises :class:`RedisReplyError` from :meth:`~RedisLink.call`
  (the connection is fine); in :meth:`~RedisLink.call_many` it is a
  :class:`~.resp.ReplyError` value among the replies. A connection that fails (refused, reset,
  closed by the server, out of step, a write stalled for ``write_timeout``) fails every
  caller waiting on it with :class:`RedisLinkError` (an :class:`OSError`); the link then
  **reconnects on the next call** (AUTH and SELECT again). What was in flight is not resent:
  the caller decides whether its command may run twice.
* Leaving :func:`open_redis_link` closes the connection: waiters get :class:`RedisLinkError`,
  later calls :class:`trio.ClosedResourceError`.

URLs: ``redis://[[user]:password@]host[:port][/db]`` and ``unix://[[user]:password@]/path
[?db=N]``. ``rediss://`` (TLS) is refused for now (see :func:`parse_redis_url`).
"""

from __future__ import annotations

import collections
import hashlib
import socket
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Final

import attrs
import outcome
import trio

from .resp import (
    NEED_DATA,
    Arg,
    Reply,
    ReplyError,
    RespParser,
    RespProtocolError,
    encode_command,
    encode_commands,
)

__all__ = [
    "REDIS_CONNECT_TIMEOUT",
    "REDIS_WRITE_TIMEOUT",
    "RedisAddress",
    "RedisLink",
    "RedisLinkError",
    "RedisLinkStatistics",
    "RedisReplyError",
    "Submitted",
    "open_redis_link",
    "parse_redis_url",
]

REDIS_CONNECT_TIMEOUT: Final = 5.0
"""Seconds to connect, AUTH and SELECT."""
REDIS_WRITE_TIMEOUT: Final = 10.0
"""Seconds a write may wait for the socket to take more bytes before the link is broken."""
_READ_SIZE: Final = 64 * 1024


class RedisLinkError(OSError):
    """The connection to Redis failed or broke (or AUTH/SELECT was refused): the command may
    or may not have run. The next call reconnects."""


class RedisReplyError(Exception):
    """Redis answered the command with an error (``reply.code``: ``ERR``, ``NOSCRIPT``,
    ``WRONGTYPE`` ...); the connection is fine."""

    def __init__(self, reply: ReplyError) -> None:
        super().__init__(reply.message)
        self.reply = reply

    @property
    def code(self) -> str:
        return self.reply.code


@attrs.frozen(kw_only=True)
class RedisAddress:
    """Where a link connects and how it logs in (see :func:`parse_redis_url`)."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None
    """A Unix socket's path (``unix://``); then host and port are unused."""
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    db: int = 0

    def describe(self) -> str:
        """Where, for messages (never the password)."""
        if self.path is not None:
            return f"unix://{self.path} db {self.db}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{host}:{self.port}/{self.db}"


def parse_redis_url(url: str) -> RedisAddress:
    """``redis://[[user]:password@]host[:port][/db]`` or ``unix://[[user]:password@]/path
    [?db=N]`` (user and password percent-decoded). Raises :class:`ValueError` naming what is
    wrong (never echoing the password). ``rediss://`` is refused: this link speaks no TLS yet."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "rediss":
        raise ValueError(
            "rediss:// (Redis over TLS) is not supported by the Redis link yet: use redis:// "
            "on a private network or a TLS tunnel (stunnel, spiped) to the server"
        )
    if scheme not in ("redis", "unix"):
        raise ValueError(
            f"a Redis URL starts with redis:// or unix://, not {scheme or 'nothing'}:// "
            "(redis://[:password@]host[:port][/db])"
        )
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"db"})
    if unknown:
        raise ValueError(f"the Redis URL's options {unknown} are not supported (only db=N)")
    username = urllib.parse.unquote(parts.username) if parts.username else None
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    if username is not None and password is None:
        raise ValueError("the Redis URL names a user without a password (user:password@)")
    db_text = query["db"][-1] if "db" in query else ""
    if scheme == "unix":
        if not parts.path:
            raise ValueError("a unix:// Redis URL needs the socket's path: unix:///run/redis.sock")
        path: str | None = urllib.parse.unquote(parts.path)
        host, port = "localhost", 6379
    else:
        path = None
        host = parts.hostname or "localhost"
        try:
            port = parts.port or 6379
        except ValueError:
            raise ValueError("the Redis URL's port is not a number from 1 to 65535") from None
        db_text = parts.path.strip("/") or db_text
    if db_text and not (db_text.isascii() and db_text.isdigit()):
        raise ValueError(f"the Redis URL's database must be a number, not {db_text!r}")
    return RedisAddress(
        host=host,
        port=port,
        path=path,
        username=username,
        password=password,
        db=int(db_text or 0),
    )


@attrs.frozen(kw_only=True)
class RedisLinkStatistics:
    connected: bool
    waiting: int
    """Callers waiting for replies on the current connection (cancelled ones included until
    their replies are read)."""
    buffered: int
    """Bytes of commands waiting for the socket to take them."""
    connects: int
    """Connections made so far (1 + the reconnections)."""


@attrs.define(eq=False, slots=True)
class _Waiter:
    task: trio.lowlevel.Task | None
    """None once its caller was cancelled (or for a submission): its replies are read and
    dropped, or handed to :attr:`done`'s waiter."""
    expected: int
    replies: list[Reply]
    done: trio.Event | None = None
    """A submission's (:meth:`RedisLink.submit`): set when its replies, or its error, are in."""
    error: RedisLinkError | None = None


@attrs.frozen(eq=False)
class Submitted:
    """Commands written by :meth:`RedisLink.submit`, whose replies are still to come."""

    _waiter: _Waiter

    async def replies(self) -> list[Reply]:
        """Their replies in order, an error reply as a :class:`~.resp.ReplyError` value;
        :class:`RedisLinkError` if the connection failed first. Leaving the wait (cancelled)
        leaves the replies to be read and dropped."""
        waiter = self._waiter
        assert waiter.done is not None
        await waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        return waiter.replies


@attrs.define(eq=False)
class _Connection:
    """One socket and what is in flight on it."""

    sock: trio.socket.SocketType
    raw: socket.socket
    """The same socket, for synchronous sends and receives (it is non-blocking)."""
    where: str
    link: RedisLink
    parser: RespParser = attrs.field(factory=RespParser)
    waiters: collections.deque[_Waiter] = attrs.field(factory=collections.deque)
    out: bytearray = attrs.field(factory=bytearray)
    """Bytes of commands the socket did not take yet (a flusher is writing them)."""
    failure: RedisLinkError | None = None

    def write(self, data: bytes) -> None:
        """Put ``data`` on the wire after what came before; never blocks."""
        if self.failure is not None:
            raise self._error()
        if self.out:
            self.out += data
            return
        try:
            sent = self.raw.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.fail(exc, "writing to Redis failed")
            raise self._error() from exc
        if sent < len(data):
            self.out += memoryview(data)[sent:]
            self.link._nursery.start_soon(self._flush)

    async def _flush(self) -> None:
        try:
            with trio.move_on_after(self.link.write_timeout) as stalled:
                while self.out:
                    await trio.lowlevel.wait_writable(self.raw)
                    try:
                        sent = self.raw.send(self.out)
                    except BlockingIOError:
                        continue
                    del self.out[:sent]
                    stalled.deadline = trio.current_time() + self.link.write_timeout
            if stalled.cancelled_caught:
                self.fail(None, f"Redis took no bytes for {self.link.write_timeout} s")
        except trio.ClosedResourceError:
            pass  # failed and closed meanwhile
        except OSError as exc:
            self.fail(exc, "writing to Redis failed")

    async def read(self) -> None:
        """The connection's reader: replies to their waiters, in order."""
        buffer = bytearray(_READ_SIZE)
        view = memoryview(buffer)
        parser, waiters = self.parser, self.waiters
        try:
            while True:
                await trio.lowlevel.wait_readable(self.raw)
                try:
                    size = self.raw.recv_into(buffer)
                except BlockingIOError:
                    continue
                if not size:
                    self.fail(None, "Redis closed the connection")
                    return
                parser.feed(view[:size])
                while (reply := parser.next_reply()) is not NEED_DATA:
                    if not waiters:
                        self.fail(None, "Redis sent a reply no command asked for")
                        return
                    waiter = waiters[0]
                    waiter.replies.append(reply)
                    if len(waiter.replies) == waiter.expected:
                        waiters.popleft()
                        if waiter.done is not None:
                            waiter.done.set()
                        elif waiter.task is not None:
                            trio.lowlevel.reschedule(waiter.task, outcome.Value(waiter.replies))
        except trio.ClosedResourceError:
            pass  # failed and closed meanwhile
        except RespProtocolError as exc:
            self.fail(exc, f"Redis sent what is not RESP2 ({exc})")
        except OSError as exc:
            self.fail(exc, "reading from Redis failed")

    def fail(self, cause: BaseException | None, why: str) -> None:
        """Close the socket; every waiter gets a :class:`RedisLinkError`."""
        if self.failure is not None:
            return
        self.failure = RedisLinkError(f"{why} ({self.where})")
        self.failure.__cause__ = cause
        if self.link._conn is self:
            self.link._conn = None
        self.sock.close()  # wakes the reader and a flusher with ClosedResourceError
        waiters, self.waiters = self.waiters, collections.deque()
        for waiter in waiters:
            if waiter.done is not None:
                waiter.error = self._error()
                waiter.error.__cause__ = cause
                waiter.done.set()
            elif waiter.task is not None:
                error = self._error()
                error.__cause__ = cause
                trio.lowlevel.reschedule(waiter.task, outcome.Error(error))

    def _error(self) -> RedisLinkError:
        assert self.failure is not None
        return RedisLinkError(*self.failure.args)


def _abandon(waiter: _Waiter) -> trio.lowlevel.Abort:
    waiter.task = None
    return trio.lowlevel.Abort.SUCCEEDED


@attrs.define(eq=False)
class RedisLink:
    """A connection to one Redis (see the module docstring). Open it with
    :func:`open_redis_link`."""

    address: RedisAddress
    connect_timeout: float
    write_timeout: float
    _nursery: trio.Nursery
    _conn: _Connection | None = None
    _connecting: trio.Lock = attrs.field(factory=trio.Lock)
    _closed: bool = False
    _connects: int = 0
    _shas: dict[str, str] = attrs.field(factory=dict)

    async def call(self, *args: Arg) -> Reply:
        """Send one command; its reply. An error reply raises :class:`RedisReplyError`; a
        failed connection :class:`RedisLinkError`."""
        (reply,) = await self._send(encode_command(*args), 1)
        if isinstance(reply, ReplyError):
            raise RedisReplyError(reply)
        return reply

    async def call_encoded(self, command: bytes) -> Reply:
        """:meth:`call` of a command already encoded (:func:`~.resp.join_command`: its parts
        encoded once by the caller)."""
        (reply,) = await self._send(command, 1)
        if isinstance(reply, ReplyError):
            raise RedisReplyError(reply)
        return reply

    async def call_many(self, commands: Sequence[Sequence[Arg]]) -> list[Reply]:
        """Send the commands in one write; their replies in order, an error reply as a
        :class:`~.resp.ReplyError` value (not atomic: wrap them in MULTI/EXEC for that)."""
        if not commands:
            await trio.lowlevel.checkpoint()
            return []
        return await self._send(encode_commands(commands), len(commands))

    async def submit(self, commands: Sequence[Sequence[Arg]]) -> Submitted:
        """Write the commands now, in order after every command written before, and return
        without waiting for their replies (:meth:`Submitted.replies`): a pipeline whose
        sender goes on writing while the replies come. Connects first if need be (the only
        wait); :class:`RedisLinkError` if the connection is broken."""
        await trio.lowlevel.checkpoint_if_cancelled()
        conn = self._conn
        if conn is None:
            conn = await self._connect()
        conn.write(encode_commands(commands))
        waiter = _Waiter(None, len(commands), [], trio.Event())
        conn.waiters.append(waiter)
        return Submitted(waiter)

    @property
    def connected(self) -> bool:
        """A connection is up: :meth:`submit` writes at once, without a scheduler turn."""
        return self._conn is not None

    def script_sha(self, script: str) -> str:
        """The SHA1 EVALSHA names ``script`` by (for a pipeline of EVALSHAs: a NOSCRIPT
        reply in it means the server must load it, as :meth:`evalsha` does)."""
        sha = self._shas.get(script)
        if sha is None:
            sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
        return sha

    async def evalsha(
        self, script: str, keys: Sequence[Arg] = (), args: Sequence[Arg] = ()
    ) -> Reply:
        """Run the Lua ``script`` by its SHA1 (EVALSHA); if the server does not have it
        (NOSCRIPT: a restart, SCRIPT FLUSH), load it and run it, in one round trip."""
        sha = self.script_sha(script)
        command = ("EVALSHA", sha, len(keys), *keys, *args)
        try:
            return await self.call(*command)
        except RedisReplyError as exc:
            if exc.code != "NOSCRIPT":
                raise
        loaded, reply = await self.call_many([("SCRIPT", "LOAD", script), command])
        for answer in (loaded, reply):
            if isinstance(answer, ReplyError):
                raise RedisReplyError(answer)
        return reply

    def statistics(self) -> RedisLinkStatistics:
        conn = self._conn
        return RedisLinkStatistics(
            connected=conn is not None,
            waiting=len(conn.waiters) if conn is not None else 0,
            buffered=len(conn.out) if conn is not None else 0,
            connects=self._connects,
        )

    async def _send(self, data: bytes, expected: int) -> list[Reply]:
        await trio.lowlevel.checkpoint_if_cancelled()
        conn = self._conn
        if conn is None:
            conn = await self._connect()
        conn.write(data)  # whole on the wire or in conn.out: nothing to cancel half-way
        waiter = _Waiter(trio.lowlevel.current_task(), expected, [])
        conn.waiters.append(waiter)
        replies: list[Reply] = await trio.lowlevel.wait_task_rescheduled(lambda _: _abandon(waiter))
        return replies

    async def _connect(self) -> _Connection:
        async with self._connecting:
            if self._closed:
                raise trio.ClosedResourceError("the Redis link is closed")
            if self._conn is None:
                self._install(*await _open_socket(self.address, self.connect_timeout))
            assert self._conn is not None
            return self._conn

    def _install(self, sock: trio.socket.SocketType, raw: socket.socket) -> None:
        conn = _Connection(sock, raw, self.address.describe(), self)
        self._conn = conn
        self._connects += 1
        self._nursery.start_soon(conn.read)

    def _close(self) -> None:
        self._closed = True
        conn = self._conn
        if conn is not None:
            conn.fail(None, "the Redis link was closed")


async def _open_socket(
    address: RedisAddress, connect_timeout: float
) -> tuple[trio.socket.SocketType, socket.socket]:
    """A connected socket, logged in and on its database."""
    where = address.describe()
    sock: trio.socket.SocketType | None = None
    try:
        with trio.fail_after(connect_timeout):
            if address.path is not None:
                targets: list[tuple[int, object]] = [(socket.AF_UNIX, address.path)]
            else:
                infos = await trio.socket.getaddrinfo(
                    address.host, address.port, type=socket.SOCK_STREAM
                )
                targets = [(family, sockaddr) for family, _, _, _, sockaddr in infos]
            error: OSError | None = None
            for family, target in targets:
                raw = socket.socket(family, socket.SOCK_STREAM)
                sock = trio.socket.from_stdlib_socket(raw)
                try:
                    await sock.connect(target)
                except OSError as exc:
                    sock.close()
                    sock, error = None, exc
                    continue
                if family != socket.AF_UNIX:
                    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await _log_in(sock, address)
                opened, sock = sock, None
                return opened, raw
            raise RedisLinkError(f"cannot connect to Redis at {where}: {error}") from error
    except trio.TooSlowError:
        raise RedisLinkError(f"no Redis answered at {where} within {connect_timeout} s") from None
    except RespProtocolError as exc:
        raise RedisLinkError(f"what answered at {where} does not speak RESP2") from exc
    except OSError as exc:
        if isinstance(exc, RedisLinkError):
            raise
        raise RedisLinkError(f"cannot connect to Redis at {where}: {exc}") from exc
    finally:
        if sock is not None:  # connected, and failed or cancelled while logging in
            sock.close()


async def _log_in(sock: trio.socket.SocketType, address: RedisAddress) -> None:
    commands: list[tuple[Arg, ...]] = []
    if address.password is not None:
        user = (address.username,) if address.username else ()
        commands.append(("AUTH", *user, address.password))
    if address.db:
        commands.append(("SELECT", address.db))
    if not commands:
        return
    data = encode_commands(commands)
    while data:
        data = data[await sock.send(data) :]
    parser, replies = RespParser(), list[Reply]()
    while len(replies) < len(commands):
        reply = parser.next_reply()
        if reply is NEED_DATA:
            chunk = await sock.recv(_READ_SIZE)
            if not chunk:
                raise RedisLinkError(f"Redis at {address.describe()} closed the connection")
            parser.feed(chunk)
        else:
            replies.append(reply)
    for command, reply in zip(commands, replies, strict=True):
        if isinstance(reply, ReplyError):
            name = "AUTH" if command[0] == "AUTH" else "SELECT"
            hint = "the user and password in the URL" if name == "AUTH" else "the URL's db"
            raise RedisLinkError(
                f"Redis at {address.describe()} refused {name}: {reply.message} (check {hint})"
            )


@asynccontextmanager
async def open_redis_link(
    url: str,
    *,
    connect_timeout: float = REDIS_CONNECT_TIMEOUT,
    write_timeout: float = REDIS_WRITE_TIMEOUT,
    lazy: bool = False,
) -> AsyncIterator[RedisLink]:
    """A :class:`RedisLink` to the Redis at ``url``, connected (AUTH and SELECT done) before
    the block runs: an unreachable server raises :class:`RedisLinkError` here -- unless
    ``lazy``: then the first call connects (a server down at start is that call's error).
    Leaving the block closes it. ``url``: see :func:`parse_redis_url` (a malformed one raises
    :class:`ValueError`)."""
    address = parse_redis_url(url)
    opened = None if lazy else await _open_socket(address, connect_timeout)  # unwrapped
    try:
        async with trio.open_nursery() as nursery:
            link = RedisLink(address, connect_timeout, write_timeout, nursery)
            try:
                if opened is not None:
                    link._install(*opened)
                yield link
            finally:
                link._close()
    finally:
        if opened is not None:
            opened[0].close()  # idempotent: closed already unless the nursery failed to open
