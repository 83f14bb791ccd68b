"""Several edges as users run them: ``dispatcher serve`` processes (each with a ``dispatcher
node`` process dialling it) sharing one real ``redis-server`` and one real PostgreSQL
database, clients with the official openai SDK. :func:`open_cluster` owns every process it
starts and every server: leaving it stops them all.

Each node serves the model ``echo`` twice: provider ``flaky`` fails every attempt before its
first token (retryable), provider ``steady`` answers. So a good share of the requests are
*recovered* (their first attempt fails on ``flaky``, the next answers on ``steady``) -- every
count below must still count each request once.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import attrs
import httpx
import openai

from tests.chaos.processes import Proc, Processes, tracebacks
from tests.store import postgres_server
from tests.store.redis_server import RedisServer, own_server

Backend = Literal["shared", "memory"]
"""``shared``: ``[store]`` names the Redis and the PostgreSQL; ``memory``: every edge keeps
its own limits in memory and its own SQLite ledger (what the tests show failing)."""

START_BOUND = 30.0
ADMIN_KEY = "admin-cluster"
HOLD_LEASE = 3.0
"""``[store] hold_lease_s`` of the test edges: a SIGKILLed edge's holds return within this."""

WORDS = "alpha beta gamma delta epsilon"
TOKENS = 10
"""What one request of :data:`WORDS` bills: echo counts 5 prompt words and 5 answered."""


@attrs.frozen
class Tenant:
    id: str
    limits: dict[str, float]

    @property
    def key(self) -> str:
        return f"sk-{self.id}"

    def toml(self) -> str:
        fields = "".join(f"{name} = {value!r}\n" for name, value in self.limits.items())
        return f'[[keys]]\nid = "{self.id}"\nkey = "{self.key}"\n{fields}'


@attrs.define(eq=False)
class Edge:
    name: str
    config: Path
    proc: Proc
    port: int = 0
    node: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str, *, retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=key, max_retries=retries, timeout=60
        )

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=30, **kwargs)


@attrs.define(eq=False)
class Cluster:
    backend: Backend
    place: Path
    processes: Processes
    tenants: tuple[Tenant, ...]
    redis: RedisServer | None
    database_url: str | None
    edges: list[Edge] = attrs.field(factory=list)
    store: dict[str, Any] = attrs.field(factory=dict)

    def edge_toml(self, name: str) -> str:
        data = self.place / name
        lines = [
            "local_node = false",
            f'data_dir = "{data}"',
            f'admin_keys = ["{ADMIN_KEY}"]',
            "[nodes]\nheartbeat_interval = 1\nheartbeat_timeout = 5",
            '[prices."echo"]\ninput_per_mtok = 1000000.0\noutput_per_mtok = 1000000.0',
        ]
        if self.backend == "shared":
            assert self.redis is not None
            assert self.database_url is not None
            store = {
                "redis_url": self.redis.url,
                "database_url": self.database_url,
                "hold_lease_s": HOLD_LEASE,
                "edge_id": name,
                **self.store,
            }
            body = "".join(f"{k} = {_toml(v)}\n" for k, v in store.items())
            lines.append(f"[store]\n{body}")
        lines.extend(tenant.toml() for tenant in self.tenants)
        return "\n".join(lines) + "\n"

    def start_edge(self, name: str) -> Edge:
        config = self.place / f"{name}.toml"
        config.write_text(self.edge_toml(name))
        proc = self.processes.spawn(
            name, ["-m", "dispatcher", "serve", "--config", str(config), "--port", "0"]
        )
        edge = Edge(name, config, proc)
        edge.port = int(wait_for_line(proc, r"listening on http://127\.0\.0\.1:(\d+)/v1"))
        node_config = self.place / f"{name}-node.toml"
        node_config.write_text(NODE_TOML.format(id=f"node-{name}"))
        edge.node = self.processes.spawn(
            f"{name}-node",
            [
                "-m", "dispatcher", "node", "--config", str(node_config),
                "--edge", f"ws://127.0.0.1:{edge.port}/v1/nodes/connect",
            ],
        )  # fmt: skip
        wait_until(lambda: _serves_echo(edge), f"{name} serves echo")
        self.edges.append(edge)
        return edge

    def kill(self, edge: Edge) -> None:
        """SIGKILL the edge (its node is left to reconnect or be stopped at the end)."""
        self.processes.kill(edge.proc)
        self.edges.remove(edge)

    def stop(self, edge: Edge) -> None:
        """SIGTERM the edge and wait for it to drain and exit."""
        edge.proc.popen.send_signal(signal.SIGTERM)
        edge.proc.popen.wait(timeout=30)
        self.edges.remove(edge)


NODE_TOML = """\
[node]
id = "{id}"
[[providers]]
id = "flaky"
type = "echo"
options = {{ fail_before_first_token = true }}
  [[providers.models]]
  name = "echo"
  slots = 64
[[providers]]
id = "steady"
type = "echo"
  [[providers.models]]
  name = "echo"
  slots = 64
"""


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _serves_echo(edge: Edge) -> bool:
    try:
        answer = httpx.get(
            f"{edge.url}/v1/models", headers={"authorization": "Bearer sk-probe"}, timeout=5
        )
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and any(
        model["id"] == "echo" for model in answer.json().get("data", ())
    )


def wait_until(check: Callable[[], bool], what: str, bound: float = START_BOUND) -> None:
    deadline = time.monotonic() + bound
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {bound} s: {what}")
        time.sleep(0.1)


def wait_for_line(proc: Proc, pattern: str, bound: float = START_BOUND) -> str:
    """The first group of ``pattern`` once ``proc``'s stdout has it."""
    regex = re.compile(pattern, re.MULTILINE)
    deadline = time.monotonic() + bound
    while (match := regex.search(proc.stdout())) is None:
        if not proc.running or time.monotonic() > deadline:
            raise AssertionError(
                f"{proc.name} did not print {pattern!r} (exit status {proc.popen.poll()}); "
                f"stderr tail:\n{proc.stderr()[-3000:]}"
            )
        time.sleep(0.05)
    return match.group(1)


def new_database() -> str:
    """A database of its own on the session's PostgreSQL server: its URL."""
    import psycopg

    server = postgres_server.server_url()
    name = "cluster_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.rsplit("/", 1)[0] + f"/{name}"


@contextlib.contextmanager
def open_cluster(
    place: Path,
    backend: Backend,
    tenants: tuple[Tenant, ...],
    *,
    edges: int = 2,
    store: dict[str, Any] | None = None,
) -> Iterator[Cluster]:
    """``edges`` edges (``edge-a``, ``edge-b``, ...) each with its node, on ``backend``."""
    with contextlib.ExitStack() as stack:
        redis: RedisServer | None = None
        database: str | None = None
        if backend == "shared":
            redis = stack.enter_context(own_server())
            database = new_database()
        processes = Processes(place)
        stack.callback(processes.close)
        probe = Tenant("probe", {})  # no limits: what the harness asks with
        cluster = Cluster(backend, place, processes, (probe, *tenants), redis, database)
        cluster.store.update(store or {})
        for index in range(edges):
            cluster.start_edge(f"edge-{chr(ord('a') + index)}")
        yield cluster


def tracebacks_of(cluster: Cluster) -> list[str]:
    """Tracebacks any edge or node printed (none expected)."""
    found: list[str] = []
    for proc in cluster.processes.procs:
        found.extend(f"{proc.name}: {tb}" for tb in tracebacks(proc.stderr()))
    return found
