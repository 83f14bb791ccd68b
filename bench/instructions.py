"""CPU instructions per request on the real path, each process measured on its own, per path.

``python -m bench.instructions [--requests N] [--cells CELL ...] [--process edge node]
[--limits unlimited memory redis] [TREE ...]`` (default: this checkout, every cell, both
processes, the open edge). For each tree (a checkout of this
repository: compare a commit with ``git worktree add``) and each of the two processes of the
real path -- the edge (``python -m bench._edge_server edge``) and a real node
(``python -m dispatcher node`` over the websocket, a ``node.toml`` of three providers: ``echo``,
``tunnel`` (``type = "openai"``, ``path = "tunnel"``) and ``openai`` (normalized), the last
two on ``bench._fake_upstream`` in a process of its own) -- that one process runs under
``valgrind --tool=callgrind`` while one keep-alive client sends chat completions back to back.

A *cell* is a path (``echo``, ``tunnel``, ``openai``) and a mode: ``plain`` (non-streaming;
``echo`` answers ``"hello"``, the upstream 16 tokens) or ``stream`` (``"stream": true``, 64
tokens: echo's 64 words, the upstream's 64 tokens). Each process runs once with the base
plan -- every cell's :data:`WARMUP` then :data:`BASE_REQUESTS` requests, in turn -- and once
per cell with that plan plus ``N`` more requests of that cell at the end; the difference of
the instructions counted, divided by N, is the process's instructions per request of that
cell (start-up, joining, the other cells and shutting down cancel out).

``--limits`` (issue #23) runs the edge as ``python -m dispatcher serve`` with the ``store``
section's config instead (``bench.store_bench.edge_toml``: one ``[[keys]]`` tenant, whose key
the client sends), once per mode given: ``unlimited`` (the tenant has no limits), ``memory``
(``rpm``, ``tpm``, ``max_concurrent`` set, never reached, on the embedded limits) and
``redis`` (the same on ``[store] redis_url``, a ``redis-server`` started for the run): the
edge's instructions per request that the shared limits add, where wall-clock on loopback
cannot separate them from the machine's noise. ``--process redis`` (with ``--limits redis``)
counts the third process of that path, ``redis-server`` itself (a server of its own for each
run, under callgrind): what the limit script and the server's side of its round trip cost
per request, a figure no machine's speed changes.

Wall-clock latency on a shared machine moves by +-15 % between runs; instruction counts
repeat to about +-1 % (a little more for streams, whose frames coalesce by timing), so this is
the figure that says whether a change made the path cheaper. Needs valgrind (Debian's
``valgrind``); about a minute per run, two runs at once. Not a section of
``python -m bench`` for those two reasons.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import attrs

REPO_ROOT = Path(__file__).resolve().parent.parent
BASE_REQUESTS = 50
WARMUP = 20
JOIN_TIMEOUT = 900.0
NON_STREAM_TOKENS = 16
STREAM_TOKENS = 64
PATHS = ("echo", "tunnel", "openai")
MODES = ("plain", "stream")
CELLS = tuple(f"{path}-{mode}" for path in PATHS for mode in MODES)
KEY_ENV = "BENCH_INSTRUCTIONS_UPSTREAM_KEY"
LIMITS = ("unlimited", "memory", "redis")
BANNER = re.compile(r"listening on http://127\.0\.0\.1:(\d+)/v1")

NODE_TOML = """\
[node]
id = "bench"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"

[[providers]]
id = "echo"
type = "echo"
  [[providers.models]]
  name = "echo"
  slots = 8

[[providers]]
id = "up-tunnel"
type = "openai"
path = "tunnel"
base_url = "http://127.0.0.1:{up}/v1"
api_key_env = "{key_env}"
  [[providers.models]]
  name = "tunnel"
  served_name = "bench-model"
  slots = 8

[[providers]]
id = "up-openai"
type = "openai"
base_url = "http://127.0.0.1:{up}/v1"
api_key_env = "{key_env}"
  [[providers.models]]
  name = "openai"
  served_name = "bench-model"
  slots = 8
"""


def request_body(cell: str) -> bytes:
    """The chat completion a cell sends."""
    path, _, mode = cell.partition("-")
    stream = mode == "stream"
    if path == "echo":
        # echo answers with the user's words, one token each
        content = " ".join(f"w{i}" for i in range(STREAM_TOKENS)) if stream else "hello"
        body: dict[str, object] = {
            "model": "echo",
            "messages": [{"role": "user", "content": content}],
        }
    else:
        tokens = STREAM_TOKENS if stream else NON_STREAM_TOKENS
        body = {
            "model": path,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": tokens,
        }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def _read_head(sock: socket.socket, data: bytes) -> tuple[bytes, bytes]:
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            raise RuntimeError("the edge closed the connection")
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _exchange(
    sock: socket.socket, method: str, path: str, body: bytes = b"", headers: str = ""
) -> bytes:
    """One request on the keep-alive connection (``headers``: extra header lines); the
    response body (de-chunked)."""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        f"Content-Type: application/json\r\n{headers}\r\n"
    )
    sock.sendall(head.encode() + body)
    response_head, rest = _read_head(sock, b"")
    if response_head.split()[1] != b"200":
        raise RuntimeError(f"{method} {path}: {response_head[:200]!r}")
    found = re.search(rb"content-length: (\d+)", response_head, re.IGNORECASE)
    if found is not None:
        while len(rest) < int(found.group(1)):
            rest += sock.recv(65536)
        return rest
    if not re.search(rb"transfer-encoding: chunked", response_head, re.IGNORECASE):
        raise RuntimeError(f"{method} {path}: neither Content-Length nor chunked")
    return _read_chunked(sock, rest)


def _read_chunked(sock: socket.socket, data: bytes) -> bytes:
    body = b""
    while True:
        while b"\r\n" not in data:
            data += sock.recv(65536)
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        while len(data) < size + 2:
            data += sock.recv(65536)
        body += data[:size]
        data = data[size + 2 :]
        if size == 0:
            return body


def _check(cell: str, body: bytes) -> None:
    """The answer is the one asked for (a failure here is a broken path, not a figure)."""
    path, _, mode = cell.partition("-")
    if mode == "stream":
        ok = body.rstrip().endswith(b"data: [DONE]")
        last = f"w{STREAM_TOKENS - 1}" if path == "echo" else f"tok{STREAM_TOKENS - 1}"
        ok = ok and last.encode() in body
    else:
        answer = json.loads(body)
        content = answer["choices"][0]["message"]["content"]
        ok = "hello" in content if path == "echo" else f"tok{NON_STREAM_TOKENS - 1}" in content
    if not ok:
        raise RuntimeError(f"{cell}: unexpected answer {body[-300:]!r}")


@attrs.frozen
class Variant:
    """Which edge: the open one (``limits`` None), or the daemon with the store section's
    tenant and ``limits`` (:data:`LIMITS`; ``redis_url`` for ``redis``)."""

    limits: str | None = None
    redis_url: str | None = None

    def edge_command(self, tmp: str) -> list[str]:
        if self.limits is None:
            return [sys.executable, "-m", "bench._edge_server", "edge"]
        from bench.store_bench import edge_toml

        config = Path(tmp) / "edge.toml"
        text = edge_toml(limited=self.limits != "unlimited", redis_url=self.redis_url)
        config.write_text(text.replace("{tmp}", tmp))
        argv = [sys.executable, "-m", "dispatcher", "--log-level", "WARNING", "serve"]
        return [*argv, "--config", str(config), "--no-local-node", "--port", "0"]

    @property
    def headers(self) -> str:
        if self.limits is None:
            return ""
        from bench.store_bench import AUTH_HEADER

        return AUTH_HEADER


OPEN_EDGE = Variant()


GRIND = ("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null")


def count(
    tree: Path,
    process: str,
    plan: Sequence[tuple[str, int]],
    upstream: int,
    variant: Variant = OPEN_EDGE,
) -> int:
    """Instructions ``process`` (``edge``, ``node``, or ``redis``: the variant's
    ``redis-server``) of ``tree`` ran in a whole run of ``plan``: (cell, requests) in order,
    each answer checked."""
    if process == "redis":
        return _count_redis(tree, plan, upstream, variant)
    return _count(tree, process, plan, upstream, variant)


def _count_redis(
    tree: Path, plan: Sequence[tuple[str, int]], upstream: int, variant: Variant
) -> int:
    """:func:`count` of a ``redis-server`` of the run's own, under callgrind."""
    from tests.store.redis_server import RedisServer  # as bench._stores does

    server = RedisServer(wrapper=GRIND, start_within=120.0)
    try:
        url = server.start()
        _count(tree, "", plan, upstream, attrs.evolve(variant, redis_url=url))
        server.stop()  # SIGTERM: redis-server shuts down, callgrind writes its summary
        report = server.log.read_text(errors="replace")
    finally:
        server.close()
    return _collected(report, "redis-server")


def _count(
    tree: Path,
    process: str,
    plan: Sequence[tuple[str, int]],
    upstream: int,
    variant: Variant,
) -> int:
    """:func:`count` of the edge or the node (``process`` empty: neither is counted)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", KEY_ENV: "sk-bench"}
    grind = list(GRIND)
    with (
        tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp,
        subprocess.Popen(
            [*(grind if process == "edge" else []), *variant.edge_command(tmp)],
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as edge,
    ):
        assert edge.stdout is not None
        port = next(
            int(found.group(1))
            for line in edge.stdout
            if (found := re.search(r"BENCH-PORT (\d+)", line) or BANNER.search(line)) is not None
        )
        node_toml = Path(tmp) / "node.toml"
        node_toml.write_text(NODE_TOML.format(edge_port=port, up=upstream, key_env=KEY_ENV))
        node_command = [sys.executable, "-m", "dispatcher", "--log-level", "WARNING", "node"]
        node_command += ["--config", str(node_toml)]
        with subprocess.Popen(
            [*(grind if process == "node" else []), *node_command],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ) as node:
            try:
                _drive(port, plan, variant.headers)
            except BaseException:
                node.kill()
                edge.kill()
                raise
            node.send_signal(signal.SIGTERM)
            _, node_err = node.communicate(timeout=JOIN_TIMEOUT)
        edge.send_signal(signal.SIGTERM)
        _, edge_err = edge.communicate(timeout=JOIN_TIMEOUT)
    if not process:
        return 0
    return _collected(edge_err if process == "edge" else node_err, f"the {process}")


def _collected(report: str, who: str) -> int:
    """The instruction count of callgrind's summary in ``report`` (``who`` ran under it)."""
    collected = re.search(r"Collected : (\d+)", report)
    if collected is None:
        raise RuntimeError(f"no callgrind summary from {who}: {report[-1000:]}")
    return int(collected.group(1))


def _drive(port: int, plan: Sequence[tuple[str, int]], headers: str = "") -> None:
    """Wait for the node to join (every model listed), then send the plan's requests."""
    wanted = set(PATHS)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        joined_by = time.monotonic() + JOIN_TIMEOUT
        while not wanted <= {
            model["id"]
            for model in json.loads(_exchange(sock, "GET", "/v1/models", headers=headers))["data"]
        }:
            if time.monotonic() > joined_by:
                raise RuntimeError("the node did not join the edge")
            time.sleep(1.0)
        for cell, requests in plan:
            body = request_body(cell)
            for _ in range(requests):
                _check(cell, _exchange(sock, "POST", "/v1/chat/completions", body, headers))


def base_plan(cells: Sequence[str]) -> list[tuple[str, int]]:
    return [(cell, WARMUP + BASE_REQUESTS) for cell in cells]


def per_request(
    tree: Path,
    process: str,
    cells: Sequence[str],
    requests: int,
    upstream: int,
    variant: Variant = OPEN_EDGE,
) -> dict[str, float]:
    """Each cell's instructions per request in ``process``: the base run and one run per
    cell, two at a time (one per core)."""
    base = base_plan(cells)
    with ThreadPoolExecutor(2) as pool:
        base_count = pool.submit(count, tree, process, base, upstream, variant)
        more = {
            cell: pool.submit(count, tree, process, [*base, (cell, requests)], upstream, variant)
            for cell in cells
        }
        return {
            cell: (future.result() - base_count.result()) / requests
            for cell, future in more.items()
        }


@contextmanager
def fake_upstream() -> Iterator[int]:
    """``bench._fake_upstream`` in its own process; its port."""
    with subprocess.Popen(
        [sys.executable, "-m", "bench._fake_upstream"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as upstream:
        try:
            assert upstream.stdout is not None
            port = next(
                int(found.group(1))
                for line in upstream.stdout
                if (found := re.search(r"BENCH-PORT (\d+)", line)) is not None
            )
            yield port
        finally:
            upstream.send_signal(signal.SIGTERM)
            try:
                upstream.wait(timeout=10)
            except subprocess.TimeoutExpired:
                upstream.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("trees", nargs="*", type=Path, default=[REPO_ROOT], metavar="TREE")
    parser.add_argument("--requests", type=int, default=200, metavar="N")
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS)
    parser.add_argument(
        "--process", nargs="+", default=["edge", "node"], choices=["edge", "node", "redis"]
    )
    parser.add_argument("--limits", nargs="+", choices=LIMITS, default=[])
    args = parser.parse_args(argv)
    if "redis" in args.process and "redis" not in args.limits:
        parser.error("--process redis counts the redis-server of --limits redis")
    print(
        f"instructions per chat completion ({args.requests} counted; plain: non-streaming, "
        f"{NON_STREAM_TOKENS} tokens from the upstream; stream: {STREAM_TOKENS} tokens)"
    )
    both = "edge" in args.process and "node" in args.process
    columns = [*args.process, *(["both"] if both else [])]
    print(f"{'tree':<32} {'cell':<24}" + "".join(f" {name:>12}" for name in columns))
    with fake_upstream() as upstream, _redis(needed="redis" in args.limits) as redis_url:
        variants = [Variant(mode, redis_url if mode == "redis" else None) for mode in args.limits]
        for tree in args.trees:
            for variant in variants or [OPEN_EDGE]:
                figures = {
                    process: per_request(
                        tree, process, args.cells, args.requests, upstream, variant
                    )
                    for process in args.process
                    if process != "redis" or variant.limits == "redis"
                }
                for cell in args.cells:
                    values = [figures[p][cell] if p in figures else None for p in args.process]
                    if both:
                        values.append(figures["edge"][cell] + figures["node"][cell])
                    label = cell if variant.limits is None else f"{cell} ({variant.limits})"
                    print(
                        f"{str(tree)[-32:]:<32} {label:<24}"
                        + "".join(f" {'-' if v is None else f'{v:,.0f}':>12}" for v in values),
                        flush=True,
                    )
    return 0


@contextmanager
def _redis(*, needed: bool) -> Iterator[str | None]:
    """A ``redis-server`` for the run (the tests' own fixture process), if ``needed``."""
    if not needed:
        yield None
        return
    from tests.store.redis_server import RedisServer  # as bench._stores does

    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
