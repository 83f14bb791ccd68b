"""HTTP section: our server (``dispatcher.http.serve_http``) next to a bare h11 + Trio loop.

Measures, for each server in its own process, with the load generator in this process:

* requests/s and p50/p99 latency of a trivial JSON POST at 1 and 32 keep-alive clients;
* SSE chunks/s of one stream of small events;
* websocket messages/s received by the server (ours only: the bare loop has no websockets);
* RSS per idle SSE stream with 5,000 streams open (a fresh server process for this one).

The server side of this module runs as ``python -m bench.http_bench serve ours|bare``.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import trio

from bench import Table, fmt_int
from bench._load import (
    LoadResult,
    MachineLoad,
    ServerDidNotStart,
    ServerProcess,
    announce_port,
    close_all,
    cpu_seconds,
    http_request,
    open_idle_streams,
    raise_nofile_limit,
    read_event_stream,
    request_load,
    rss_kib,
    server_process,
    websocket_one_way,
)
from bench.bare_h11 import JSON_REPLY, SSE_EVENT, SSE_HEADERS, handle_connection, sse_count

if TYPE_CHECKING:
    from dispatcher.http import Request, Responder

TIME_LIMIT = 115.0
"""The whole section is cut off after this many seconds."""

ROUNDS = 3
"""Each timed measurement is split in this many rounds, the servers taking turns."""
WARMUP = 0.3
"""Per round, before the timed part."""
DURATION = 3.0
"""Timed seconds of each JSON POST measurement per server (all rounds together)."""
SSE_EVENTS = 200_000
WS_MESSAGES = 100_000
IDLE_STREAMS = 5_000
IDLE_WARMUP_STREAMS = 20

TARGET_RPS_RATIO = 0.50
TARGET_SSE = 35_000.0
TARGET_IDLE_KIB = 15.0

KINDS = ("ours", "bare")
TITLES = {"ours": "ours (serve_http)", "bare": "bare h11 loop"}

JSON_BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hello"}], "stream": False}
).encode()
WS_MESSAGE = b'{"choices":[{"delta":"token"}]}'
WS_END = b"end"


# =========================================================================== server side


async def ours_handler(request: Request, responder: Responder) -> None:
    """The benchmark routes on our server; same behaviour as ``bare_h11.handle_connection``."""
    path = request.path
    if path == "/echo":
        json.loads(await request.body())
        await responder.respond(200, [(b"content-type", b"application/json")], JSON_REPLY)
    elif path == "/sse":
        stream = await responder.start_stream(200, SSE_HEADERS)
        for _ in range(sse_count(request.query)):
            await stream.send(SSE_EVENT)
    elif path == "/idle":
        stream = await responder.start_stream(200, SSE_HEADERS)
        await stream.send(SSE_EVENT)
        await trio.sleep_forever()
    elif path == "/ws" and request.is_websocket_upgrade:
        ws = await responder.accept_websocket()
        count = 0
        first = 0.0
        while await ws.receive() != WS_END.decode():
            if count == 0:
                first = time.perf_counter()
            count += 1
        await ws.send(f"{count} {time.perf_counter() - first:.6f}")
        await ws.aclose()
    else:
        await responder.respond(404)


async def _serve_ours() -> None:
    from dispatcher.http import Server, ServerLimits, serve_http

    async with trio.open_nursery() as nursery:
        server: Server = await nursery.start(
            partial(
                serve_http,
                ours_handler,
                host="127.0.0.1",
                port=0,
                limits=ServerLimits(shutdown_grace=1.0),
            )
        )
        announce_port(server.address.port)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                server.shutdown()  # graceful; serve_http returns when it is over
                break


async def _serve_bare() -> None:
    async with trio.open_nursery() as nursery:
        listeners: list[trio.SocketListener] = await nursery.start(
            partial(trio.serve_tcp, handle_connection, 0, host="127.0.0.1")
        )
        announce_port(listeners[0].socket.getsockname()[1])
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def serve_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.http_bench")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one benchmark server; print BENCH-PORT <n>")
    serve.add_argument("kind", choices=KINDS)
    args = parser.parse_args(argv)
    raise_nofile_limit()
    trio.run(_serve_ours if args.kind == "ours" else _serve_bare)


# =========================================================================== client side


@dataclass
class Results:
    """Per server kind: cells to print, numbers for the targets, notes."""

    cells: dict[tuple[str, str], str] = field(default_factory=dict)
    values: dict[tuple[str, ...], float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def cell(self, metric: str, kind: str) -> str:
        return self.cells.get((metric, kind), "not run")


def _server_args(kind: str) -> list[str]:
    return ["bench.http_bench", "serve", kind]


def _unwrap(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _error_text(exc: BaseException) -> str:
    exc = _unwrap(exc)
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    return f"error: {type(exc).__name__}: {exc}".splitlines()[0][:70]


async def _measure(
    results: Results,
    kind: str,
    metrics: Sequence[str],
    server: ServerProcess | None,
    body: Callable[[ServerProcess], Awaitable[None]],
    *,
    limit: float,
) -> None:
    """Run ``body``; on failure (or no server) every metric of it shows the error.

    Skipped if one of ``metrics`` already has a cell for ``kind`` (an earlier round failed:
    cells of interleaved measurements are only filled in at the end).
    """
    if server is None:
        for metric in metrics:
            results.cells.setdefault((metric, kind), "server did not start")
        return
    if any((metric, kind) in results.cells for metric in metrics):
        return
    try:
        with trio.fail_after(limit):
            await body(server)
    except Exception as exc:
        for metric in metrics:
            results.cells[(metric, kind)] = _error_text(exc)
        tail = server.stderr_tail(5)
        results.notes.append(f"{kind}: {', '.join(metrics)}: {_error_text(exc)}")
        if tail:
            results.notes.append(f"{kind} server stderr (tail): {tail!r}")


def _order(round_: int) -> Sequence[str]:
    """Servers take turns, alternating who goes first, so that load from other processes
    on the machine falls on both columns alike."""
    return KINDS if round_ % 2 == 0 else KINDS[::-1]


_PER_CPU = "per server CPU-second"


def _clients(clients: int) -> str:
    return f"{clients} client" if clients == 1 else f"{clients} clients"


def _load_metrics(clients: int) -> tuple[str, str]:
    """(requests/s row, latency row) of the JSON POST at ``clients`` connections."""
    return (
        f"JSON POST, {_clients(clients)}: req/s",
        f"    p50 / p99 latency, {_clients(clients)} (ms)",
    )


@dataclass
class _Rounds:
    """What the rounds of one measurement on one server add up to."""

    loads: list[LoadResult] = field(default_factory=list)
    events: int = 0
    seconds: float = 0.0
    server_cpu: float = 0.0
    client_cpu: float = 0.0


async def _json_round(rounds: _Rounds, clients: int, server: ServerProcess) -> None:
    request = http_request("POST", "/echo", JSON_BODY, headers="Content-Type: application/json\r\n")
    rounds.loads.append(
        await request_load(
            server.port,
            request,
            clients=clients,
            duration=DURATION / ROUNDS,
            warmup=WARMUP,
            server_pid=server.pid,
        )
    )


async def _json_load(
    results: Results, servers: dict[str, ServerProcess | None], clients: int
) -> None:
    rps_metric, lat_metric = _load_metrics(clients)
    rounds = {kind: _Rounds() for kind in KINDS}
    for round_ in range(ROUNDS):
        for kind in _order(round_):
            await _measure(
                results,
                kind,
                (rps_metric, lat_metric),
                servers[kind],
                partial(_json_round, rounds[kind], clients),
                limit=DURATION / ROUNDS + WARMUP + 10,
            )
    for kind in KINDS:
        if (rps_metric, kind) in results.cells:
            continue  # failed
        result = LoadResult.combined(rounds[kind].loads)
        results.values[(rps_metric, kind)] = result.rps
        results.values[(_PER_CPU, rps_metric, kind)] = result.per_server_cpu_second
        results.cells[(rps_metric, kind)] = fmt_int(result.rps)
        results.cells[(lat_metric, kind)] = (
            f"{result.percentile_ms(0.50):.2f} / {result.percentile_ms(0.99):.2f}"
        )
        results.notes.append(
            f"{kind}, JSON POST, {_clients(clients)}: {result.requests:,} responses in "
            f"{result.seconds:g} s; server CPU {result.server_cpu:.0%} "
            f"({fmt_int(result.per_server_cpu_second)} per server CPU-second), "
            f"load generator CPU {result.client_cpu:.0%}"
        )


SSE_METRIC = f"SSE chunks/s (1 stream, {SSE_EVENTS:,} events)"
WS_METRIC = f"WS messages/s (server side, {WS_MESSAGES:,})"
IDLE_METRIC = f"RSS per idle SSE stream ({IDLE_STREAMS:,} streams)"


async def _sse_round(rounds: _Rounds, events: int, server: ServerProcess) -> None:
    if not rounds.events:
        await read_event_stream(server.port, "/sse?n=1000")  # warm-up
    cpu0, own0 = cpu_seconds(server.pid), time.process_time()
    received, seconds = await read_event_stream(server.port, f"/sse?n={events}")
    rounds.server_cpu += cpu_seconds(server.pid) - cpu0
    rounds.client_cpu += time.process_time() - own0
    if received != events:
        raise RuntimeError(f"read {received} events, expected {events}")
    rounds.events += received
    rounds.seconds += seconds


async def _sse(results: Results, servers: dict[str, ServerProcess | None]) -> None:
    rounds = {kind: _Rounds() for kind in KINDS}
    for round_ in range(ROUNDS):
        events = SSE_EVENTS // ROUNDS + (SSE_EVENTS % ROUNDS if round_ == 0 else 0)
        for kind in _order(round_):
            await _measure(
                results,
                kind,
                [SSE_METRIC],
                servers[kind],
                partial(_sse_round, rounds[kind], events),
                limit=30,
            )
    for kind in KINDS:
        if (SSE_METRIC, kind) in results.cells:
            continue
        r = rounds[kind]
        results.values[(SSE_METRIC, kind)] = r.events / r.seconds
        results.cells[(SSE_METRIC, kind)] = fmt_int(r.events / r.seconds)
        results.notes.append(
            f"{kind}, SSE: {r.events:,} events in {r.seconds:.2f} s; server CPU "
            f"{r.server_cpu / r.seconds:.0%} ({fmt_int(_ratio(r.events, r.server_cpu))} per "
            f"server CPU-second), load generator CPU {r.client_cpu / r.seconds:.0%}"
        )


async def _websocket(results: Results, kind: str, server: ServerProcess) -> None:
    await websocket_one_way(server.port, "/ws", WS_MESSAGE, 1000, WS_END)  # warm-up
    ack, seconds = await websocket_one_way(server.port, "/ws", WS_MESSAGE, WS_MESSAGES, WS_END)
    count_text, _, elapsed_text = ack.partition(" ")
    count, server_seconds = int(count_text), float(elapsed_text)
    if count != WS_MESSAGES:
        raise RuntimeError(f"server counted {count} messages, expected {WS_MESSAGES}")
    results.values[(WS_METRIC, kind)] = count / server_seconds
    results.cells[(WS_METRIC, kind)] = fmt_int(count / server_seconds)
    results.notes.append(
        f"{kind}, websocket: server received {count:,} in {server_seconds:.2f} s; "
        f"client send-to-ack {count / seconds:,.0f} msg/s"
    )


async def _idle_streams(results: Results, kind: str) -> None:
    async with server_process(kind, _server_args(kind)) as server:

        async def body(server: ServerProcess) -> None:
            warm = await open_idle_streams(
                server.port, "/idle", IDLE_WARMUP_STREAMS, concurrency=10
            )
            close_all(warm)
            await trio.sleep(0.5)
            before = rss_kib(server.pid)
            start = time.perf_counter()
            socks = await open_idle_streams(server.port, "/idle", IDLE_STREAMS, concurrency=64)
            try:
                opened = time.perf_counter() - start
                await trio.sleep(0.5)
                after = rss_kib(server.pid)
            finally:
                close_all(socks)
            per_stream = (after - before) / IDLE_STREAMS
            results.values[(IDLE_METRIC, kind)] = per_stream
            results.cells[(IDLE_METRIC, kind)] = f"{per_stream:.1f} KB"
            results.notes.append(
                f"{kind}, idle streams: RSS {before / 1024:.1f} -> {after / 1024:.1f} MB, "
                f"{IDLE_STREAMS:,} opened in {opened:.1f} s"
            )

        await _measure(results, kind, [IDLE_METRIC], server, body, limit=40)


async def _start(stack: AsyncExitStack, results: Results, kind: str) -> ServerProcess | None:
    try:
        return await stack.enter_async_context(server_process(kind, _server_args(kind)))
    except Exception as exc:
        results.notes.append(str(_unwrap(exc)))
        return None


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _verdict(ok: bool, detail: str = "") -> str:
    text = "PASS" if ok else "MISS"
    return f"{text} ({detail})" if detail else text


def _table(results: Results) -> Table:
    rows: list[Sequence[str]] = []

    def row(metric: str, target: str = "", verdict: str = "") -> None:
        rows.append([metric, *(results.cell(metric, kind) for kind in KINDS), target, verdict])

    for clients in (1, 32):
        rps_metric, lat_metric = _load_metrics(clients)
        ours = results.values.get((rps_metric, "ours"))
        bare = results.values.get((rps_metric, "bare"))
        verdict = ""
        if ours is not None and bare:
            ratio = ours / bare
            per_cpu = _ratio(
                results.values.get((_PER_CPU, rps_metric, "ours"), math.nan),
                results.values.get((_PER_CPU, rps_metric, "bare"), math.nan),
            )
            verdict = _verdict(
                ratio >= TARGET_RPS_RATIO, f"{ratio:.0%} of bare; per CPU-second {per_cpu:.0%}"
            )
        row(rps_metric, f">= {TARGET_RPS_RATIO:.0%} of bare", verdict)
        row(lat_metric)
    sse = results.values.get((SSE_METRIC, "ours"))
    row(SSE_METRIC, f">= {fmt_int(TARGET_SSE)}", "" if sse is None else _verdict(sse >= TARGET_SSE))
    results.cells.setdefault((WS_METRIC, "bare"), "n/a")
    row(WS_METRIC)
    idle = results.values.get((IDLE_METRIC, "ours"))
    row(
        IDLE_METRIC,
        f"<= {TARGET_IDLE_KIB:g} KB",
        "" if idle is None else _verdict(idle <= TARGET_IDLE_KIB),
    )
    notes = [
        "targets apply to ours; the bare loop is the ceiling of h11 + Trio on this machine",
        "KB = 1024 bytes; numbers vary 20-40% between runs: compare columns of one run",
        *results.notes,
    ]
    return Table(
        title="http: our server vs a bare h11 + Trio loop (each in its own process)",
        columns=["metric", *(TITLES[kind] for kind in KINDS), "target", "ours vs target"],
        rows=rows,
        notes=notes,
    )


async def run() -> list[Table]:
    raise_nofile_limit()
    results = Results()
    load = MachineLoad()
    try:
        with trio.fail_after(TIME_LIMIT - 5):
            async with AsyncExitStack() as stack:
                servers = {kind: await _start(stack, results, kind) for kind in KINDS}
                for clients in (1, 32):
                    await _json_load(results, servers, clients)
                await _sse(results, servers)
                await _measure(
                    results,
                    "ours",
                    [WS_METRIC],
                    servers["ours"],
                    partial(_websocket, results, "ours"),
                    limit=20,
                )
            for kind in KINDS:
                try:
                    await _idle_streams(results, kind)
                except Exception as exc:
                    error = _unwrap(exc)
                    results.cells[(IDLE_METRIC, kind)] = (
                        "server did not start"
                        if isinstance(error, ServerDidNotStart)
                        else _error_text(error)
                    )
    except trio.TooSlowError:
        results.notes.append(f"section cut off after {TIME_LIMIT - 5:g} s")
    results.notes.append(load.note())
    return [_table(results)]


if __name__ == "__main__":
    serve_main(sys.argv[1:])
