"""The Trio driver (:mod:`dispatcher.store.redis_link`) against a real ``redis-server``
(``redis_server.py``):

* commands answer replies of every type; an error reply raises :class:`RedisReplyError` from
  ``call`` and is a value in ``call_many``;
* 500 calls from 500 tasks at once each get their own reply (pipelined on one connection);
* a caller cancelled while its command is in flight leaves the link in step: its reply is
  dropped, the next caller gets its own; a caller cancelled before sending sends nothing;
* AUTH (the ``default`` user with ``--requirepass``, or a wrong password: a
  :class:`RedisLinkError` naming AUTH) and SELECT of the URL's database;
* the server killed mid-call fails the waiter with :class:`RedisLinkError`, calls fail while
  it is down, and the link reconnects when it is back;
* a stalled server (SIGSTOP) fails a write that waits longer than ``write_timeout``;
* EVALSHA after SCRIPT FLUSH loads the script again;
* one call costs at most 3 task steps (the caller's and the reader's, with slack);
* leaving the block fails the waiters and refuses later calls;
* the URLs it takes, and the clear errors for those it does not.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator

import pytest
import trio

from dispatcher.store.redis_link import (
    RedisAddress,
    RedisLink,
    RedisLinkError,
    RedisReplyError,
    open_redis_link,
    parse_redis_url,
)
from dispatcher.store.resp import ReplyError

from . import redis_server

pytestmark = pytest.mark.skipif(redis_server.BINARY is None, reason="no redis-server")


@pytest.fixture
async def link() -> AsyncIterator[RedisLink]:
    async with open_redis_link(redis_server.url()) as link:
        await link.call("FLUSHDB")
        yield link


@pytest.fixture
def server() -> Iterator[redis_server.RedisServer]:
    """A server of the test's own, to stop and start."""
    with redis_server.own_server() as server:
        yield server


async def test_replies_of_every_type(link: RedisLink) -> None:
    assert await link.call("PING") == "PONG"
    assert await link.call("SET", "k", "v\r\n\x00") == "OK"
    assert await link.call("GET", "k") == b"v\r\n\x00"
    assert await link.call("GET", "missing") is None
    assert await link.call("INCRBY", "n", -5) == -5
    assert await link.call("RPUSH", "l", "a", 2, 1.5) == 3
    assert await link.call("LRANGE", "l", 0, -1) == [b"a", b"2", b"1.5"]
    assert await link.call("LRANGE", "missing", 0, -1) == []
    assert await link.evalsha("return {1, 'x', {2, {}}, false}") == [1, b"x", [2, []], None]
    with pytest.raises(RedisReplyError) as caught:
        await link.call("LPUSH", "k", "x")
    assert caught.value.code == "WRONGTYPE"
    replies = await link.call_many([("INCR", "n"), ("HGET", "k", "f"), ("GET", "k")])
    assert replies[0] == -4
    assert isinstance(replies[1], ReplyError)
    assert replies[1].code == "WRONGTYPE"
    assert replies[2] == b"v\r\n\x00"
    assert await link.call_many([]) == []


async def test_500_concurrent_calls_get_their_own_replies(link: RedisLink) -> None:
    got: dict[int, object] = {}

    async def one(index: int) -> None:
        if index % 3:
            got[index] = await link.call("ECHO", f"reply {index}")
        else:
            got[index] = (await link.call_many([("ECHO", f"reply {index}"), ("PING",)]))[0]

    async with trio.open_nursery() as nursery:
        for index in range(500):
            nursery.start_soon(one, index)
    assert got == {index: f"reply {index}".encode() for index in range(500)}
    assert link.statistics().connects == 1
    assert link.statistics().waiting == 0


async def test_a_caller_cancelled_in_flight_leaves_the_link_in_step(link: RedisLink) -> None:
    cancelled = trio.CancelScope()

    async def blocked() -> None:
        with cancelled:
            await link.call("BLPOP", "queue", 0)  # the server holds it until a push
        assert cancelled.cancelled_caught

    async with trio.open_nursery() as nursery:
        nursery.start_soon(blocked)
        await trio.testing.wait_all_tasks_blocked()
        assert link.statistics().waiting == 1
        cancelled.cancel()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.call, "ECHO", "after")  # queued behind the BLPOP
        await trio.testing.wait_all_tasks_blocked()
        async with open_redis_link(redis_server.url()) as other:
            assert await other.call("RPUSH", "queue", "item") == 1  # the BLPOP answers
    # the BLPOP's reply [queue, item] was dropped; each caller gets its own
    assert await link.call("ECHO", "mine") == b"mine"
    assert await link.call("LLEN", "queue") == 0
    assert link.statistics().waiting == 0
    assert link.statistics().connects == 1


async def test_a_caller_cancelled_before_sending_sends_nothing(link: RedisLink) -> None:
    with trio.move_on_after(0) as scope:  # the deadline has passed when the call starts
        await link.call("SET", "sent", 1)
    assert scope.cancelled_caught
    assert await link.call("EXISTS", "sent") == 0


async def test_auth_with_a_password_and_select() -> None:
    server = redis_server.RedisServer(password="s3cret:/@")
    server.start()
    try:
        url = server.url.replace("s3cret:/@", "s3cret%3A%2F%40")
        async with open_redis_link(url.replace("/0", "/3")) as db3, open_redis_link(url) as db0:
            assert await db3.call("SET", "here", "3") == "OK"
            assert await db0.call("GET", "here") is None
            assert await db3.call("GET", "here") == b"3"
        user = url.replace("//:", "//default:")
        async with open_redis_link(user) as link:
            assert await link.call("GET", "here") is None  # db 0
        with pytest.raises(RedisLinkError, match=r"refused AUTH.*check the user and password"):
            async with open_redis_link(url.replace("s3cret", "wrong")):
                pass
        with pytest.raises(RedisLinkError, match="refused SELECT"):
            async with open_redis_link(url.replace("/0", "/99")):
                pass
        async with open_redis_link(f"redis://127.0.0.1:{server.port}") as anonymous:
            with pytest.raises(RedisReplyError) as caught:
                await anonymous.call("GET", "here")
            assert caught.value.code == "NOAUTH"
    finally:
        server.close()


async def test_the_server_killed_mid_call_and_back(server: redis_server.RedisServer) -> None:
    async with open_redis_link(server.url, connect_timeout=2) as link:
        assert await link.call("SET", "k", 1) == "OK"
        failed: list[BaseException] = []

        async def waiting() -> None:
            try:
                await link.call("BLPOP", "queue", 0)
            except RedisLinkError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting)
            nursery.start_soon(waiting)
            await trio.testing.wait_all_tasks_blocked()
            assert link.statistics().waiting == 2
            await trio.to_thread.run_sync(server.stop)
        assert len(failed) == 2
        assert "Redis closed the connection (redis://127.0.0.1:" in str(failed[0])
        assert not link.statistics().connected
        with pytest.raises(RedisLinkError, match="cannot connect to Redis at redis://127"):
            await link.call("PING")
        await trio.to_thread.run_sync(server.start)
        assert await link.call("PING") == "PONG"
        assert await link.call("GET", "k") is None  # a new server (no persistence)
        assert link.statistics().connects == 2


async def test_a_stalled_server_fails_a_write_after_the_timeout(
    server: redis_server.RedisServer,
) -> None:
    assert server.process is not None
    async with open_redis_link(server.url, write_timeout=0.5) as link:
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            big = b"x" * (1024 * 1024)
            with pytest.raises(RedisLinkError, match=r"took no bytes for 0\.5 s"):
                await link.call_many([("SET", f"k{i}", big) for i in range(64)])
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert await link.call("PING") == "PONG"
        assert link.statistics().connects == 2


async def test_a_pipeline_bigger_than_the_socket_buffer(link: RedisLink) -> None:
    """The rest waits in the link's buffer; a call made meanwhile queues behind it."""
    value = b"y" * 4096
    commands = [("SET", f"k{i}", value) for i in range(4000)]  # 16 MiB
    got: list[object] = []

    async def after() -> None:
        got.append(await link.call("GET", "k3999"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.call_many, commands)
        while not link.statistics().waiting:  # the pipeline was written, or queued
            await trio.lowlevel.checkpoint()
        assert link.statistics().buffered > 0
        nursery.start_soon(after)
    assert got == [value]
    assert link.statistics().buffered == 0


async def test_evalsha_reloads_after_script_flush(link: RedisLink) -> None:
    script = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
    assert await link.evalsha(script, ["counter"], [5]) == 5
    assert await link.call("SCRIPT", "FLUSH") == "OK"
    assert await link.evalsha(script, ["counter"], [2]) == 7
    with pytest.raises(RedisReplyError) as caught:
        await link.evalsha("return redis.call('NOPE')")
    assert caught.value.code == "ERR"


async def test_a_call_costs_few_task_steps(link: RedisLink) -> None:
    steps = 0

    class Count(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            nonlocal steps
            steps += 1

    await link.call("SET", "k", "v")
    trio.lowlevel.add_instrument(Count())
    for _ in range(200):
        await link.call("GET", "k")
    assert steps <= 3 * 200, steps


async def test_leaving_the_block_fails_waiters_and_refuses_calls() -> None:
    failed: list[BaseException] = []
    async with open_redis_link(redis_server.url()) as link:

        async def waiting() -> None:
            try:
                await link.call("BLPOP", "never", 0)
            except RedisLinkError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting)
            await trio.testing.wait_all_tasks_blocked()
            link._close()
    assert len(failed) == 1
    assert "the Redis link was closed" in str(failed[0])
    with pytest.raises(trio.ClosedResourceError):
        await link.call("PING")


async def test_nothing_listening() -> None:
    server = redis_server.RedisServer()  # a port nobody listens on
    port = redis_server._free_port()
    server.close()
    with pytest.raises(
        RedisLinkError, match=f"cannot connect to Redis at redis://127.0.0.1:{port}"
    ):
        async with open_redis_link(f"redis://127.0.0.1:{port}"):
            pass


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("redis://localhost", RedisAddress()),
        ("redis://r.internal:7000/2", RedisAddress(host="r.internal", port=7000, db=2)),
        ("redis://:p%40ss@h/0", RedisAddress(host="h", password="p@ss")),
        ("REDIS://u:p@[::1]:1/", RedisAddress(host="::1", port=1, username="u", password="p")),
        ("unix:///run/r.sock?db=4", RedisAddress(path="/run/r.sock", db=4)),
        ("unix://:pw@/run/r.sock", RedisAddress(path="/run/r.sock", password="pw")),
    ],
)
def test_urls(url: str, address: RedisAddress) -> None:
    assert parse_redis_url(url) == address


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("rediss://h", "TLS.*not supported"),
        ("http://h", "starts with redis:// or unix://, not http://"),
        ("redis://h/x", "database must be a number, not 'x'"),
        ("redis://h:99999", "port is not a number"),
        ("redis://h?timeout=3", r"options \['timeout'\] are not supported"),
        ("redis://user@h", "user without a password"),
        ("unix://", "socket's path"),
    ],
)
def test_urls_refused(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_redis_url(url)


def test_a_password_is_never_shown() -> None:
    address = parse_redis_url("redis://:hunter2@h:1/0")
    assert "hunter2" not in repr(address)
    assert "hunter2" not in address.describe()
