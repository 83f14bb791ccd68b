"""The load-generating client of the ``peer`` and ``streams`` sections, in its own process.

``python -m bench._client`` reads one JSON command per line on stdin and answers each with one
JSON line on stdout (``{"error": "..."}`` when the command failed); it exits at end of input.
The bench's own (Trio) process drives it, so the client's CPU is never counted as the
server's, and it reports its own CPU share so a saturated client is visible.

It is plain asyncio with one ``asyncio.Protocol`` per connection and pre-built request bytes;
it parses only the status line, ``Content-Length`` or the chunked terminator, and (streams)
the first content delta. That is a few microseconds per response, much less than any server
it drives.

Commands:

* ``{"cmd": "load", "port", "request" (latin-1 text), "stream", "clients", "warmup",
  "duration", "pids": {name: pid}}`` -- closed-loop keep-alive load: ``clients`` connections,
  each sending ``request`` again as soon as the previous response ended. After ``warmup``
  seconds (and once every connection has had one answer) the window starts; it lasts
  ``duration`` seconds and until ``min_completions`` requests completed in it (default
  max(20, clients); at most ``max_extra`` seconds longer), so a slow server still gives
  samples. CPU times of ``pids`` (with their children) are read at its start and end;
  requests that *complete* inside it are counted for throughput, requests *sent* inside it
  give the latencies (the client waits for them after the window, up to ``drain``
  seconds). Answers ``{"completed", "seconds",
  "latencies", "ttfts", "cpu": {name: seconds}, "client_cpu", "rss": {name: KiB},
  "errors"}``.
* ``{"cmd": "hold", ...}`` -- the ``streams`` section: see :func:`hold`.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import sys
import time
from collections.abc import Mapping
from typing import Any

import orjson

HOST = "127.0.0.1"
TERMINATOR = b"\r\n0\r\n\r\n"
# The first content delta of an OpenAI-style SSE stream: `"content":"x` (not the empty role
# preamble). Our edge, LiteLLM and the fake upstream all write compact JSON.
CONTENT = re.compile(rb'"content": ?"[^"]')


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --------------------------------------------------------------------------- process stats
# From /proc (what psutil's cpu_times / memory_info read), so the client needs no extra package.

_TICKS = os.sysconf("SC_CLK_TCK")


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants (LiteLLM's proxy may fork)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
        except OSError:
            pass
    return out


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_of(pids: Mapping[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process and its live children (NaN: gone)."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        total = 0.0
        for member in _family(pid):
            try:
                total += _cpu(member)
            except OSError:
                if member == pid:
                    total = float("nan")
        out[name] = total
    return out


def rss_of(pids: Mapping[str, int]) -> dict[str, int]:
    """Resident set size of each process (with its children) in KiB."""
    out: dict[str, int] = {}
    for name, pid in pids.items():
        total = 0
        for member in _family(pid):
            try:
                total += _rss_kib(member)
            except OSError:
                pass
        out[name] = total
    return out


# --------------------------------------------------------------------------- one connection


class _Conn(asyncio.Protocol):
    """A keep-alive connection doing one request at a time: ``send()`` then wait on
    ``done``. Finds the response's end (Content-Length or chunked terminator) and, when
    ``stream``, the first content delta's arrival."""

    def __init__(self, request: bytes, stream: bool) -> None:
        self.request = request
        self.stream = stream
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[int] | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.sent_at = 0.0
        self.first_at = 0.0
        self.body = b""
        """The last Content-Length response's body."""
        self._buf = b""
        self._status = 0
        self._length = -1  # -1: head not read; -2: chunked
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("server closed the connection"))
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self) -> asyncio.Future[int]:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self._buf = b""
        self._length = -1
        self._tail = b""
        self.first_at = 0.0
        self.sent_at = time.perf_counter()
        self.transport.write(self.request)
        return self.done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.done is None or self.done.done():
            return  # a held stream's later bytes, or bytes after a failure
        if self._length == -1:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buf[:end].lower()
            body = self._buf[end + 4 :]
            self._buf = b""
            self._status = int(head[9:12])
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                eol = head.find(b"\r\n", at + 2)
                self._length = int(head[at + 17 : eol if eol >= 0 else len(head)])
            elif b"transfer-encoding: chunked" in head:
                self._length = -2
            else:
                self.done.set_exception(ValueError(f"unframed response: {head[:200]!r}"))
                return
            data = body
        if self.stream and not self.first_at and CONTENT.search(self._tail + data):
            self.first_at = now
        if self._length >= 0:
            self._buf += data
            if len(self._buf) >= self._length:
                self.body = self._buf[: self._length]
                self.done.set_result(self._status)
        else:
            tail = (self._tail + data)[-16:]
            self._tail = tail
            if tail.endswith(TERMINATOR):
                self.done.set_result(self._status)


async def _open(port: int, request: bytes, stream: bool) -> _Conn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: _Conn(request, stream), HOST, port)
    return conn


# --------------------------------------------------------------------------- load


async def load(command: Mapping[str, Any]) -> dict[str, Any]:
    port = int(command["port"])
    request = str(command["request"]).encode("latin-1")
    stream = bool(command["stream"])
    clients = int(command["clients"])
    warmup = float(command["warmup"])
    duration = float(command["duration"])
    min_completions = int(command.get("min_completions", max(20, clients)))
    max_extra = float(command.get("max_extra", 8.0))
    drain = float(command.get("drain", 30.0))
    pids: dict[str, int] = {k: int(v) for k, v in command.get("pids", {}).items()}
    conns = [await _open(port, request, stream) for _ in range(clients)]
    latencies: list[float] = []
    ttfts: list[float] = []
    errors: list[str] = []
    completed = 0
    warmed: set[int] = set()
    measuring = False
    stopping = False
    failed = asyncio.Event()
    marks: dict[str, Any] = {}

    def mark(which: str) -> None:
        marks[which] = (time.perf_counter(), time.process_time(), cpu_of(pids))

    async def worker(index: int, conn: _Conn) -> None:
        nonlocal completed
        perf = time.perf_counter
        while not stopping:
            counted = measuring
            try:
                status = await conn.send()
            except (ConnectionError, ValueError) as exc:
                errors.append(str(exc))
                failed.set()
                return
            ended = perf()
            warmed.add(index)
            if status != 200:
                errors.append(f"status {status}")
                if len(errors) > 20:
                    failed.set()
                    return
                continue
            if stream and not conn.first_at:
                errors.append("a stream without content")
            if measuring:
                completed += 1
            if counted:
                latencies.append(ended - conn.sent_at)
                if stream and conn.first_at:
                    ttfts.append(conn.first_at - conn.sent_at)

    async def control() -> None:
        """Warm-up (at least ``warmup`` s and until every connection has had an answer, at
        most ``max_extra`` s more), then the window: at least ``duration`` s and until
        ``min_completions`` completed in it (at most ``max_extra`` s more)."""
        nonlocal measuring, stopping
        begin = time.perf_counter()
        await asyncio.sleep(warmup)
        while len(warmed) < clients and time.perf_counter() - begin < warmup + max_extra:
            await asyncio.sleep(0.01)
        mark("start")
        measuring = True
        opened = time.perf_counter()
        await asyncio.sleep(duration)
        while completed < min_completions and time.perf_counter() - opened < duration + max_extra:
            await asyncio.sleep(0.01)
        mark("end")
        measuring = False
        stopping = True

    tasks = [asyncio.ensure_future(worker(i, conn)) for i, conn in enumerate(conns)]
    controller = asyncio.ensure_future(control())
    try:
        stopper = asyncio.ensure_future(failed.wait())
        await asyncio.wait([controller, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not controller.done():  # a connection failed: stop the turn now
            controller.cancel()
            stopping = True
            if "start" not in marks:
                mark("start")
            mark("end")
        await asyncio.wait_for(asyncio.gather(*tasks), drain)
    except TimeoutError:
        errors.append(f"requests still unanswered {drain:g} s after the window")
    finally:
        for task in tasks:
            task.cancel()
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
    (w0, c0, p0), (w1, c1, p1) = marks["start"], marks["end"]
    seconds = max(w1 - w0, 1e-9)
    return {
        "completed": completed,
        "seconds": seconds,
        "latencies": latencies,
        "ttfts": ttfts,
        "cpu": {name: p1[name] - p0[name] for name in pids},
        "client_cpu": (c1 - c0) / seconds,
        "rss": rss_of(pids),
        "errors": errors[:5] + ([f"... {len(errors)} errors in all"] if len(errors) > 5 else []),
    }


# --------------------------------------------------------------------------- hold


async def _get(port: int, target: str, timeout: float) -> tuple[float, bytes]:
    """One GET on a fresh connection: (seconds, body); raises TimeoutError."""
    started = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), timeout)  # to EOF: Connection: close
        head, _, body = data.partition(b"\r\n\r\n")
        if b"chunked" in head.lower():
            body = _dechunk(body)
        return time.perf_counter() - started, body
    finally:
        writer.close()


def _dechunk(raw: bytes) -> bytes:
    out: list[bytes] = []
    at = 0
    while True:
        eol = raw.find(b"\r\n", at)
        if eol < 0:
            return b"".join(out)
        size = int(raw[at:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(raw[eol + 2 : eol + 2 + size])
        at = eol + 2 + size + 2


def metric_sum(text: bytes, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text exposition."""
    total = 0.0
    prefix = name.encode()
    for line in text.split(b"\n"):
        if line.startswith(prefix) and line[len(prefix) : len(prefix) + 1] in (b" ", b"{"):
            total += float(line.rsplit(b" ", 1)[1])
    return total


def metric_labels(text: bytes, name: str, label: str) -> set[str]:
    found = set()
    pattern = re.compile(
        rb"^" + re.escape(name.encode()) + rb"\{[^}]*" + label.encode() + rb'="([^"]*)"'
    )
    for line in text.split(b"\n"):
        if m := pattern.match(line):
            found.add(m.group(1).decode())
    return found


async def probe(
    port: int, request: bytes, count: int, limit: float, errors: list[str]
) -> list[float]:
    """Sequential non-stream requests on one keep-alive connection (``count``, or as many as
    fit in ``limit`` seconds): the latencies of the 200s. Other answers are added to
    ``errors`` (status and the start of the body) and do not count."""
    latencies: list[float] = []
    deadline = time.perf_counter() + limit
    conn: _Conn | None = None
    try:
        while len(latencies) < count and time.perf_counter() < deadline:
            if conn is None or conn.closed.done():
                conn = await _open(port, request, False)
            try:
                status = await asyncio.wait_for(
                    conn.send(), max(deadline - time.perf_counter(), 0.1)
                )
            except (ConnectionError, ValueError, TimeoutError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                conn = None
                continue
            if status != 200:
                errors.append(f"status {status}: {conn.body[:160].decode(errors='replace')}")
                await asyncio.sleep(0.05)
                continue
            latencies.append(time.perf_counter() - conn.sent_at)
    finally:
        if conn is not None and conn.transport is not None:
            conn.transport.close()
    return latencies


async def hold(command: Mapping[str, Any]) -> dict[str, Any]:
    """Hold ``n`` streams on the edge and measure around them.

    1. warm-up and the "before" probe: ``probe_count`` sequential non-stream requests;
    2. RSS of ``pids`` (edge, node); ``n`` connections opened (``open_concurrency`` connects
       at a time), each sending ``stream_request``; established = its first content delta
       arrived (the edge commits a stream at its first token);
    3. RSS again ``settle`` s later: KiB per stream = delta / n;
    4. the "during" probe; how many held streams the server closed;
    5. every held connection closed at once; ``/metrics`` polled every ``poll`` s (a fresh
       connection each time, ``poll_timeout`` s to answer) until
       ``dispatcher_slots_in_use``, ``dispatcher_inflight_requests`` and
       ``dispatcher_inflight_runs`` are all 0: the release time, and the slowest answer.
    """
    port = int(command["port"])
    n = int(command["n"])
    stream_request = str(command["stream_request"]).encode("latin-1")
    probe_request = str(command["probe_request"]).encode("latin-1")
    probe_count = int(command["probe_count"])
    pids: dict[str, int] = {k: int(v) for k, v in command["pids"].items()}
    establish_timeout = float(command.get("establish_timeout", 120.0))
    release_timeout = float(command.get("release_timeout", 60.0))
    poll = float(command.get("poll", 0.05))
    poll_timeout = float(command.get("poll_timeout", 5.0))
    open_concurrency = int(command.get("open_concurrency", 200))
    settle = float(command.get("settle", 1.0))
    out: dict[str, Any] = {"n": n}

    errors: dict[str, list[str]] = {"before": [], "during": [], "after": [], "streams": []}
    out["errors"] = errors
    await probe(port, probe_request, 20, 10.0, [])
    out["before"] = await probe(port, probe_request, probe_count, 20.0, errors["before"])
    _, metrics = await _get(port, "/metrics", poll_timeout)
    out["nodes_before"] = sorted(metric_labels(metrics, "dispatcher_slots_total", "node"))
    out["rss_before"] = rss_of(pids)

    conns: list[_Conn] = []
    gate = asyncio.Semaphore(open_concurrency)
    started = time.perf_counter()

    async def opener() -> None:
        async with gate:
            conn = await _open(port, stream_request, True)
        conns.append(conn)
        conn.send()

    try:
        await asyncio.wait_for(asyncio.gather(*(opener() for _ in range(n))), establish_timeout)
        out["open_seconds"] = time.perf_counter() - started
        deadline = started + establish_timeout
        while True:
            pending = sum(1 for c in conns if not c.first_at)
            failed = sum(1 for c in conns if c.done is not None and c.done.done())
            if pending == failed or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.05)
        out["established"] = sum(1 for c in conns if c.first_at)
        for conn in conns:
            if conn.done is not None and conn.done.done() and not conn.first_at:
                failure = conn.done.exception()
                errors["streams"].append(
                    f"{type(failure).__name__}: {failure}"
                    if failure is not None
                    else f"status {conn.done.result()}"
                )
        out["establish_seconds"] = time.perf_counter() - started
        out["failed_to_establish"] = pending
        await asyncio.sleep(settle)
        out["rss_during"] = rss_of(pids)
        out["during"] = await probe(port, probe_request, probe_count, 30.0, errors["during"])
        out["dropped_while_held"] = sum(1 for c in conns if c.closed.done())
        _, metrics = await _get(port, "/metrics", poll_timeout)
        out["slots_in_use_held"] = metric_sum(metrics, "dispatcher_slots_in_use")
    finally:
        cpu_left = cpu_of(pids)
        left = time.perf_counter()
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
    slowest = 0.0
    unanswered = 0
    released = None
    in_use_released = None
    while time.perf_counter() - left < release_timeout:
        try:
            took, metrics = await _get(port, "/metrics", poll_timeout)
        except (TimeoutError, OSError):
            unanswered += 1
            slowest = max(slowest, poll_timeout)
            continue
        slowest = max(slowest, took)
        busy = sum(
            metric_sum(metrics, name)
            for name in (
                "dispatcher_slots_in_use",
                "dispatcher_inflight_requests",
                "dispatcher_inflight_runs",
            )
        )
        if busy == 0 and in_use_released is None:
            in_use_released = time.perf_counter() - left
        # a slot whose client left stays draining until the node confirms the cancel
        if busy == 0 and metric_sum(metrics, "dispatcher_slots_draining") == 0:
            released = time.perf_counter() - left
            break
        await asyncio.sleep(poll)
    cpu_released = cpu_of(pids)
    # the CPU both daemons spent from the close to the last slot freed (the polls included)
    out["release_cpu"] = {name: cpu_released[name] - cpu_left[name] for name in pids}
    out["in_use_release_seconds"] = in_use_released
    out["release_seconds"] = released
    out["metrics_slowest"] = slowest
    out["metrics_unanswered"] = unanswered
    _, metrics = await _get(port, "/metrics", poll_timeout)
    out["nodes_after"] = sorted(metric_labels(metrics, "dispatcher_slots_total", "node"))
    out["after"] = await probe(port, probe_request, probe_count, 20.0, errors["after"])
    return out


# --------------------------------------------------------------------------- main


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = orjson.loads(line)
        try:
            if command["cmd"] == "load":
                answer = await load(command)
            elif command["cmd"] == "hold":
                answer = await hold(command)
            else:
                answer = {"error": f"unknown command {command['cmd']!r}"}
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.buffer.write(orjson.dumps(answer) + b"\n")
        sys.stdout.buffer.flush()


def main() -> None:
    raise_nofile()
    asyncio.run(_serve())


if __name__ == "__main__":
    main()
