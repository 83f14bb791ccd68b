"""A real ``redis-server`` for the Redis backends' tests: started on first use on a free port
(``redis-server`` takes no port 0), in a temp dir, without persistence; stopped when the test
session ends (:func:`stop`, from ``tests/store/conftest.py``). Each xdist worker has its own.
:class:`RedisServer` is one more, for a test that stops and restarts (or pauses and resumes)
its server."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BINARY = shutil.which("redis-server")
"""None: the Redis cases are deselected (``tests/store/conftest.py``)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up, with a password
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process in its own temp dir; ``password``: it requires one
    (``--requirepass``, the ``default`` user's), and its :attr:`url` carries it."""

    def __init__(
        self,
        *,
        password: str | None = None,
        wrapper: tuple[str, ...] = (),
        start_within: float = 10.0,
    ) -> None:
        if BINARY is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        self.binary = BINARY
        self.password = password
        self.wrapper = wrapper
        """A command it runs under (``bench.instructions``: valgrind; its report goes to
        :attr:`log`)."""
        self.start_within = start_within
        self.place = tempfile.TemporaryDirectory(prefix="dispatcher-redis-")
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        """Where the server (and its :attr:`wrapper`) writes."""
        return Path(self.place.name, "redis.log")

    @property
    def url(self) -> str:
        login = f":{self.password}@" if self.password is not None else ""
        return f"redis://{login}127.0.0.1:{self.port}/0"

    def start(self) -> str:
        """Start it (on its former port if it ran before); its URL."""
        for _ in range(5):  # a free port may be taken between the probe and the bind
            port = self.port or _free_port()
            command = [*self.wrapper, self.binary, "--port", str(port), "--bind", "127.0.0.1"]
            command += ["--dir", self.place.name, "--save", "", "--appendonly", "no"]
            if self.password is not None:
                command += ["--requirepass", self.password]
            with self.log.open("ab") as log:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + self.start_within
            while process.poll() is None and time.monotonic() < deadline:
                if _answers(port):
                    self.process, self.port = process, port
                    return self.url
                time.sleep(0.02)
            process.kill()
            process.wait()
            if self.port:
                time.sleep(0.2)  # its former port may be freeing
        raise RuntimeError(f"redis-server did not start: see {self.place.name}/redis.log")

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): it keeps its data and its port, and answers nothing
        (a server past every deadline) until :meth:`resume`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused process run again (SIGCONT)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the process (nothing is left running; a paused one too)."""
        process, self.process = self.process, None
        if process is None:
            return
        process.send_signal(signal.SIGCONT)
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        self.stop()
        self.place.cleanup()


@contextlib.contextmanager
def own_server() -> Iterator[RedisServer]:
    """A ``redis-server`` of the caller's own for the block (to stop and start again),
    closed however the block is left."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


_server: RedisServer | None = None


def url() -> str:
    """The session's server's URL (started now if it is not running)."""
    global _server
    if _server is None:
        server = RedisServer()
        server.start()
        _server = server
    return _server.url


def stop() -> None:
    """Stop the session's server if it was started."""
    global _server
    server, _server = _server, None
    if server is not None:
        server.close()
