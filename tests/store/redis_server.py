"""A real ``redis-server`` for the Redis backends' tests: started on first use on a free port
(``redis-server`` takes no port 0), in a temp dir, without persistence; stopped when the test
session ends (:func:`stop`, from ``tests/store/conftest.py``). Each xdist worker has its own."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARY = shutil.which("redis-server")
"""None: the Redis cases are deselected (``tests/store/conftest.py``)."""

_server: tuple[subprocess.Popen[bytes], tempfile.TemporaryDirectory[str], str] | None = None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def url() -> str:
    """The running server's URL (started now if it is not running)."""
    global _server
    if _server is not None:
        return _server[2]
    if BINARY is None:
        raise RuntimeError("redis-server is not installed: apt-get install redis-server")
    place = tempfile.TemporaryDirectory(prefix="dispatcher-redis-")
    for _ in range(5):  # the port may be taken between the probe and the bind
        port = _free_port()
        command = [BINARY, "--port", str(port), "--bind", "127.0.0.1", "--dir", place.name]
        command += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        with Path(place.name, "redis.log").open("ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10.0
        while process.poll() is None and time.monotonic() < deadline:
            if _answers(port):
                _server = (process, place, f"redis://127.0.0.1:{port}/0")
                return _server[2]
            time.sleep(0.02)
        process.kill()
        process.wait()
    place.cleanup()
    raise RuntimeError("redis-server did not start: see its log in " + place.name)


def stop() -> None:
    """Stop the server if it was started (nothing is left running)."""
    global _server
    if _server is None:
        return
    process, place, _ = _server
    _server = None
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    place.cleanup()
