"""Processes of the ``peer``, ``streams``, ``store`` and ``cluster`` sections: the real
daemons and the client.

* :func:`edge_daemon` -- ``python -m dispatcher serve --config edge.toml --no-local-node
  --port 0`` (the port is read from its banner);
* :func:`node_daemon` -- ``python -m dispatcher node --config node.toml``, yielded once the
  edge (each edge, for a node serving several) lists every wanted model;
* :func:`client_process` -- ``python -m bench._client``, driven with one JSON line per
  command (:class:`Client`);
* :func:`litellm_proxy` -- ``litellm --config litellm.yaml --port P`` when it is installed.

Every one of them starts through ``python -m bench._nofile`` (RLIMIT_NOFILE soft = hard, then
exec: the pid is the daemon's) and runs under ``trio.run_process`` in a nursery: leaving the
block sends SIGTERM, then SIGKILL after 5 s, and waits. stderr goes to a temporary file
(``ServerProcess.stderr_tail``), from which :func:`log_notes` reports warnings.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import trio

from bench._load import HOST, REPO_ROOT, LoadError, ServerDidNotStart, ServerProcess
from bench.edge_bench import wait_for_models

BANNER = re.compile(rb"listening on https?://[^\s:]+:(\d+)/v1")


def _wrapped(argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "bench._nofile", *argv]


def free_port() -> int:
    """A port nothing listens on right now (for programs that cannot be told port 0)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    """Read and drop what a child writes on stdout, so its pipe never fills."""
    while await stream.receive_some(65536):
        pass


@asynccontextmanager
async def _daemon(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    banner: re.Pattern[bytes] | None = None,
    start_timeout: float = 30.0,
) -> AsyncIterator[tuple[ServerProcess, trio.Process]]:
    """Run ``argv`` until the block ends. With ``banner``, wait for that pattern on stdout;
    its first group is the port."""
    with tempfile.TemporaryFile() as err:
        async with trio.open_nursery() as nursery:
            proc: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    _wrapped(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    check=False,
                    cwd=REPO_ROOT,
                    env={**os.environ, **(env or {})},
                )
            )
            try:
                server = ServerProcess(name, proc.pid, 0, err)
                assert proc.stdout is not None
                if banner is not None:
                    buf = b""
                    with trio.move_on_after(start_timeout):
                        while not (found := banner.search(buf)):
                            data = await proc.stdout.receive_some(4096)
                            if not data:
                                break
                            buf += data
                    if not found:
                        raise ServerDidNotStart(
                            f"{name} did not start (exit {proc.poll()}): "
                            + (server.stderr_tail(2) or "no output")
                        )
                    server.port = int(found.group(1))
                nursery.start_soon(_drain, proc.stdout)
                yield server, proc
            finally:
                nursery.cancel_scope.cancel()
        _keep_log(name, err)


def _keep_log(name: str, err: Any) -> None:
    """With ``BENCH_LOG_DIR`` set, the process's whole stderr is kept there as
    ``<name>-<pid>.log`` (to read why something broke; the tables only quote warnings)."""
    folder = os.environ.get("BENCH_LOG_DIR")
    if not folder:
        return
    err.seek(0)
    path = Path(folder) / f"{name}-{os.getpid()}-{id(err)}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(err.read())


@asynccontextmanager
async def edge_daemon(edge_toml: str, *, log_level: str = "INFO") -> AsyncIterator[ServerProcess]:
    """``dispatcher serve`` with this config (written to a temporary file, whose directory
    ``{tmp}`` in the text names: the usage ledger goes there)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "edge.toml"
        config.write_text(edge_toml.replace("{tmp}", tmp))
        argv = [sys.executable, "-m", "dispatcher", "--log-level", log_level, "serve"]
        argv += ["--config", str(config), "--no-local-node", "--port", "0"]
        async with _daemon("edge", argv, banner=BANNER) as (server, _):
            yield server


@asynccontextmanager
async def node_daemon(
    edge_port: int | Sequence[int],
    node_toml: str,
    models: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log_level: str = "INFO",
    headers: str = "",
) -> AsyncIterator[ServerProcess]:
    """``dispatcher node`` with this config; yielded once the edge lists all ``models``
    (asked with ``headers``: extra header lines, a client key when the edge wants one).
    Several edge ports (a node serving several edges, ``[node] edges``): once every one of
    those edges lists them."""
    edge_ports = [edge_port] if isinstance(edge_port, int) else list(edge_port)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "node.toml"
        config.write_text(node_toml)
        argv = [sys.executable, "-m", "dispatcher", "--log-level", log_level, "node"]
        argv += ["--config", str(config)]
        async with _daemon("node", argv, env=env) as (node, proc):
            try:
                with trio.fail_after(30):
                    for port in edge_ports:
                        await wait_for_models(
                            port,
                            lambda listed: all(model in listed for model in models),
                            alive=lambda: proc.poll() is None,
                            headers=headers,
                        )
            except (trio.TooSlowError, ServerDidNotStart):
                raise ServerDidNotStart(
                    f"node did not join (exit {proc.poll()}): {node.stderr_tail(3)}"
                ) from None
            yield node


def litellm_executable() -> str | None:
    """The ``litellm`` command of this environment (or on PATH), None when not installed."""
    beside = Path(sys.executable).parent / "litellm"
    if beside.exists():
        return str(beside)
    return shutil.which("litellm")


LITELLM_YAML = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{served}
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: sk-bench-upstream
litellm_settings:
  drop_params: true
  telemetry: false
general_settings:
  master_key: {master_key}
"""
LITELLM_MASTER_KEY = "sk-bench-0f3a9c27e1d84b6a95c03e7d2b1f8a64"
"""The proxy refuses to start without a strong master key; clients send it as their key."""


@asynccontextmanager
async def litellm_proxy(
    executable: str, upstream_port: int, *, model: str, served: str, start_timeout: float = 180.0
) -> AsyncIterator[ServerProcess]:
    """The LiteLLM proxy (its default: one worker) routing ``model`` to the fake upstream;
    yielded once ``GET /health/liveliness`` answers 200."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "litellm.yaml"
        config.write_text(
            LITELLM_YAML.format(
                model=model,
                served=served,
                upstream_port=upstream_port,
                master_key=LITELLM_MASTER_KEY,
            )
        )
        port = free_port()
        argv = [executable, "--config", str(config), "--host", HOST, "--port", str(port)]
        env = {
            # no network: the bundled cost map, no telemetry
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "LITELLM_LOG": "ERROR",
            "DISABLE_SCHEMA_UPDATE": "True",
        }
        async with _daemon("litellm", argv, env=env) as (proxy, proc):
            proxy.port = port
            with trio.move_on_after(start_timeout):
                while proc.poll() is None:
                    if await _status(port, "/health/liveliness") == 200:
                        break
                    await trio.sleep(0.25)
            if await _status(port, "/health/liveliness") != 200:
                raise ServerDidNotStart(
                    f"litellm did not start (exit {proc.poll()}): {proxy.stderr_tail(3)}"
                )
            yield proxy


async def _status(port: int, target: str) -> int:
    """The status of a GET on a fresh connection; 0 when nothing answers."""
    try:
        with trio.fail_after(5):
            stream = await trio.open_tcp_stream(HOST, port)
            async with stream:
                await stream.send_all(
                    f"GET {target} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
                )
                data = b""
                while b"\r\n" not in data:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return 0
                    data += chunk
                return int(data[9:12])
    except (OSError, trio.TooSlowError, ValueError, trio.BrokenResourceError):
        return 0


class Client:
    """The client process: :meth:`call` sends one command and returns its answer."""

    def __init__(self, proc: trio.Process, server: ServerProcess) -> None:
        self.proc = proc
        self.server = server
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def call(self, command: Mapping[str, Any], *, timeout: float = 180.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        await self.proc.stdin.send_all(orjson.dumps(command) + b"\n")
        with trio.fail_after(timeout):
            while b"\n" not in self._buf:
                data = await self.proc.stdout.receive_some(1 << 20)
                if not data:
                    raise LoadError(
                        f"the client process exited ({self.proc.poll()}): "
                        + self.server.stderr_tail(3)
                    )
                self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        answer: dict[str, Any] = orjson.loads(line)
        if "error" in answer:
            raise LoadError(f"client: {answer['error']}")
        return answer


@asynccontextmanager
async def client_process() -> AsyncIterator[Client]:
    """``python -m bench._client`` until the block ends (end of input, then SIGTERM)."""
    with tempfile.TemporaryFile() as err:
        async with trio.open_nursery() as nursery:
            proc: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    _wrapped([sys.executable, "-m", "bench._client"]),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    check=False,
                    cwd=REPO_ROOT,
                )
            )
            try:
                yield Client(proc, ServerProcess("client", proc.pid, 0, err))
            finally:
                assert proc.stdin is not None
                with trio.move_on_after(1):
                    await proc.stdin.aclose()
                nursery.cancel_scope.cancel()


def log_notes(process: ServerProcess, *, keep: int = 1) -> list[str]:
    """A note when a process logged warnings or errors (its stderr), naming the last ones."""
    lines = process.stderr_tail(100_000).splitlines()
    bad = [
        line
        for line in lines
        if "WARNING" in line or "ERROR" in line or "Traceback" in line or "CRITICAL" in line
    ]
    if not bad:
        return []
    last = "; ".join(line[:200] for line in bad[-keep:])
    return [f"{process.name} process logged {len(bad)} warning/error line(s); last: {last}"]


def matching_lines(process: ServerProcess, needles: Sequence[str], *, keep: int = 3) -> list[str]:
    """The first ``keep`` lines of the process's stderr containing any of ``needles``."""
    found = [
        line[:240]
        for line in process.stderr_tail(1_000_000).splitlines()
        if any(needle in line for needle in needles)
    ]
    return found[:keep]


def count_lines(process: ServerProcess, needle: str) -> int:
    """How many lines of the process's stderr contain ``needle``."""
    return sum(needle in line for line in process.stderr_tail(1_000_000).splitlines())
