"""The chaos soak's moving parts: the topology it starts, the request plan, the clients,
the node killer, and what it reads back from the edge (log, ``/metrics``, ``GET /v1/usage``).

The topology: one edge (``dispatcher serve``, no local node, its usage ledger in the work
directory) and three ``dispatcher node`` processes serving the model group ``chat``:

* ``node-1`` and ``node-2``: the built-in ``echo`` adapter, 4 slots each;
* ``node-3``: ``echo`` with 2 slots and an ``openai`` provider (``faulty``, 3 slots) pointing
  at :mod:`tests.chaos.upstream`, a fake OpenAI-compatible server that injects faults.

Every request's answer is its own user message (echo, and the fake upstream mirrors echo),
so a client knows exactly what a complete answer is. The client sends its own
``x-request-id`` (the usage ledger's key) and the request id as the body's ``user`` field
(the fake upstream logs it). Everything is measured from outside, over 127.0.0.1 sockets.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs
import httpx
import orjson
import trio
from prometheus_client.parser import text_string_to_metric_families

from .processes import Proc, Processes

MODEL = "chat"
NODES: dict[str, dict[str, int]] = {
    "node-1": {"echo": 4},
    "node-2": {"echo": 4},
    "node-3": {"echo": 2, "faulty": 3},
}
"""Slots per provider of each node."""
TOTAL_SLOTS = sum(sum(p.values()) for p in NODES.values())
FAULTY_PROVIDER = "faulty"

MAX_ATTEMPTS = 3
FIRST_TOKEN_TIMEOUT = 2.0
STALL_TIMEOUT = 2.0

GAUGES = (
    "dispatcher_slots_in_use",
    "dispatcher_slots_draining",
    "dispatcher_queue_depth",
    "dispatcher_inflight_requests",
    "dispatcher_inflight_runs",
    "dispatcher_inflight_tunnels",
)

REQUEST_BOUND = 90.0
"""No single client request may take longer than this (it is recorded as hung)."""
DRAIN_BOUND = 2.0
"""Bound on closing a response (and finishing httpx's iterators) once a client is done."""

_WORD = re.compile(r"\s*\S+\s*")
_VOCABULARY = (
    *("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"),
    *("juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo"),
    *("sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu"),
)

LeaveKind = Literal["no", "early", "mid_stream"]

MID_STREAM_MARGIN = 150
"""Words of a mid-stream leaver's answer still to come when it leaves (3 ms each: 0.45 s,
more than a client lags behind the edge even on a loaded 2-core machine)."""


# ------------------------------------------------------------------------------ configs


def edge_toml(usage_db: Path) -> str:
    return f"""\
host = "127.0.0.1"
port = 0
local_node = false
usage_db = {json.dumps(str(usage_db))}

[http]
shutdown_grace = 2.0

[admission]
max_queue = 10000
queue_timeout_s = 60.0
max_attempts = {MAX_ATTEMPTS}
request_timeout_s = 60.0
first_token_timeout_s = {FIRST_TOKEN_TIMEOUT}
stall_timeout_s = {STALL_TIMEOUT}
"""


def node_toml(node_id: str, edge_url: str, upstream_url: str) -> str:
    providers = NODES[node_id]
    parts = [
        f"""\
[node]
id = "{node_id}"
label = "chaos soak {node_id}"
edge_url = "{edge_url}"
reconnect_min_backoff = 0.1
reconnect_max_backoff = 1.0
"""
    ]
    for provider, slots in providers.items():
        if provider == "echo":
            parts.append(
                f"""
[[providers]]
id = "echo"
type = "echo"
options = {{ token_delay = 0.005 }}
  [[providers.models]]
  name = "{MODEL}"
  slots = {slots}
"""
            )
        else:
            parts.append(
                f"""
[[providers]]
id = "{provider}"
type = "openai"
path = "normalized"
base_url = "{upstream_url}/v1"
options = {{ connect_timeout = 5, read_timeout = 30 }}
  [[providers.models]]
  name = "{MODEL}"
  served_name = "chaos-model"
  slots = {slots}
"""
            )
    return "".join(parts)


# ------------------------------------------------------------------------------ the plan


@attrs.frozen(kw_only=True)
class Plan:
    """What one client does."""

    index: int
    request_id: str
    stream: bool
    words: tuple[str, ...]
    token_delay: float
    leave: LeaveKind
    leave_after_s: float | None = None
    """``early``: close the connection this long after sending (before any token: the
    request asks for a slow first token)."""
    leave_after_words: int | None = None
    """``mid_stream``: close the connection once this many words have arrived."""
    context_words: int = 0
    """Words of a long system message before the user's (a long-context request: its
    ``run.request`` frame is megabytes, so writing it to the node takes a while)."""

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def prompt_words(self) -> int:
        """What echo and the fake upstream report as ``prompt_tokens``."""
        return self.context_words + len(self.words)

    def context(self) -> str:
        vocabulary = _VOCABULARY
        return " ".join(
            vocabulary[(self.index + i) % len(vocabulary)] for i in range(self.context_words)
        )

    def body(self) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        if self.context_words:
            messages.append({"role": "system", "content": self.context()})
        messages.append({"role": "user", "content": self.text})
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "stream": self.stream,
            "user": self.request_id,
            "echo": {"token_delay": self.token_delay},
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def make_plans(count: int, seed: int) -> list[Plan]:
    """``count`` requests, ~60% streamed:

    * ~12% leave early, at a random moment in the first 0.3 s: while queued, or dispatched
      and waiting for the first token (they ask for a 0.3 s delay before each token);
    * ~35% of the streams (~20% overall) leave mid-stream after a random number of words,
      with at least :data:`MID_STREAM_MARGIN` words (0.45 s) still to come, so the run cannot
      have finished at the edge when the client leaves (even a client lagging behind on a
      loaded machine); otherwise its row would rightly say ``completed``;
    * ~4% are long-context requests (a system message of 0.5-2 MB), half of which leave
      within 0.15 s -- possibly while their ``run.request`` is being written to the node;
    * the rest ask for 6-30 words at 2-8 ms each.
    """
    rng = random.Random(seed)
    plans = []
    for index in range(count):
        stream = rng.random() < 0.6
        roll = rng.random()
        request_id = f"chaos-{seed}-{index:05d}"
        common: dict[str, Any] = {"index": index, "request_id": request_id, "stream": stream}
        if roll < 0.12:
            plan = Plan(
                **common,
                words=tuple(rng.choices(_VOCABULARY, k=rng.randint(4, 8))),
                token_delay=0.3,
                leave="early",
                leave_after_s=rng.uniform(0.0, 0.3),
            )
        elif stream and roll < 0.12 + 0.35:
            words = rng.randint(MID_STREAM_MARGIN + 50, MID_STREAM_MARGIN + 120)
            plan = Plan(
                **{**common, "stream": True},
                words=tuple(rng.choices(_VOCABULARY, k=words)),
                token_delay=0.003,
                leave="mid_stream",
                leave_after_words=rng.randint(1, words - MID_STREAM_MARGIN),
            )
        elif roll > 0.96:
            leaves = rng.random() < 0.5
            plan = Plan(
                **common,
                words=tuple(rng.choices(_VOCABULARY, k=rng.randint(6, 12))),
                token_delay=0.3 if leaves else 0.005,
                leave="early" if leaves else "no",
                leave_after_s=rng.uniform(0.0, 0.15) if leaves else None,
                context_words=rng.randint(80_000, 320_000),
            )
        else:
            plan = Plan(
                **common,
                words=tuple(rng.choices(_VOCABULARY, k=rng.randint(6, 30))),
                token_delay=round(rng.uniform(0.002, 0.008), 4),
                leave="no",
            )
        plans.append(plan)
    return plans


# ------------------------------------------------------------------------------ clients


View = str
"""What a client saw: ``complete``, ``error_event``, ``left``, ``http_<status>``,
``truncated`` (a stream that ended with neither ``[DONE]`` nor an error event, or a 200
body that is cut or unparseable), ``wrong_content``, ``transport_error`` (no response at
all), ``hung``."""


@attrs.define(eq=False)
class Seen:
    """What one client saw, recorded as it happened."""

    plan: Plan
    started_at: float = 0.0
    """``time.time()`` when the request was sent."""
    ended_at: float = 0.0
    status: int | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    text: str = ""
    content_events: int = 0
    done: bool = False
    error: Any = None
    """The SSE error event's object, or the error body of a non-200 answer."""
    events_after_end: int = 0
    cut: str | None = None
    """Why the body broke off (a transport error after the response began)."""
    transport_error: str | None = None
    left: bool = False
    left_after_headers: bool = False
    usage: tuple[int, int] | None = None
    finish_reason: str | None = None
    body_error: str | None = None
    """A 200 non-streamed body that could not be understood."""
    hung: bool = False

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def words_received(self) -> int:
        return len(_WORD.findall(self.text))

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
        if self.status is None:
            return "transport_error"
        if self.status != 200:
            return f"http_{self.status}"
        if self.plan.stream:
            if self.error is not None and not self.done:
                return "error_event"
            if not self.done or self.cut is not None:
                return "truncated"
        elif self.cut is not None or self.body_error is not None:
            return "truncated"
        return "complete" if self.text == self.plan.text else "wrong_content"

    def describe(self) -> str:
        h = self.headers
        parts = [
            f"{self.request_id}: saw {self.view}",
            f"{'stream' if self.plan.stream else 'non-stream'}",
            f"leave={self.plan.leave}",
            f"status={self.status}",
            f"words {self.words_received}/{len(self.plan.words)}",
            f"done={self.done}",
        ]
        if h.get("x-dispatcher-node"):
            parts.append(
                f"served by {h.get('x-dispatcher-node')}/{h.get('x-dispatcher-provider')} "
                f"attempts={h.get('x-dispatcher-attempts')}"
            )
        if self.error is not None:
            parts.append(f"error={json.dumps(self.error)[:200]}")
        for name in ("cut", "transport_error", "body_error"):
            value = getattr(self, name)
            if value:
                parts.append(f"{name}={value}")
        parts.append(f"t={self.ended_at - self.started_at:.3f}s")
        return ", ".join(parts)


_T = TypeVar("_T")


@asynccontextmanager
async def _finished(
    response: httpx.Response, iterator: AsyncIterator[_T]
) -> AsyncIterator[AsyncIterator[_T]]:
    """``iterator`` (httpx's chain of async generators), closed properly however the block is
    left: close the response, then run the chain to its end (as the node did while its client
    was httpx's; otherwise Trio warns about suspended generators). Shielded and bounded."""
    try:
        yield iterator
    finally:
        with trio.move_on_after(DRAIN_BOUND, shield=True):
            await response.aclose()
            try:
                async for _ in iterator:
                    pass
            except Exception:  # the read on the closed connection fails: expected
                pass


class _Body(httpx.AsyncByteStream):
    """A request body that calls ``on_sent`` once httpx has written all of it (when it asks
    for more). Not an async generator, unlike httpx's own ``ByteStream``: a client cancelled
    while its body is being sent would leave one suspended, and Trio warns about that."""

    def __init__(self, data: bytes, on_sent: Callable[[], None]) -> None:
        self._data: bytes | None = data
        self._on_sent: Callable[[], None] | None = on_sent

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            on_sent, self._on_sent = self._on_sent, None
            if on_sent is not None:
                on_sent()
            raise StopAsyncIteration
        return data


@asynccontextmanager
async def _sent(client: httpx.AsyncClient, request: httpx.Request) -> AsyncIterator[httpx.Response]:
    """``client.stream`` for a prepared request: the response, closed when the block is left."""
    response = await client.send(request, stream=True)
    try:
        yield response
    finally:
        with trio.move_on_after(DRAIN_BOUND, shield=True):
            await response.aclose()


def _sse_events(buffer: bytearray) -> Iterator[str]:
    """Complete SSE events' ``data`` taken from the front of ``buffer``."""
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return
        raw = bytes(buffer[:end]).decode("utf-8", errors="replace")
        del buffer[: end + 2]
        data = [line[5:].removeprefix(" ") for line in raw.split("\n") if line.startswith("data:")]
        if data:
            yield "\n".join(data)


async def run_client(client: httpx.AsyncClient, plan: Plan) -> Seen:
    seen = Seen(plan)
    seen.started_at = time.time()
    finished_reading = False
    with trio.move_on_after(REQUEST_BOUND) as bound:
        with trio.CancelScope() as leave_scope:

            def sent() -> None:
                # an early leaver's clock starts once its whole request is on the wire
                if plan.leave_after_s is not None:
                    leave_scope.deadline = trio.current_time() + plan.leave_after_s

            try:
                data = orjson.dumps(plan.body())
                request = client.build_request(
                    "POST",
                    "/v1/chat/completions",
                    content=data,
                    headers={"x-request-id": plan.request_id, "content-type": "application/json"},
                )
                request.stream = _Body(data, sent)
                async with _sent(client, request) as response:
                    seen.status = response.status_code
                    seen.headers = {k.lower(): v for k, v in response.headers.items()}
                    try:
                        finished_reading = await _read_response(seen, response)
                    except httpx.HTTPError as exc:
                        seen.cut = f"{type(exc).__name__}: {exc}"
                        finished_reading = True
            except httpx.HTTPError as exc:
                if seen.status is None:
                    seen.transport_error = f"{type(exc).__name__}: {exc}"
                elif seen.cut is None:
                    seen.cut = f"{type(exc).__name__}: {exc}"
                finished_reading = True
        if leave_scope.cancelled_caught and not finished_reading:
            seen.left = True
            seen.left_after_headers = seen.status is not None
    if bound.cancelled_caught:
        seen.hung = True
    seen.ended_at = time.time()
    return seen


async def _read_response(seen: Seen, response: httpx.Response) -> bool:
    """Read the answer into ``seen``; True once read to its end, False when the client left
    (mid-stream, as planned)."""
    plan = seen.plan
    if response.status_code != 200 or not plan.stream:
        raw = bytearray()
        async with _finished(response, response.aiter_bytes()) as chunks:
            async for chunk in chunks:
                raw += chunk
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if response.status_code == 200:
                seen.body_error = f"not JSON ({exc}): {bytes(raw[:200])!r}"
            return True
        if response.status_code != 200:
            seen.error = body.get("error", body) if isinstance(body, dict) else body
            return True
        try:
            choice = body["choices"][0]
            seen.text = choice["message"]["content"] or ""
            seen.finish_reason = choice["finish_reason"]
            seen.usage = (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
        except (KeyError, IndexError, TypeError) as exc:
            seen.body_error = f"unexpected body ({exc!r}): {bytes(raw[:200])!r}"
        return True

    buffer = bytearray()
    async with _finished(response, response.aiter_bytes()) as chunks:
        async for chunk in chunks:
            buffer += chunk
            for data in _sse_events(buffer):
                if seen.done or seen.error is not None:
                    seen.events_after_end += 1
                    continue
                if data.strip() == "[DONE]":
                    seen.done = True
                    continue
                try:
                    event = orjson.loads(data)
                except orjson.JSONDecodeError:
                    seen.cut = f"an SSE event that is not JSON: {data[:200]!r}"
                    continue
                if "error" in event:
                    seen.error = event["error"]
                    continue
                usage = event.get("usage")
                if isinstance(usage, dict):
                    seen.usage = (usage["prompt_tokens"], usage["completion_tokens"])
                for choice in event.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        seen.text += content
                        seen.content_events += 1
                    if choice.get("finish_reason"):
                        seen.finish_reason = choice["finish_reason"]
            if (
                plan.leave_after_words is not None
                and not seen.done
                and seen.error is None
                and seen.words_received >= plan.leave_after_words
            ):
                seen.left = True
                seen.left_after_headers = True
                return False
    if buffer.strip():
        seen.cut = f"the body ended inside an SSE event: {bytes(buffer[:200])!r}"
    return True


# ------------------------------------------------------------------------------ the edge's log


JOINED = re.compile(r"node (\S+) \((.*)\) joined from (\S+), generation (\d+), models: (.*)$")
LEFT = re.compile(r"node (\S+) generation (\d+) left: (.*)$")
FAILED_BEFORE_COMMIT = re.compile(
    r"request (\S+) attempt (\d+) failed before commit: (.*) "
    r"\((retrying|giving up|not retryable)\)$"
)
NOT_SENT = re.compile(
    r"request (\S+) attempt (\d+) was not sent: (.*) \((retrying|falling back|giving up)\)$"
)


@attrs.frozen
class EdgeLog:
    """What the soak reads from the edge's stderr."""

    text: str
    joined: list[tuple[str, int, str]]
    """(node, generation, line)"""
    left: list[tuple[str, int, str, str]]
    """(node, generation, reason, line)"""
    failed_before_commit: dict[str, dict[int, str]]
    """request id -> attempt -> the log line"""
    not_sent: dict[str, dict[int, str]]
    """request id -> attempt -> the log line of an attempt whose request never went out"""

    @classmethod
    def parse(cls, text: str) -> EdgeLog:
        joined, left = [], []
        failed: dict[str, dict[int, str]] = {}
        not_sent: dict[str, dict[int, str]] = {}
        for line in text.splitlines():
            if "joined from" in line and (m := JOINED.search(line)):
                joined.append((m.group(1), int(m.group(4)), line))
            elif " left: " in line and (m := LEFT.search(line)):
                left.append((m.group(1), int(m.group(2)), m.group(3), line))
            elif "failed before commit" in line and (m := FAILED_BEFORE_COMMIT.search(line)):
                failed.setdefault(m.group(1), {})[int(m.group(2))] = line
            elif "was not sent" in line and (m := NOT_SENT.search(line)):
                not_sent.setdefault(m.group(1), {})[int(m.group(2))] = line
        return cls(text, joined, left, failed, not_sent)

    def generation(self, node_id: str) -> int | None:
        """The node's latest generation that joined."""
        generations = [g for n, g, _ in self.joined if n == node_id]
        return max(generations) if generations else None


# ------------------------------------------------------------------------------ the soak


@attrs.define(eq=False)
class Kill:
    node_id: str
    generation: int | None
    at_request: int
    at: float
    """``time.monotonic()`` of the SIGKILL."""
    at_wall: float = 0.0
    """``time.time()`` of the SIGKILL (rows' ``ended_at`` is wall-clock time)."""
    rejoined_generation: int | None = None
    rejoin_s: float | None = None


@attrs.define(eq=False)
class Topology:
    """The running processes and how to reach them."""

    procs: Processes
    workdir: Path
    edge: Proc
    upstream: Proc
    nodes: dict[str, Proc]
    base_url: str
    edge_url: str
    upstream_url: str
    node_configs: dict[str, Path]
    upstream_log: Path
    incarnations: dict[str, int] = attrs.field(factory=dict)

    def edge_log(self) -> EdgeLog:
        return EdgeLog.parse(self.edge.stderr())

    def restart_node(self, node_id: str) -> Proc:
        number = self.incarnations.get(node_id, 0) + 1
        self.incarnations[node_id] = number
        proc = self.procs.spawn(
            f"{node_id}.{number}",
            ["-m", "dispatcher", "node", "--config", str(self.node_configs[node_id])],
        )
        self.nodes[node_id] = proc
        return proc


async def start_topology(procs: Processes, workdir: Path, seed: int) -> Topology:
    upstream_log = workdir / "upstream-faults.jsonl"
    upstream = procs.spawn(
        "upstream",
        ["-m", "tests.chaos.upstream", "--seed", str(seed), "--log", str(upstream_log)],
    )
    edge_config = workdir / "edge.toml"
    edge_config.write_text(edge_toml(workdir / "usage.sqlite3"))
    edge = procs.spawn(
        "edge",
        ["-m", "dispatcher", "serve", "--config", str(edge_config), "--no-local-node"],
    )
    banner = await edge.wait_for_stdout(r"listening on (http://127\.0\.0\.1:\d+)/v1", 30)
    base_url = banner.group(1)
    edge_url = base_url.replace("http://", "ws://") + "/v1/nodes/connect"
    up = await upstream.wait_for_stdout(r"listening on (http://127\.0\.0\.1:\d+)", 30)
    upstream_url = up.group(1)
    topology = Topology(
        procs=procs,
        workdir=workdir,
        edge=edge,
        upstream=upstream,
        nodes={},
        base_url=base_url,
        edge_url=edge_url,
        upstream_url=upstream_url,
        node_configs={},
        upstream_log=upstream_log,
    )
    for node_id in NODES:
        path = workdir / f"{node_id}.toml"
        path.write_text(node_toml(node_id, edge_url, upstream_url))
        topology.node_configs[node_id] = path
        topology.incarnations[node_id] = -1
        topology.restart_node(node_id)
    with trio.move_on_after(30):
        while {n for n, _, _ in topology.edge_log().joined} != set(NODES):
            await trio.sleep(0.05)
    joined = {n for n, _, _ in topology.edge_log().joined}
    assert joined == set(NODES), (
        f"only {sorted(joined)} of {sorted(NODES)} joined the edge within 30 s; "
        f"edge stderr tail:\n{edge.stderr()[-3000:]}"
    )
    return topology


async def wait_rejoined(topology: Topology, kill: Kill, timeout: float = 20.0) -> None:
    """Wait (bounded) until the killed node's restart joined with a newer generation."""
    with trio.move_on_after(timeout):
        while True:
            generation = topology.edge_log().generation(kill.node_id)
            if generation is not None and generation > (kill.generation or 0):
                kill.rejoined_generation = generation
                kill.rejoin_s = time.monotonic() - kill.at
                return
            await trio.sleep(0.02)


@attrs.define(eq=False)
class SoakRun:
    """Everything the checks look at."""

    seed: int
    count: int
    concurrency: int
    kill_every: int
    plans: list[Plan]
    seen: list[Seen] = attrs.field(factory=list)
    kills: list[Kill] = attrs.field(factory=list)
    load_s: float = 0.0
    settle_s: float = 0.0
    settled: bool = False
    gauges_zero_s: float | None = None
    """Seconds from the last client's end until every gauge first read 0."""
    rss_before_kib: int | None = None
    rss_after_kib: int | None = None
    rss_peak_kib: int | None = None
    load_average: tuple[float, float] | None = None
    """The machine's 1-minute load average before and after the load."""
    rows: list[dict[str, Any]] = attrs.field(factory=list)
    index: RowIndex = attrs.field(factory=lambda: RowIndex({}, {}, {}, []))
    usage_totals: dict[str, Any] = attrs.field(factory=dict)
    usage_truncated: bool = False
    metrics: dict[str, list[tuple[dict[str, str], float]]] = attrs.field(factory=dict)
    edge_log: EdgeLog | None = None
    logs: dict[str, str] = attrs.field(factory=dict)
    """Every process's stderr, by incarnation name."""
    killed: set[str] = attrs.field(factory=set)
    """Incarnation names that were SIGKILLed on purpose."""
    upstream_requests: list[dict[str, Any]] = attrs.field(factory=list)
    readback_error: str | None = None
    """Why ``/metrics`` or ``GET /v1/usage`` could not be read at the end, if they could not."""
    exited: dict[str, int | None] = attrs.field(factory=dict)
    """Processes (not SIGKILLed on purpose) that were no longer running at the end: their
    exit status."""


async def run_load(topology: Topology, run: SoakRun) -> None:
    """Run every plan through ``run.concurrency`` clients; SIGKILL and restart a node after
    every ``run.kill_every`` requests sent."""
    sent = 0
    kill_requests: trio.MemorySendChannel[int]
    kill_requests, kill_queue = trio.open_memory_channel[int](math.inf)
    rotation = list(NODES)
    rng = random.Random(run.seed + 2)
    rng.shuffle(rotation)

    killer_done = trio.Event()

    async def killer() -> None:
        try:
            await kill_all()
        finally:
            killer_done.set()

    async def kill_all() -> None:
        async for at_request in kill_queue:
            node_id = rotation[len(run.kills) % len(rotation)]
            proc = topology.nodes[node_id]
            kill = Kill(node_id, topology.edge_log().generation(node_id), at_request, 0.0)
            kill.at, kill.at_wall = time.monotonic(), time.time()
            topology.procs.kill(proc)
            run.killed.add(proc.name)
            run.kills.append(kill)
            topology.restart_node(node_id)
            await wait_rejoined(topology, kill)

    async def worker(client: httpx.AsyncClient, plans: trio.MemoryReceiveChannel[Plan]) -> None:
        nonlocal sent
        async for plan in plans:
            sent += 1
            if run.kill_every and sent % run.kill_every == 0 and sent < run.count:
                kill_requests.send_nowait(sent)
            run.seen.append(await run_client(client, plan))

    async def sample_rss() -> None:
        while True:
            rss = topology.edge.rss_kib()
            if rss is not None:
                run.rss_peak_kib = max(run.rss_peak_kib or 0, rss)
            await trio.sleep(0.25)

    limits = httpx.Limits(
        max_connections=run.concurrency * 2, max_keepalive_connections=run.concurrency
    )
    timeout = httpx.Timeout(REQUEST_BOUND)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    async with (
        httpx.AsyncClient(base_url=topology.base_url, limits=limits, timeout=timeout) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(killer)
        nursery.start_soon(sample_rss)
        send, receive = trio.open_memory_channel[Plan](0)
        async with trio.open_nursery() as workers:
            for _ in range(run.concurrency):
                workers.start_soon(worker, client, receive.clone())
            receive.close()
            async with send:
                for plan in run.plans:
                    await send.send(plan)
        run.load_s = time.monotonic() - started
        run.load_average = (load_before, os.getloadavg()[0])
        kill_requests.close()
        with trio.move_on_after(30):  # the last restart's wait is bounded inside too
            await killer_done.wait()
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------ reading back


Metrics = dict[str, list[tuple[dict[str, str], float]]]
"""Samples by name: (labels, value)."""


async def scrape_metrics(client: httpx.AsyncClient) -> Metrics:
    response = await client.get("/metrics")
    response.raise_for_status()
    families: Metrics = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            families.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return families


async def fetch_usage(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/v1/usage", params={"model": MODEL, "limit": 10000})
    response.raise_for_status()
    report: dict[str, Any] = response.json()
    return report


def gauge_total(metrics: Metrics, name: str) -> float:
    return sum(value for _, value in metrics.get(name, []))


Row = dict[str, Any]
"""A ledger row as ``GET /v1/usage`` lists it."""


@attrs.frozen
class RowIndex:
    """The ledger rows by the client they belong to. A row belongs to the client whose own
    id it carries: ``client_request_id`` (ledger schema 2, where the edge makes up the key)
    or, when that is absent, its key ``request_id`` (the edge keys rows by the client's
    ``x-request-id``). The edge logs attempts by the key; ``edge_ids`` maps keys back."""

    by_client: dict[str, list[Row]]
    """Client request id -> its rows, by attempt."""
    edge_ids: dict[str, str]
    """Ledger key -> client request id."""
    failed: dict[str, dict[int, str]]
    """Client request id -> attempt -> the edge's "failed before commit" log line."""
    unmapped: list[str]
    """"failed before commit" lines of a key that no row and no client has."""

    @classmethod
    def build(cls, client_ids: set[str], rows: list[Row], log: EdgeLog) -> RowIndex:
        by_client: dict[str, list[Row]] = {}
        edge_ids: dict[str, str] = {}
        for row in rows:
            client = client_id_of(row, client_ids)
            by_client.setdefault(client, []).append(row)
            edge_ids.setdefault(row["request_id"], client)
        for client_rows in by_client.values():
            client_rows.sort(key=lambda r: r["attempt"])
        failed: dict[str, dict[int, str]] = {}
        unmapped: list[str] = []
        for key, attempts in log.failed_before_commit.items():
            owner = edge_ids.get(key) or (key if key in client_ids else None)
            if owner is None:
                unmapped += attempts.values()
            else:
                failed.setdefault(owner, {}).update(attempts)
        return cls(by_client, edge_ids, failed, unmapped)


def client_id_of(row: Row, client_ids: set[str]) -> str:
    """The client's own id of ``row`` (see :class:`RowIndex`)."""
    own = row.get("client_request_id")
    if isinstance(own, str) and own in client_ids:
        return own
    return str(row["request_id"])


def expected_rows_present(run: SoakRun, rows: list[Row], log: EdgeLog) -> bool:
    """Every row the clients and the edge's log say must exist is there (the settle test)."""
    index = RowIndex.build({s.request_id for s in run.seen}, rows, log)
    if index.unmapped:
        return False
    for seen in run.seen:
        attempts = {r["attempt"] for r in index.by_client.get(seen.request_id, [])}
        if set(index.failed.get(seen.request_id, {})) - attempts:
            return False
        if seen.attempts is not None and seen.attempts not in attempts:
            return False
    return True


async def settle(topology: Topology, run: SoakRun, bound: float = 40.0) -> None:
    """Wait (bounded) until the gauges are back to 0, every row that must exist exists, and
    the row count has not moved for 2 s; then read everything back into ``run``. An edge
    that cannot be read is recorded (``run.readback_error``), not raised: the checks then
    say what is missing."""
    started = time.monotonic()
    stable_since: float | None = None
    last_attempts = -1
    report: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=topology.base_url, timeout=30) as client:
        with trio.move_on_after(bound):
            while topology.edge.running:
                try:
                    metrics = await scrape_metrics(client)
                    report = await fetch_usage(client)
                except httpx.HTTPError as exc:
                    run.readback_error = f"{type(exc).__name__}: {exc}"
                    await trio.sleep(0.25)
                    continue
                attempts = report["totals"]["attempts"]
                now = time.monotonic()
                if attempts != last_attempts:
                    last_attempts, stable_since = attempts, now
                gauges_zero = all(gauge_total(metrics, g) == 0 for g in GAUGES)
                if gauges_zero and run.gauges_zero_s is None:
                    run.gauges_zero_s = now - started
                if (
                    gauges_zero
                    and stable_since is not None
                    and now - stable_since >= 2.0
                    and expected_rows_present(run, report["rows"], topology.edge_log())
                ):
                    run.settled = True
                    break
                await trio.sleep(0.25)
        run.settle_s = time.monotonic() - started
        try:
            run.metrics = await scrape_metrics(client)
            report = await fetch_usage(client)
            run.readback_error = None
        except httpx.HTTPError as exc:
            run.readback_error = f"{type(exc).__name__}: {exc}"
    run.rows = report.get("rows", [])
    run.edge_log = topology.edge_log()
    run.index = RowIndex.build({s.request_id for s in run.seen}, run.rows, run.edge_log)
    run.usage_totals = report.get("totals", {})
    run.usage_truncated = bool(report.get("truncated"))
    run.rss_after_kib = topology.edge.rss_kib()
    run.logs = {p.name: p.stderr() for p in topology.procs.procs}
    run.exited = {
        p.name: p.popen.returncode
        for p in topology.procs.procs
        if not p.killed and p.popen.poll() is not None
    }
    run.upstream_requests = [
        json.loads(line) for line in topology.upstream_log.read_text().splitlines() if line.strip()
    ]
