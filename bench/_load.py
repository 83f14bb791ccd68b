"""The shared load generator and process helpers of the benchmarks.

Clients are raw Trio sockets sending pre-built HTTP/1.1 bytes and parsing only what they must
(the status, Content-Length, the chunked terminator), so the client is cheap next to the server
under test. Servers run in their own process (:func:`server_process`), never in this one.
Linux only (``/proc`` for RSS and CPU time). Every address is 127.0.0.1.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    RejectConnection,
    RejectData,
    TextMessage,
)
from wsproto.events import Request as WSRequest

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
READ_SIZE = 65536
PORT_LINE = b"BENCH-PORT "

Sock = trio.socket.SocketType


class LoadError(Exception):
    """The server under test answered something unexpected."""


class ServerDidNotStart(LoadError):
    """The server process exited, or did not report its port in time."""


# --------------------------------------------------------------------------- processes


def raise_nofile_limit(wanted: int = 20_000) -> int:
    """Raise RLIMIT_NOFILE's soft limit towards ``wanted`` (capped by the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def announce_port(port: int) -> None:
    """Called by a server process once it listens: tells :func:`server_process` the port."""
    sys.stdout.buffer.write(PORT_LINE + str(port).encode() + b"\n")
    sys.stdout.buffer.flush()


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LoadError(f"no VmRSS for pid {pid}")


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time consumed so far by ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def system_busy_seconds() -> float:
    """CPU time spent by the whole machine, all CPUs, outside idle and iowait."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


class MachineLoad:
    """How much CPU *other* processes used while a section ran (a busy machine skews every
    figure; the note says so next to them)."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._own = own_cpu_seconds()
        self._busy = system_busy_seconds()

    def note(self) -> str:
        wall = time.perf_counter() - self._started
        own = own_cpu_seconds() - self._own
        others = (system_busy_seconds() - self._busy - own) / wall
        return (
            f"other processes used {max(others, 0.0):.1f} of {os.cpu_count()} CPUs on average "
            "during the section"
            + (" (a busy machine: expect noisier figures)" if others > 0.25 else "")
        )


def own_cpu_seconds() -> float:
    """CPU time of this process plus its children that have been waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@dataclass
class ServerProcess:
    name: str
    pid: int
    port: int
    stderr: IO[bytes]

    def stderr_tail(self, lines: int = 15) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        text = self.stderr.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


@asynccontextmanager
async def server_process(
    name: str, args: Sequence[str], *, start_timeout: float = 30.0
) -> AsyncIterator[ServerProcess]:
    """Run ``python -m ARGS...`` (from the repository root) until the block ends.

    The child prints ``BENCH-PORT <n>`` on stdout once it listens; its stderr goes to a
    temporary file (see :meth:`ServerProcess.stderr_tail`). On leaving, the child gets
    SIGTERM, then SIGKILL after 5 s (trio.run_process's cancellation), and is waited for.
    """
    with tempfile.TemporaryFile() as err:
        async with trio.open_nursery() as nursery:
            command = [sys.executable, "-m", *args]
            proc: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    check=False,
                    cwd=REPO_ROOT,
                )
            )
            try:
                server = ServerProcess(name, proc.pid, 0, err)
                assert proc.stdout is not None
                with trio.move_on_after(start_timeout):
                    buf = b""
                    while b"\n" not in buf:
                        data = await proc.stdout.receive_some(4096)
                        if not data:
                            break
                        buf += data
                line = buf.partition(b"\n")[0]
                if not line.startswith(PORT_LINE):
                    raise ServerDidNotStart(
                        f"{name} server did not start (exit {proc.poll()}): "
                        + (server.stderr_tail(1) or "no output")
                    )
                server.port = int(line[len(PORT_LINE) :])
                yield server
            finally:
                nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- sockets


async def connect(port: int) -> Sock:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.connect((HOST, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def send_all(sock: Sock, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


async def _recv(sock: Sock) -> bytes:
    data = await sock.recv(READ_SIZE)
    if not data:
        raise LoadError("server closed the connection")
    return data


async def read_head(sock: Sock, data: bytes) -> tuple[int, bytes, bytes]:
    """Read up to the end of a response head: (status, lower-cased head, bytes after it)."""
    while (end := data.find(b"\r\n\r\n")) < 0:
        data += await _recv(sock)
    head = data[:end].lower()
    if not head.startswith(b"http/1.1 "):
        raise LoadError(f"not an HTTP/1.1 response: {data[:60]!r}")
    return int(head[9:12]), head, data[end + 4 :]


def http_request(method: str, target: str, body: bytes = b"", headers: str = "") -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: {HOST}\r\n{headers}"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


async def exchange(sock: Sock, request: bytes, pending: bytes) -> tuple[int, bytes]:
    """Send one request, read one Content-Length response: (status, bytes left over)."""
    await send_all(sock, request)
    status, head, data = await read_head(sock, pending)
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        raise LoadError(f"response without Content-Length: {head[:200]!r}")
    eol = head.find(b"\r\n", at + 2)
    length = int(head[at + 17 : eol if eol >= 0 else len(head)])
    while len(data) < length:
        data += await _recv(sock)
    return status, data[length:]


# --------------------------------------------------------------------------- request load


@dataclass
class LoadResult:
    clients: int
    requests: int
    seconds: float
    latencies: list[float]
    client_cpu: float
    """Load generator CPU seconds per wall second during the measured window."""
    server_cpu: float = float("nan")
    """The same for the server process, when its pid was given."""
    pid_cpu: dict[int, float] = field(default_factory=dict)
    """The same for each of the ``watch_pids`` given, by pid."""

    @classmethod
    def combined(cls, parts: Sequence[LoadResult]) -> LoadResult:
        """Several runs (rounds) of the same load as one."""
        seconds = sum(part.seconds for part in parts)
        return cls(
            clients=parts[0].clients,
            requests=sum(part.requests for part in parts),
            seconds=seconds,
            latencies=[latency for part in parts for latency in part.latencies],
            client_cpu=sum(part.client_cpu * part.seconds for part in parts) / seconds,
            server_cpu=sum(part.server_cpu * part.seconds for part in parts) / seconds,
            pid_cpu={
                pid: sum(part.pid_cpu[pid] * part.seconds for part in parts) / seconds
                for pid in parts[0].pid_cpu
                if all(pid in part.pid_cpu for part in parts)
            },
        )

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def per_server_cpu_second(self) -> float:
        """Responses per second of server CPU: less sensitive than req/s to other load."""
        return self.rps / self.server_cpu if self.server_cpu > 0 else float("nan")

    def percentile_ms(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def request_load(
    port: int | Sequence[int],
    request: bytes,
    *,
    clients: int,
    duration: float,
    warmup: float,
    server_pid: int | None = None,
    watch_pids: Sequence[int] = (),
) -> LoadResult:
    """``clients`` keep-alive connections, each sending ``request`` back to back.

    Runs ``warmup + duration`` seconds; counts the responses completed inside the last
    ``duration`` seconds and their latencies (send to last byte). Several ports: the
    connections are spread over them in turn (client i to ``port[i % len(port)]``).
    ``watch_pids``: processes whose CPU over the counted window goes to ``pid_cpu``.
    """
    ports = [port] if isinstance(port, int) else list(port)
    socks: list[Sock] = []
    latencies: list[float] = []
    completed = 0
    try:
        for i in range(clients):
            socks.append(await connect(ports[i % len(ports)]))
        start = time.perf_counter()
        measure_from = start + warmup
        stop_at = measure_from + duration
        cpu_at: list[float] = []
        server_cpu_at: list[float] = []
        pid_cpu_at: dict[int, list[float]] = {}

        async def worker(sock: Sock) -> None:
            nonlocal completed
            pending = b""
            perf = time.perf_counter
            while (t0 := perf()) < stop_at:
                status, pending = await exchange(sock, request, pending)
                t1 = perf()
                if status != 200:
                    raise LoadError(f"status {status}")
                if measure_from <= t1 < stop_at:
                    completed += 1
                    if t0 >= measure_from:
                        latencies.append(t1 - t0)

        async def cpu_marks() -> None:
            await trio.sleep_until(trio.current_time() + warmup)
            cpu_at.append(time.process_time())
            if server_pid is not None:
                server_cpu_at.append(cpu_seconds(server_pid))
            for pid in watch_pids:
                pid_cpu_at.setdefault(pid, []).append(cpu_seconds(pid))
            await trio.sleep(duration)
            cpu_at.append(time.process_time())
            if server_pid is not None:
                server_cpu_at.append(cpu_seconds(server_pid))
            for pid in watch_pids:
                pid_cpu_at[pid].append(cpu_seconds(pid))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cpu_marks)
            for sock in socks:
                nursery.start_soon(worker, sock)
    finally:
        for sock in socks:
            sock.close()

    def rate(marks: list[float]) -> float:
        return (marks[1] - marks[0]) / duration if len(marks) == 2 else float("nan")

    return LoadResult(
        clients,
        completed,
        duration,
        latencies,
        rate(cpu_at),
        server_cpu=rate(server_cpu_at),
        pid_cpu={pid: rate(marks) for pid, marks in pid_cpu_at.items()},
    )


# --------------------------------------------------------------------------- SSE


async def read_event_stream(port: int, target: str) -> tuple[int, float]:
    """GET ``target``, read the chunked event stream to its end: (events, seconds).

    Events are counted by their ``\\n\\n`` terminators (event bodies hold no newline).
    """
    sock = await connect(port)
    try:
        start = time.perf_counter()
        await send_all(sock, http_request("GET", target))
        status, head, data = await read_head(sock, b"")
        if status != 200 or b"transfer-encoding: chunked" not in head:
            raise LoadError(f"expected a chunked 200, got {head[:200]!r}")
        events = data.count(b"\n\n")
        tail = data[-7:]
        while not tail.endswith(b"\r\n0\r\n\r\n"):
            data = await _recv(sock)
            events += (tail[-1:] + data).count(b"\n\n")
            tail = (tail + data[-7:])[-7:]
        return events, time.perf_counter() - start
    finally:
        sock.close()


# --------------------------------------------------------------------------- websocket


def masked_text_frame(payload: bytes, mask: bytes = b"\x5a\x13\xc7\x3e") -> bytes:
    """One client->server text frame (FIN, masked) of fewer than 126 bytes."""
    if len(payload) >= 126:
        raise ValueError("payload too long for a one-byte length")
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x81, 0x80 | len(payload)]) + mask + masked


async def websocket_one_way(
    port: int, target: str, message: bytes, count: int, end_message: bytes
) -> tuple[str, float]:
    """Open a websocket, send ``count`` copies of ``message`` then ``end_message`` as fast as
    the socket takes them, and wait for the server's text acknowledgement.

    Returns (the acknowledgement, seconds from the first byte sent to the ack). Frames are
    pre-built (one mask key for all: fine for a benchmark, not for a real client) so the
    client costs nothing per message.
    """
    ws = WSConnection(ConnectionType.CLIENT)
    sock = await connect(port)
    try:
        await send_all(sock, ws.send(WSRequest(host=f"{HOST}:{port}", target=target)))
        accepted = False
        while not accepted:
            ws.receive_data(await _recv(sock))
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    accepted = True
                elif isinstance(event, RejectConnection | RejectData):
                    raise LoadError(f"websocket upgrade rejected: {event!r}")
        blob = masked_text_frame(message) * count + masked_text_frame(end_message)
        start = time.perf_counter()
        await send_all(sock, blob)
        ack: list[str] = []
        while True:
            ws.receive_data(await _recv(sock))
            for event in ws.events():
                if isinstance(event, TextMessage):
                    ack.append(event.data)
                    if event.message_finished:
                        elapsed = time.perf_counter() - start
                        await _close_websocket(sock, ws)
                        return "".join(ack), elapsed
                elif isinstance(event, CloseConnection):
                    raise LoadError(f"websocket closed before the ack: {event!r}")
    finally:
        sock.close()


async def _close_websocket(sock: Sock, ws: WSConnection) -> None:
    """Best effort closing handshake, bounded to 2 s."""
    with trio.move_on_after(2):
        if ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            await send_all(sock, ws.send(CloseConnection(code=1000)))
        while ws.state is not ConnectionState.CLOSED:
            data = await sock.recv(READ_SIZE)
            if not data:
                return
            ws.receive_data(data)
            for event in ws.events():
                if (
                    isinstance(event, CloseConnection)
                    and ws.state is ConnectionState.REMOTE_CLOSING
                ):
                    await send_all(sock, ws.send(event.response()))


# --------------------------------------------------------------------------- idle streams


async def open_idle_streams(
    port: int, target: str, count: int, *, concurrency: int = 64
) -> list[Sock]:
    """Open ``count`` connections, each with a GET ``target`` whose first event has arrived.

    Connections are opened ``concurrency`` at a time. The caller closes the returned sockets;
    on error they are closed here.
    """
    socks: list[Sock] = []
    request = http_request("GET", target)
    remaining = count

    async def opener() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            sock = await connect(port)
            socks.append(sock)
            await send_all(sock, request)
            status, _, data = await read_head(sock, b"")
            if status != 200:
                raise LoadError(f"status {status}")
            while b"\n\n" not in data:
                data += await _recv(sock)

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(opener)
    except BaseException:
        close_all(socks)
        raise
    return socks


def close_all(socks: list[Sock]) -> None:
    for sock in socks:
        sock.close()
    socks.clear()
