"""The cluster soak's moving parts (issue #24, acceptance 2): what it starts, the request plan,
the clients, the conductor of its faults, and what it reads back. The checks are in
:mod:`tests.cluster_chaos.checks`.

What runs, each a real process on 127.0.0.1: a ``redis-server`` and a PostgreSQL database
(started by the test); two edges (``dispatcher serve`` with ``[store]`` naming both); three
``dispatcher node`` processes, **each dialling both edges** and sharing its slots between
them; and one process of fake engines (:mod:`tests.cluster_chaos.engine`), one engine per node and
provider, each counting how many requests it answers at once against its node's slots:

* ``node-1``: provider ``engine``, 3 slots, normalized path;
* ``node-2``: provider ``engine``, 3 slots, tunnel path;
* ``node-3``: provider ``engine``, 2 slots, and provider ``flaky``, 2 slots, whose engine
  answers a share of its requests HTTP 500 before any token (the edge recovers them).

Every request asks for the model ``m`` and is answered with its own user message, so each
client knows what a complete answer is. The clients are the official openai SDK (each in a
thread), sending to the edge their plan names, or to the other while that one is down (the
harness is the load balancer); one key in five has limits. The conductor SIGKILLs a node and
restarts it every ~300 requests, SIGKILLs an edge once and restarts it on the same port (same
outbox), and restarts Redis once (emptied: no persistence). Meanwhile the edges' beliefs of
each node's slots are read in consistent cuts, the node frozen (:func:`take_cuts`).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import attrs
import httpx
import openai
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.chaos.processes import Proc, Processes
from tests.cluster.cluster import ADMIN_KEY, Tenant
from tests.store.redis_server import RedisServer

MODEL = "m"
SERVED = "fake-model"
EDGES = ("edge-a", "edge-b")


@attrs.frozen
class Provider:
    slots: int
    path: Literal["normalized", "tunnel"] = "normalized"
    fail_rate: float = 0.0


NODES: dict[str, dict[str, Provider]] = {
    "node-1": {"engine": Provider(3)},
    "node-2": {"engine": Provider(3, path="tunnel")},
    "node-3": {"engine": Provider(2), "flaky": Provider(2, fail_rate=0.3)},
}
"""Each node's providers of the model ``m`` (one fake engine each)."""
FLAKY = ("node-3", "flaky")

LIMITED = Tenant("limited", {"rpm": 40, "max_concurrent": 2, "tpm": 2500})
"""The key with limits: held globally (both edges, one Redis)."""
OPEN = (Tenant("open-1", {}), Tenant("open-2", {}))
TENANTS = (LIMITED, *OPEN)

MAX_ATTEMPTS = 3
HOLD_LEASE = 3.0
REQUEST_BOUND = 90.0
"""No request may take longer than this (it is recorded as hung)."""
START_BOUND = 60.0
REJOIN_BOUND = 30.0
QUIET = 2.0
"""Seconds the conductor lets pass after a fault's recovery before the next fault: each
fault's effects are its own."""

_WORD = re.compile(r"\s*\S+\s*")
_VOCABULARY = (
    *("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"),
    *("juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo"),
    *("sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu"),
)


def engine_name(node: str, provider: str) -> str:
    return f"{node}/{provider}"


# ------------------------------------------------------------------------------ configs


def edge_toml(name: str, data: Path, redis_url: str, database_url: str) -> str:
    keys = "\n".join(tenant.toml() for tenant in TENANTS)
    return f"""\
local_node = false
expose_node_ids = true
data_dir = {json.dumps(str(data))}
admin_keys = ["{ADMIN_KEY}"]

[http]
shutdown_grace = 2.0

[admission]
max_queue = 10000
queue_timeout_s = 60.0
max_attempts = {MAX_ATTEMPTS}
request_timeout_s = 60.0
first_token_timeout_s = 5.0
stall_timeout_s = 5.0

[nodes]
heartbeat_interval = 1
heartbeat_timeout = 5

[store]
redis_url = "{redis_url}"
database_url = "{database_url}"
hold_lease_s = {HOLD_LEASE}
edge_id = "{name}"

{keys}
"""


def node_toml(node: str, edge_urls: list[str], engines: dict[str, str]) -> str:
    parts = [
        f"""\
[node]
id = "{node}"
edges = {json.dumps(edge_urls)}
reconnect_min_backoff = 0.1
reconnect_max_backoff = 1.0
"""
    ]
    for provider, spec in NODES[node].items():
        parts.append(
            f"""
[[providers]]
id = "{provider}"
type = "openai"
path = "{spec.path}"
base_url = "{engines[engine_name(node, provider)]}/v1"
options = {{ connect_timeout = 5, read_timeout = 30 }}
  [[providers.models]]
  name = "{MODEL}"
  served_name = "{SERVED}"
  slots = {spec.slots}
"""
        )
    return "".join(parts)


# ------------------------------------------------------------------------------ the plan


LeaveKind = Literal["no", "early", "mid_stream"]


@attrs.frozen(kw_only=True)
class Plan:
    """What one client does."""

    index: int
    request_id: str
    key: Tenant
    edge: str
    """The edge it is sent to (the other one while this one is down)."""
    stream: bool
    words: tuple[str, ...]
    token_delay: float
    first_token_delay: float = 0.0
    leave: LeaveKind = "no"
    leave_after_s: float | None = None
    """``early``: the client gives up this long after sending (its SDK timeout), before any
    token: while queued, or dispatched and waiting for the first token."""
    leave_after_words: int | None = None
    """``mid_stream``: the client closes the stream once this many words arrived."""

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def expected(self) -> str:
        return "".join(_WORD.findall(self.text))

    @property
    def max_tokens(self) -> int:
        return len(self.words) + 4

    def body(self) -> dict[str, Any]:
        """The body the SDK sends (what the edge estimates the request's tokens from)."""
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": self.text}],
            "max_tokens": self.max_tokens,
            "user": self.request_id,
            "engine": {
                "token_delay": self.token_delay,
                "first_token_delay": self.first_token_delay,
            },
        }
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


def make_plans(count: int, seed: int) -> list[Plan]:
    """``count`` requests, ~60% streamed, a fifth on the limited key, alternating edges:
    ~12% leave early (within 0.5 s, their first token 0.6 s away), ~35% of the streams leave
    mid-stream after a random number of words; the rest ask for 6-24 words at 2-8 ms."""
    rng = random.Random(seed)
    plans = []
    for index in range(count):
        common: dict[str, Any] = {
            "index": index,
            "request_id": f"cc-{seed}-{index:05d}",
            "key": LIMITED if rng.random() < 0.2 else OPEN[index % 2],
            "edge": EDGES[index % 2],
        }
        stream = rng.random() < 0.6
        roll = rng.random()
        if roll < 0.12:
            plan = Plan(
                **common,
                stream=stream,
                words=tuple(rng.choices(_VOCABULARY, k=rng.randint(4, 8))),
                token_delay=0.005,
                first_token_delay=0.6,
                leave="early",
                leave_after_s=round(rng.uniform(0.02, 0.5), 3),
            )
        elif stream and roll < 0.12 + 0.35:
            words = rng.randint(60, 120)
            plan = Plan(
                **common,
                stream=True,
                words=tuple(rng.choices(_VOCABULARY, k=words)),
                token_delay=0.004,
                leave="mid_stream",
                leave_after_words=rng.randint(1, words - 20),
            )
        else:
            plan = Plan(
                **common,
                stream=stream,
                words=tuple(rng.choices(_VOCABULARY, k=rng.randint(6, 24))),
                token_delay=round(rng.uniform(0.002, 0.008), 4),
            )
        plans.append(plan)
    return plans


# ------------------------------------------------------------------------------ clients


View = str
"""What a client saw: ``complete``; ``left`` (as planned); ``http_<status>`` (its error's
code in :attr:`Seen.code`); ``error_event`` (an error in the stream: the SDK raised it);
``broken`` (the connection broke: the SDK raised ``APIConnectionError``); ``truncated`` (a
silent truncation: a 200 whose stream ended without its finish and usage chunks and without
an error, or whose text is not the answer); ``hung`` (no end within :data:`REQUEST_BOUND`)."""


@attrs.define(eq=False)
class Seen:
    plan: Plan
    edge: str
    started: float = 0.0
    """``time.time()`` when the request was sent."""
    ended: float = 0.0
    status: int | None = None
    code: str | None = None
    message: str = ""
    headers: dict[str, str] = attrs.field(factory=dict)
    text: str = ""
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None
    left: bool = False
    left_at: float | None = None
    """No later than the client's close of its connection, when it left."""
    error: str | None = None
    """The error the SDK raised (its type and message), if any."""
    broken: bool = False
    hung: bool = False
    event_error: bool = False

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def attempts(self) -> int | None:
        value = self.headers.get("x-dispatcher-attempts")
        return int(value) if value and value.isdigit() else None

    @property
    def view(self) -> View:
        if self.hung:
            return "hung"
        if self.left:
            return "left"
        if self.broken:
            return "broken"
        if self.event_error:
            return "error_event"
        if self.status is None:
            return "broken"
        if self.status != 200:
            return f"http_{self.status}"
        complete = self.finish_reason == "stop" and (not self.plan.stream or self.usage is not None)
        if not complete or self.text != self.plan.expected:
            return "truncated"
        return "complete"

    def describe(self) -> str:
        h = self.headers
        parts = [
            f"{self.request_id}: saw {self.view}",
            "stream" if self.plan.stream else "non-stream",
            f"key={self.plan.key.id}",
            f"edge={self.edge}",
            f"leave={self.plan.leave}",
            f"status={self.status}",
            f"code={self.code}",
            f"chars {len(self.text)}/{len(self.plan.expected)}",
            f"finish={self.finish_reason}",
            f"usage={self.usage}",
        ]
        if h.get("x-dispatcher-node"):
            parts.append(
                f"served by {h.get('x-dispatcher-node')}/{h.get('x-dispatcher-provider')} "
                f"attempts={h.get('x-dispatcher-attempts')}"
            )
        if self.error:
            parts.append(f"error={self.error[:300]}")
        parts.append(f"at {self.started:.3f}..{self.ended:.3f}")
        return ", ".join(parts)


def run_client(client: openai.OpenAI, plan: Plan, edge: str) -> Seen:
    """One request through the official SDK, in this thread: what the client saw."""
    seen = Seen(plan, edge)
    kwargs = plan.body()  # the SDK's parameters, but the engine's knobs
    kwargs["extra_body"] = {"engine": kwargs.pop("engine")}
    kwargs["extra_headers"] = {"x-request-id": plan.request_id}
    kwargs["timeout"] = plan.leave_after_s if plan.leave == "early" else REQUEST_BOUND
    seen.started = time.time()
    try:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        seen.status = raw.http_response.status_code
        seen.headers = {k.lower(): v for k, v in raw.headers.items()}
        if plan.stream:
            chunks: openai.Stream[Any] = raw.parse()
            try:
                for chunk in chunks:
                    if chunk.usage is not None:
                        seen.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                    for choice in chunk.choices:
                        seen.text += choice.delta.content or ""
                        if choice.finish_reason:
                            seen.finish_reason = choice.finish_reason
                    words = len(_WORD.findall(seen.text))
                    if plan.leave_after_words is not None and words >= plan.leave_after_words:
                        seen.left, seen.left_at = True, time.time()
                        break
            finally:
                chunks.close()
        else:
            completion = raw.parse()
            choice = completion.choices[0]
            seen.text = choice.message.content or ""
            seen.finish_reason = choice.finish_reason
            if completion.usage is not None:
                usage = completion.usage
                seen.usage = (usage.prompt_tokens, usage.completion_tokens)
    except openai.APITimeoutError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
        if plan.leave == "early":
            # The SDK's timeout closed the connection, at its deadline or after it.
            assert plan.leave_after_s is not None
            seen.left, seen.left_at = True, seen.started + plan.leave_after_s
        else:
            seen.hung = True
    except openai.APIConnectionError as exc:
        seen.error = f"{type(exc).__name__}: {exc} ({exc.__cause__!r})"
        seen.broken = True
    except openai.APIStatusError as exc:
        seen.status = exc.status_code
        body = exc.body if isinstance(exc.body, dict) else {}
        seen.code = body.get("code")
        seen.message = str(body.get("message", ""))
        seen.error = f"{type(exc).__name__}: {exc}"
    except openai.APIError as exc:  # an error event in the stream
        seen.event_error = True
        body = exc.body if isinstance(exc.body, dict) else {}
        seen.code = body.get("code")
        seen.error = f"{type(exc).__name__}: {exc}"
    seen.ended = time.time()
    return seen


# ------------------------------------------------------------------------------ processes


@attrs.define(eq=False)
class EdgeRef:
    name: str
    config: Path
    proc: Proc
    port: int = 0
    up: bool = True
    """The load balancer sends it requests (False from just before its kill until it is
    back with every node)."""
    incarnation: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def node_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/nodes/connect"


@attrs.define(eq=False)
class Topology:
    place: Path
    processes: Processes
    redis: RedisServer
    database_url: str
    engines_proc: Proc
    engines: dict[str, str]
    """Engine name -> its base URL."""
    edges: dict[str, EdgeRef] = attrs.field(factory=dict)
    nodes: dict[str, Proc] = attrs.field(factory=dict)
    incarnations: dict[str, int] = attrs.field(factory=dict)

    def start_edge(self, name: str, port: int = 0) -> EdgeRef:
        config = self.place / f"{name}.toml"
        if not config.exists():
            data = self.place / f"{name}-data"
            config.write_text(edge_toml(name, data, self.redis.url, self.database_url))
        number = self.incarnations.get(name, -1) + 1
        self.incarnations[name] = number
        proc = self.processes.spawn(
            name if number == 0 else f"{name}.{number}",
            ["-m", "dispatcher", "serve", "--config", str(config), "--port", str(port)],
        )
        edge = self.edges.get(name)
        if edge is None:
            edge = self.edges[name] = EdgeRef(name, config, proc)
        edge.proc, edge.incarnation = proc, number
        return edge

    def start_node(self, node: str) -> Proc:
        config = self.place / f"{node}.toml"
        if not config.exists():
            urls = [self.edges[name].node_url for name in EDGES]
            config.write_text(node_toml(node, urls, self.engines))
        number = self.incarnations.get(node, -1) + 1
        self.incarnations[node] = number
        proc = self.processes.spawn(
            node if number == 0 else f"{node}.{number}",
            ["-m", "dispatcher", "node", "--config", str(config)],
        )
        self.nodes[node] = proc
        return proc

    def live_edges(self) -> list[EdgeRef]:
        return [edge for edge in self.edges.values() if edge.up]

    def edge_logs(self) -> dict[str, str]:
        """Every edge incarnation's stderr, by process name."""
        return {
            proc.name: proc.stderr()
            for proc in self.processes.procs
            if proc.name.split(".")[0] in EDGES
        }


async def wait_listening(proc: Proc) -> int:
    match = await proc.wait_for_stdout(r"listening on http://127\.0\.0\.1:(\d+)/v1", START_BOUND)
    return int(match.group(1))


async def start_topology(
    processes: Processes, place: Path, redis: RedisServer, database_url: str, seed: int
) -> Topology:
    spec = [
        {"name": engine_name(node, provider), "slots": p.slots, "fail_rate": p.fail_rate}
        for node, providers in NODES.items()
        for provider, p in providers.items()
    ]
    engines_proc = processes.spawn(
        "engines",
        ["-m", "tests.cluster_chaos.engine", "--spec", json.dumps(spec), "--seed", str(seed)],
    )
    engines: dict[str, str] = {}
    for item in spec:
        name = re.escape(str(item["name"]))
        found = await engines_proc.wait_for_stdout(
            rf"engine {name} listening on (http://127\.0\.0\.1:\d+)", START_BOUND
        )
        engines[str(item["name"])] = found.group(1)
    topology = Topology(place, processes, redis, database_url, engines_proc, engines)
    for name in EDGES:
        edge = topology.start_edge(name)
        edge.port = await wait_listening(edge.proc)
    for node in NODES:
        topology.start_node(node)
    async with httpx.AsyncClient(timeout=30) as client:
        for edge in topology.edges.values():
            await wait_all_nodes(client, edge, START_BOUND)
    return topology


# ------------------------------------------------------------------------------ reading back


Metrics = dict[str, list[tuple[dict[str, str], float]]]
"""Samples by name: (labels, value)."""


async def scrape(client: httpx.AsyncClient, edge: EdgeRef) -> Metrics:
    response = await client.get(
        f"{edge.url}/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    response.raise_for_status()
    families: Metrics = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            families.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return families


def total(metrics: Metrics, name: str, **labels: str) -> float:
    return sum(
        value
        for found, value in metrics.get(name, [])
        if all(found.get(k) == v for k, v in labels.items())
    )


def nodes_in(metrics: Metrics) -> set[str]:
    """The nodes whose candidates an edge has (with slots or not)."""
    return {labels["node"] for labels, _ in metrics.get("dispatcher_slots_total", [])}


async def wait_all_nodes(client: httpx.AsyncClient, edge: EdgeRef, bound: float) -> None:
    """Until ``edge`` has every node's candidates (fails past ``bound``)."""
    with trio.move_on_after(bound):
        while True:
            try:
                if nodes_in(await scrape(client, edge)) == set(NODES):
                    return
            except httpx.HTTPError:
                pass
            await trio.sleep(0.1)
    raise AssertionError(
        f"{edge.name} does not have every node within {bound} s; stderr tail:\n"
        f"{edge.proc.stderr()[-3000:]}"
    )


async def engine_status(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    response = await client.get(f"{base_url}/_status")
    response.raise_for_status()
    status: dict[str, Any] = response.json()
    return status


# ------------------------------------------------------------------------------ the soak


EventKind = Literal["node", "edge", "redis"]


@attrs.define(eq=False)
class Event:
    """One fault the conductor injects once ``at`` requests were sent."""

    kind: EventKind
    at: int
    target: str = ""
    started: float = 0.0
    """``time.time()`` of the fault (the SIGKILL, Redis's stop)."""
    resumed: float = 0.0
    """``time.time()`` once the edge or Redis answered again (the edge listening, Redis
    answering PING); before :attr:`back`."""
    back: float = 0.0
    """``time.time()`` once recovered (the node rejoined every live edge; the edge serving
    with every node; every edge deciding on Redis again); 0: never."""
    notes: list[str] = attrs.field(factory=list)
    begun: trio.Event = attrs.field(factory=trio.Event, repr=False)
    """Set with :attr:`started`: the load goes on from there, so requests run during it."""

    def begin(self) -> None:
        """The fault happens now (called just before the SIGKILL or Redis's stop)."""
        self.started = time.time()
        self.begun.set()

    @property
    def recovered(self) -> bool:
        return self.back > 0.0

    def describe(self) -> str:
        took = f"{self.back - self.started:.1f} s" if self.recovered else "NOT recovered"
        extra = f"; {'; '.join(self.notes)}" if self.notes else ""
        return f"#{self.at} {self.kind} {self.target}: back in {took}{extra}"


def make_events(count: int) -> list[Event]:
    """A node SIGKILLed every ~300 requests (a quarter of a shorter run), rotating; the edge
    ``edge-a`` SIGKILLed once (at ~40%) and Redis restarted once (at ~85%)."""
    every = min(300, max(50, count // 4))
    rotation = list(NODES)
    events = [
        Event("node", at, rotation[number % len(rotation)])
        for number, at in enumerate(range(every, count - every // 3, every))
    ]
    events.append(Event("edge", int(count * 0.4), "edge-a"))
    events.append(Event("redis", int(count * 0.85), "redis"))
    events.sort(key=lambda event: event.at)
    return events


@attrs.define(eq=False)
class SoakRun:
    """Everything the checks look at."""

    seed: int
    count: int
    concurrency: int
    plans: list[Plan]
    events: list[Event]
    seen: list[Seen] = attrs.field(factory=list)
    load_s: float = 0.0
    settle_s: float = 0.0
    settled: bool = False
    metrics: dict[str, Metrics] = attrs.field(factory=dict)
    """Each edge's /metrics at the end."""
    engines: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """Each engine's ``/_status`` at the end."""
    cuts: int = 0
    """Consistent cuts taken (:func:`take_cuts`)."""
    unstable_cuts: int = 0
    """Cuts given up: an edge's two reads differed (a message was still arriving)."""
    held_most: dict[tuple[str, str], float] = attrs.field(factory=dict)
    """The most slots of each (node, provider) the edges held together (in the cuts)."""
    granted_most: dict[tuple[str, str], float] = attrs.field(factory=dict)
    """The most slots of each (node, provider) the edges were granted together (cuts)."""
    beyond: list[str] = attrs.field(factory=list)
    """The cuts that found the edges beyond a node's slots."""
    rows: list[dict[str, Any]] = attrs.field(factory=list)
    logs: dict[str, str] = attrs.field(factory=dict)
    """Every process's stderr, by incarnation name."""
    killed: set[str] = attrs.field(factory=set)
    exited: dict[str, int | None] = attrs.field(factory=dict)
    readback_error: str | None = None


async def kill_node(topology: Topology, event: Event, client: httpx.AsyncClient) -> None:
    node = event.target
    proc = topology.nodes[node]
    joins = {edge.name: _joins(edge, node) for edge in topology.live_edges()}
    lefts = {edge.name: _lefts(edge, node) for edge in topology.live_edges()}
    event.begin()
    topology.processes.kill(proc)
    # The engines must see every connection of the dead node closed before it restarts: the
    # count of what runs on an engine is the node's, not a dead incarnation's.
    with trio.move_on_after(10):
        for provider in NODES[node]:
            url = topology.engines[engine_name(node, provider)]
            while (await engine_status(client, url))["active"]:
                await trio.sleep(0.05)
    topology.start_node(node)
    with trio.move_on_after(REJOIN_BOUND):
        # back: every live edge saw the dead session leave and the new one join
        while any(
            _joins(topology.edges[name], node) <= joins[name]
            or _lefts(topology.edges[name], node) <= lefts[name]
            for name in joins
        ):
            await trio.sleep(0.05)
        event.back = time.time()


def _lefts(edge: EdgeRef, node: str) -> int:
    """How many of ``node``'s sessions left ``edge``'s current incarnation (its log)."""
    return len(re.findall(rf"node {re.escape(node)} generation \d+ left: ", edge.proc.stderr()))


def _joins(edge: EdgeRef, node: str) -> int:
    """How many times ``node`` joined ``edge``'s current incarnation (its log)."""
    return len(re.findall(rf"node {re.escape(node)} \(.*\) joined from", edge.proc.stderr()))


async def kill_edge(topology: Topology, event: Event, client: httpx.AsyncClient) -> None:
    edge = topology.edges[event.target]
    edge.up = False
    await trio.sleep(0.2)  # the load balancer's requests already sent reach it
    event.begin()
    topology.processes.kill(edge.proc)
    await trio.sleep(1.0)  # down for a while: the nodes' sessions to it end, its holds wait
    topology.start_edge(edge.name, edge.port)
    await wait_listening(edge.proc)
    event.resumed = time.time()
    await wait_all_nodes(client, edge, REJOIN_BOUND)
    edge.up = True
    event.back = time.time()


async def restart_redis(topology: Topology, event: Event, client: httpx.AsyncClient) -> None:
    event.begin()
    await trio.to_thread.run_sync(topology.redis.stop)
    await trio.sleep(1.0)
    await trio.to_thread.run_sync(topology.redis.start)
    event.resumed = time.time()
    event.notes.append(f"Redis answering after {event.resumed - event.started:.1f} s")
    with trio.move_on_after(REJOIN_BOUND):
        for edge in topology.edges.values():
            while total(await scrape(client, edge), "dispatcher_limit_store_up") != 1.0:
                await trio.sleep(0.05)
        event.back = time.time()


CONDUCT: dict[EventKind, Callable[[Topology, Event, httpx.AsyncClient], Awaitable[None]]] = {
    "node": kill_node,
    "edge": kill_edge,
    "redis": restart_redis,
}


async def run_load(topology: Topology, run: SoakRun) -> None:
    """Every plan through ``run.concurrency`` clients (threads of the SDK). Each event is
    injected once its request count is reached, while the load goes on; when the previous
    event is not over yet (its recovery and :data:`QUIET`), the load waits for it there, so
    every fault happens under load and each one's effects are its own."""
    threads = trio.CapacityLimiter(run.concurrency)
    faults = trio.Lock()
    clients: dict[tuple[int, str, int, str], openai.OpenAI] = {}
    lock = threading.Lock()

    def client_for(worker: int, edge: EdgeRef, key: str) -> openai.OpenAI:
        # One SDK client per worker, edge incarnation and key (its connections pooled):
        # a restarted edge gets new ones, as a client's retry would.
        ident = (worker, edge.name, edge.incarnation, key)
        with lock:
            found = clients.get(ident)
            if found is None:
                found = clients[ident] = openai.OpenAI(
                    base_url=f"{edge.url}/v1", api_key=key, max_retries=0, timeout=REQUEST_BOUND
                )
            return found

    async def inject(event: Event, done: trio.Event) -> None:
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                async with faults:
                    await CONDUCT[event.kind](topology, event, client)
                await trio.sleep(QUIET)
        finally:
            event.begun.set()  # never leave the feeder waiting, however this ends
            done.set()

    async def worker(number: int, plans: trio.MemoryReceiveChannel[Plan]) -> None:
        async for plan in plans:
            chosen = topology.edges[plan.edge]
            if not chosen.up:
                chosen = topology.live_edges()[0]
            client = client_for(number, chosen, plan.key.key)
            seen = await trio.to_thread.run_sync(
                run_client, client, plan, chosen.name, limiter=threads
            )
            run.seen.append(seen)

    started = time.monotonic()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take_cuts, topology, run, faults)
            send, receive = trio.open_memory_channel[Plan](0)
            async with trio.open_nursery() as workers:
                for number in range(run.concurrency):
                    workers.start_soon(worker, number, receive.clone())
                receive.close()
                pending = list(run.events)
                previous = trio.Event()
                previous.set()
                async with send:
                    for plan in run.plans:
                        while pending and pending[0].at <= plan.index:
                            await previous.wait()
                            previous = trio.Event()
                            event = pending.pop(0)
                            nursery.start_soon(inject, event, previous)
                            # The plans up to the next event are sent from the fault on,
                            # not before it (a cut may hold the conductor a while): on a
                            # fast machine they were all over before it began.
                            await event.begun.wait()
                        await send.send(plan)
            run.load_s = time.monotonic() - started
            with trio.move_on_after(REJOIN_BOUND + 30):
                await previous.wait()
            nursery.cancel_scope.cancel()
    finally:
        for client in clients.values():
            client.close()


GAUGES = (
    "dispatcher_slots_in_use",
    "dispatcher_slots_draining",
    "dispatcher_queue_depth",
    "dispatcher_inflight_requests",
    "dispatcher_inflight_runs",
    "dispatcher_inflight_tunnels",
    "dispatcher_usage_rows_in_outbox",
)


def per_candidate(metrics: Metrics, *names: str) -> dict[tuple[str, str], float]:
    """The sum of the gauges ``names`` of each (node, provider) of ``m``."""
    found: dict[tuple[str, str], float] = {}
    for name in names:
        for labels, value in metrics.get(name, []):
            if labels.get("model") == MODEL:
                key = (labels["node"], labels["provider"])
                found[key] = found.get(key, 0.0) + value
    return found


CUT_EVERY = 0.5
"""Seconds between two cuts (:func:`take_cuts`)."""
CUT_SETTLE = 0.2
"""Seconds a frozen node's last messages get to reach the edges before a cut is read."""


async def take_cuts(topology: Topology, run: SoakRun, faults: trio.Lock) -> None:
    """Until cancelled, every :data:`CUT_EVERY` seconds, one node after the other: a
    consistent cut of what the two edges believe of that node's slots. The node is frozen
    (SIGSTOP) -- only its ``capacity`` messages change an edge's grant -- and once what it
    sent has arrived, each edge is read twice, in turn (A, B, A, B); then it runs on
    (SIGCONT). When both reads of each edge agree, nothing was still arriving, and what they
    say held at one instant: each edge's grant (``dispatcher_slots_total``) and what it holds
    (in use and draining, at most its grant). Together they must not exceed the node's slots.
    Never while a fault is being injected (``faults``)."""
    first, second = (topology.edges[name] for name in EDGES)
    rotation = list(NODES)
    async with httpx.AsyncClient(timeout=10) as client:
        for turn in itertools.count():
            await trio.sleep(CUT_EVERY)
            node = rotation[turn % len(rotation)]
            async with faults:
                proc = topology.nodes[node]
                if not proc.running:
                    continue
                taken_at = time.time()
                proc.popen.send_signal(signal.SIGSTOP)
                try:
                    await trio.sleep(CUT_SETTLE)
                    reads = [await scrape(client, e) for e in (first, second, first, second)]
                except httpx.HTTPError:
                    continue
                finally:
                    proc.popen.send_signal(signal.SIGCONT)
            granted = [per_candidate(read, "dispatcher_slots_total") for read in reads]
            held = [
                per_candidate(read, "dispatcher_slots_in_use", "dispatcher_slots_draining")
                for read in reads
            ]
            keys = [key for key in configured_slots() if key[0] == node]
            if any(granted[0].get(k) != granted[2].get(k) for k in keys) or any(
                granted[1].get(k) != granted[3].get(k) for k in keys
            ):
                run.unstable_cuts += 1
                continue
            run.cuts += 1
            for key in keys:
                slots = configured_slots()[key]
                for what, reading, most in (
                    ("granted", granted, run.granted_most),
                    ("held", held, run.held_most),
                ):
                    together = reading[0].get(key, 0.0) + reading[1].get(key, 0.0)
                    most[key] = max(most.get(key, 0.0), together)
                    if together > slots:
                        run.beyond.append(
                            f"{key[0]}/{key[1]}: {what} {together:g} of {slots} at "
                            f"{taken_at:.3f} ({first.name} {reading[0].get(key, 0.0):g}, "
                            f"{second.name} {reading[1].get(key, 0.0):g})"
                        )


def configured_slots() -> dict[tuple[str, str], int]:
    return {(node, p): spec.slots for node, ps in NODES.items() for p, spec in ps.items()}


def at_rest(metrics: dict[str, Metrics]) -> bool:
    """Every gauge 0 on every edge, and each node's slots split over the edges in full."""
    if any(total(m, gauge) for m in metrics.values() for gauge in GAUGES):
        return False
    return slot_sums(metrics) == configured_slots()


def slot_sums(metrics: dict[str, Metrics]) -> dict[tuple[str, str], int]:
    """``dispatcher_slots_total`` of each (node, provider) of ``m``, summed over the edges."""
    sums: dict[tuple[str, str], int] = {}
    for m in metrics.values():
        for labels, value in m.get("dispatcher_slots_total", []):
            if labels.get("model") == MODEL:
                key = (labels["node"], labels["provider"])
                sums[key] = sums.get(key, 0) + int(value)
    return sums


def read_rows(database_url: str) -> list[dict[str, Any]]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        return list(conn.execute("SELECT * FROM dispatcher_usage ORDER BY ended_at"))


async def settle(topology: Topology, run: SoakRun, bound: float = 60.0) -> None:
    """Wait (bounded) until every edge is at rest (:func:`at_rest`, its outbox empty) and the
    ledger's row count has not moved for 2 s; then read everything back into ``run``."""
    started = time.monotonic()
    stable_since, last = time.monotonic(), -1
    async with httpx.AsyncClient(timeout=30) as client:
        with trio.move_on_after(bound):
            while True:
                try:
                    metrics = {e.name: await scrape(client, e) for e in topology.edges.values()}
                except httpx.HTTPError as exc:
                    run.readback_error = f"{type(exc).__name__}: {exc}"
                    await trio.sleep(0.25)
                    continue
                rows = len(await trio.to_thread.run_sync(read_rows, topology.database_url))
                if rows != last:
                    stable_since, last = time.monotonic(), rows
                if at_rest(metrics) and time.monotonic() - stable_since >= 2.0:
                    run.settled = True
                    break
                await trio.sleep(0.25)
        run.settle_s = time.monotonic() - started
        try:
            run.metrics = {e.name: await scrape(client, e) for e in topology.edges.values()}
            run.engines = {
                name: await engine_status(client, url) for name, url in topology.engines.items()
            }
            run.readback_error = None
        except httpx.HTTPError as exc:
            run.readback_error = f"{type(exc).__name__}: {exc}"
    run.rows = await trio.to_thread.run_sync(read_rows, topology.database_url)
    run.logs = {proc.name: proc.stderr() for proc in topology.processes.procs}
    run.killed = {proc.name for proc in topology.processes.procs if proc.killed}
    run.exited = {
        proc.name: proc.popen.returncode
        for proc in topology.processes.procs
        if not proc.killed and proc.popen.poll() is not None
    }


def dump(run: SoakRun, path: Path) -> None:
    """What the clients saw, the faults and the ledger, as JSON (for a failure's post-mortem)."""
    data = {
        "seen": [
            {
                "request_id": seen.request_id,
                "key": seen.plan.key.id,
                "edge": seen.edge,
                "stream": seen.plan.stream,
                "leave": seen.plan.leave,
                "view": seen.view,
                "code": seen.code,
                "started": seen.started,
                "ended": seen.ended,
                "headers": seen.headers,
                "error": seen.error,
            }
            for seen in run.seen
        ],
        "events": [
            attrs.asdict(event, filter=lambda field, _: field.name != "begun")
            for event in run.events
        ],
        "rows": run.rows,
    }
    path.write_text(json.dumps(data, indent=1, default=str))
