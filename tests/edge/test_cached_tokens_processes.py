"""Cached and reasoning tokens end to end (issue #25), as users run the dispatcher: a
``dispatcher serve`` process and a ``dispatcher node`` process whose providers are a fake
OpenAI server on 127.0.0.1 reporting ``prompt_tokens_details.cached_tokens`` and
``completion_tokens_details.reasoning_tokens`` -- one ``openai`` provider on the normalized
path, one on the tunnel path.

Each front end's usage object carries them (chat completions, streamed and not; Responses;
Messages, in Anthropic's convention), and so does each attempt's row in the ledger, priced
at the cached input's own price, summed in ``GET /v1/usage``'s totals and groups."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from tests.chaos.processes import Processes, tracebacks
from tests.nodes.fake_providers import FakeOpenAI, serve_fake_openai

START_TIMEOUT = 60.0
PROMPT, CACHED, COMPLETION, REASONING = 1200, 1024, 5, 3

EDGE_TOML = """\
local_node = false
data_dir = "{data}"
admin_keys = ["sk-admin"]

[[keys]]
id = "team"
key = "sk-team"

[prices."m*"]
input_per_mtok = 4.0
output_per_mtok = 16.0
cached_input_per_mtok = 1.0

[prices."t"]
input_per_mtok = 4.0
output_per_mtok = 16.0
"""

NODE_TOML = """\
[node]
id = "cache-node"
reconnect_min_backoff = 0.1
reconnect_max_backoff = 1

[[providers]]
id = "engine"
type = "openai"
base_url = "{base_url}/v1"

  [[providers.models]]
  name = "m"
  served_name = "fake-model"

[[providers]]
id = "tunnelled"
type = "openai"
path = "tunnel"
base_url = "{base_url}/v1"

  [[providers.models]]
  name = "t"
  served_name = "fake-model"
"""

TEAM = {"authorization": "Bearer sk-team"}
ADMIN = {"authorization": "Bearer sk-admin"}
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT_USAGE = {
    "prompt_tokens": PROMPT,
    "completion_tokens": COMPLETION,
    "total_tokens": PROMPT + COMPLETION,
    "prompt_tokens_details": {"cached_tokens": CACHED},
    "completion_tokens_details": {"reasoning_tokens": REASONING},
}


async def _serves(client: httpx.AsyncClient, base: str, models: set[str]) -> bool:
    response = await client.get(f"{base}/models", headers=TEAM)
    return response.status_code == 200 and models <= {m["id"] for m in response.json()["data"]}


def _sse_data(text: str) -> list[Any]:
    return [
        orjson.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def _usage_rows(client: httpx.AsyncClient, base: str, count: int) -> dict[str, Any]:
    """``GET /v1/usage`` once it has ``count`` rows (each is recorded as its request ends,
    just after the client has its answer)."""
    with trio.fail_after(30):
        while True:
            response = await client.get(f"{base}/usage", headers=ADMIN)
            assert response.status_code == 200, response.text
            report: dict[str, Any] = response.json()
            if report["totals"]["attempts"] >= count:
                return report
            await trio.sleep(0.05)


async def test_cached_and_reasoning_tokens_from_the_provider_to_the_ledger(
    tmp_path: Path,
) -> None:
    processes = Processes(tmp_path)
    fake = FakeOpenAI(
        chunk_count=COMPLETION,
        prompt_tokens=PROMPT,
        cached_tokens=CACHED,
        reasoning_tokens=REASONING,
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_fake_openai, fake)
            config = tmp_path / "edge.toml"
            config.write_text(EDGE_TOML.format(data=tmp_path / "edge"))
            edge = processes.spawn(
                "edge", ["-m", "dispatcher", "serve", "--config", str(config), "--port", "0"]
            )
            match = await edge.wait_for_stdout(
                r"listening on http://127\.0\.0\.1:(\d+)/v1", START_TIMEOUT
            )
            base = f"http://127.0.0.1:{match[1]}/v1"
            node_config = tmp_path / "node.toml"
            node_config.write_text(NODE_TOML.format(base_url=fake.base_url))
            edge_url = base.replace("http://", "ws://") + "/nodes/connect"
            processes.spawn(
                "node",
                ["-m", "dispatcher", "node", "--config", str(node_config), "--edge", edge_url],
            )
            async with httpx.AsyncClient(timeout=60) as client:
                with trio.fail_after(START_TIMEOUT):
                    while not await _serves(client, base, {"m", "t"}):
                        await trio.sleep(0.05)
                await _each_front_end(client, base)
                report = await _usage_rows(client, base, 6)
                metrics = await client.get(base.removesuffix("/v1") + "/metrics", headers=ADMIN)
            nursery.cancel_scope.cancel()
    finally:
        processes.close()
    for proc in processes.procs:
        assert not tracebacks(proc.stderr()), proc.stderr()[-3000:]

    rows = report["rows"]
    assert len(rows) == 6
    assert {(row["model_group"], row["path"], row["route"]) for row in rows} == {
        ("m", "normalized", "/v1/chat/completions"),
        ("m", "normalized", "/v1/responses"),
        ("m", "normalized", "/v1/messages"),
        ("t", "tunnel", "/v1/chat/completions"),
    }
    for row in rows:
        assert row["usage_source"] == "reported", row
        counts = (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"])
        assert (*counts, row["cache_write_tokens"], row["reasoning_tokens"]) == (
            PROMPT, COMPLETION, CACHED, 0, REASONING,
        ), row  # fmt: skip
        if row["model_group"] == "m":  # the cached input at its own price
            expected = ((PROMPT - CACHED) * 4.0 + CACHED * 1.0 + COMPLETION * 16.0) / 1e6
        else:  # no cached price: the input's
            expected = (PROMPT * 4.0 + COMPLETION * 16.0) / 1e6
        assert row["cost_usd"] == pytest.approx(expected, rel=1e-12), row
    totals = report["totals"]
    assert (totals["cached_tokens"], totals["reasoning_tokens"]) == (6 * CACHED, 6 * REASONING)
    assert totals["cache_write_tokens"] == 0
    groups = {(group["model"], group["route"]): group for group in report["groups"]}
    chat = groups[("m", "/v1/chat/completions")]
    assert (chat["attempts"], chat["cached_tokens"], chat["reasoning_tokens"]) == (
        2, 2 * CACHED, 2 * REASONING,
    )  # fmt: skip
    tunnel = groups[("t", "/v1/chat/completions")]
    assert (tunnel["cached_tokens"], tunnel["reasoning_tokens"]) == (2 * CACHED, 2 * REASONING)

    assert metrics.status_code == 200, metrics.text
    cached = dict(
        re.findall(r'^dispatcher_cached_tokens_total\{model="(\w+)"\} (\S+)$', metrics.text, re.M)
    )
    assert cached == {"m": f"{4.0 * CACHED}", "t": f"{2.0 * CACHED}"}


async def _each_front_end(client: httpx.AsyncClient, base: str) -> None:
    """One request of each front end, its usage object checked."""
    plain = await client.post(
        f"{base}/chat/completions", headers=TEAM, json={"model": "m", "messages": MESSAGES}
    )
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"] == CHAT_USAGE

    streamed = await client.post(
        f"{base}/chat/completions",
        headers=TEAM,
        json={
            "model": "m",
            "messages": MESSAGES,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert streamed.status_code == 200, streamed.text
    usages = [chunk["usage"] for chunk in _sse_data(streamed.text) if chunk.get("usage")]
    assert usages == [CHAT_USAGE]

    responses = await client.post(
        f"{base}/responses", headers=TEAM, json={"model": "m", "input": "hi"}
    )
    assert responses.status_code == 200, responses.text
    assert responses.json()["usage"] == {
        "input_tokens": PROMPT,
        "input_tokens_details": {"cached_tokens": CACHED},
        "output_tokens": COMPLETION,
        "output_tokens_details": {"reasoning_tokens": REASONING},
        "total_tokens": PROMPT + COMPLETION,
    }

    messages = await client.post(
        f"{base}/messages",
        headers={**TEAM, "anthropic-version": "2023-06-01"},
        json={"model": "m", "max_tokens": 64, "messages": MESSAGES},
    )
    assert messages.status_code == 200, messages.text
    assert messages.json()["usage"] == {
        "input_tokens": PROMPT - CACHED,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": CACHED,
        "output_tokens": COMPLETION,
    }

    tunnelled = await client.post(
        f"{base}/chat/completions", headers=TEAM, json={"model": "t", "messages": MESSAGES}
    )
    assert tunnelled.status_code == 200, tunnelled.text
    assert tunnelled.json()["usage"] == CHAT_USAGE  # the provider's own, relayed

    tunnel_stream = await client.post(
        f"{base}/chat/completions",
        headers=TEAM,
        json={
            "model": "t",
            "messages": MESSAGES,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert tunnel_stream.status_code == 200, tunnel_stream.text
    usages = [chunk["usage"] for chunk in _sse_data(tunnel_stream.text) if chunk.get("usage")]
    assert usages == [CHAT_USAGE]
