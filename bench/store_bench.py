"""Store section (issue #23): what the shared stores cost next to the embedded ones.

1. **The limit path, from outside.** Three edges, each ``python -m dispatcher serve`` with
   one ``[[keys]]`` tenant and its own ``python -m dispatcher node`` serving ``echo``
   (256 slots) over the websocket; the client sends the tenant's key:

   * ``no limits`` -- the tenant has no limits (the embedded store still admits and
     releases it: the baseline);
   * ``memory`` -- the tenant has ``rpm``, ``tpm`` and ``max_concurrent`` set (too high to
     refuse anything), on the embedded in-memory limits;
   * ``redis`` -- the same tenant, with ``[store] redis_url`` naming a ``redis-server`` this
     section starts.

   Non-streaming chat completions back to back on keep-alive connections (``bench._load``):
   p50/p99 at one client, req/s at 64. The edges take turns in short rounds, so other load on
   the machine falls on each alike. Then :data:`SCRIPT_PROBE` requests at one client to the
   Redis edge, with ``INFO commandstats`` read around them: the scripts it ran per request
   and their time on the server. Then, in this process against the same server, the round
   trip of one ``admit`` + ``release`` of each store (the micro row).
2. **Ledger writes.** :data:`ROWS` usage rows ``record()``-ed back to back, then
   ``flush()``-ed, into SQLite (``open_usage_ledger`` on a file) and into PostgreSQL
   (``open_postgres_ledger`` on a cluster this section starts, with PostgreSQL's default
   durability): rows/s.

A missing ``redis-server`` or PostgreSQL leaves its column ``n/a`` with a note; anything else
that goes wrong fails the section. Every process started is stopped when its block is left.

``python -m bench.store_bench [--quick]`` runs this section alone.
"""

from __future__ import annotations

import hashlib
import math
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from bench import Table, fmt_int
from bench._load import (
    LoadError,
    LoadResult,
    MachineLoad,
    connect,
    cpu_seconds,
    exchange,
    http_request,
    request_load,
)
from bench._options import RunOptions
from bench._procs import edge_daemon, log_notes, node_daemon
from bench._stores import Running, postgres_missing, redis_missing, running_postgres, running_redis
from bench.edge_bench import CHAT_PATH, JSON_HEADER, fetch
from bench.usage_bench import _rows as usage_rows

TIME_LIMIT = 180.0
"""The whole section is cut off after this many seconds (about 60 s on 2 cores)."""

TENANT_KEY = "sk-bench-store-tenant-7c1e"
TENANT_ID = "bench-tenant"
AUTH_HEADER = f"Authorization: Bearer {TENANT_KEY}\r\n"
RPM = 1_000_000_000
TPM = 1_000_000_000_000
MAX_CONCURRENT = 100_000
"""The limited tenant's limits: set (each is checked and counted), never reached."""
NODE_SLOTS = 256

ROUNDS = 8
"""Each edge is measured in this many rounds per concurrency, taking turns."""
WARMUP = 0.3
DURATION = 4.0
"""Counted seconds per edge and concurrency, all rounds together."""
CLIENTS = (1, 64)
MICRO_RUNS = 5_000
IDLE_PINGS = 200
IDLE_GAP = 0.005
"""PINGs sent after this many seconds idle (the gap between one client's admissions)."""
MICRO_WARMUP = 200
SCRIPT_PROBE = 300
"""Requests at one client to the Redis edge while its scripts are counted on the server."""
ROWS = 50_000

QUICK_ROUNDS = 1
QUICK_DURATION = 1.0
QUICK_MICRO_RUNS = 500
QUICK_ROWS = 10_000

TARGET_REDIS_ADDED_P50_MS = 0.3
TARGET_POSTGRES_ROWS_S = 5_000.0

NO_LIMITS, MEMORY, REDIS = "no limits", "memory", "redis"
PATHS = (NO_LIMITS, MEMORY, REDIS)

NODE_TOML = """\
[node]
id = "bench-store-node"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"
drain_grace = 1

[[providers]]
id = "echo"
type = "echo"
  [[providers.models]]
  name = "echo"
  slots = {slots}
"""


def edge_toml(*, limited: bool, redis_url: str | None) -> str:
    """The edge's config: one tenant (with the limits or without), the store it names.
    (``{tmp}`` is the daemon's temporary directory: ``edge_daemon`` fills it in.)"""
    digest = hashlib.sha256(TENANT_KEY.encode()).hexdigest()
    text = (
        'host = "127.0.0.1"\nport = 0\nlocal_node = false\nusage_db = "{tmp}/usage.sqlite3"\n\n'
        "[http]\nshutdown_grace = 1.0\nmax_connections = 1000\n\n"
        "[admission]\nmax_queue = 1024\n\n"
        f'[[keys]]\nid = "{TENANT_ID}"\nkey_sha256 = "{digest}"\n'
    )
    if limited:
        text += f"rpm = {RPM}\ntpm = {TPM}\nmax_concurrent = {MAX_CONCURRENT}\n"
    if redis_url is not None:
        text += f'\n[store]\nredis_url = "{redis_url}"\n'
    return text


def chat_request() -> bytes:
    body = b'{"model":"echo","messages":[{"role":"user","content":"hello"}]}'
    headers = JSON_HEADER + AUTH_HEADER
    return http_request("POST", CHAT_PATH, body, headers=headers)


def fmt_ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank, as ``LoadResult.percentile_ms``."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class Plan:
    rounds: int
    duration: float
    micro_runs: int
    rows: int

    @classmethod
    def of(cls, options: RunOptions | None) -> Plan:
        if options is not None and options.quick:
            return cls(QUICK_ROUNDS, QUICK_DURATION, QUICK_MICRO_RUNS, QUICK_ROWS)
        return cls(ROUNDS, DURATION, MICRO_RUNS, ROWS)


# --------------------------------------------------------------------------- 1. limit path


@dataclass
class Edge:
    name: str
    port: int
    pid: int
    loads: dict[int, list[LoadResult]] = field(default_factory=dict)
    redis_cpu: float = 0.0
    """redis-server CPU seconds during this edge's counted rounds at 64 clients."""


@asynccontextmanager
async def _edge(
    name: str, *, limited: bool, redis_url: str | None, notes: list[str]
) -> AsyncIterator[Edge]:
    """An edge and its node, until the block ends; their warnings go to ``notes`` then."""
    async with edge_daemon(edge_toml(limited=limited, redis_url=redis_url)) as edge:
        node_toml = NODE_TOML.format(edge_port=edge.port, slots=NODE_SLOTS)
        async with node_daemon(
            edge.port, node_toml, ["echo"], log_level="WARNING", headers=AUTH_HEADER
        ) as node:
            try:
                yield Edge(name, edge.port, edge.pid)
            finally:
                notes.extend(f"{name}: {note}" for note in log_notes(edge) + log_notes(node))


async def _check_answer(edge: Edge, *, limited: bool) -> None:
    """One request: 200, and the x-ratelimit headers exactly when the tenant has limits (the
    limited edges do run the limit path)."""
    status, head, body = await fetch(edge.port, chat_request())
    if status != 200:
        raise LoadError(f"{edge.name}: the edge answered {status}: {body[:200]!r}")
    if (b"\r\nx-ratelimit-limit-requests:" in head) != limited:
        raise LoadError(f"{edge.name}: x-ratelimit headers {'missing' if limited else 'sent'}")


async def _measure_edges(edges: Sequence[Edge], plan: Plan, redis_pid: int | None) -> None:
    request = chat_request()
    per_round = plan.duration / plan.rounds
    for clients in CLIENTS:
        for round_ in range(plan.rounds):
            order = list(edges) if round_ % 2 == 0 else list(reversed(edges))
            for edge in order:
                redis = redis_pid if edge.name == REDIS and clients > 1 else None
                before = cpu_seconds(redis) if redis is not None else 0.0
                with trio.fail_after(per_round + WARMUP + 30):
                    load = await request_load(
                        edge.port,
                        request,
                        clients=clients,
                        duration=per_round,
                        warmup=WARMUP,
                        server_pid=edge.pid,
                    )
                if redis is not None:
                    edge.redis_cpu += cpu_seconds(redis) - before
                edge.loads.setdefault(clients, []).append(load)


async def _commandstats(link: Any) -> dict[str, tuple[int, int]]:
    """``INFO commandstats``: command -> (calls, µs)."""
    info = await link.call("INFO", "commandstats")
    out: dict[str, tuple[int, int]] = {}
    for line in info.decode().splitlines():
        if line.startswith("cmdstat_"):
            name, _, rest = line.removeprefix("cmdstat_").partition(":")
            fields = dict(part.split("=", 1) for part in rest.split(","))
            out[name] = (int(fields["calls"]), int(fields["usec"]))
    return out


async def _scripts_per_request(redis_url: str, edge: Edge) -> str:
    """A note: what :data:`SCRIPT_PROBE` requests at one client cost redis-server, read from
    its ``INFO commandstats`` (scripts run, their time)."""
    from dispatcher.store.redis_link import open_redis_link

    request = chat_request()
    async with open_redis_link(redis_url) as link:
        before = await _commandstats(link)
        sock = await connect(edge.port)
        with sock:
            pending = b""
            for _ in range(SCRIPT_PROBE):
                status, pending = await exchange(sock, request, pending)
                if status != 200:
                    raise LoadError(f"{edge.name}: the edge answered {status}")
        await trio.sleep(0.1)  # a write the last request left (held for an admission)
        after = await _commandstats(link)
    (calls_before, usec_before), (calls_after, usec_after) = (
        stats.get("evalsha", (0, 0)) for stats in (before, after)
    )
    calls, usec = calls_after - calls_before, usec_after - usec_before
    return (
        f"redis at 1 client ({SCRIPT_PROBE} requests, INFO commandstats): "
        f"{calls / SCRIPT_PROBE:.2f} scripts per request, {usec / SCRIPT_PROBE:.0f} µs of "
        f"script time per request ({usec / max(calls, 1):.0f} µs per script)"
    )


async def _round_trips(store: Any, limits: Any, runs: int) -> list[float]:
    """``runs`` (after a warm-up) of ``admit`` then ``release`` on ``store``: each one's
    seconds. A release is posted, not awaited: on Redis the next admit carries it in its own
    script, so in the steady state one pair's time is one round trip doing both."""
    from dispatcher.store.seam import Hold, Refusal

    times: list[float] = []
    perf = time.perf_counter
    for i in range(MICRO_WARMUP + runs):
        hold = Hold(f"micro-{i}", "micro-tenant", limits, 100, 0.0)
        start = perf()
        held = await store.admit(hold)
        if isinstance(held, Refusal):
            raise LoadError(f"the micro tenant was refused: {held.message}")
        store.release(held, answered=False)
        if i >= MICRO_WARMUP:
            times.append(perf() - start)
    flush: Callable[[], Any] | None = getattr(store, "flush", None)
    if flush is not None:
        await flush()
    return times


async def _pings(redis_url: str, client: Any, runs: int) -> tuple[float, float, float]:
    """p50 of a PING round trip, seconds: through ``client`` (the store's RESP link, as it sends
    its scripts), on a bare Trio socket back to back (the floor: loopback and redis-server
    alone), and on the bare socket after :data:`IDLE_GAP` idle (what one client's requests
    see: a server, and a CPU, woken from idle)."""
    through = await _through(client, runs)
    bare, idle = await _bare(redis_url, [b"PING\r\n"] * (runs + IDLE_PINGS), runs, b"+PONG")
    return through, bare, idle


async def _through(client: Any, runs: int) -> float:
    perf = time.perf_counter
    through: list[float] = []
    for _ in range(runs):
        start = perf()
        await client.call("PING")
        through.append(perf() - start)
    return percentile(through, 0.5)


async def _bare(
    redis_url: str, commands: Sequence[bytes], runs: int, expect: bytes
) -> tuple[float, float]:
    """p50 round trip of ``commands`` sent one at a time on a bare Trio socket (no RESP link,
    no limit store): the first ``runs`` back to back, the rest each after :data:`IDLE_GAP`
    idle; each reply must start with ``expect`` and fit one read."""
    host, _, rest = redis_url.removeprefix("redis://").partition(":")
    port = int(rest.partition("/")[0])
    perf = time.perf_counter
    bare: list[float] = []
    idle: list[float] = []
    with trio.socket.socket() as sock:
        await sock.connect((host, port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, command in enumerate(commands):
            if i >= runs:
                await trio.sleep(IDLE_GAP)
            start = perf()
            await sock.send(command)
            reply = await sock.recv(4096)
            while not reply.endswith(b"\r\n"):
                reply += await sock.recv(4096)
            if not reply.startswith(expect):
                raise LoadError(f"redis-server answered {reply[:80]!r}, not {expect!r}...")
            (bare if i < runs else idle).append(perf() - start)
    return percentile(bare, 0.5), percentile(idle, 0.5)


async def _scripts(redis_url: str, store: Any, limits: Any, runs: int) -> tuple[float, float]:
    """:func:`_bare` of the admission script itself, as one client sends it: each admission
    carrying its tenant's previous finish (the settle and release of the request before),
    its command built by the store (``_admit_command``, the write carried a store ``_Op``)
    but sent and read on the bare socket: what the Redis path costs before any of the edge's
    own work."""
    from dispatcher.store.limits_redis import _Op
    from dispatcher.store.seam import Hold

    tenant = "bench-floor"
    commands = []
    for i in range(runs + IDLE_PINGS):
        hold = Hold(f"floor-{i}", tenant, limits, 100, 0.0)
        carried = None
        if i:
            finish = ["", "", "finish", f"floor-{i - 1}", "1", "90", "0.0", "1"]
            carried = _Op(0, "finish", tenant, finish)
        commands.append(store._admit_command(hold, carried))
    return await _bare(redis_url, commands, runs, b"$")


async def _micro(redis_url: str | None, runs: int, notes: list[str]) -> dict[str, float]:
    """p50 of one admit + release, µs, per column (and a note on Redis's PING floor)."""
    from dispatcher.config import Limits
    from dispatcher.store.limits import MemoryLimits

    limited = Limits(rpm=RPM, tpm=TPM, max_concurrent=MAX_CONCURRENT)
    out = {
        NO_LIMITS: percentile(await _round_trips(MemoryLimits(), Limits(), runs), 0.5),
        MEMORY: percentile(await _round_trips(MemoryLimits(), limited, runs), 0.5),
    }
    if redis_url is not None:
        from dispatcher.store.limits_redis import open_redis_limits

        async with open_redis_limits(redis_url, prefix="bench-micro:") as store:
            out[REDIS] = percentile(await _round_trips(store, limited, runs), 0.5)
            through, bare, idle = await _pings(redis_url, store.client, runs)
            script, script_idle = await _scripts(redis_url, store, limited, runs)
        notes.append(
            f"a PING round trip to the same redis-server, p50: {through * 1e6:.0f} µs through "
            f"the store's RESP link, {bare * 1e6:.0f} µs on a bare socket, "
            f"{idle * 1e6:.0f} µs on it after {IDLE_GAP * 1e3:g} ms idle (one client's cadence: "
            "each request's admission wakes redis-server, and the edge, from idle)"
        )
        notes.append(
            f"the floor of the redis column's added p50 on this machine: one admission's "
            f"script (carrying the previous request's finish) on the bare socket, no edge "
            f"code, p50 {script * 1e6:.0f} µs back to back, {script_idle * 1e6:.0f} µs after "
            f"{IDLE_GAP * 1e3:g} ms idle"
        )
    return {name: value * 1e6 for name, value in out.items()}


async def limit_path(plan: Plan) -> Table:
    notes: list[str] = []
    missing = redis_missing()
    async with AsyncExitStack() as stack:
        redis: Running | None = None
        if missing is None:
            redis = await stack.enter_async_context(running_redis())
        redis_url = redis.url if redis is not None else None
        edges: list[Edge] = []
        for name in PATHS:
            if name == REDIS and redis_url is None:
                continue
            edge = await stack.enter_async_context(
                _edge(
                    name,
                    limited=name != NO_LIMITS,
                    redis_url=redis_url if name == REDIS else None,
                    notes=notes,
                )
            )
            await _check_answer(edge, limited=name != NO_LIMITS)
            edges.append(edge)
        await _measure_edges(edges, plan, redis.pid if redis is not None else None)
        if redis_url is not None:
            redis_edge = next(edge for edge in edges if edge.name == REDIS)
            notes.append(await _scripts_per_request(redis_url, redis_edge))
        micro = await _micro(redis_url, plan.micro_runs, notes)

    results = {
        edge.name: {c: LoadResult.combined(edge.loads[c]) for c in CLIENTS} for edge in edges
    }

    def cells(value: Callable[[str], str]) -> list[str]:
        return [value(name) if name in results else "n/a" for name in PATHS]

    def p(name: str, clients: int, q: float) -> float:
        return results[name][clients].percentile_ms(q)

    def added(name: str, clients: int, q: float) -> str:
        if name == NO_LIMITS:
            return "-"
        return f"{p(name, clients, q) - p(NO_LIMITS, clients, q):+.3f}"

    verdict = ""
    if REDIS in results:
        redis_added = p(REDIS, 1, 0.5) - p(NO_LIMITS, 1, 0.5)
        verdict = "met" if redis_added <= TARGET_REDIS_ADDED_P50_MS else "MISSED"
    lo, hi = CLIENTS
    rows: list[Sequence[str]] = [
        ["p50 ms, 1 client", *cells(lambda n: fmt_ms(p(n, lo, 0.5))), ""],
        ["p99 ms, 1 client", *cells(lambda n: fmt_ms(p(n, lo, 0.99))), ""],
        [
            "added p50 ms vs no limits",
            *cells(lambda n: added(n, lo, 0.5)),
            f"redis <= {TARGET_REDIS_ADDED_P50_MS:g} ms: {verdict or 'n/a'}",
        ],
        ["added p99 ms vs no limits", *cells(lambda n: added(n, lo, 0.99)), ""],
        [
            f"edge CPU µs/req, {lo} client",
            *cells(lambda n: fmt_int(results[n][lo].server_cpu / results[n][lo].rps * 1e6)),
            "",
        ],
        [f"req/s, {hi} clients", *cells(lambda n: fmt_int(results[n][hi].rps)), ""],
        [f"p50 ms, {hi} clients", *cells(lambda n: fmt_ms(p(n, hi, 0.5))), ""],
        [
            f"edge CPU µs/req, {hi} clients",
            *cells(lambda n: fmt_int(results[n][hi].server_cpu / results[n][hi].rps * 1e6)),
            "",
        ],
        [
            "admit+release µs p50 (in process)",
            *cells(lambda n: f"{micro[n]:.1f}" if n in micro else "n/a"),
            "",
        ],
    ]
    counted = ", ".join(
        f"{name} {results[name][lo].requests:,} / {results[name][hi].requests:,}"
        for name in results
    )
    notes[:0] = [
        "each column: `dispatcher serve` (one [[keys]] tenant, the client sends its key) + "
        f"`dispatcher node` (echo, {NODE_SLOTS} slots, websocket); non-streaming chat "
        "completion, keep-alive connections sending back to back; latency = send to last byte",
        "no limits: the tenant has none; memory: rpm, tpm, max_concurrent set (never reached) "
        "on the embedded limits; redis: the same on [store] redis_url (a local redis-server)",
        f"{plan.rounds} round(s) per edge and concurrency, taking turns, each {WARMUP:g} s "
        f"warm-up + {plan.duration / plan.rounds:g} s counted; responses counted at 1 / {hi} "
        f"clients: {counted}",
        "admit+release: in this process, one Hold admitted then released, back to back "
        "(redis: against the same server; the next admit carries the posted release in its "
        "own script, so the time is one round trip doing both)",
    ]
    if REDIS in results and redis is not None and results[REDIS][hi].seconds > 0:
        redis_rps = results[REDIS][hi].rps
        redis_cpu = next(edge.redis_cpu for edge in edges if edge.name == REDIS)
        redis_us = redis_cpu / results[REDIS][hi].seconds / redis_rps * 1e6
        notes.append(f"redis-server CPU at {hi} clients: ~{redis_us:.0f} µs per request")
    if any(math.isnan(p(name, hi, 0.5)) for name in results):
        notes.append(
            f"n/a at {hi} clients: no request was both sent and answered inside a counted "
            "window (each took longer than the window: a busy machine)"
        )
    if missing is not None:
        notes.append(f"redis column skipped: {missing}")
    return Table(
        title="store: the limit path, added per request (client -> edge -> node -> echo)",
        columns=["metric", NO_LIMITS, MEMORY, REDIS, "target"],
        rows=rows,
        notes=notes,
    )


# --------------------------------------------------------------------------- 2. ledger


@dataclass
class LedgerRun:
    rows_s: float
    record_us: float
    flush_ms: float
    batches: int


async def _write(opened: AbstractAsyncContextManager[Any], count: int) -> LedgerRun:
    rows = usage_rows(count)
    async with opened as ledger:
        start = time.perf_counter()
        for row in rows:
            ledger.record(row)
        recorded = time.perf_counter()
        await ledger.flush()
        flushed = time.perf_counter()
        stats = ledger.statistics()
        if stats.rows_written != count:
            raise LoadError(f"{stats.rows_written} of {count} rows written ({stats})")
        report = await ledger.query()
        if report.totals.attempts != count:
            raise LoadError(f"the ledger's query found {report.totals.attempts} of {count} rows")
    return LedgerRun(
        count / (flushed - start),
        (recorded - start) / count * 1e6,
        (flushed - recorded) * 1e3,
        stats.batches,
    )


def fresh_database(url: str, name: str) -> str:
    """Create the database ``name`` on the server of ``url``: its URL (the same rows can
    then be written again)."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return make_conninfo(url, dbname=name)


async def ledger_writes(plan: Plan) -> Table:
    from dispatcher.store.ledger import open_usage_ledger
    from dispatcher.store.usage_sqlite import USAGE_DB_NAME

    notes: list[str] = []
    runs: dict[str, LedgerRun | None] = {}
    columns = ["sqlite (file)", "postgresql"]  # postgresql: through the outbox, as edges run
    with tempfile.TemporaryDirectory(prefix="store-bench-") as directory:
        runs["sqlite (file)"] = await _write(
            open_usage_ledger(Path(directory) / USAGE_DB_NAME), plan.rows
        )
        missing = postgres_missing()
        if missing is not None:
            notes.append(f"postgresql column skipped: {missing}")
            runs["postgresql"] = None
        else:
            from dispatcher.store.ledger import open_batched_ledger
            from dispatcher.store.postgres import PostgresUsage, open_postgres_ledger

            columns.append("postgresql direct")
            async with running_postgres() as postgres:
                # What the edge runs: the batched writer into the outbox file, forwarded on.
                outbox = str(Path(directory) / "outbox.sqlite3")
                runs["postgresql"] = await _write(
                    open_postgres_ledger(postgres.url, outbox=outbox), plan.rows
                )
                # The batched writer straight into PostgreSQL (no outbox): the reference.
                url = await trio.to_thread.run_sync(fresh_database, postgres.url, "direct")
                runs["postgresql direct"] = await _write(
                    open_batched_ledger(lambda: PostgresUsage(url)), plan.rows
                )

    def cells(value: Callable[[LedgerRun], str]) -> list[str]:
        return [value(done) if (done := runs[name]) is not None else "n/a" for name in columns]

    pg = runs["postgresql"]
    verdict = "n/a" if pg is None else ("met" if pg.rows_s >= TARGET_POSTGRES_ROWS_S else "MISSED")
    notes[:0] = [
        f"{plan.rows:,} distinct usage rows built first (not timed), record()-ed back to back, "
        "then flush(): rows/s = rows / (record + flush); the ledgers' defaults (batch_interval "
        "0.05 s, max_batch 500 rows per transaction); the rows are then counted back by query()",
        "sqlite: open_usage_ledger on a file (WAL, synchronous=NORMAL); postgresql: "
        "open_postgres_ledger on a fresh local cluster with the default durability (fsync and "
        "synchronous_commit on), over TCP on 127.0.0.1",
    ]
    return Table(
        title="store: usage ledger writes",
        columns=["metric", *columns, "target"],
        rows=[
            ["rows/s", *cells(lambda r: fmt_int(r.rows_s)), f"postgresql >= 5,000: {verdict}"],
            ["record() µs/row", *cells(lambda r: f"{r.record_us:.2f}"), ""],
            ["flush ms", *cells(lambda r: f"{r.flush_ms:.0f}"), ""],
            ["transactions", *cells(lambda r: str(r.batches)), ""],
        ],
        notes=notes,
    )


async def run(options: RunOptions | None = None) -> Sequence[Table]:
    plan = Plan.of(options)
    machine = MachineLoad()
    limits = await limit_path(plan)
    ledger = await ledger_writes(plan)
    ledger.notes.append(machine.note())
    return [limits, ledger]


if __name__ == "__main__":
    import sys

    from bench import render

    quick = "--quick" in sys.argv[1:]
    for result in trio.run(run, RunOptions(quick=quick)):
        print(render(result))
        print()
