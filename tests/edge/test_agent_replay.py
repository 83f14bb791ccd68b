"""What the real agent clients send, replayed (issue #21): the request bodies Codex CLI
(``/v1/responses``) and Claude Code (``/v1/messages`` and ``count_tokens``) sent a real edge,
captured unmodified with their headers (``tests/fixtures/agents/``), are posted to an edge on
127.0.0.1 serving the node of ``tests/agents/node.toml`` (the one ``nox -s agents`` runs the
clients against), and each must be answered 200 with a complete answer.

This is the fast half of the agents check: a validator tightened against what the clients
really send fails here, in the test command, before ``nox -s agents`` (which needs npm) runs.
To capture new bodies, run the clients through a recording proxy (``tests/agents/``'s
``record`` option, see ``docs/agents.md``).
"""

from __future__ import annotations

import functools
import string
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from dispatcher.config import EdgeConfig, HTTPSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from nodes.adapters import ADAPTERS
from nodes.config import NodeConfig, parse_node_config

from .fakes import wait_until

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
NODE_TOML = Path(__file__).resolve().parents[1] / "agents" / "node.toml"
MARKER = "/nonexistent/marker.txt"


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = orjson.loads((FIXTURES / f"{name}.json").read_bytes())
    return loaded


def agents_node(edge_url: str, marker: str) -> NodeConfig:
    """The node of ``tests/agents/node.toml``, its placeholders filled in."""
    text = string.Template(NODE_TOML.read_text()).substitute(edge_url=edge_url, marker=marker)
    return parse_node_config(
        tomllib.loads(text), source=str(NODE_TOML), environ={}, adapters=ADAPTERS
    )


@asynccontextmanager
async def open_edge() -> AsyncIterator[tuple[Dispatcher, str]]:
    config = EdgeConfig(port=0, local_node=False, http=HTTPSettings(shutdown_grace=2))
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        await dispatcher.attach_local_node(agents_node("ws://127.0.0.1:1/v1/nodes/connect", MARKER))
        server: Server = await nursery.start(
            functools.partial(dispatcher.serve, host="127.0.0.1", port=0)
        )
        yield dispatcher, f"http://127.0.0.1:{server.address.port}"
        server.shutdown()
        nursery.cancel_scope.cancel()


async def replay(base: str, name: str) -> httpx.Response:
    captured = fixture(name)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        return await client.request(
            captured["method"],
            captured["target"],
            headers=[(key, value) for key, value in captured["headers"]],
            content=orjson.dumps(captured["body"]),
        )


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of an SSE body with ``event:`` lines."""
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            lines = dict(line.split(": ", 1) for line in block.split("\n"))
            events.append((lines["event"], orjson.loads(lines["data"])))
    return events


def test_the_fixtures_are_what_the_clients_sent() -> None:
    """What makes them worth replaying: the fields and shapes the edge once refused."""
    codex = fixture("codex-first-turn")["body"]
    assert {"reasoning", "include", "prompt_cache_key", "client_metadata"} <= set(codex)
    assert {"namespace", "web_search"} <= {tool["type"] for tool in codex["tools"]}
    follow_up = fixture("codex-tool-follow-up")["body"]
    assert [i["type"] for i in follow_up["input"][-2:]] == ["function_call", "function_call_output"]
    claude = fixture("claude-code-first-turn")["body"]
    assert "system" in {message["role"] for message in claude["messages"]}
    assert claude["thinking"] == {"type": "adaptive"}
    assert {"context_management", "output_config"} <= set(claude)
    results = fixture("claude-code-tool-follow-up")["body"]["messages"][-1]["content"]
    assert results[0]["type"] == "tool_result"
    assert fixture("claude-code-count-tokens")["target"].startswith("/v1/messages/count_tokens")


@pytest.mark.parametrize("name", ["codex-first-turn", "codex-tool-follow-up"])
async def test_codex_requests_are_answered_with_a_complete_stream(name: str) -> None:
    async with open_edge() as (dispatcher, base):
        response = await replay(base, name)
        assert response.status_code == 200, response.text
        assert response.headers["x-dispatcher-dropped-tools"] == "web_search"
        events = sse_events(response.text)
        kinds = [kind for kind, _ in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed", kinds
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        output = events[-1][1]["response"]["output"]
        if name == "codex-first-turn":
            # echo-codex-tool's first answer: a call of Codex's own shell tool
            (call,) = output
            assert (call["type"], call["name"]) == ("function_call", "exec_command")
            assert orjson.loads(call["arguments"]) == {"cmd": f"cat {MARKER}"}
        else:
            # then the tool's result, read back as the answer
            (message,) = output
            assert message["type"] == "message"
            assert "hi-from-marker-file-7731" in message["content"][0]["text"]
        await wait_until(lambda: dispatcher.admission.statistics().in_use == 0)


@pytest.mark.parametrize("name", ["claude-code-first-turn", "claude-code-tool-follow-up"])
async def test_claude_code_requests_are_answered_with_a_complete_stream(name: str) -> None:
    async with open_edge() as (_, base):
        response = await replay(base, name)
        assert response.status_code == 200, response.text
        events = sse_events(response.text)
        kinds = [kind for kind, _ in events]
        assert kinds[0] == "message_start"
        assert kinds[-2:] == ["message_delta", "message_stop"], kinds
        blocks = [data["content_block"] for kind, data in events if kind == "content_block_start"]
        stop = events[-2][1]["delta"]["stop_reason"]
        if name == "claude-code-first-turn":
            assert [block["type"] for block in blocks] == ["tool_use"]
            assert blocks[0]["name"] == "Read"
            assert stop == "tool_use"
        else:
            assert [block["type"] for block in blocks] == ["text"]
            text = "".join(
                data["delta"]["text"] for kind, data in events if kind == "content_block_delta"
            )
            assert "hi-from-marker-file-7731" in text
            assert stop == "end_turn"


async def test_claude_code_count_tokens_is_answered() -> None:
    async with open_edge() as (_, base):
        response = await replay(base, "claude-code-count-tokens")
        assert response.status_code == 200, response.text
        tokens = response.json()["input_tokens"]
        # the body is 34 KiB of tool definitions: the estimate is in the thousands
        assert 5_000 < tokens < 20_000


async def test_count_tokens_takes_the_body_claude_code_sends_messages() -> None:
    """``count_tokens`` accepts what ``messages`` accepts: Claude Code's first-turn body
    (``max_tokens``, ``stream``, ``thinking``, a system message in ``messages`` ...), posted to
    it unmodified, is counted."""
    captured = fixture("claude-code-first-turn")
    async with open_edge() as (_, base), httpx.AsyncClient(base_url=base) as client:
        response = await client.post(
            "/v1/messages/count_tokens?beta=true",
            headers=captured["headers"],
            content=orjson.dumps(captured["body"]),
        )
        assert response.status_code == 200, response.text
        assert response.json()["input_tokens"] > 5_000
