"""Tunnel section: one OpenAI SSE stream relayed client -> edge -> websocket -> node -> provider
and back, next to the same stream read from the provider directly, in one run.

Processes, all on 127.0.0.1, the load generator in this process on raw Trio sockets
(``bench._load``):

* the provider: ``python -m bench.tunnel_bench provider``, our HTTP server answering
  ``POST /v1/chat/completions`` with ``"stream": true`` as vLLM does: one SSE event (one
  ``chat.completion.chunk`` of ~170 bytes) per token and per write, ``max_tokens`` tokens, the
  usage chunk when ``stream_options.include_usage`` is set, then ``[DONE]``. It requires the
  node's key (``Authorization: Bearer``);
* the edge: ``python -m bench._edge_server edge`` (``open_dispatcher``, no local node);
* the node: ``python -m dispatcher node --config node.toml``, one provider with
  ``path = "tunnel"`` pointing at the provider, its key in the environment.

Two measurements, the paths taking turns (direct, tunnel, tunnel, direct, ...):

1. **Stream relay.** One stream of :data:`STREAM_TOKENS` tokens per round; content chunks/s
   from request sent to the chunked terminator. The client asks the tunnel without
   ``include_usage`` (so the edge adds it and strips the extra chunk) and the provider
   directly with it (the provider does the same work either way). After the clock stops, the
   tunnel's bytes are checked equal to the direct bytes minus the usage chunk.
2. **Added TTFT.** :data:`TTFT_REQUESTS` short streams per path on one keep-alive connection:
   request sent -> first content chunk received; p50/p99 of each and the difference.

``python -m bench.tunnel_bench`` runs this section alone.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import trio

from bench import Table, fmt_int
from bench._load import (
    LoadError,
    MachineLoad,
    ServerProcess,
    Sock,
    announce_port,
    connect,
    cpu_seconds,
    http_request,
    raise_nofile_limit,
    read_head,
    send_all,
    server_process,
)
from bench.edge_bench import dechunk, log_notes, node_process, percentile, recv

if TYPE_CHECKING:
    from dispatcher.http import Request, Responder, Server

TIME_LIMIT = 120.0

CHAT_PATH = "/v1/chat/completions"
MODEL = "tunneled"
SERVED = "bench-model"
KEY_ENV = "BENCH_TUNNEL_PROVIDER_KEY"
KEY = "sk-bench-provider-key"
NODE_ID = "bench-tunnel-node"

STREAM_TOKENS = 30_000
ROUNDS = 3
"""Stream relay: rounds per path, taking turns."""
TTFT_REQUESTS = 200
TTFT_WARMUP = 20
TTFT_TOKENS = 8

TARGET_RATIO = 0.5
"""Tunnel chunks/s >= this share of direct chunks/s."""

JSON_HEADER = "Content-Type: application/json\r\n"
FIRST_CONTENT = b'"delta":{"content":"tok'


# --------------------------------------------------------------------------- the provider


def _chunk_prefix(model: bytes) -> bytes:
    return (
        b'data: {"id":"chatcmpl-bench-0123456789","object":"chat.completion.chunk",'
        b'"created":1700000000,"model":' + model + b',"system_fingerprint":null,"choices":'
    )


async def serve_provider() -> None:
    """The fake vLLM (see the module docstring) until SIGTERM."""
    import signal

    from dispatcher.http import ServerLimits, serve_http

    async def handler(request: Request, responder: Responder) -> None:
        if (request.method, request.path) != ("POST", CHAT_PATH):
            await responder.respond(404)
            return
        body = orjson.loads(await request.body())
        if request.header(b"authorization") != f"Bearer {KEY}".encode():
            await responder.respond(401, [(b"content-type", b"application/json")], b"{}")
            return
        tokens = int(body.get("max_tokens") or 16)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        prefix = _chunk_prefix(orjson.dumps(body.get("model")))
        usage_null = b',"usage":null' if include_usage else b""
        stream = await responder.start_stream(
            200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        )
        await stream.send(
            prefix + b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            b'"finish_reason":null}]' + usage_null + b"}\n\n"
        )
        content = b'[{"index":0,"delta":{"content":"tok%d "},"logprobs":null,"finish_reason":null}]'
        for i in range(tokens):
            await stream.send(prefix + content % i + usage_null + b"}\n\n")
        tail = [
            prefix + b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]'
            b"" + usage_null + b"}\n\n"
        ]
        if include_usage:
            usage = {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": tokens + 9}
            tail.append(prefix + b'[],"usage":' + orjson.dumps(usage) + b"}\n\n")
        tail.append(b"data: [DONE]\n\n")
        await stream.send(b"".join(tail))

    async with trio.open_nursery() as nursery:
        server: Server = await nursery.start(
            partial(serve_http, handler, port=0, limits=ServerLimits(shutdown_grace=1.0))
        )
        announce_port(server.address.port)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                server.shutdown()
                return


# --------------------------------------------------------------------------- the node


NODE_TOML = """\
[node]
id = "{node_id}"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"

[[providers]]
id = "bench-vllm"
type = "openai"
path = "tunnel"
base_url = "http://127.0.0.1:{provider_port}/v1"
api_key_env = "{key_env}"

[[providers.models]]
name = "{model}"
served_name = "{served}"
slots = 4
"""


@asynccontextmanager
async def tunnel_node(edge_port: int, provider_port: int) -> AsyncIterator[ServerProcess]:
    """``python -m dispatcher node`` with a tunnel provider, until the block ends; yields once
    the edge lists the tunnel model."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "node.toml"
        config.write_text(
            NODE_TOML.format(
                node_id=NODE_ID,
                edge_port=edge_port,
                provider_port=provider_port,
                key_env=KEY_ENV,
                model=MODEL,
                served=SERVED,
            )
        )
        async with node_process(
            edge_port, model=MODEL, args=["--config", str(config)], env={KEY_ENV: KEY}
        ) as node:
            yield node


# --------------------------------------------------------------------------- the client


def chat_request(model: str, tokens: int, *, include_usage: bool, key: bool) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": tokens,
        "stream": True,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    headers = JSON_HEADER + (f"Authorization: Bearer {KEY}\r\n" if key else "")
    return http_request("POST", CHAT_PATH, orjson.dumps(body), headers=headers)


@dataclass
class StreamRun:
    seconds: float
    first_content: float
    body: bytes


async def read_chunked(sock: Sock, pending: bytes, start: float) -> tuple[float, bytes, bytes]:
    """Read one chunked SSE response: (time of its first content, raw body, bytes left)."""
    status, head, data = await read_head(sock, pending)
    if status != 200 or b"transfer-encoding: chunked" not in head:
        raise LoadError(f"expected a chunked 200, got {head[:200]!r} {data[:200]!r}")
    first = 0.0
    pieces = [data]
    if FIRST_CONTENT in data:
        first = time.perf_counter() - start
    tail = data[-40:]
    while True:
        end = tail.find(b"\r\n0\r\n\r\n")
        if end >= 0:
            break
        data = await recv(sock)
        pieces.append(data)
        if not first and FIRST_CONTENT in tail + data:
            first = time.perf_counter() - start
        tail = (tail + data)[-40:]
    raw = b"".join(pieces)
    stop = raw.rfind(b"\r\n0\r\n\r\n") + 7
    return first, raw[:stop], raw[stop:]


async def one_stream(port: int, request: bytes) -> StreamRun:
    sock = await connect(port)
    try:
        start = time.perf_counter()
        await send_all(sock, request)
        first, raw, _ = await read_chunked(sock, b"", start)
        seconds = time.perf_counter() - start
    finally:
        sock.close()
    return StreamRun(seconds, first, dechunk(raw))


def content_events(body: bytes) -> int:
    return body.count(b'"delta":{"content":"tok')


def strip_usage_chunk(body: bytes) -> bytes:
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    return b"".join(e for e in events if b'"choices":[],"usage":{' not in e)


@dataclass
class Paths:
    direct_port: int
    edge_port: int
    runs: dict[str, list[StreamRun]] = field(default_factory=lambda: {"direct": [], "tunnel": []})

    def request(self, path: str, tokens: int) -> tuple[int, bytes]:
        if path == "direct":
            return self.direct_port, chat_request(SERVED, tokens, include_usage=True, key=True)
        return self.edge_port, chat_request(MODEL, tokens, include_usage=False, key=False)


async def measure_stream(paths: Paths, pids: dict[str, int]) -> Table:
    for path in ("direct", "tunnel"):  # warm-up
        port, request = paths.request(path, 2_000)
        await one_stream(port, request)
    cpu = {path: dict.fromkeys(pids, 0.0) for path in ("direct", "tunnel")}
    order = ["direct", "tunnel", "tunnel", "direct"] * ROUNDS
    for path in order[: 2 * ROUNDS]:
        port, request = paths.request(path, STREAM_TOKENS)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        with trio.fail_after(30):
            run = await one_stream(port, request)
        for name, pid in pids.items():
            cpu[path][name] += cpu_seconds(pid) - before[name]
        paths.runs[path].append(run)
    rates: dict[str, float] = {}
    for path, runs in paths.runs.items():
        for run in runs:
            if content_events(run.body) != STREAM_TOKENS or not run.body.endswith(
                b"data: [DONE]\n\n"
            ):
                raise LoadError(f"{path}: an incomplete stream ({len(run.body)} bytes)")
        rates[path] = STREAM_TOKENS * len(runs) / sum(r.seconds for r in runs)
    direct_body = paths.runs["direct"][0].body
    exact = all(r.body == strip_usage_chunk(direct_body) for r in paths.runs["tunnel"])
    if not exact:
        raise LoadError("the tunnel's bytes differ from the provider's (minus the usage chunk)")
    ratio = rates["tunnel"] / rates["direct"]
    seconds = {path: sum(r.seconds for r in runs) for path, runs in paths.runs.items()}
    rows: list[Sequence[str]] = [
        ["direct (client -> provider)", fmt_int(rates["direct"]), "", ""],
        [
            "tunnel (client -> edge -> ws -> node -> provider)",
            fmt_int(rates["tunnel"]),
            f"{ratio:.0%} of direct (>= {TARGET_RATIO:.0%})",
            "PASS" if ratio >= TARGET_RATIO else "MISS",
        ],
    ]
    notes = [
        f"{ROUNDS} streams per path (after a 2,000-token warm-up each), paths taking turns; "
        f"each {STREAM_TOKENS:,} content chunks of ~170 bytes, one provider write per chunk; "
        f"rate = chunks / time from request sent to the chunked terminator "
        f"({seconds['direct']:.2f} s direct, {seconds['tunnel']:.2f} s tunnel in all)",
        "the tunnel request leaves out include_usage (the edge adds it and strips the extra "
        "chunk); the direct one asks for it, so the provider's work is the same; each tunnel "
        "body was checked equal to the direct body minus the usage chunk, byte for byte",
    ]
    for path in ("direct", "tunnel"):
        shares = ", ".join(
            f"{name} {used / seconds[path]:.0%}" for name, used in cpu[path].items() if used
        )
        notes.append(f"CPU during the {path} streams (of one core): {shares}")
    return Table(
        title="tunnel: one long SSE stream relayed through edge + ws node, vs the provider direct",
        columns=["path", "content chunks/s", "", ""],
        rows=rows,
        notes=notes,
    )


async def ttft_series(port: int, request: bytes, count: int) -> list[float]:
    """``count`` streams back to back on one keep-alive connection: first-content times."""
    sock = await connect(port)
    firsts: list[float] = []
    pending = b""
    try:
        for _ in range(count):
            start = time.perf_counter()
            await send_all(sock, request)
            first, _, pending = await read_chunked(sock, pending, start)
            firsts.append(first)
    finally:
        sock.close()
    return firsts


async def measure_ttft(paths: Paths) -> Table:
    results: dict[str, list[float]] = {"direct": [], "tunnel": []}
    per_round = TTFT_REQUESTS // 4
    for path in ("direct", "tunnel"):
        port, request = paths.request(path, TTFT_TOKENS)
        await ttft_series(port, request, TTFT_WARMUP)
    for path in ["direct", "tunnel", "tunnel", "direct", "direct", "tunnel", "tunnel", "direct"]:
        port, request = paths.request(path, TTFT_TOKENS)
        with trio.fail_after(30):
            results[path].extend(await ttft_series(port, request, per_round))
    p = {
        (path, q): percentile(values, q) * 1000
        for path, values in results.items()
        for q in (0.5, 0.99)
    }
    rows: list[Sequence[str]] = [
        [
            "p50",
            f"{p[('direct', 0.5)]:.2f}",
            f"{p[('tunnel', 0.5)]:.2f}",
            f"{p[('tunnel', 0.5)] - p[('direct', 0.5)]:+.2f}",
        ],
        [
            "p99",
            f"{p[('direct', 0.99)]:.2f}",
            f"{p[('tunnel', 0.99)]:.2f}",
            f"{p[('tunnel', 0.99)] - p[('direct', 0.99)]:+.2f}",
        ],
    ]
    notes = [
        f"{len(results['direct'])} short streams ({TTFT_TOKENS} tokens) per path after "
        f"{TTFT_WARMUP} warm-up, one keep-alive connection per series, series taking turns; "
        "TTFT = request sent -> the bytes of the first content chunk received",
        "the tunnel adds: the edge's HTTP handling and admission, the tunnel.request frame, "
        "the node's upstream request (a pooled keep-alive connection), tunnel.start and the "
        "first body frame back",
    ]
    return Table(
        title="tunnel: time to first content chunk, ms",
        columns=["", "direct", "tunnel", "added"],
        rows=rows,
        notes=notes,
    )


# --------------------------------------------------------------------------- the section


async def run() -> list[Table]:
    raise_nofile_limit()
    load = MachineLoad()
    async with (
        server_process("provider", ["bench.tunnel_bench", "provider"]) as provider,
        server_process("edge", ["bench._edge_server", "edge"]) as edge,
        tunnel_node(edge.port, provider.port) as node,
    ):
        paths = Paths(direct_port=provider.port, edge_port=edge.port)
        pids = {"provider": provider.pid, "edge": edge.pid, "node": node.pid}
        tables = [await measure_stream(paths, pids), await measure_ttft(paths)]
        for process in (provider, edge, node):
            tables[-1].notes.extend(log_notes(process))
    tables[-1].notes.append(load.note())
    return tables


def _main() -> None:
    from bench import render

    if sys.argv[1:] == ["provider"]:
        raise_nofile_limit()
        trio.run(serve_provider)
        return
    for table in trio.run(run):
        print(render(table), flush=True)
        print(flush=True)


if __name__ == "__main__":
    _main()
