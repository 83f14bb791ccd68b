"""A real PostgreSQL server for the contract suite: ``initdb`` and ``pg_ctl`` in a temporary
directory, on a free port of 127.0.0.1, started once per test session on first use and stopped
at its end (``tests/store/conftest.py``). Run as root, the server runs as the ``postgres`` user
(``runuser -u postgres --``): PostgreSQL refuses to run as root.

Each test gets a schema of its own (:func:`schema_url`), named after its place, so a test that
reopens a backend on the same place finds what it left there.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Final

__all__ = ["binaries", "halt", "resume", "schema_url", "stop", "unavailable_reason"]

_DEBIAN: Final = Path("/usr/lib/postgresql")
_START_TIMEOUT: Final = 60


def binaries() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: ``DISPATCHER_PG_BIN``, else the newest of
    Debian's ``/usr/lib/postgresql/*/bin``, else the one on ``PATH``; None without them."""
    if explicit := os.environ.get("DISPATCHER_PG_BIN"):
        return Path(explicit) if (Path(explicit) / "initdb").is_file() else None
    if _DEBIAN.is_dir():
        found = sorted(
            (p / "bin" for p in _DEBIAN.iterdir() if (p / "bin" / "initdb").is_file()),
            key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        )
        if found:
            return found[-1]
    on_path = shutil.which("pg_ctl")
    if on_path and (Path(on_path).parent / "initdb").is_file():
        return Path(on_path).parent
    return None


def unavailable_reason() -> str | None:
    """Why no server can be started here (None: one can)."""
    if binaries() is None:
        return "no PostgreSQL binaries (initdb, pg_ctl): apt-get install postgresql"
    if os.getuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a postgres user to run PostgreSQL as"
    return None


class _Server:
    def __init__(self) -> None:
        bin_dir = binaries()
        if bin_dir is None:
            raise RuntimeError(f"cannot start PostgreSQL: {unavailable_reason()}")
        self._bin = bin_dir
        self._root = Path(tempfile.mkdtemp(prefix="dispatcher-pg-"))
        self._as: list[str] = []
        if os.getuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self._root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self.data = self._root / "data"
        initdb = ["-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]
        try:
            # A natural-language default collation, as production databases have: text the
            # backends order must not depend on it (they compare bytes, as SQLite does).
            self._run(
                "initdb", *initdb, "--locale=C.UTF-8", "--locale-provider=icu",
                "--icu-locale=en-US",
            )  # fmt: skip
        except RuntimeError:  # before PostgreSQL 15, or built without ICU
            shutil.rmtree(self.data, ignore_errors=True)
            self._run("initdb", *initdb, "--locale=C.UTF-8")
        self.port = 0
        self._options = ""
        self._started = False

    def _run(self, tool: str, *args: str) -> None:
        command = [*self._as, str(self._bin / tool), *args]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_START_TIMEOUT, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}):\n{done.stdout}{done.stderr}")

    def start(self) -> None:
        for _ in range(5):  # a free port may be taken between the probe and the start
            self.port = _free_port()
            options = (
                f"-p {self.port} -k {self._root} -c listen_addresses=127.0.0.1 "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
                "-c max_connections=200 -c TimeZone=Pacific/Kiritimati"  # UTC+14: days are UTC's
            )
            self._options = options
            try:
                self._run(
                    "pg_ctl", "-D", str(self.data), "-o", options, "-l",
                    str(self._root / "log"), "-w", "-t", str(_START_TIMEOUT), "start",
                )  # fmt: skip
            except RuntimeError:
                continue
            self._started = True
            return
        log = (self._root / "log").read_text(errors="replace")
        raise RuntimeError(f"PostgreSQL did not start:\n{log}")

    def halt(self) -> None:
        """Stop the server (``-m fast``: every session is cut off, what was committed is
        kept: it runs with ``synchronous_commit=off``, which an immediate stop would make
        lose recent commits), keeping its data and port."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def resume(self) -> None:
        """Start the halted server again, on the same port."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-o", self._options, "-l",
            str(self._root / "log"), "-w", "-t", str(_START_TIMEOUT), "start",
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        try:
            if self._started:
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
                self._started = False
        finally:
            shutil.rmtree(self._root, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


_lock = threading.Lock()
_server: _Server | None = None


def server_url() -> str:
    """The session's server (started on first use): its URL, as the superuser."""
    global _server
    with _lock:
        if _server is None:
            server = _Server()
            try:
                server.start()
            except BaseException:
                server.stop()
                raise
            _server = server
            atexit.register(stop)  # in case the session's end is never reached
        return _server.url


def stop() -> None:
    """Stop the session's server, if it was started."""
    global _server
    with _lock:
        server, _server = _server, None
    if server is not None:
        server.stop()


def halt() -> None:
    """Stop the session's server, cutting off every session; :func:`resume` starts it again
    on the same port. Every test on the server waits for it meanwhile: resume it in a
    ``finally``."""
    server_url()
    assert _server is not None
    _server.halt()


def resume() -> None:
    assert _server is not None
    _server.resume()


def schema_url(place: Path) -> str:
    """A URL on the session's server whose connections use a schema of their own, named after
    ``place`` (created if missing)."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    url = server_url()
    schema = "t_" + hashlib.sha256(os.fspath(place).encode()).hexdigest()[:20]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
    return make_conninfo(url, options=f"-c search_path={schema}")
