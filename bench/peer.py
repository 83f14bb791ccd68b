"""Peer section: every path through edge + node next to the upstream called directly and to
the LiteLLM proxy on the same upstream, in one run (issue #12).

Processes, all on 127.0.0.1 (see ``bench/README.md``, "peer"):

* the upstream: ``python -m bench._fake_upstream`` (OpenAI JSON and SSE, Ollama NDJSON);
* the edge: ``python -m dispatcher serve`` with a temporary ``edge.toml``;
* the node: ``python -m dispatcher node`` with a temporary ``node.toml``: four providers on
  the same upstream -- ``tunnel`` (``openai``, ``path = "tunnel"``), ``openai``
  (normalized), ``ollama`` (normalized, the upstream's ``/api/chat``) and ``echo``;
* LiteLLM's proxy (``litellm --config``, its default one worker), when installed;
* the client: ``python -m bench._client`` (asyncio, raw protocol, pre-built requests).

Paths: ``direct`` (the upstream itself), ``tunnel``, ``openai``, ``ollama``, ``echo``,
``litellm``. Cells: non-stream (16 tokens) and 64-token streams, at concurrency 1 / 16 / 64;
in each cell the paths take turns, round after round (the order reversed every other round),
so the machine's noise falls on every path alike. Each turn is a closed-loop keep-alive load:
warm-up, then a window whose completions give req/s and whose requests give the latencies
(TTFT for streams), with the CPU time of the edge, the node, LiteLLM and the upstream read at
the window's edges.

``python -m bench.peer [--quick]`` runs this section alone.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import orjson
import trio

from bench import Table, fmt_int
from bench._load import (
    LoadError,
    MachineLoad,
    ServerProcess,
    http_request,
    raise_nofile_limit,
    server_process,
)
from bench._options import RunOptions
from bench._procs import (
    LITELLM_MASTER_KEY,
    Client,
    client_process,
    edge_daemon,
    litellm_executable,
    litellm_proxy,
    log_notes,
    node_daemon,
)
from bench.edge_bench import JSON_HEADER, percentile, words

TIME_LIMIT = 600.0

CHAT_PATH = "/v1/chat/completions"
SERVED = "bench-model"
KEY_ENV = "BENCH_PEER_UPSTREAM_KEY"
NODE_ID = "bench-peer-node"
SLOTS = 256
NON_STREAM_TOKENS = 16
STREAM_TOKENS = 64

OURS = ("tunnel", "openai", "ollama", "echo")
"""Our paths; each is also the model name the node serves it under."""


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...]
    rounds: int
    warmup: float
    window: float


MAX_EXTRA = 8.0
"""A turn's warm-up and window each stretch by up to this many seconds for a slow path (until
every connection had an answer; until max(20, c) requests completed in the window)."""
DRAIN = 30.0
"""How long the client waits for the window's requests after it."""

FULL = Plan(concurrency=(1, 16, 64), rounds=3, warmup=0.3, window=1.0)
QUICK = Plan(concurrency=(1, 16), rounds=1, warmup=0.2, window=0.5)

# Targets of issue #12.
ADDED_P50_MS = 1.0
ADDED_P99_MS = 2.0
LITELLM_P50_SHARE = 1 / 15
CPU_NON_STREAM_MS = 0.8
CPU_STREAM_MS = 2.0
LITELLM_THROUGHPUT = 30.0
NON_STREAM_RPS = 2000.0
STREAMS_PER_S = 500.0
CPU_SPREAD = 1.5
CLIENT_BUSY = 0.7
"""Client CPU share above which a cell is flagged: the client may be the bottleneck."""


EDGE_TOML = """\
host = "127.0.0.1"
port = 0
local_node = false
usage_db = "{tmp}/usage.sqlite3"

[http]
shutdown_grace = 1.0
max_connections = 2000

[admission]
max_queue = 1024
"""

NODE_TOML = """\
[node]
id = "{node_id}"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"
drain_grace = 1

[[providers]]
id = "up-tunnel"
type = "openai"
path = "tunnel"
base_url = "http://127.0.0.1:{up}/v1"
api_key_env = "{key_env}"
  [[providers.models]]
  name = "tunnel"
  served_name = "{served}"
  slots = {slots}

[[providers]]
id = "up-openai"
type = "openai"
base_url = "http://127.0.0.1:{up}/v1"
api_key_env = "{key_env}"
  [[providers.models]]
  name = "openai"
  served_name = "{served}"
  slots = {slots}

[[providers]]
id = "up-ollama"
type = "ollama"
base_url = "http://127.0.0.1:{up}"
  [[providers.models]]
  name = "ollama"
  served_name = "{served}"
  slots = {slots}

[[providers]]
id = "echo"
type = "echo"
  [[providers.models]]
  name = "echo"
  slots = {slots}
"""


@dataclass
class Target:
    name: str
    port: int
    model: str
    pids: dict[str, int]
    include_usage: bool
    """Ask for the usage chunk (direct, LiteLLM); through our edge the edge or the adapter
    asks for it, as for a client that did not."""
    headers: str = ""
    """Extra request header lines (LiteLLM's key)."""

    def request(self, *, stream: bool) -> bytes:
        tokens = STREAM_TOKENS if stream else NON_STREAM_TOKENS
        body: dict[str, Any] = {
            "model": self.model,
            # echo answers with these words; the upstream with max_tokens tokens
            "messages": [{"role": "user", "content": words(tokens)}],
            "max_tokens": tokens,
        }
        if stream:
            body["stream"] = True
            if self.include_usage:
                body["stream_options"] = {"include_usage": True}
        return http_request(
            "POST", CHAT_PATH, orjson.dumps(body), headers=JSON_HEADER + self.headers
        )


@dataclass
class Cell:
    """One path's turns in one (mode, concurrency) cell, added up."""

    completed: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    client_cpu: float = 0.0
    errors: list[str] = field(default_factory=list)

    def add(self, answer: dict[str, Any]) -> None:
        self.completed += int(answer["completed"])
        self.seconds += float(answer["seconds"])
        self.latencies.extend(answer["latencies"])
        self.ttfts.extend(answer["ttfts"])
        for name, seconds in answer["cpu"].items():
            self.cpu[name] = self.cpu.get(name, 0.0) + float(seconds)
        self.client_cpu = max(self.client_cpu, float(answer["client_cpu"]))
        self.errors.extend(answer["errors"])

    @property
    def ok(self) -> bool:
        return self.completed > 0 and bool(self.latencies)

    @property
    def rps(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else math.nan

    def first(self, stream: bool) -> list[float]:
        """The latencies that count: TTFT for streams, the whole response otherwise."""
        return self.ttfts if stream else self.latencies

    def p(self, q: float, stream: bool) -> float:
        return percentile(self.first(stream), q) * 1000

    def cpu_ms(self, name: str) -> float:
        """CPU milliseconds of process ``name`` per completed request (NaN when not there)."""
        if name not in self.cpu or self.completed == 0:
            return math.nan
        return self.cpu[name] * 1000 / self.completed

    def proxy_cpu_ms(self) -> float:
        """Edge + node (ours) or LiteLLM's own: the relay's CPU per request."""
        if "litellm" in self.cpu:
            return self.cpu_ms("litellm")
        if "edge" in self.cpu:
            return self.cpu_ms("edge") + self.cpu_ms("node")
        return math.nan


Results = dict[tuple[bool, int], dict[str, Cell]]
"""(stream, concurrency) -> path -> cell."""


def _f(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _signed(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.2f}"


def _ratio(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


# --------------------------------------------------------------------------- measuring


async def _turn(
    client: Client, target: Target, *, stream: bool, clients: int, warmup: float, window: float
) -> dict[str, Any]:
    return await client.call(
        {
            "cmd": "load",
            "port": target.port,
            "request": target.request(stream=stream).decode("latin-1"),
            "stream": stream,
            "clients": clients,
            "warmup": warmup,
            "duration": window,
            "drain": DRAIN,
            "max_extra": MAX_EXTRA,
            "pids": target.pids,
        },
        timeout=warmup + window + 2 * MAX_EXTRA + DRAIN + 15.0,
    )


async def measure(client: Client, targets: Sequence[Target], plan: Plan) -> Results:
    results: Results = {}
    # One short turn per path and mode first: pools filled, code paths warm (not counted).
    for stream in (False, True):
        for target in targets:
            try:
                await _turn(client, target, stream=stream, clients=4, warmup=0.3, window=0.2)
            except Exception as exc:  # reported with the cell's errors below
                print(f"peer: warm-up of {target.name} failed: {exc}", file=sys.stderr)
    for stream in (False, True):
        for clients in plan.concurrency:
            cells = {target.name: Cell() for target in targets}
            for round_no in range(plan.rounds):
                order = list(targets) if round_no % 2 == 0 else list(reversed(targets))
                for target in order:
                    try:
                        answer = await _turn(
                            client,
                            target,
                            stream=stream,
                            clients=clients,
                            warmup=plan.warmup,
                            window=plan.window,
                        )
                    except Exception as exc:
                        cells[target.name].errors.append(str(exc))
                        continue
                    cells[target.name].add(answer)
            results[(stream, clients)] = cells
    return results


# --------------------------------------------------------------------------- tables


def cell_table(results: Results, plan: Plan, *, stream: bool, names: Sequence[str]) -> Table:
    what = "64-token streams" if stream else f"non-stream ({NON_STREAM_TOKENS} tokens)"
    lat = "TTFT " if stream else ""
    rate = "streams/s" if stream else "req/s"
    columns = [
        "path",
        "c",
        f"{lat}p50 ms",
        f"{lat}p99 ms",
        "+p50 ms",
        "+p99 ms",
        rate,
        "x direct",
        "x LiteLLM",
        "edge/LiteLLM CPU ms/req",
        "node CPU ms/req",
        "relay CPU ms/req",
        "upstream CPU ms/req",
        "client CPU",
    ]
    if stream:
        columns.insert(4, "whole p50 ms")
    table = Table(f"peer: {what}, added latency vs the upstream called directly", columns)
    flagged: list[str] = []
    for clients in plan.concurrency:
        cells = results.get((stream, clients), {})
        direct = cells.get("direct")
        litellm = cells.get("litellm")
        for name in names:
            cell = cells.get(name)
            if cell is None:
                continue
            if not cell.ok:
                why = cell.errors[0] if cell.errors else "no request completed"
                table.rows.append([name, str(clients), f"error: {why}"])
                continue
            p50, p99 = cell.p(0.5, stream), cell.p(0.99, stream)
            added50 = added99 = math.nan
            if direct is not None and direct.ok and name != "direct":
                added50 = p50 - direct.p(0.5, stream)
                added99 = p99 - direct.p(0.99, stream)
            to_direct = cell.rps / direct.rps if direct is not None and direct.ok else math.nan
            to_litellm = (
                cell.rps / litellm.rps
                if litellm is not None and litellm.ok and name != "litellm"
                else math.nan
            )
            proxy = cell.cpu_ms("litellm") if name == "litellm" else cell.cpu_ms("edge")
            row = [
                name,
                str(clients),
                _f(p50),
                _f(p99),
                _signed(added50),
                _signed(added99),
                fmt_int(cell.rps),
                _ratio(to_direct),
                _ratio(to_litellm),
                _f(proxy),
                _f(cell.cpu_ms("node")),
                _f(cell.proxy_cpu_ms()),
                _f(cell.cpu_ms("upstream"), 3),
                f"{cell.client_cpu:.0%}",
            ]
            if stream:
                row.insert(4, _f(percentile(cell.latencies, 0.5) * 1000))
            table.rows.append(row)
            if cell.client_cpu > CLIENT_BUSY:
                flagged.append(f"{name} c={clients}")
            if cell.errors:
                table.notes.append(
                    f"{name} c={clients}: {len(cell.errors)} error(s), e.g. {cell.errors[0]}"
                )
    n = plan.rounds
    table.notes.append(
        f"{n} turn(s) per path and cell, paths taking turns; each {plan.warmup:g} s warm-up + "
        f"{plan.window:g} s counted. Latency: request sent -> "
        + ("first content delta (TTFT); 'whole' to the last byte" if stream else "last byte")
        + "; + = minus the direct path's in the same cell (nearest-rank percentiles)."
    )
    table.notes.append(
        "CPU per request: the process's user+system time over the counted window / requests "
        "completed in it; relay = edge + node (ours) or LiteLLM's own process."
    )
    if flagged:
        table.notes.append(
            f"client above {CLIENT_BUSY:.0%} of a CPU in: {', '.join(flagged)} -- "
            "it may be what limits those cells"
        )
    else:
        table.notes.append(f"the client stayed below {CLIENT_BUSY:.0%} of a CPU in every cell")
    return table


def _verdict(value: float, limit: float, *, at_most: bool = True, unit: str = "") -> str:
    if math.isnan(value):
        return "n/a"
    met = value <= limit if at_most else value >= limit
    shown = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return f"{shown}{unit} {'met' if met else 'MISSED'}"


def targets_table(results: Results, plan: Plan, *, litellm: bool) -> Table:
    top = max(plan.concurrency)
    low = min(plan.concurrency)
    table = Table(
        "peer: targets of issue #12 (ours per path; ratios from this one run)",
        ["target", *OURS],
    )

    def cell(stream: bool, clients: int, name: str) -> Cell | None:
        found = results.get((stream, clients), {}).get(name)
        return found if found is not None and found.ok else None

    def added(stream: bool, q: float, name: str) -> float:
        ours, direct = cell(stream, low, name), cell(stream, low, "direct")
        if ours is None or direct is None:
            return math.nan
        return ours.p(q, stream) - direct.p(q, stream)

    for stream in (False, True):
        kind = "stream TTFT" if stream else "non-stream"
        table.rows.append(
            [f"added p50 c={low}, {kind} <= {ADDED_P50_MS:g} ms"]
            + [_verdict(added(stream, 0.5, name), ADDED_P50_MS) for name in OURS]
        )
        table.rows.append(
            [f"added p99 c={low}, {kind} <= {ADDED_P99_MS:g} ms"]
            + [_verdict(added(stream, 0.99, name), ADDED_P99_MS) for name in OURS]
        )
        if litellm:
            row = [f"added p50 c={low}, {kind} <= 1/15 of LiteLLM's"]
            lite = added(stream, 0.5, "litellm")
            for name in OURS:
                share = added(stream, 0.5, name) / lite if lite > 0 else math.nan
                row.append(_verdict(share * 15, 1.0, unit="/15"))
            table.rows.append(row)
    for stream, limit in ((False, CPU_NON_STREAM_MS), (True, CPU_STREAM_MS)):
        kind = "64-token stream" if stream else "non-stream"
        row = [f"edge+node CPU per {kind}, c={top} <= {limit:g} ms"]
        for name in OURS:
            found = cell(stream, top, name)
            row.append(_verdict(found.proxy_cpu_ms() if found else math.nan, limit))
        table.rows.append(row)
    for stream, floor in ((False, NON_STREAM_RPS), (True, STREAMS_PER_S)):
        kind = "streams/s" if stream else "req/s"
        row = [f"{kind} at c={top} >= {floor:,.0f}"]
        for name in OURS:
            found = cell(stream, top, name)
            row.append(_verdict(found.rps if found else math.nan, floor, at_most=False))
        table.rows.append(row)
        if litellm:
            row = [f"{kind} at c={top} >= {LITELLM_THROUGHPUT:g}x LiteLLM's"]
            lite_cell = cell(stream, top, "litellm")
            for name in OURS:
                found = cell(stream, top, name)
                ratio = found.rps / lite_cell.rps if found is not None and lite_cell else math.nan
                row.append(_verdict(ratio, LITELLM_THROUGHPUT, at_most=False, unit="x"))
            table.rows.append(row)
    for stream in (False, True):
        kind = "stream" if stream else "non-stream"
        spreads = []
        for clients in plan.concurrency:
            costs = [
                found.proxy_cpu_ms() for name in OURS if (found := cell(stream, clients, name))
            ]
            if len(costs) == len(OURS) and min(costs) > 0:
                spreads.append(max(costs) / min(costs))
        worst = max(spreads) if spreads else math.nan
        table.rows.append(
            [
                f"no path > {CPU_SPREAD:g}x another in CPU ({kind}, worst c)",
                _verdict(worst, CPU_SPREAD, unit="x"),
            ]
        )
    if top < 64:
        table.notes.append(f"--quick: the c=64 targets are judged at c={top}")
    return table


def memory_table(processes: Sequence[ServerProcess], start: dict[str, int]) -> Table:
    from bench._load import rss_kib

    table = Table("peer: resident memory (VmRSS)", ["process", "after start-up MiB", "end MiB"])
    for proc in processes:
        try:
            end = rss_kib(proc.pid)
        except (OSError, LoadError):
            end = 0  # gone already
        began = start.get(proc.name)
        table.rows.append(
            [proc.name, "-" if began is None else _f(began / 1024, 1), _f(end / 1024, 1)]
        )
    return table


# --------------------------------------------------------------------------- the section


async def run(options: RunOptions | None = None) -> list[Table]:
    plan = QUICK if options is not None and options.quick else FULL
    raise_nofile_limit(1_000_000)
    load = MachineLoad()
    tables: list[Table] = []
    executable = litellm_executable()
    async with (
        server_process("upstream", ["bench._fake_upstream"]) as upstream,
        edge_daemon(EDGE_TOML) as edge,
    ):
        node_toml = NODE_TOML.format(
            node_id=NODE_ID,
            edge_port=edge.port,
            up=upstream.port,
            key_env=KEY_ENV,
            served=SERVED,
            slots=SLOTS,
        )
        async with node_daemon(
            edge.port, node_toml, OURS, env={KEY_ENV: "sk-bench-upstream"}
        ) as node:
            ours = {"edge": edge.pid, "node": node.pid, "upstream": upstream.pid}
            targets = [Target("direct", upstream.port, SERVED, {"upstream": upstream.pid}, True)]
            targets += [Target(name, edge.port, name, dict(ours), False) for name in OURS]
            processes = [upstream, edge, node]
            async with client_process() as client, AsyncExitStack() as stack:
                proxy: ServerProcess | None = None
                if executable is None:
                    missing = "LiteLLM not installed: its column and rows are skipped"
                else:
                    try:
                        proxy = await stack.enter_async_context(
                            litellm_proxy(executable, upstream.port, model="litellm", served=SERVED)
                        )
                    except Exception as exc:  # any failure to start: measure without it
                        missing = f"LiteLLM did not start, skipped: {_first_leaf(exc)}"
                if proxy is not None:
                    targets.append(
                        Target(
                            "litellm",
                            proxy.port,
                            "litellm",
                            {"litellm": proxy.pid, "upstream": upstream.pid},
                            True,
                            headers=f"Authorization: Bearer {LITELLM_MASTER_KEY}\r\n",
                        )
                    )
                    processes.append(proxy)
                tables.extend(await _measure(client, targets, plan, processes))
                if proxy is None:
                    tables[-1].notes.append(
                        missing + " (BENCH_LITELLM=1 nox -s bench -- peer installs it)"
                    )
                else:
                    tables[-1].notes.extend(log_notes(proxy))
            tables[-1].notes.extend(log_notes(edge) + log_notes(node))
    tables[-1].notes.append(load.note())
    return tables


def _first_leaf(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


async def _measure(
    client: Client,
    targets: Sequence[Target],
    plan: Plan,
    processes: Sequence[ServerProcess],
) -> list[Table]:
    from bench._load import rss_kib

    start = {proc.name: rss_kib(proc.pid) for proc in processes}
    results = await measure(client, targets, plan)
    names = [target.name for target in targets]
    return [
        cell_table(results, plan, stream=False, names=names),
        cell_table(results, plan, stream=True, names=names),
        memory_table([*processes, client.server], start),
        targets_table(results, plan, litellm="litellm" in names),
    ]


def _main() -> None:
    from bench import render

    quick = "--quick" in sys.argv[1:]
    for table in trio.run(run, RunOptions(quick=quick)):
        print(render(table), end="\n\n")


if __name__ == "__main__":
    _main()
