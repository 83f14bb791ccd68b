"""Cluster section (issue #24): one node behind several edges, its slots granted to each.

1. **One edge vs two.** The same ``dispatcher node`` config (echo, :data:`NODE_SLOTS` slots)
   dialling one ``dispatcher serve`` and, in another pair, two (``[node] edges``, the node
   granting each a share of its slots). Non-streaming chat completions back to back on
   keep-alive connections (``bench._load``), the setups taking turns in short rounds so other
   load on the machine falls on each alike: p50/p99 at one client, req/s at 64 clients (for
   two edges split 32 + 32, and all 64 on one of the two), the CPU of the edges and of the
   node per request.
2. **Hand-over.** A node of :data:`HANDOVER_SLOTS` slots behind edges A and B. A is kept
   saturated (:data:`A_CLIENTS` clients sending long echo runs, more than the slots: A holds
   every slot and always has requests waiting); then one short request arrives at B, which
   holds none. B is served when the node has taken a slot from A: at the first end of one of
   A's runs, the node lowers A's grant, A confirms it, the node grants B a slot, B admits and
   sends the run. **Hand-over** = from that first end of a run on A, as A's client sees its
   response end, to B's response complete (B's run is one word, no delay). Before each,
   A's and B's ``/metrics`` are polled until A holds every slot and B none. Then the case
   where slots are free: A runs :data:`FREE_A_CLIENTS` long runs (fewer than the slots), and a
   short request on B and one on A alternate, each served at once.
3. **Where a hand-over's time goes.** The same hand-overs with the node in the bench process
   (``nodes.agent.serve_node`` over each edge's default dial, its connection wrapped to
   timestamp the ``capacity``, ``demand``, ``run.request`` and ``run.completed`` frames): each
   step from the run end on A to B's answer, on one clock with the clients.

Every process started is stopped when its block is left.
``python -m bench.cluster_bench [--quick]`` runs this section alone.
"""

from __future__ import annotations

import math
import random
import re
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import attrs
import trio

from bench import Table, fmt_int
from bench._load import (
    LoadError,
    LoadResult,
    MachineLoad,
    ServerProcess,
    Sock,
    connect,
    exchange,
    http_request,
    request_load,
)
from bench._options import RunOptions
from bench._procs import count_lines, edge_daemon, log_notes, node_daemon
from bench.edge_bench import chat_request, fetch, wait_for_models, words
from dispatcher import wire
from dispatcher.shared.transport import Connection, RawFrame

if TYPE_CHECKING:
    from nodes.config import NodeConfig

TIME_LIMIT = 300.0
"""The whole section is cut off after this many seconds (about 2 minutes on 2 cores)."""

NODE_SLOTS = 64
CLIENTS = (1, 64)
ROUNDS = 8
"""Each setup is measured in this many rounds per concurrency, taking turns."""
WARMUP = 0.3
DURATION = 4.0
"""Counted seconds per setup and concurrency, all rounds together."""
QUICK_ROUNDS = 2
QUICK_DURATION = 1.0

HANDOVER_SLOTS = 4
A_CLIENTS = 10
"""Clients keeping edge A saturated: well beyond the slots, so A always has requests waiting
(with only a few more than the slots, all of those between two requests at once make A's
demand dip below the slots, and the node lowers A's grant to spread the spare one)."""
A_WORDS = (2, 8)
"""Each of A's long runs echoes between this many words (chosen at random per request)..."""
TOKEN_DELAY = 0.01
"""... each after this delay: a run lasts 20 to 80 ms, so A's runs end at scattered times."""
HANDOVERS = 200
QUICK_HANDOVERS = 30
HANDOVER_WARMUP = 5
FREE_A_CLIENTS = 2
"""Clients on A in the free-slots case: fewer than the slots, so B has one to start at once."""
FREE_RUNS = 200
QUICK_FREE_RUNS = 30
SETTLE_TIMEOUT = 10.0
SETTLE_POLL = 0.002
PHASE = 0.02
"""A request on B is sent after a random pause of up to this many seconds (after the slots
settled), so it falls at a random moment of A's runs."""

ONE, SPLIT, ON_A = "one edge", "two edges, split", "two edges, all on A"
SETUPS = (ONE, SPLIT, ON_A)

EDGE_TOML = """\
host = "127.0.0.1"
port = 0
local_node = false
usage_db = "{tmp}/usage.sqlite3"

[http]
shutdown_grace = 1.0
max_connections = 1000

[admission]
max_queue = 1024
"""

NODE_TOML = """\
[node]
id = "{node_id}"
edges = [{edges}]
drain_grace = 1

[[providers]]
id = "echo"
type = "echo"
  [[providers.models]]
  name = "echo"
  slots = {slots}
"""


def fmt_ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def fmt_ratio(value: float) -> str:
    return "n/a" if math.isnan(value) or math.isinf(value) else f"{value:.2f}x"


def percentile_ms(values: Sequence[float], q: float) -> float:
    """Nearest rank, as ``LoadResult.percentile_ms``; ``values`` in seconds."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


@dataclass(frozen=True)
class Plan:
    rounds: int
    duration: float
    handovers: int
    free_runs: int

    @classmethod
    def of(cls, options: RunOptions | None) -> Plan:
        if options is not None and options.quick:
            return cls(QUICK_ROUNDS, QUICK_DURATION, QUICK_HANDOVERS, QUICK_FREE_RUNS)
        return cls(ROUNDS, DURATION, HANDOVERS, FREE_RUNS)


@dataclass
class Cluster:
    """One node and the edges it serves (processes)."""

    name: str
    edges: list[ServerProcess]
    node: ServerProcess
    refused: int = 0
    """Lines of the node's log naming ``beyond_grant`` (a run refused: the edge's count was
    wrong), read when the block ends."""

    @property
    def ports(self) -> list[int]:
        return [edge.port for edge in self.edges]


@asynccontextmanager
async def open_cluster(
    name: str, *, edges: int, slots: int, notes: list[str]
) -> AsyncIterator[Cluster]:
    """``edges`` edges and one node serving all of them, until the block ends; the processes'
    warnings go to ``notes`` then."""
    async with AsyncExitStack() as stack:
        started = [await stack.enter_async_context(edge_daemon(EDGE_TOML)) for _ in range(edges)]
        urls = ", ".join(f'"ws://127.0.0.1:{edge.port}/v1/nodes/connect"' for edge in started)
        node_toml = NODE_TOML.format(
            node_id="bench-" + re.sub(r"[^A-Za-z0-9]+", "-", name), edges=urls, slots=slots
        )
        node = await stack.enter_async_context(
            node_daemon([edge.port for edge in started], node_toml, ["echo"], log_level="WARNING")
        )
        cluster = Cluster(name, started, node)
        try:
            yield cluster
        finally:
            cluster.refused = count_lines(node, "beyond_grant")
            for process in [*started, node]:
                notes.extend(f"{name}: {note}" for note in log_notes(process))


# --------------------------------------------------------------------------- 1. one vs two


@dataclass
class Setup:
    name: str
    cluster: Cluster
    spread: bool
    """Clients spread over every edge (else all on the first)."""
    loads: dict[int, list[LoadResult]] = field(default_factory=dict)

    def ports(self, clients: int, round_: int) -> list[int]:
        ports = self.cluster.ports
        if not self.spread:
            return ports[:1]
        if clients < len(ports):  # one client: on each edge in turn, round by round
            return [ports[round_ % len(ports)]]
        return ports

    def result(self, clients: int) -> LoadResult:
        return LoadResult.combined(self.loads[clients])

    def cpu_us(self, clients: int, which: str) -> float:
        """µs of CPU per response over the counted windows: the edges' (summed) or the
        node's."""
        result = self.result(clients)
        pids = [e.pid for e in self.cluster.edges] if which == "edge" else [self.cluster.node.pid]
        if result.requests == 0:
            return math.nan
        return sum(result.pid_cpu[pid] for pid in pids) / result.rps * 1e6


async def _measure_setups(setups: Sequence[Setup], plan: Plan) -> None:
    request = chat_request()
    per_round = plan.duration / plan.rounds
    for clients in CLIENTS:
        for round_ in range(plan.rounds):
            order = list(setups) if round_ % 2 == 0 else list(reversed(setups))
            for setup in order:
                cluster = setup.cluster
                with trio.fail_after(per_round + WARMUP + 30):
                    load = await request_load(
                        setup.ports(clients, round_),
                        request,
                        clients=clients,
                        duration=per_round,
                        warmup=WARMUP,
                        watch_pids=[*(e.pid for e in cluster.edges), cluster.node.pid],
                    )
                setup.loads.setdefault(clients, []).append(load)


async def _check(port: int) -> None:
    status, _, body = await fetch(port, chat_request())
    if status != 200:
        raise LoadError(f"the edge on port {port} answered {status}: {body[:200]!r}")


async def one_vs_two(plan: Plan) -> Table:
    notes: list[str] = []
    async with (
        open_cluster("one edge", edges=1, slots=NODE_SLOTS, notes=notes) as one,
        open_cluster("two edges", edges=2, slots=NODE_SLOTS, notes=notes) as two,
    ):
        for port in [*one.ports, *two.ports]:
            await _check(port)
        setups = [Setup(ONE, one, spread=False), Setup(SPLIT, two, True), Setup(ON_A, two, False)]
        await _measure_setups(setups, plan)
    by_name = {setup.name: setup for setup in setups}
    lo, hi = CLIENTS

    def row(label: str, value: Callable[[Setup], float], show: Callable[[float], str]) -> list[str]:
        values = [value(by_name[name]) for name in SETUPS]
        base = values[0]
        ratios = [fmt_ratio(v / base) if base else "n/a" for v in values[1:]]
        return [label, *(show(v) for v in values), *ratios]

    rows: list[Sequence[str]] = [
        row("p50 ms, 1 client", lambda s: s.result(lo).percentile_ms(0.5), fmt_ms),
        row("p99 ms, 1 client", lambda s: s.result(lo).percentile_ms(0.99), fmt_ms),
        row(f"req/s, {hi} clients", lambda s: s.result(hi).rps, fmt_int),
        row(f"p50 ms, {hi} clients", lambda s: s.result(hi).percentile_ms(0.5), fmt_ms),
        row(f"p99 ms, {hi} clients", lambda s: s.result(hi).percentile_ms(0.99), fmt_ms),
        row(f"edge CPU µs/req, {hi} clients", lambda s: s.cpu_us(hi, "edge"), fmt_int),
        row(f"node CPU µs/req, {hi} clients", lambda s: s.cpu_us(hi, "node"), fmt_int),
        row(f"edge CPU µs/req, {lo} client", lambda s: s.cpu_us(lo, "edge"), fmt_int),
        row(f"node CPU µs/req, {lo} client", lambda s: s.cpu_us(lo, "node"), fmt_int),
    ]
    counted = ", ".join(
        f"{name} {by_name[name].result(lo).requests:,} / {by_name[name].result(hi).requests:,}"
        for name in SETUPS
    )
    notes[:0] = [
        f"one edge: `dispatcher node` (echo, {NODE_SLOTS} slots) with `[node] edges` naming one "
        "`dispatcher serve` (local_node = false); two edges: the same node config naming two "
        f"(the node grants each a share of its {NODE_SLOTS} slots, by demand)",
        f"{SPLIT}: the {hi} clients' connections alternate between the two edges "
        f"({hi // 2} + {hi // 2}); at 1 client, the client is on A one round, on B the next; "
        f"{ON_A}: every client on the first edge (its grant grows to what it asks, the other "
        "edge idle)",
        "non-streaming chat completion ('hello' to echo), keep-alive connections sending back "
        "to back; latency = send to last byte; ratios: the column over 'one edge'",
        f"{plan.rounds} round(s) per setup and concurrency, taking turns (the order reversed "
        f"every other round), each {WARMUP:g} s warm-up + {plan.duration / plan.rounds:g} s "
        f"counted; responses counted at 1 / {hi} clients: {counted}",
        "edge CPU: the user + system time of every edge of the setup (summed), node CPU the "
        "node's, over the counted windows, per response",
    ]
    refused = one.refused + two.refused
    notes.append(f"runs the node refused as beyond an edge's grant (its log): {refused}")
    return Table(
        title="cluster: one node behind one edge vs two (client -> edge(s) -> node -> echo)",
        columns=["metric", *SETUPS, "split / one", "all on A / one"],
        rows=rows,
        notes=notes,
    )


# --------------------------------------------------------------------------- 2. hand-over

_GAUGE = re.compile(rb'^dispatcher_slots_(total|in_use)\{[^}]*model="echo"[^}]*\} (\S+)$', re.M)


async def slots(port: int) -> tuple[float, float]:
    """What the edge at ``port`` believes of echo on the node: (slots granted, in use)."""
    status, _, body = await fetch(port, http_request("GET", "/metrics"))
    if status != 200:
        raise LoadError(f"GET /metrics answered {status}")
    found = {b"total": 0.0, b"in_use": 0.0}
    for kind, value in _GAUGE.findall(body):
        found[kind] += float(value)
    return found[b"total"], found[b"in_use"]


async def wait_for_slots(
    ports: Sequence[int], wanted: Callable[[float, float, float, float], bool]
) -> None:
    """Until ``wanted(a_total, a_in_use, b_total, b_in_use)`` holds (polled)."""
    a, b = ports
    with trio.fail_after(SETTLE_TIMEOUT):
        while True:
            a_total, a_used = await slots(a)
            b_total, b_used = await slots(b)
            if wanted(a_total, a_used, b_total, b_used):
                return
            await trio.sleep(SETTLE_POLL)


def a_holds_all(a_total: float, a_used: float, b_total: float, b_used: float) -> bool:
    return a_total == HANDOVER_SLOTS and a_used == HANDOVER_SLOTS and b_total == 0


def long_runs() -> list[bytes]:
    """A's requests: runs of :data:`A_WORDS` words, :data:`TOKEN_DELAY` s each."""
    low, high = A_WORDS
    return [
        chat_request(words(count), echo={"token_delay": TOKEN_DELAY})
        for count in range(low, high + 1)
    ]


async def keep_busy(port: int, requests: Sequence[bytes], ends: list[float]) -> None:
    """One client on ``port`` sending ``requests`` (one at random each time) back to back,
    for ever: each response's end (``perf_counter``) appended to ``ends``."""
    rng = random.Random()
    sock = await connect(port)
    try:
        pending = b""
        while True:
            status, pending = await exchange(sock, rng.choice(requests), pending)
            if status != 200:
                raise LoadError(f"a long run on A answered {status}")
            ends.append(time.perf_counter())
    finally:
        sock.close()


async def timed(sock: Sock, request: bytes) -> tuple[float, float]:
    """One request on ``sock``: (sent, answered) perf_counter times."""
    sent = time.perf_counter()
    status, rest = await exchange(sock, request, b"")
    answered = time.perf_counter()
    if status != 200 or rest:
        raise LoadError(f"a short request answered {status} (and {len(rest)} bytes more)")
    return sent, answered


# The node's frames, when it runs in the bench process: which edge (A, B), which way.
A, B = 0, 1
M = TypeVar("M")


@dataclass(frozen=True)
class Frame:
    at: float
    """``perf_counter`` when the node handed it to its connection, or had it from it."""
    edge: int
    by_node: bool
    message: object


_WATCHED = ('"capacity"', '"demand"', '"run.request"', '"run.completed"')


class WatchedConnection:
    """A node's connection to one edge, passed through, its ``capacity``, ``demand``,
    ``run.request`` and ``run.completed`` frames logged with their time."""

    def __init__(self, inner: Connection, frames: list[Frame], edge: int) -> None:
        self._inner = inner
        self._frames = frames
        self._edge = edge

    def _log(self, frame: RawFrame, by_node: bool) -> None:
        if isinstance(frame, str) and any(tag in frame for tag in _WATCHED):
            at = time.perf_counter()
            self._frames.append(Frame(at, self._edge, by_node, wire.decode(frame)))

    async def send(self, frame: RawFrame) -> None:
        # Logged as it is handed to the connection: an answer the edge sends back at once
        # may be received before this send returns.
        self._log(frame, by_node=True)
        await self._inner.send(frame)

    async def receive(self) -> RawFrame:
        frame = await self._inner.receive()
        self._log(frame, by_node=False)
        return frame

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        await self._inner.aclose(code, reason)


def watched_dial(
    config: NodeConfig, frames: list[Frame], edge: int
) -> Callable[[], AbstractAsyncContextManager[Connection]]:
    """The node's default dial of ``config.edge_url``, its connection watched."""
    from nodes.agent import dial_edge

    @asynccontextmanager
    async def dial() -> AsyncIterator[Connection]:
        async with dial_edge(config) as conn:
            yield WatchedConnection(conn, frames, edge)

    return dial


def _first(
    frames: Sequence[Frame],
    kind: type[M],
    *,
    edge: int,
    by_node: bool,
    after: float,
    where: Callable[[M], bool] = lambda _: True,
) -> tuple[float, M] | None:
    for frame in frames:
        message = frame.message
        if (
            frame.at >= after
            and frame.edge == edge
            and frame.by_node == by_node
            and isinstance(message, kind)
            and where(message)
        ):
            return frame.at, message
    return None


GRANT_TO_B = "grant sent to B"
STEPS = (
    "lowered grant sent to A",
    "A's confirmation received",
    "A's report of a slot given back",
    GRANT_TO_B,
    "B's run.request received",
    "B's run.completed sent",
    "B's client has the answer",
)


@dataclass
class Timeline:
    """One hand-over as the node saw it (seconds)."""

    demand_b: float
    """B's request sent -> B's demand (waiting) at the node."""
    run_end: float
    """B's demand at the node -> the first run end on A after it."""
    steps: dict[str, float]
    """Each of :data:`STEPS`, from that run end."""
    refilled: bool
    """A sent a run.request between that run end and the grant to B: A refilled the slot
    before giving one back."""
    end_first: bool
    """The node sent A the run's end before the lowered grant (not the order
    ``nodes/grants.py`` asks for)."""


def timeline(frames: Sequence[Frame], sent: float, answered: float) -> Timeline | None:
    """The hand-over in the node's frames; None when a step is missing (B got a slot
    without one: no hand-over)."""
    demand_b = _first(
        frames, wire.Demand, edge=B, by_node=False, after=sent, where=lambda m: m.waiting > 0
    )
    if demand_b is None:
        return None
    at = demand_b[0]
    completed_a = _first(frames, wire.RunCompleted, edge=A, by_node=True, after=at)
    lowered_a = _first(frames, wire.Capacity, edge=A, by_node=True, after=at)
    granted_b = _first(
        frames, wire.Capacity, edge=B, by_node=True, after=at, where=lambda m: m.slots > 0
    )
    request_b = _first(frames, wire.RunRequest, edge=B, by_node=False, after=sent)
    if completed_a is None or lowered_a is None or granted_b is None or request_b is None:
        return None
    serial = lowered_a[1].serial
    confirmed_a = _first(
        frames,
        wire.Demand,
        edge=A,
        by_node=False,
        after=lowered_a[0],
        where=lambda m: m.serial >= serial,
    )
    lowered = lowered_a[1].slots
    freed_a = _first(
        frames,
        wire.Demand,
        edge=A,
        by_node=False,
        after=lowered_a[0],
        where=lambda m: m.serial >= serial and m.in_use <= lowered,
    )
    completed_b = _first(frames, wire.RunCompleted, edge=B, by_node=True, after=request_b[0])
    if confirmed_a is None or freed_a is None or completed_b is None:
        return None
    end = min(completed_a[0], lowered_a[0])
    refill = _first(frames, wire.RunRequest, edge=A, by_node=False, after=end)
    times = (
        lowered_a[0],
        confirmed_a[0],
        freed_a[0],
        granted_b[0],
        request_b[0],
        completed_b[0],
        answered,
    )
    return Timeline(
        demand_b=at - sent,
        run_end=end - at,
        steps={step: t - end for step, t in zip(STEPS, times, strict=True)},
        refilled=refill is not None and refill[0] < granted_b[0],
        end_first=completed_a[0] < lowered_a[0],
    )


@dataclass
class Handovers:
    handover: list[float] = field(default_factory=list)
    """From the first end of a run on A (its client) after B's request was sent to B's
    answer, seconds."""
    wait: list[float] = field(default_factory=list)
    """B's request, send to answer, seconds."""
    a_end_wait: list[float] = field(default_factory=list)
    """From B's request sent to that first end on A."""
    without: int = 0
    """B answered before any run on A ended: B had a slot (not a hand-over)."""
    back: list[float] = field(default_factory=list)
    """From B's answer to A holding every slot again (polled), seconds."""
    timelines: list[Timeline] = field(default_factory=list)
    """With the node in the bench process: each hand-over as the node saw it."""
    untimed: int = 0
    """With the node in the bench process: hand-overs whose frames lacked a step."""


async def measure_handovers(
    ports: Sequence[int], count: int, frames: list[Frame] | None = None
) -> Handovers:
    """``count`` hand-overs (after :data:`HANDOVER_WARMUP`), each from A saturated to one
    request on B; ``frames``: the node's, when it runs in this process."""
    a, b = ports
    short = chat_request()
    result = Handovers()
    ends: list[float] = []
    rng = random.Random(24)
    async with trio.open_nursery() as nursery:
        runs = long_runs()
        for _ in range(A_CLIENTS):
            nursery.start_soon(keep_busy, a, runs, ends)
        sock = await connect(b)
        try:
            for i in range(HANDOVER_WARMUP + count):
                await wait_for_slots(ports, a_holds_all)
                await trio.sleep(rng.uniform(0, PHASE))
                del ends[:]
                if frames is not None:
                    del frames[:]
                sent, answered = await timed(sock, short)
                after = [end for end in ends if end >= sent]
                counted = i >= HANDOVER_WARMUP
                handed = bool(after) and after[0] <= answered
                if counted and not handed:
                    result.without += 1
                elif counted:
                    result.handover.append(answered - after[0])
                    result.a_end_wait.append(after[0] - sent)
                    result.wait.append(answered - sent)
                    if frames is not None:
                        seen = timeline(frames, sent, answered)
                        if seen is None:
                            result.untimed += 1
                        else:
                            result.timelines.append(seen)
                back_from = time.perf_counter()
                await wait_for_slots(ports, a_holds_all)
                if counted:
                    result.back.append(time.perf_counter() - back_from)
        finally:
            sock.close()
        nursery.cancel_scope.cancel()
    return result


@dataclass
class FreeSlots:
    on_b: list[float] = field(default_factory=list)
    on_a: list[float] = field(default_factory=list)


async def measure_free(ports: Sequence[int], count: int) -> FreeSlots:
    """A runs :data:`FREE_A_CLIENTS` long runs; short requests on B and on A alternate."""
    a, b = ports
    short = chat_request()
    result = FreeSlots()
    rng = random.Random(25)
    async with trio.open_nursery() as nursery:
        runs = long_runs()
        for _ in range(FREE_A_CLIENTS):
            nursery.start_soon(keep_busy, a, runs, [])
        await wait_for_slots(ports, lambda a_total, a_used, b_total, b_used: a_used > 0)
        socks = {a: await connect(a), b: await connect(b)}
        try:
            for i in range(HANDOVER_WARMUP + count):
                for port, times in ((b, result.on_b), (a, result.on_a)):
                    await trio.sleep(rng.uniform(0, PHASE))
                    sent, answered = await timed(socks[port], short)
                    if i >= HANDOVER_WARMUP:
                        times.append(answered - sent)
        finally:
            for sock in socks.values():
                sock.close()
        nursery.cancel_scope.cancel()
    return result


def cells(values: Sequence[float]) -> list[str]:
    """p50, p99, max (ms) and the count of ``values`` (seconds)."""
    top = fmt_ms(max(values) * 1000) if values else "n/a"
    return [fmt_ms(percentile_ms(values, 0.5)), fmt_ms(percentile_ms(values, 0.99)), top]


def _runs_note() -> str:
    low, high = A_WORDS
    return (
        f"a node of {HANDOVER_SLOTS} echo slots serving two `dispatcher serve`, A and B; "
        f"{A_CLIENTS} clients keep A saturated with long runs (non-streaming, echo of {low} to "
        f"{high} words at {TOKEN_DELAY * 1000:g} ms a word, chosen at random: "
        f"{low * TOKEN_DELAY * 1000:g}-{high * TOKEN_DELAY * 1000:g} ms), so A holds every "
        "slot and always has requests waiting"
    )


def _settle_note() -> str:
    return (
        f"before each hand-over both edges' /metrics are polled (every {SETTLE_POLL * 1000:g} "
        f"ms) until A's dispatcher_slots_total and _in_use for echo are {HANDOVER_SLOTS} and "
        f"B's total 0; then, after a random pause of up to {PHASE * 1000:g} ms, one short "
        "request ('hello': non-streaming, one word, no delay) goes to B on a keep-alive "
        "connection"
    )


async def handover(plan: Plan) -> Table:
    """The hand-over with ``dispatcher node`` as its own process, seen from the clients; and
    the free-slots case."""
    notes: list[str] = []
    async with open_cluster("hand-over", edges=2, slots=HANDOVER_SLOTS, notes=notes) as cluster:
        for port in cluster.ports:
            await _check(port)
        taken = await measure_handovers(cluster.ports, plan.handovers)
        free = await measure_free(cluster.ports, plan.free_runs)
    rows: list[Sequence[str]] = [
        ["hand-over: first run end on A -> B answered", *cells(taken.handover)],
        ["  B's request: sent -> answered", *cells(taken.wait)],
        ["  B's request sent -> first run end on A", *cells(taken.a_end_wait)],
        ["  B answered -> A holds every slot again", *cells(taken.back)],
        ["free slots: a request on B, sent -> answered", *cells(free.on_b)],
        ["free slots: a request on A, sent -> answered", *cells(free.on_a)],
    ]
    notes[:0] = [
        _runs_note(),
        _settle_note(),
        "hand-over = B's response complete minus the end of the first of A's responses to "
        "complete after B's request was sent, both as the bench's clients see them (one "
        "clock): a run's end makes the node lower A's grant, A confirms, the node grants "
        "B, B admits and runs. From outside it is approximate both ways: A's client sees "
        "its run end a little after the node does (A relays run.completed), and a run that "
        "ended before B's demand reached the node hands nothing over (A refills it); the "
        "next table times the same steps at the node",
        f"hand-overs counted: {len(taken.handover)} (after {HANDOVER_WARMUP} warm-up); B "
        f"answered before any run on A ended (B had a slot: no hand-over): {taken.without}",
        f"'A holds every slot again': from B's answer until A's /metrics shows "
        f"{HANDOVER_SLOTS} granted and in use and B's 0 (polled: a few ms coarse)",
        f"free slots: {FREE_A_CLIENTS} clients run the same long runs on A (fewer than the "
        "slots: the idle slots are granted too, so B holds some); short requests on B and on "
        f"A alternate, each after a random pause of up to {PHASE * 1000:g} ms; "
        f"{len(free.on_b)} each",
        f"runs the node refused as beyond an edge's grant (its log): {cluster.refused}",
    ]
    return Table(
        title="cluster: a slot handed from a busy edge to another (dispatcher node process), ms",
        columns=["interval", "p50", "p99", "max"],
        rows=rows,
        notes=notes,
    )


async def handover_in_process(plan: Plan) -> Table:
    """The same hand-overs with the node in the bench process, its frames timestamped."""
    from nodes.adapters import ADAPTERS
    from nodes.agent import serve_node
    from nodes.config import parse_node_config

    notes: list[str] = []
    frames: list[Frame] = []
    async with AsyncExitStack() as stack:
        edges = [await stack.enter_async_context(edge_daemon(EDGE_TOML)) for _ in range(2)]
        urls = [f"ws://127.0.0.1:{edge.port}/v1/nodes/connect" for edge in edges]
        text = NODE_TOML.format(
            node_id="bench-in-process",
            edges=", ".join(f'"{url}"' for url in urls),
            slots=HANDOVER_SLOTS,
        )
        config = parse_node_config(
            tomllib.loads(text), source="bench", environ={}, adapters=ADAPTERS
        )
        dials = {
            url: watched_dial(attrs.evolve(config, edge_url=url, edges=()), frames, index)
            for index, url in enumerate(urls)
        }
        ports = [edge.port for edge in edges]
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(serve_node, config, dials=dials))
                with trio.fail_after(30):
                    for port in ports:
                        await wait_for_models(port, lambda models: "echo" in models)
                for port in ports:
                    await _check(port)
                taken = await measure_handovers(ports, plan.handovers, frames)
                nursery.cancel_scope.cancel()
        finally:
            for edge in edges:
                notes.extend(f"in process: {note}" for note in log_notes(edge))
    seen = taken.timelines
    refilled = [t for t in seen if t.refilled]
    direct = [t for t in seen if not t.refilled]
    rows: list[Sequence[str]] = [
        ["B's request sent -> B's demand at the node", *cells([t.demand_b for t in seen])],
        ["B's demand at the node -> first run end on A", *cells([t.run_end for t in seen])],
        ["from that run end on A (node side):", "", "", ""],
        *([f"  -> {step}", *cells([t.steps[step] for t in seen])] for step in STEPS),
        ["hand-over seen by the clients (as above)", *cells(taken.handover)],
        [
            f"run end on A -> grant sent to B, A refilled first ({len(refilled)})",
            *cells([t.steps[GRANT_TO_B] for t in refilled]),
        ],
        [
            f"run end on A -> grant sent to B, A did not ({len(direct)})",
            *cells([t.steps[GRANT_TO_B] for t in direct]),
        ],
    ]
    end_first = sum(t.end_first for t in seen)
    notes[:0] = [
        "the same edges and hand-overs as above, but the node runs in the bench process "
        "(nodes.agent.serve_node, the same config, each edge's default dial with its "
        "connection wrapped to timestamp the capacity, demand, run.request and run.completed "
        "frames, with the clients' clock); no production code changed",
        "run end on A = the first run.completed or capacity the node sent A after B's demand "
        "(waiting) reached it, whichever came first; each step is the first frame of its "
        "kind after: A's confirmation is A's demand naming the lowered grant's serial; the "
        "grant to B the first capacity of 1 slot or more",
        f"hand-overs timed: {len(seen)}; without every step in the frames: {taken.untimed}; "
        f"B had a slot (no hand-over): {taken.without}",
        f"in {end_first} of {len(seen)} hand-overs the node's first frame to A after B's "
        "demand was a run.completed, the lowered grant after it (nodes/grants.py asks for "
        "the grant first; in the others the grant went first, or A was lowered at B's "
        "demand itself, a run of A's having just ended); A refilled a freed slot from its "
        f"queue before giving one back in {len(refilled)}: B's grant then waits for a later "
        "run end on A ('A refilled first')",
    ]
    return Table(
        title="cluster: where a hand-over's time goes (node in the bench process), ms",
        columns=["interval", "p50", "p99", "max"],
        rows=rows,
        notes=notes,
    )


async def run(options: RunOptions | None = None) -> Sequence[Table]:
    plan = Plan.of(options)
    machine = MachineLoad()
    tables = [await one_vs_two(plan), await handover(plan), await handover_in_process(plan)]
    tables[-1].notes.append(machine.note())
    return tables


if __name__ == "__main__":
    import sys

    from bench import render

    quick = "--quick" in sys.argv[1:]
    for result in trio.run(run, RunOptions(quick=quick)):
        print(render(result))
        print()
