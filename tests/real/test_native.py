"""Native routes on a tunnel to the real engine: llama-server speaks the Anthropic Messages
API (``/v1/messages``) and the Responses API itself, so a tunnel provider that declares those
routes gets the client's request relayed byte for byte, not translated. And with its prompt
cache on, the engine reports the prompt tokens it reused: the usage the client sees and the
ledger's row carry them (issue #25).

This module starts its own engine (the session's runs with ``--no-cache-prompt``, for exact
comparisons), with one slot, so a repeated prompt lands where its prefix is kept.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from .answers import QUESTION, SYSTEM, client
from .stack import Stack, start_edge, start_engine, start_node

NATIVE = "smol-native"

NODE_TOML = """\
[node]
id = "native-node"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"
reconnect_min_backoff = 0.2
reconnect_max_backoff = 1

[[providers]]
id = "engine-native"
type = "openai"
path = "tunnel"
base_url = "{engine}/v1"
routes = ["chat", "messages", "responses"]

  [[providers.models]]
  name = "{native}"
  served_name = "smollm2"
  slots = 1
"""

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

LONG_SYSTEM = "You are a careful assistant for a library. " + " ".join(
    f"Rule {n}: answer politely, cite the shelf number, and never invent a title."
    for n in range(1, 31)
)
"""A system prompt of several hundred tokens: what a repeated request finds in the cache."""


@pytest.fixture(scope="module")
def native(
    real_engine: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    engine, model = real_engine
    stack = Stack(tmp_path_factory.mktemp("native"))
    try:
        template = os.environ.get("DISPATCHER_REAL_TEMPLATE") or None
        # --alias: the engine's answers name the model as the node's served_name does (a
        # llama-server without one names its GGUF file's path in /v1/messages answers, which
        # the tunnel would relay as it is: it renames only the served name)
        start_engine(stack, engine, model, template, cache_prompt=True, parallel=1, alias="smollm2")
        data = stack.workdir / "edge-data"
        data.mkdir()
        start_edge(stack, EDGE_TOML.format(data=data))
        port = stack.edge_url.rpartition(":")[2]
        start_node(
            stack,
            NODE_TOML.format(edge_port=port, engine=stack.engine_url, native=NATIVE),
            [NATIVE],
        )
        yield stack
    finally:
        stack.close()


def _events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """An SSE body's ``(event, data)`` pairs."""
    events = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, data = "", b""
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data += line[5:].strip()
        if data:
            events.append((name, orjson.loads(data)))
    return events


MESSAGE = {
    "max_tokens": 24,
    "system": SYSTEM,
    "messages": [{"role": "user", "content": QUESTION}],
    "temperature": 0,
}


def test_messages_are_relayed_natively(native: Stack) -> None:
    """The engine's own ``/v1/messages`` answer, streamed: the same events as the engine
    sends for the same request, the model renamed to the client's."""
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "sk-native"}
    body = {**MESSAGE, "stream": True}
    with httpx.Client(timeout=300) as http:
        direct = http.post(
            f"{native.engine_url}/v1/messages", json={**body, "model": "smollm2"}, headers=headers
        )
        edge = http.post(
            f"{native.edge_url}/v1/messages", json={**body, "model": NATIVE}, headers=headers
        )
    assert direct.status_code == edge.status_code == 200, edge.text
    assert edge.headers["x-dispatcher-provider"] == "engine-native"
    direct_events, edge_events = _events(direct.content), _events(edge.content)
    assert [name for name, _ in edge_events] == [name for name, _ in direct_events]
    assert edge_events[0][0] == "message_start"
    assert edge_events[0][1]["message"]["model"] == NATIVE
    assert direct_events[0][1]["message"]["model"] == "smollm2"
    assert edge_events[-1][0] == "message_stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_with_the_anthropic_sdk(native: Stack, stream: bool) -> None:
    with anthropic.Anthropic(
        base_url=native.edge_url, api_key="sk-native", max_retries=0, timeout=300
    ) as sdk:
        # this SDK's create() has no temperature argument: it goes as an extra field
        knobs = {key: value for key, value in MESSAGE.items() if key != "temperature"}
        request: dict[str, Any] = {**knobs, "model": NATIVE, "extra_body": {"temperature": 0}}
        if stream:
            with sdk.messages.stream(**request) as events:
                text = "".join(events.text_stream)
                message = events.get_final_message()
        else:
            message = sdk.messages.create(**request)
            text = "".join(block.text for block in message.content if block.type == "text")
    assert text.strip()
    assert message.model == NATIVE
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0


def test_a_repeated_prompt_reads_the_engines_cache(native: Stack) -> None:
    """The same long system prompt twice: the second time the engine reuses its prefix and
    says so (``cache_read_input_tokens``); the client sees it, and the ledger's row keeps it."""
    request: dict[str, Any] = {
        "model": NATIVE,
        "max_tokens": 8,
        "system": LONG_SYSTEM,
        "messages": [{"role": "user", "content": "Where are the atlases?"}],
        "extra_body": {"temperature": 0},
    }
    with anthropic.Anthropic(
        base_url=native.edge_url, api_key="sk-native", max_retries=0, timeout=300
    ) as sdk:
        first = sdk.messages.create(**request)
        second = sdk.messages.with_raw_response.create(**request)
    again = second.parse()
    cached = again.usage.cache_read_input_tokens or 0
    assert cached > 100, (first.usage, again.usage)
    print(
        f"\nrepeated prompt on the native tunnel: first {first.usage.input_tokens} input tokens, "
        f"cache read {first.usage.cache_read_input_tokens}; second {again.usage.input_tokens} "
        f"input tokens, cache read {cached}"
    )
    request_id = second.headers["x-dispatcher-request-id"]
    with httpx.Client(timeout=30) as http:
        for _ in range(100):  # the ledger is written in batches
            report = http.get(f"{native.edge_url}/v1/usage", params={"model": NATIVE}).json()
            rows = [row for row in report["rows"] if row["request_id"] == request_id]
            if rows:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"no ledger row for {request_id}: {report}")
    (row,) = rows
    assert row["cached_tokens"] == cached
    assert row["prompt_tokens"] == again.usage.input_tokens + cached
    assert row["path"] == "tunnel"
    assert row["usage_source"] == "reported"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_are_relayed_natively(native: Stack, stream: bool) -> None:
    with client(native.edge_url) as sdk:
        request: dict[str, Any] = {
            "model": NATIVE,
            "instructions": SYSTEM,
            "input": QUESTION,
            "max_output_tokens": 24,
            "temperature": 0,
        }
        if stream:
            events = list(sdk.responses.create(**request, stream=True))
            assert events[0].type == "response.created"
            completed = [e for e in events if e.type == "response.completed"]
            assert len(completed) == 1
            response = completed[0].response
        else:
            response = sdk.responses.create(**request)
    assert isinstance(response, openai.types.responses.Response)
    assert response.model == NATIVE
    assert response.output_text.strip()
    assert response.usage is not None
    assert response.usage.output_tokens > 0
