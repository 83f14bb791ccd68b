"""Edge section: the whole path, client -> edge (HTTP) -> websocket -> node -> echo -> back.

Three measurements, every process on 127.0.0.1, the load generator in this process on raw Trio
sockets (``bench._load``):

1. **Added latency.** The edge (``python -m bench._edge_server edge``: ``open_dispatcher`` with
   no local node) and a real node in another process (``python -m dispatcher node``) joined
   over the websocket. One keep-alive client sends non-streaming chat completions back to back;
   the same client against our HTTP server alone (``_edge_server direct``: ``serve_http``
   answering the very bytes the edge answered) gives the baseline. p50/p99 of each and the
   difference.
2. **One long stream.** One ``"stream": true`` request whose echo reply is
   :data:`STREAM_WORDS` words (the per-request ``"echo": {"reply": ...}`` knob); SSE ``data:``
   events/s and words (echo tokens)/s. The runner and the SSE writer coalesce tokens that pile
   up, so events < tokens: tokens/s is the figure to compare.
3. **Client disconnect -> node sees ``run.cancel``.** The node subprocess is stopped and a node
   runs in *this* process instead (``nodes.agent.serve_node``, default echo config, the default
   websocket dial wrapped to timestamp frames), so one clock covers both ends. Each run: a
   stream with ``token_delay`` 0.01 s, read to the first content chunk, close the socket; the
   time until the node's receive loop gets ``run.cancel`` for that run (the runner cancels
   the run's scope in the same step), and until the node has sent ``run.cancelled``.

``python -m bench.edge_bench`` runs this section alone.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import trio

from bench import Table, fmt_int
from bench._load import (
    READ_SIZE,
    REPO_ROOT,
    LoadError,
    LoadResult,
    MachineLoad,
    ServerDidNotStart,
    ServerProcess,
    Sock,
    connect,
    cpu_seconds,
    http_request,
    raise_nofile_limit,
    read_head,
    request_load,
    send_all,
    server_process,
)
from dispatcher import wire
from dispatcher.shared.transport import Connection, RawFrame

if TYPE_CHECKING:
    from nodes.config import NodeConfig

TIME_LIMIT = 90.0
"""The whole section is cut off after this many seconds."""

CHAT_PATH = "/v1/chat/completions"
NODE_ID = "bench-node"
CANCEL_NODE_ID = "bench-cancel-node"

ROUNDS = 3
"""Latency: each server is measured in this many rounds, taking turns."""
WARMUP = 0.3
"""Latency: seconds of requests before each round's counted part."""
DURATION = 3.0
"""Latency: counted seconds per server, all rounds together."""
STREAM_WORDS = 50_000
STREAM_RUNS = 3
"""Measured long streams (after one short warm-up stream)."""
CANCEL_RUNS = 200
CANCEL_WARMUP = 10
CANCEL_TOKEN_DELAY = 0.01
CANCEL_WAIT = 2.0
"""A cancel not seen by the node within this many seconds counts as a timeout."""

TARGET_ADDED_P50_MS = 1.0
TARGET_TOKENS_PER_S = 15_000.0
TARGET_CANCEL_P99_MS = 20.0

JSON_HEADER = "Content-Type: application/json\r\n"


def chat_request(content: str = "hello", **extra: Any) -> bytes:
    body = {"model": "echo", "messages": [{"role": "user", "content": content}], **extra}
    return http_request("POST", CHAT_PATH, orjson.dumps(body), headers=JSON_HEADER)


def words(count: int) -> str:
    """``count`` distinct-looking words separated by single spaces (echo: one token each)."""
    return " ".join(f"w{i % 9973}" for i in range(count))


def percentile(values: Sequence[float], q: float) -> float:
    """The same nearest-rank percentile as ``LoadResult.percentile_ms`` (no interpolation)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fmt_ms(seconds: float) -> str:
    if math.isinf(seconds):
        return "timeout"
    return f"{seconds * 1000:.2f}"


# --------------------------------------------------------------------------- HTTP helpers


async def recv(sock: Sock) -> bytes:
    data = await sock.recv(READ_SIZE)
    if not data:
        raise LoadError("server closed the connection")
    return data


async def fetch(port: int, request: bytes) -> tuple[int, bytes, bytes]:
    """One request on a fresh connection, a Content-Length response: (status, head, body)."""
    sock = await connect(port)
    try:
        await send_all(sock, request)
        status, head, data = await read_head(sock, b"")
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            raise LoadError(f"response without Content-Length: {head[:200]!r}")
        eol = head.find(b"\r\n", at + 2)
        length = int(head[at + 17 : eol if eol >= 0 else len(head)])
        while len(data) < length:
            data += await recv(sock)
        return status, head, data[:length]
    finally:
        sock.close()


async def edge_models(port: int, *, headers: str = "") -> list[str]:
    """The models ``GET /v1/models`` lists (``headers``: extra header lines, a client key)."""
    status, _, body = await fetch(port, http_request("GET", "/v1/models", headers=headers))
    if status != 200:
        raise LoadError(f"GET /v1/models answered {status}")
    return [model["id"] for model in orjson.loads(body)["data"]]


async def wait_for_models(
    port: int,
    wanted: Callable[[list[str]], bool],
    *,
    alive: Callable[[], bool] = lambda: True,
    headers: str = "",
) -> None:
    while not wanted(await edge_models(port, headers=headers)):
        if not alive():
            raise ServerDidNotStart("the node process exited before joining the edge")
        await trio.sleep(0.02)


def dechunk(raw: bytes) -> bytes:
    """A complete chunked body (terminator included) as its payload."""
    out: list[bytes] = []
    pos = 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        start = eol + 2
        out.append(raw[start : start + size])
        pos = start + size + 2


# --------------------------------------------------------------------------- processes


@asynccontextmanager
async def node_process(
    edge_port: int,
    *,
    model: str = "echo",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[ServerProcess]:
    """``python -m dispatcher node ARGS`` (default: dial the edge as NODE_ID, serving echo),
    until the block ends; yields once the edge lists ``model``. Left: SIGTERM (SIGKILL after
    5 s), waited for."""
    node_args = list(args) or [
        "--edge",
        f"ws://127.0.0.1:{edge_port}/v1/nodes/connect",
        "--id",
        NODE_ID,
    ]
    command = [sys.executable, "-m", "dispatcher", "--log-level", "WARNING", "node", *node_args]
    with tempfile.TemporaryFile() as err:
        async with trio.open_nursery() as nursery:
            proc: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    check=False,
                    cwd=REPO_ROOT,
                    env={**os.environ, **(env or {})},
                )
            )
            try:
                node = ServerProcess("node", proc.pid, 0, err)
                try:
                    with trio.fail_after(30):
                        await wait_for_models(
                            edge_port,
                            lambda models: model in models,
                            alive=lambda: proc.poll() is None,
                        )
                except (trio.TooSlowError, ServerDidNotStart):
                    raise ServerDidNotStart(
                        f"node did not join (exit {proc.poll()}): {node.stderr_tail(3)}"
                    ) from None
                yield node
            finally:
                nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- 1. latency


@dataclass
class _Rounds:
    loads: list[LoadResult] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


async def _latency_round(rounds: _Rounds, port: int, pids: dict[str, int]) -> None:
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    rounds.loads.append(
        await request_load(
            port, chat_request(), clients=1, duration=DURATION / ROUNDS, warmup=WARMUP
        )
    )
    for name, pid in pids.items():
        rounds.cpu[name] = rounds.cpu.get(name, 0.0) + cpu_seconds(pid) - cpu0[name]
    rounds.seconds += DURATION / ROUNDS + WARMUP


async def measure_latency(edge: ServerProcess, node: ServerProcess) -> Table:
    # Capture the edge's answer; the direct server answers these very bytes.
    status, head, body = await fetch(edge.port, chat_request())
    if status != 200:
        raise LoadError(f"the edge answered {status}: {body[:200]!r}")
    reply = orjson.loads(body)["choices"][0]["message"]["content"]
    if reply != "hello":
        raise LoadError(f"echo answered {reply!r}")
    headers = [
        line.decode().split(": ", 1)
        for line in head.split(b"\r\n")[1:]
        if line.startswith((b"content-type:", b"x-dispatcher-"))
    ]
    with tempfile.NamedTemporaryFile(suffix=".json") as spec:
        spec.write(orjson.dumps({"headers": headers, "body": body.decode()}))
        spec.flush()
        async with server_process("direct", ["bench._edge_server", "direct", spec.name]) as direct:
            rounds = {"edge": _Rounds(), "direct": _Rounds()}
            targets = {
                "edge": (edge.port, {"edge": edge.pid, "node": node.pid}),
                "direct": (direct.port, {"direct": direct.pid}),
            }
            for round_ in range(ROUNDS):
                order = ("edge", "direct") if round_ % 2 == 0 else ("direct", "edge")
                for kind in order:
                    port, pids = targets[kind]
                    with trio.fail_after(DURATION / ROUNDS + WARMUP + 10):
                        await _latency_round(rounds[kind], port, pids)

    results = {kind: LoadResult.combined(r.loads) for kind, r in rounds.items()}
    p = {
        (kind, q): result.percentile_ms(q) for kind, result in results.items() for q in (0.50, 0.99)
    }
    added_p50 = p[("edge", 0.50)] - p[("direct", 0.50)]
    added_p99 = p[("edge", 0.99)] - p[("direct", 0.99)]
    verdict = "PASS" if added_p50 <= TARGET_ADDED_P50_MS else "MISS"
    rows: list[Sequence[str]] = [
        [
            "p50 latency, ms",
            f"{p[('edge', 0.50)]:.3f}",
            f"{p[('direct', 0.50)]:.3f}",
            f"{added_p50:+.3f}",
            f"added <= {TARGET_ADDED_P50_MS:g} ms",
            verdict,
        ],
        [
            "p99 latency, ms",
            f"{p[('edge', 0.99)]:.3f}",
            f"{p[('direct', 0.99)]:.3f}",
            f"{added_p99:+.3f}",
        ],
        [
            "requests/s (1 client)",
            fmt_int(results["edge"].rps),
            fmt_int(results["direct"].rps),
        ],
    ]
    notes = [
        "latency: send of the pre-built request to the last byte of the response, one "
        "keep-alive connection, requests back to back",
        f"{ROUNDS} rounds per server, taking turns (edge, direct, direct, edge, ...), each "
        f"{WARMUP:g} s warm-up + {DURATION / ROUNDS:g} s counted; "
        f"{results['edge'].requests:,} edge and {results['direct'].requests:,} direct "
        "responses counted",
        "edge = `python -m bench._edge_server edge` (open_dispatcher, no local node) + "
        "`python -m dispatcher node` (another process, real websocket) + echo; the body is "
        f"{len(body)} bytes ({len(chat_request())}-byte request)",
        "direct = serve_http in its own process, reading the request body and answering the "
        "same headers and body bytes (no JSON parsing, no run)",
    ]
    for kind, r in rounds.items():
        rps = results[kind].rps
        shares = ", ".join(
            f"{name} {seconds / r.seconds:.0%} (~{seconds / r.seconds / rps * 1e6:.0f} us/req)"
            for name, seconds in r.cpu.items()
        )
        notes.append(f"{kind}: CPU {shares}; load generator {results[kind].client_cpu:.0%}")
    return Table(
        title="edge: added latency, non-streaming chat completion, 1 client",
        columns=["metric", "edge + ws node + echo", "direct (serve_http)", "added", "target", ""],
        rows=rows,
        notes=notes,
    )


# --------------------------------------------------------------------------- 2. stream


@dataclass
class StreamResult:
    seconds: float
    """Request sent -> chunked terminator received."""
    first_content: float
    """Request sent -> response head (sent with the first content chunk)."""
    events: int
    """SSE ``data:`` events, ``[DONE]`` included."""
    content_events: int
    """Events carrying non-empty content."""
    chars: int
    tokens: int


async def read_stream(port: int, request: bytes, reply: str) -> StreamResult:
    """Send ``request`` (a streaming chat completion), read the SSE response to its end, then
    check it (parsing happens after the clock stops)."""
    sock = await connect(port)
    try:
        start = time.perf_counter()
        await send_all(sock, request)
        status, head, data = await read_head(sock, b"")
        first = time.perf_counter()
        if status != 200 or b"transfer-encoding: chunked" not in head:
            raise LoadError(f"expected a chunked 200, got {head[:200]!r} {data[:200]!r}")
        pieces = [data]
        tail = data[-7:]
        while not tail.endswith(b"\r\n0\r\n\r\n"):
            data = await recv(sock)
            pieces.append(data)
            tail = (tail + data)[-7:]
        end = time.perf_counter()
    finally:
        sock.close()
    events = [e for e in dechunk(b"".join(pieces)).split(b"\n\n") if e]
    content: list[str] = []
    content_events = 0
    for event in events:
        if not event.startswith(b"data: "):
            raise LoadError(f"not an SSE data event: {event[:100]!r}")
        payload = event[6:]
        if payload == b"[DONE]":
            continue
        choices = orjson.loads(payload)["choices"]
        text = choices[0]["delta"].get("content") if choices else None
        if text:
            content.append(text)
            content_events += 1
    if events[-1] != b"data: [DONE]":
        raise LoadError(f"the stream did not end with [DONE]: {events[-1][:200]!r}")
    text = "".join(content)
    if text != reply:
        raise LoadError(f"streamed {len(text)} characters, expected {len(reply)}")
    return StreamResult(
        seconds=end - start,
        first_content=first - start,
        events=len(events),
        content_events=content_events,
        chars=len(text),
        tokens=len(text.split()),
    )


async def measure_stream(edge: ServerProcess, node: ServerProcess) -> Table:
    warm = words(2_000)
    await read_stream(edge.port, chat_request("go", stream=True, echo={"reply": warm}), warm)
    reply = words(STREAM_WORDS)
    request = chat_request("go", stream=True, echo={"reply": reply})
    results: list[StreamResult] = []
    cpu = {"edge": 0.0, "node": 0.0, "load generator": 0.0}
    for _ in range(STREAM_RUNS):
        cpu0 = {
            "edge": cpu_seconds(edge.pid),
            "node": cpu_seconds(node.pid),
            "load generator": time.process_time(),
        }
        with trio.fail_after(20):
            results.append(await read_stream(edge.port, request, reply))
        cpu["edge"] += cpu_seconds(edge.pid) - cpu0["edge"]
        cpu["node"] += cpu_seconds(node.pid) - cpu0["node"]
        cpu["load generator"] += time.process_time() - cpu0["load generator"]
    seconds = sum(r.seconds for r in results)
    events = sum(r.events for r in results)
    tokens = sum(r.tokens for r in results)
    chars = sum(r.chars for r in results)
    tokens_per_s = tokens / seconds
    per_run = ", ".join(f"{r.tokens / r.seconds:,.0f}" for r in results)
    rows: list[Sequence[str]] = [
        [
            "words (echo tokens)/s",
            fmt_int(tokens_per_s),
            f">= {fmt_int(TARGET_TOKENS_PER_S)}",
            "PASS" if tokens_per_s >= TARGET_TOKENS_PER_S else "MISS",
        ],
        ["SSE data events/s", fmt_int(events / seconds)],
        ["content characters/s", fmt_int(chars / seconds)],
        ["words per content event", f"{tokens / sum(r.content_events for r in results):.1f}"],
        ["time to first content, ms", ", ".join(f"{r.first_content * 1000:.1f}" for r in results)],
    ]
    notes = [
        f"{STREAM_RUNS} streams (after a {len(warm.split()):,}-word warm-up), each the echo reply "
        f"of {STREAM_WORDS:,} words ({len(reply):,} characters) given in the request's "
        '"echo": {"reply": ...}; token_delay 0, so echo produces as fast as the path takes',
        "rates: totals over the streams / their time from request sent to the chunked "
        f"terminator ({seconds:.2f} s in all); words/s per stream: {per_run}",
        "events: every SSE data: event (role, content, finish, [DONE]); content was checked "
        "equal to the reply after the clock stopped",
        "CPU during the streams (of one core): "
        + ", ".join(f"{name} {used / seconds:.0%}" for name, used in cpu.items())
        + " (the load generator's includes parsing and checking after each stream)",
    ]
    return Table(
        title="edge: one long stream through edge + ws node + echo",
        columns=["metric", "figure", "target", ""],
        rows=rows,
        notes=notes,
    )


# --------------------------------------------------------------------------- 3. cancel


class FrameWatch:
    """Timestamps (``time.perf_counter``) of ``run.cancel`` frames received and
    ``run.cancelled`` frames sent by the in-process node, by run id."""

    def __init__(self) -> None:
        self._times: dict[tuple[str, str], float] = {}
        self._events: dict[tuple[str, str], trio.Event] = {}

    def _event(self, key: tuple[str, str]) -> trio.Event:
        return self._events.setdefault(key, trio.Event())

    def mark(self, kind: str, run_id: str, at: float) -> None:
        self._times.setdefault((kind, run_id), at)
        self._event((kind, run_id)).set()

    async def wait(self, kind: str, run_id: str) -> float:
        await self._event((kind, run_id)).wait()
        return self._times[(kind, run_id)]

    def forget(self, run_id: str) -> None:
        for kind in ("cancel", "cancelled"):
            self._times.pop((kind, run_id), None)
            self._events.pop((kind, run_id), None)


class WatchedConnection:
    """A node's :class:`~dispatcher.shared.transport.Connection`, passed through, timestamping the
    frames :class:`FrameWatch` wants."""

    def __init__(self, inner: Connection, watch: FrameWatch) -> None:
        self._inner = inner
        self._watch = watch

    async def send(self, frame: RawFrame) -> None:
        await self._inner.send(frame)
        if isinstance(frame, str) and '"run.cancelled"' in frame:
            at = time.perf_counter()
            message = wire.decode(frame)
            if isinstance(message, wire.RunCancelled):
                self._watch.mark("cancelled", message.run_id, at)

    async def receive(self) -> RawFrame:
        frame = await self._inner.receive()
        if isinstance(frame, str) and '"run.cancel"' in frame:
            at = time.perf_counter()
            message = wire.decode(frame)
            if isinstance(message, wire.RunCancel):
                self._watch.mark("cancel", message.run_id, at)
        return frame

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        await self._inner.aclose(code, reason)


def watched_dial(
    config: NodeConfig, watch: FrameWatch
) -> Callable[[], AbstractAsyncContextManager[Connection]]:
    """The node's default dial (``nodes.agent.dial_edge``), its connection watched."""
    from nodes.agent import dial_edge

    @asynccontextmanager
    async def dial() -> AsyncIterator[Connection]:
        async with dial_edge(config) as conn:
            yield WatchedConnection(conn, watch)

    return dial


def run_id_of(data: bytes) -> str:
    at = data.find(b'"id":"chatcmpl-')
    if at < 0:
        raise LoadError(f"no completion id in {data[:200]!r}")
    start = at + len(b'"id":"chatcmpl-')
    return data[start : data.index(b'"', start)].decode()


async def cancel_once(port: int, request: bytes, watch: FrameWatch) -> tuple[float, float]:
    """One disconnect: seconds from closing the socket to the node receiving ``run.cancel``
    and to it sending ``run.cancelled`` (``inf`` when not within :data:`CANCEL_WAIT`)."""
    sock = await connect(port)
    try:
        await send_all(sock, request)
        status, _, data = await read_head(sock, b"")
        if status != 200:
            raise LoadError(f"status {status}")
        # The edge holds the head until the first content, then sends the role chunk and
        # the content in one write: two events means the first content chunk is here.
        while data.count(b"\n\n") < 2:
            data += await recv(sock)
        if b'"delta":{"content":"w' not in data:
            raise LoadError(f"no content in the first chunk: {data[:300]!r}")
        run_id = run_id_of(data)
    except BaseException:
        sock.close()
        raise
    closed = time.perf_counter()
    sock.close()
    cancel = cancelled = math.inf
    with trio.move_on_after(CANCEL_WAIT):
        cancel = await watch.wait("cancel", run_id) - closed
        cancelled = await watch.wait("cancelled", run_id) - closed
    watch.forget(run_id)
    return cancel, cancelled


async def measure_cancel(edge: ServerProcess) -> Table:
    from nodes.agent import serve_node
    from nodes.config import default_node_config

    config = attrs.evolve(default_node_config(CANCEL_NODE_ID), edge_url=_ws_url(edge.port))
    watch = FrameWatch()
    reply = words(500)  # 5 s at 0.01 s per token: never finishes before the disconnect
    request = chat_request(
        "go", stream=True, echo={"reply": reply, "token_delay": CANCEL_TOKEN_DELAY}
    )
    cancels: list[float] = []
    confirms: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_node, config, dial=watched_dial(config, watch)))
        with trio.fail_after(10):
            await wait_for_models(edge.port, lambda models: "echo" in models)
        for i in range(CANCEL_WARMUP + CANCEL_RUNS):
            cancel, cancelled = await cancel_once(edge.port, request, watch)
            if i >= CANCEL_WARMUP:
                cancels.append(cancel)
                confirms.append(cancelled)
        nursery.cancel_scope.cancel()
    timeouts = sum(math.isinf(c) for c in cancels)
    p99 = percentile(cancels, 0.99)
    rows: list[Sequence[str]] = [
        [
            "disconnect -> node receives run.cancel",
            fmt_ms(percentile(cancels, 0.50)),
            fmt_ms(p99),
            fmt_ms(max(cancels)),
            f"p99 <= {TARGET_CANCEL_P99_MS:g} ms",
            "PASS" if p99 * 1000 <= TARGET_CANCEL_P99_MS else "MISS",
        ],
        [
            "disconnect -> node sent run.cancelled",
            fmt_ms(percentile(confirms, 0.50)),
            fmt_ms(percentile(confirms, 0.99)),
            fmt_ms(max(confirms)),
        ],
    ]
    notes = [
        f"{CANCEL_RUNS} disconnects (after {CANCEL_WARMUP} warm-up), one at a time: a stream "
        f"with echo token_delay {CANCEL_TOKEN_DELAY:g} s, read to the first content chunk, "
        "socket closed (t0)",
        "the node runs in the bench process (nodes.agent.serve_node, default echo config, the "
        "default websocket dial with its Connection wrapped): 'receives run.cancel' is when "
        "the node's receive loop gets the frame (it cancels the run's scope in the same step); "
        "'sent run.cancelled' is when its confirmation left the node",
        "the edge is the same subprocess as above (its first node stopped); one clock "
        "(perf_counter) for t0 and the node side",
        f"timeouts (no run.cancel within {CANCEL_WAIT:g} s): {timeouts}",
    ]
    return Table(
        title="edge: client disconnect -> node sees the cancel",
        columns=["interval, ms", "p50", "p99", "max", "target", ""],
        rows=rows,
        notes=notes,
    )


def _ws_url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/nodes/connect"


# --------------------------------------------------------------------------- the section


def log_notes(process: ServerProcess) -> list[str]:
    """A note when a process logged warnings or errors (its stderr), naming the last one."""
    lines = process.stderr_tail(10_000).splitlines()
    bad = [line for line in lines if "WARNING" in line or "ERROR" in line or "Traceback" in line]
    if not bad:
        return []
    return [f"{process.name} process logged {len(bad)} warning/error line(s); last: {bad[-1]}"]


async def run() -> list[Table]:
    raise_nofile_limit()
    tables: list[Table] = []
    load = MachineLoad()
    async with server_process("edge", ["bench._edge_server", "edge"]) as edge:
        async with node_process(edge.port) as node:
            tables.append(await measure_latency(edge, node))
            tables.append(await measure_stream(edge, node))
            tables[-1].notes.extend(log_notes(node))
        with trio.fail_after(10):
            await wait_for_models(edge.port, lambda models: not models)
        tables.append(await measure_cancel(edge))
        tables[-1].notes.extend(log_notes(edge))
    tables[-1].notes.append(load.note())
    return tables


def _main() -> None:
    from bench import render

    for table in trio.run(run):
        print(render(table), flush=True)
        print(flush=True)


if __name__ == "__main__":
    _main()
