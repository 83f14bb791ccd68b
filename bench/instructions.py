"""CPU instructions per request on the real path, each process measured on its own.

``python -m bench.instructions [--requests N] [TREE ...]`` (default: this checkout). For each
tree (a checkout of this repository: compare a commit with ``git worktree add``) and each of
the two processes of the ``edge`` section's latency path -- the edge
(``python -m bench._edge_server edge``) and a real node (``python -m dispatcher node``) over
the websocket -- that one process runs under ``valgrind --tool=callgrind`` while one
keep-alive client sends non-streaming chat completions back to back; the run is made twice,
with 50 and with ``50 + N`` requests, and the difference of the instructions counted,
divided by N, is the process's instructions per request (start-up, joining and shutting
down cancel out).

Wall-clock latency on a shared machine moves by +-15 % between runs; instruction counts
repeat to about +-1 %, so this is the figure that says whether a change made the path
cheaper. Needs valgrind (Debian's ``valgrind``); a few minutes per tree. Not a section of
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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BASE_REQUESTS = 50
WARMUP = 20
JOIN_TIMEOUT = 300.0
CHAT = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hello"}]}).encode()


def _exchange(sock: socket.socket, method: str, path: str, body: bytes = b"") -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        "Content-Type: application/json\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    response_head, _, rest = data.partition(b"\r\n\r\n")
    if response_head.split()[1] != b"200":
        raise RuntimeError(f"{method} {path}: {response_head[:200]!r}")
    found = re.search(rb"content-length: (\d+)", response_head, re.IGNORECASE)
    if found is None:
        raise RuntimeError(f"{method} {path}: no Content-Length")
    while len(rest) < int(found.group(1)):
        rest += sock.recv(65536)
    return rest


def count(tree: Path, process: str, requests: int) -> int:
    """Instructions ``process`` (``edge`` or ``node``) of ``tree`` ran in a whole run of
    ``requests`` counted requests (after the warm-up)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    grind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    edge_command = [sys.executable, "-m", "bench._edge_server", "edge"]
    with subprocess.Popen(
        [*(grind if process == "edge" else []), *edge_command],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as edge:
        assert edge.stdout is not None
        port = next(
            int(found.group(1))
            for line in edge.stdout
            if (found := re.search(r"BENCH-PORT (\d+)", line)) is not None
        )
        node_command = [sys.executable, "-m", "dispatcher", "--log-level", "WARNING", "node"]
        node_command += ["--edge", f"ws://127.0.0.1:{port}/v1/nodes/connect", "--id", "bench"]
        with subprocess.Popen(
            [*(grind if process == "node" else []), *node_command],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ) as node:
            try:
                _drive(port, requests)
            except BaseException:
                node.kill()
                edge.kill()
                raise
            node.send_signal(signal.SIGTERM)
            _, node_err = node.communicate(timeout=JOIN_TIMEOUT)
        edge.send_signal(signal.SIGTERM)
        _, edge_err = edge.communicate(timeout=JOIN_TIMEOUT)
    report = edge_err if process == "edge" else node_err
    collected = re.search(r"Collected : (\d+)", report)
    if collected is None:
        raise RuntimeError(f"no callgrind summary from the {process}: {report[-1000:]}")
    return int(collected.group(1))


def _drive(port: int, requests: int) -> None:
    """Wait for the node to join, then send the requests (``WARMUP`` first)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        joined_by = time.monotonic() + JOIN_TIMEOUT
        while not any(
            model["id"] == "echo"
            for model in json.loads(_exchange(sock, "GET", "/v1/models"))["data"]
        ):
            if time.monotonic() > joined_by:
                raise RuntimeError("the node did not join the edge")
            time.sleep(1.0)
        for _ in range(WARMUP + requests):
            _exchange(sock, "POST", "/v1/chat/completions", CHAT)


def per_request(tree: Path, process: str, requests: int) -> float:
    """The two runs at once (one per core)."""
    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(count, tree, process, BASE_REQUESTS)
        more = pool.submit(count, tree, process, BASE_REQUESTS + requests)
        return (more.result() - base.result()) / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("trees", nargs="*", type=Path, default=[REPO_ROOT], metavar="TREE")
    parser.add_argument("--requests", type=int, default=200, metavar="N")
    args = parser.parse_args(argv)
    print(f"instructions per non-streaming chat completion ({args.requests} counted)")
    print(f"{'tree':<40} {'edge':>12} {'node':>12} {'both':>12}")
    for tree in args.trees:
        edge, node = (per_request(tree, process, args.requests) for process in ("edge", "node"))
        print(f"{tree!s:<40} {edge:>12,.0f} {node:>12,.0f} {edge + node:>12,.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
