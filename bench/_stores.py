"""Real shared-store servers for the ``store`` section, each held by an ``async with``.

* :func:`running_redis` -- ``redis-server`` in a temporary directory on a free port of
  127.0.0.1, no persistence: the tests' :class:`tests.store.redis_server.RedisServer`.
* :func:`running_postgres` -- ``initdb`` + ``pg_ctl`` in a temporary directory on a free port,
  as the tests' server (``tests/store/postgres_server.py``: Debian's binaries, the
  ``postgres`` user when run as root) but with PostgreSQL's default durability (``fsync``,
  ``synchronous_commit`` and ``full_page_writes`` on): a throughput figure is meant for a
  server as it is deployed, not as the tests run it.

Their start and stop are blocking calls, made in a worker thread; leaving the block, however
it is left, stops the server (shielded) and removes its directory. :func:`redis_missing` and
:func:`postgres_missing` say why one cannot be started here (None: it can).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from tests.store import postgres_server, redis_server

STOP_TIMEOUT = 30.0
"""Seconds a stopping server is waited for (it is killed by then: see the helpers)."""


def redis_missing() -> str | None:
    """Why no ``redis-server`` can be started here (None: it can)."""
    if redis_server.BINARY is None:
        return "redis-server is not installed (apt-get install redis-server)"
    return None


def postgres_missing() -> str | None:
    """Why no PostgreSQL server can be started here (None: it can)."""
    return postgres_server.unavailable_reason()


@dataclass(frozen=True)
class Running:
    url: str
    pid: int | None
    """The server process (its CPU time can be read from ``/proc``); None if unknown."""


@asynccontextmanager
async def running_redis() -> AsyncIterator[Running]:
    """A fresh ``redis-server`` for the block."""
    server = redis_server.RedisServer()
    try:
        url = await trio.to_thread.run_sync(server.start)
        yield Running(url, server.process.pid if server.process is not None else None)
    finally:
        with trio.move_on_after(STOP_TIMEOUT, shield=True):
            await trio.to_thread.run_sync(server.close)


class _DurablePostgres(postgres_server._Server):
    """The tests' server (``initdb`` as they run it), started with the default durability."""

    def start(self) -> None:
        for _ in range(5):  # a free port may be taken between the probe and the start
            self.port = postgres_server._free_port()
            options = f"-p {self.port} -k {self._root} -c listen_addresses=127.0.0.1"
            try:
                self._run(
                    "pg_ctl", "-D", str(self.data), "-o", options, "-l",
                    str(self._root / "log"), "-w", "-t", "60", "start",
                )  # fmt: skip
            except RuntimeError:
                continue
            self._started = True
            return
        log = (self._root / "log").read_text(errors="replace")
        raise RuntimeError(f"PostgreSQL did not start:\n{log}")

    def pid(self) -> int | None:
        """The postmaster's pid (first line of ``postmaster.pid``)."""
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None


@asynccontextmanager
async def running_postgres() -> AsyncIterator[Running]:
    """A fresh PostgreSQL cluster for the block (its ``postgres`` database, as the
    superuser, trust authentication on 127.0.0.1)."""
    server: _DurablePostgres | None = None
    try:
        server = await trio.to_thread.run_sync(_DurablePostgres)
        await trio.to_thread.run_sync(server.start)
        yield Running(server.url, server.pid())
    finally:
        if server is not None:
            with trio.move_on_after(STOP_TIMEOUT, shield=True):
                await trio.to_thread.run_sync(server.stop)
