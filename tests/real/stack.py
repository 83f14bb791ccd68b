"""The real stack: a ``llama-server`` on 127.0.0.1, and an edge and a node (``python -m
dispatcher serve`` / ``node``, this working tree's code) in front of it, the node serving the
same engine twice:

* ``smol-tunnel`` -- provider ``engine-tunnel``, ``type = "openai"``, ``path = "tunnel"``: the
  client's HTTP request relayed to the engine;
* ``smol-normalized`` -- provider ``engine-normalized``, ``type = "openai"``, normalized: the
  node's adapter calls the engine and the edge renders its events.

:class:`Stack` owns the three children (SIGTERM, then SIGKILL after a bound, always reaped)
and their logs (``<workdir>/<name>.log``, the tail quoted when something does not come up).
Nothing here waits without a bound.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]

TUNNEL = "smol-tunnel"
NORMALIZED = "smol-normalized"
MODELS = (TUNNEL, NORMALIZED)

CONTEXT = 2048
"""The engine's context per slot (``-c`` over ``-np``): small, so that an overflowing prompt
is quick to build and quick for the engine to refuse."""

PARALLEL = 2
"""The engine's slots (``-np``); the node gives each model one, so the two never queue."""

START_TIMEOUT = 120.0
TERM_GRACE = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@attrs.define(eq=False)
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.name} ({self.log}) ---\n{self.text()[-chars:]}"

    @property
    def running(self) -> bool:
        return self.popen.poll() is None


SLOT_EVENT = re.compile(rb"\bid +(\d+) \| task (\d+) \| (processing task|stop processing)")
"""llama-server's log lines for a slot taking a task (``slot launch_slot_: id  1 | task 348 |
processing task``) and releasing it (``slot      release: id  1 | task 348 | stop processing:
n_tokens = 193, ...``)."""


@attrs.define(eq=False)
class EngineLog:
    """The engine's slots as its log tells them, read without asking the engine.

    Why not ``GET /slots`` (or ``/metrics``) while waiting for the engine to notice a client
    leaving: llama-server looks at a non-streamed request's socket only when its HTTP thread
    has waited a whole second for that request's result, and every result it sends for any
    other task -- each ``GET /slots`` and ``/metrics`` is one, so is each token another slot
    streams -- wakes that thread and starts the second again (``server_response::
    recv_with_timeout``). Polled every 50 ms, the engine never notices a client that left a
    non-streamed request, whichever way it came (issue #21). Its log costs it nothing."""

    path: Path
    busy: dict[int, int] = attrs.field(factory=dict)
    """Slot id -> the task it is processing."""
    launched: list[tuple[int, int]] = attrs.field(factory=list)
    """Every (slot, task) the engine began, in order."""
    released: dict[int, int] = attrs.field(factory=dict)
    """Task -> ``n_tokens`` (prompt and generated) its slot held when it stopped."""
    _offset: int = 0
    _partial: bytes = b""

    def read(self) -> EngineLog:
        """Take in what the engine logged since the last read."""
        with self.path.open("rb") as log:
            log.seek(self._offset)
            data = log.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            match = SLOT_EVENT.search(line)
            if match is None:
                continue
            slot, task = int(match.group(1)), int(match.group(2))
            if match.group(3) == b"processing task":
                self.busy[slot] = task
                self.launched.append((slot, task))
            else:
                if self.busy.get(slot) == task:
                    del self.busy[slot]
                tokens = re.search(rb"n_tokens = (\d+)", line)
                self.released[task] = int(tokens.group(1)) if tokens else -1
        return self


@attrs.define(eq=False)
class Stack:
    workdir: Path
    engine_url: str = ""
    """The engine's root, e.g. ``http://127.0.0.1:41234`` (its API under ``/v1``)."""
    edge_url: str = ""
    children: list[Child] = attrs.field(factory=list)
    engine_log: EngineLog | None = None

    @property
    def engine(self) -> Child:
        return self.children[0]

    @property
    def log(self) -> EngineLog:
        """The engine's log, read up to now."""
        assert self.engine_log is not None, "the engine is not started"
        return self.engine_log.read()

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.workdir / f"{name}.log"
        child_env = {**os.environ, **(env or {})}
        child_env.pop("PYTHONWARNINGS", None)
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
            )
        child = Child(name, popen, log)
        self.children.append(child)
        return child

    def close(self) -> None:
        """Stop every child still running, the node first (SIGTERM; SIGKILL after
        :data:`TERM_GRACE`), and reap them all."""
        for child in reversed(self.children):
            if not child.running:
                continue
            try:
                child.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                child.popen.wait(timeout=TERM_GRACE)
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait(timeout=10)

    def diagnostics(self) -> str:
        return "\n".join(child.tail() for child in self.children)


def _wait(what: str, stack: Stack, child: Child, probe: Any, timeout: float) -> Any:
    """Call ``probe()`` until it returns something truthy; fail with the logs if ``child``
    exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.running:
            break
        try:
            result = probe()
        except (httpx.HTTPError, OSError):
            result = None
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(
        f"{what}: not within {timeout:g} s (exit status {child.popen.poll()})\n"
        + stack.diagnostics()
    )


def start_engine(
    stack: Stack,
    engine: str,
    model: str,
    template: str | None,
    *,
    cache_prompt: bool = False,
    parallel: int = PARALLEL,
    alias: str | None = None,
    context: int = CONTEXT,
    threads: int | None = None,
    extra: Sequence[str] = (),
    name: str = "llama-server",
) -> None:
    """``llama-server`` with the model, CPU only, ``/slots`` and ``/metrics`` on, and a ChatML
    chat template: ``template`` (a file: the nox session gives one of llama.cpp's bundled
    templates that renders tool definitions), else llama.cpp's built-in ``chatml``. (With the
    model's own template llama-server silently drops tool definitions.) ``cache_prompt``: the
    engine keeps each slot's prompt and reuses its prefix (off by default: see below);
    ``parallel`` slots of ``context`` tokens each; ``alias``: the model name the engine
    answers with (``--alias``; without it, its ``/v1/messages`` names the GGUF file's path);
    ``threads`` (default ``DISPATCHER_REAL_THREADS``, else 2); ``extra`` arguments; ``name``
    its log's. Another engine started on the same stack becomes ``stack.engine_url`` (read it
    after each)."""
    port = free_port()
    if threads is None:
        threads = int(os.environ.get("DISPATCHER_REAL_THREADS", "2"))
    argv = [
        engine,
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--ctx-size", str(context * parallel),
        "--parallel", str(parallel),
        "--threads", str(threads),
        "--jinja",
        *(["--chat-template-file", template] if template else ["--chat-template", "chatml"]),
        # Every prompt evaluated whole: a prompt served partly from the cache is evaluated
        # in other batch shapes, whose last bits differ, and at temperature 0 one close call
        # between two tokens then makes the direct and the edge's answers part ways.
        *([] if cache_prompt else ["--no-cache-prompt"]),
        *(["--alias", alias] if alias else []),
        "--metrics",
        "--slots",
        "--no-webui",
        *extra,
    ]  # fmt: skip
    engine_child = stack.spawn(name, argv)
    stack.engine_url = f"http://127.0.0.1:{port}"
    stack.engine_log = EngineLog(engine_child.log)

    def healthy() -> bool:
        return httpx.get(f"{stack.engine_url}/health", timeout=2).status_code == 200

    _wait(f"{name} /health", stack, engine_child, healthy, START_TIMEOUT)


EDGE_TOML = """\
host = "127.0.0.1"
port = 0
local_node = false
data_dir = "{data}"
expose_node_ids = true

[admission]
request_timeout_s = 300.0
first_token_timeout_s = 120.0
stall_timeout_s = 120.0
"""

NODE_TOML = """\
[node]
id = "real-node"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"
reconnect_min_backoff = 0.2
reconnect_max_backoff = 1

[[providers]]
id = "engine-tunnel"
type = "openai"
path = "tunnel"
base_url = "{engine}/v1"

  [[providers.models]]
  name = "{tunnel}"
  served_name = "smollm2"
  slots = 1
  capabilities = ["tools"]

[[providers]]
id = "engine-normalized"
type = "openai"
path = "normalized"
base_url = "{engine}/v1"

  [[providers.models]]
  name = "{normalized}"
  served_name = "smollm2"
  slots = 1
  capabilities = ["tools"]
"""
# No context_window: the edge would refuse an overflowing prompt itself, from its estimate;
# the engine is the one that must refuse it here, and the edge relay that as a 400.

LISTENING = re.compile(r"edge listening on http://127\.0\.0\.1:(\d+)/v1")


def start_edge(stack: Stack, edge_toml: str) -> None:
    """An edge process with the config ``edge_toml`` (``port = 0``): once its banner says
    where it listens, ``stack.edge_url``."""
    path = stack.workdir / "edge.toml"
    path.write_text(edge_toml)
    edge = stack.spawn("edge", [sys.executable, "-m", "dispatcher", "serve", "--config", str(path)])

    def listening() -> int | None:
        match = LISTENING.search(edge.text())
        return int(match.group(1)) if match else None

    port: int = _wait("the edge's banner", stack, edge, listening, START_TIMEOUT)
    stack.edge_url = f"http://127.0.0.1:{port}"


def start_node(
    stack: Stack,
    node_toml: str,
    models: Collection[str],
    *,
    name: str = "node",
    ready: Callable[[], bool] | None = None,
) -> None:
    """A node process with the config ``node_toml`` (kept as ``<name>.toml``); returns once
    the edge is ready and serves every one of ``models`` (or once ``ready()`` says so)."""
    path = stack.workdir / f"{name}.toml"
    path.write_text(node_toml)
    node = stack.spawn(name, [sys.executable, "-m", "dispatcher", "node", "--config", str(path)])

    def serving() -> bool:
        answer = httpx.get(f"{stack.edge_url}/readyz", timeout=2)
        return answer.status_code == 200 and set(models) <= set(answer.json()["models"])

    _wait("the edge ready with the node's models", stack, node, ready or serving, START_TIMEOUT)


def start_edge_and_node(stack: Stack) -> None:
    data = stack.workdir / "edge-data"
    data.mkdir()
    start_edge(stack, EDGE_TOML.format(data=data))
    port = stack.edge_url.rpartition(":")[2]
    node_toml = NODE_TOML.format(
        edge_port=port, engine=stack.engine_url, tunnel=TUNNEL, normalized=NORMALIZED
    )
    start_node(stack, node_toml, MODELS)


def slots(stack: Stack) -> list[dict[str, Any]]:
    """The engine's ``GET /slots``."""
    answer = httpx.get(f"{stack.engine_url}/slots", timeout=5)
    answer.raise_for_status()
    result: list[dict[str, Any]] = answer.json()
    return result


def busy_slots(stack: Stack) -> list[int]:
    return [int(slot["id"]) for slot in slots(stack) if slot.get("is_processing")]


def tokens_predicted(stack: Stack) -> int:
    """The engine's ``llamacpp:tokens_predicted_total`` (a cancelled task counts its tokens)."""
    metrics = httpx.get(f"{stack.engine_url}/metrics", timeout=5).text
    for line in metrics.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total "):
            return int(float(line.split()[1]))
    raise AssertionError(f"no tokens_predicted_total in the engine's /metrics:\n{metrics}")


CANCEL_BOUND = 20.0
"""Seconds the engine gets to see the client gone and free its slot."""


def seconds_until_idle(stack: Stack, since: float, bound: float = CANCEL_BOUND) -> float:
    """Wait until the engine's log shows no slot processing (:class:`EngineLog`: the engine
    is not asked, which would keep it from noticing a client gone); the seconds from
    ``since`` (``time.monotonic()``). Fails past ``bound``."""
    while busy := stack.log.busy:
        elapsed = time.monotonic() - since
        assert elapsed < bound, (
            f"the engine is still generating {elapsed:.1f} s after the client left "
            f"(slot -> task: {busy})\n" + stack.diagnostics()
        )
        time.sleep(0.01)
    return time.monotonic() - since
