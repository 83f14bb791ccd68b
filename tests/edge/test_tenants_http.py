"""Tenants over HTTP (issue #14, acceptance 2): each ``[[keys]]`` limit seen by the official
SDKs against a real edge on 127.0.0.1 -- the 429 arrives as ``openai.RateLimitError`` (or
``anthropic.RateLimitError``) with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers;
a recovered request counts once; a cancelled stream counts the tokens it used."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import trio

from dispatcher import wire
from dispatcher.config import (
    EdgeConfig,
    KeySettings,
    PriceSettings,
    QueuePolicySettings,
)

from .fakes import ScriptedNode, ServedEdge, connect, hello, serve_edge, wait_until

ADMIN = "sk-admin"
ALICE = "sk-alice"
BOB = "sk-bob"
MESSAGES: list[Any] = [{"role": "user", "content": "one two three four"}]
BODY = {"model": "echo", "messages": MESSAGES}
CLIENT_ID = "client-chosen-1"


class Edge(ServedEdge):
    def openai(self, key: str) -> openai.OpenAI:
        # max_retries=0: the SDK retries a 429 by itself otherwise.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=30)


def alice(**limits: Any) -> KeySettings:
    return KeySettings(id="alice", key=ALICE, **limits)


def open_edge(
    *keys: KeySettings,
    prices: dict[str, PriceSettings] | None = None,
    local_node: bool = True,
) -> AbstractAsyncContextManager[Edge]:
    config = EdgeConfig(
        port=0,
        local_node=False,
        admin_keys=(ADMIN,),
        keys=keys,
        prices=prices or {},
        models={"m": QueuePolicySettings()},
    )
    return serve_edge(config, Edge, local_node=local_node)


def chat(edge: Edge, key: str, model: str = "echo", **extra: Any) -> Any:
    """One chat completion through the SDK: (headers, completion)."""
    with edge.openai(key) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=MESSAGES, **extra
        )
        return raw.headers, raw.parse()


def refused(edge: Edge, key: str, model: str = "echo", **extra: Any) -> openai.RateLimitError:
    with edge.openai(key) as client, pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, **extra)
    return info.value


async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: function(*args, **kwargs))


# ------------------------------------------------------------------ rates


async def test_rpm_refusal_is_a_rate_limit_error_with_openais_headers() -> None:
    async with open_edge(alice(rpm=2)) as edge:
        first, _ = await in_thread(chat, edge, ALICE)
        second, _ = await in_thread(chat, edge, ALICE)
        error = await in_thread(refused, edge, ALICE)
    assert first["x-ratelimit-limit-requests"] == "2"
    assert first["x-ratelimit-remaining-requests"] == "1"
    assert second["x-ratelimit-remaining-requests"] == "0"
    assert second["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-tokens" not in first  # no TPM configured: no token headers
    assert error.status_code == 429
    assert error.code == "rate_limit_exceeded"
    assert error.type == "requests"
    headers = error.response.headers
    assert 55 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert len(edge.rows) == 2  # the refused request reached no node


async def test_tpm_counts_the_reported_usage_not_the_estimate() -> None:
    async with open_edge(alice(tpm=100)) as edge:
        # The estimate counts max_tokens: 90 of the 100 at admission ...
        headers, completion = await in_thread(chat, edge, ALICE, max_tokens=90)
        assert int(headers["x-ratelimit-remaining-tokens"]) < 10
        used = completion.usage.total_tokens
        assert 0 < used < 20
        # ... corrected to what was used when its usage row was recorded.
        await wait_until(lambda: len(edge.rows) == 1)
        error = await in_thread(refused, edge, ALICE, max_tokens=95)
    assert error.type == "tokens"
    assert error.code == "rate_limit_exceeded"
    headers = error.response.headers
    assert headers["x-ratelimit-limit-tokens"] == "100"
    assert int(headers["x-ratelimit-remaining-tokens"]) == 100 - used
    assert int(headers["retry-after"]) >= 1


async def open_stream(
    edge: Edge, key: str, body: dict[str, Any], until: bytes
) -> trio.SocketStream:
    """POST a streamed chat on a raw socket (the test decides when the client leaves) and
    read until ``until`` arrived."""
    payload = orjson.dumps(body)
    stream = await trio.open_tcp_stream("127.0.0.1", edge.server.address.port)
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
        % (key.encode(), len(payload), payload)
    )
    received = b""
    with trio.fail_after(10):
        while until not in received:
            chunk = await stream.receive_some()
            assert chunk, "the edge closed the stream early"
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 ")
    return stream


async def test_concurrency_limit_holds_for_the_whole_request() -> None:
    body = {"model": "echo", "messages": MESSAGES, "stream": True}
    async with open_edge(alice(max_concurrent=1)) as edge:
        # The stream starts and stalls: its place is held.
        held = await open_stream(edge, ALICE, {**body, "echo": {"stall_after_tokens": 2}}, b"one")
        error = await in_thread(refused, edge, ALICE)
        assert error.code == "rate_limit_exceeded"
        assert error.response.headers["retry-after"] == "1"
        assert "in flight" in error.message
        await held.aclose()
        # The client left: the request ended, its place is free again.
        await wait_until(lambda: edge.dispatcher.tenants.limits.in_flight("alice") == 0)
        _, completion = await in_thread(chat, edge, ALICE)
        assert completion.choices[0].message.content == "one two three four"


# ------------------------------------------------------------------ budgets


async def test_a_spent_token_budget_is_insufficient_quota() -> None:
    async with open_edge(alice(budget_tokens_day=5)) as edge:
        await in_thread(chat, edge, ALICE)  # spends more than 5: the budget is gone after it
        await wait_until(lambda: len(edge.rows) == 1)
        error = await in_thread(refused, edge, ALICE)
    assert error.status_code == 429
    assert error.code == "insufficient_quota"
    assert error.type == "insufficient_quota"
    assert 0 < int(error.response.headers["retry-after"]) <= 86400  # the next UTC midnight


async def test_a_money_budget_is_spent_at_the_price_table() -> None:
    # 1 USD per input token: the first request costs more than the budget of 3 USD.
    prices = {"echo": PriceSettings(input_per_mtok=1_000_000.0, output_per_mtok=0.0)}
    async with open_edge(alice(budget_usd_month=3.0), prices=prices) as edge:
        _, completion = await in_thread(chat, edge, ALICE)
        await wait_until(lambda: len(edge.rows) == 1)
        error = await in_thread(refused, edge, ALICE)
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            auth = {"authorization": f"Bearer {ALICE}"}
            usage = (await client.get("/v1/usage", headers=auth)).json()
    assert error.code == "insufficient_quota"
    assert usage["rows"][0]["cost_usd"] == pytest.approx(completion.usage.prompt_tokens)
    assert usage["cost_usd"] == pytest.approx(completion.usage.prompt_tokens)


# ------------------------------------------------------------------ counted once


async def fail_first_then_answer(nodes: list[ScriptedNode], failed: list[str]) -> None:
    """Each node answers its runs; the first run of all fails before any content."""

    async def serve(node: ScriptedNode) -> None:
        while True:
            request = await node.receive_run()
            if not failed:
                failed.append(node.conn.name if hasattr(node.conn, "name") else "first")
                fault = {"code": "upstream_5xx", "message": "boom", "retryable": True}
                await node.emit(request.run_id, ("run.started", {}), ("run.failed", fault))
                continue
            usage = wire.Usage(prompt_tokens=4, completion_tokens=2)
            await node.emit(
                request.run_id,
                ("run.started", {}),
                ("run.delta", {"text": "ok ok"}),
                ("run.usage", {"usage": usage}),
                ("run.completed", {}),
            )

    async with trio.open_nursery() as nursery:
        for node in nodes:
            nursery.start_soon(serve, node)


async def test_a_recovered_request_counts_once() -> None:
    async with open_edge(alice(rpm=2), local_node=False) as edge:
        nodes = [
            await connect(edge.dispatcher, hello("node-a", model="m")),
            await connect(edge.dispatcher, hello("node-b", model="m")),
        ]
        failed: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail_first_then_answer, nodes, failed)
            headers, completion = await in_thread(chat, edge, ALICE, model="m")
            # Two attempts, one request of the limit: another one still fits.
            assert headers["x-dispatcher-attempts"] == "2"
            assert headers["x-ratelimit-remaining-requests"] == "1"
            await in_thread(chat, edge, ALICE, model="m")
            error = await in_thread(refused, edge, ALICE, model="m")
            assert error.code == "rate_limit_exceeded"
            nursery.cancel_scope.cancel()
        await wait_until(lambda: len(edge.rows) == 3)
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            auth = {"authorization": f"Bearer {ALICE}"}
            usage = (await client.get("/v1/usage?group_by=key", headers=auth)).json()
    assert completion.choices[0].message.content == "ok ok"
    assert [row.billable_to for row in edge.rows].count("operator") == 1
    (group,) = usage["groups"]
    assert group["key"] == "alice"
    assert group["requests"] == 2
    assert group["attempts"] == 3
    # Only the committed attempts are billed: 6 tokens each, the failed one's are not.
    assert group["billable"]["total_tokens"] == 12


async def test_a_cancelled_stream_counts_the_tokens_it_used() -> None:
    async with open_edge(alice(tpm=1000)) as edge:
        words = " ".join(f"w{i}" for i in range(40))
        body = {
            "model": "echo",
            "messages": [{"role": "user", "content": words}],
            "stream": True,
            "echo": {"stall_after_tokens": 5},
        }
        stream = await open_stream(edge, ALICE, body, b"w4 ")  # 5 tokens, then it stalls
        await stream.aclose()
        # The client left: the row (cancelled, billable) carries the 5 tokens emitted.
        await wait_until(lambda: len(edge.rows) == 1)
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            auth = {"authorization": f"Bearer {ALICE}"}
            usage = (await client.get("/v1/usage", headers=auth)).json()
        headers, completion = await in_thread(chat, edge, ALICE)
    (row, _) = edge.rows
    assert row.outcome == "cancelled"
    assert row.billable_to == "client"
    assert (row.prompt_tokens, row.completion_tokens) == (40, 5)
    assert usage["totals"]["billable"]["client"]["completion_tokens"] == 5
    # The window holds the stream's 45 tokens (not its estimate, nothing less) beside the
    # estimate of the request answered now.
    estimate = 1000 - int(headers["x-ratelimit-remaining-tokens"]) - 45
    assert 0 < estimate <= 10
    assert completion.usage.total_tokens > 0


# ------------------------------------------------------------------ other routes


async def test_the_anthropic_route_answers_the_429_in_its_shape_with_the_headers() -> None:
    async with open_edge(alice(rpm=1)) as edge:

        def messages() -> Any:
            client = anthropic.Anthropic(base_url=edge.url, api_key=ALICE, max_retries=0)
            with client:
                first = client.messages.with_raw_response.create(
                    model="echo", max_tokens=64, messages=MESSAGES
                )
                with pytest.raises(anthropic.RateLimitError) as info:
                    client.messages.create(model="echo", max_tokens=64, messages=MESSAGES)
            return first.headers, info.value

        first, error = await in_thread(messages)
    assert first["x-ratelimit-remaining-requests"] == "0"
    assert error.status_code == 429
    assert error.body["type"] == "error"
    assert error.body["error"]["type"] == "rate_limit_error"
    assert error.response.headers["x-ratelimit-limit-requests"] == "1"
    assert int(error.response.headers["retry-after"]) >= 55


async def test_embeddings_and_responses_routes_are_limited_too() -> None:
    async with open_edge(alice(rpm=1)) as edge:
        await in_thread(chat, edge, ALICE)

        def others() -> list[openai.RateLimitError]:
            errors = []
            with edge.openai(ALICE) as client:
                with pytest.raises(openai.RateLimitError) as info:
                    client.responses.create(model="echo", input="hi")
                errors.append(info.value)
                with pytest.raises(openai.RateLimitError) as info:
                    client.embeddings.create(model="echo", input="hi")
                errors.append(info.value)
            return errors

        errors = await in_thread(others)
    for error in errors:
        assert error.response.headers["x-ratelimit-remaining-requests"] == "0"


async def test_a_model_outside_the_keys_patterns_does_not_exist_for_it() -> None:
    async with open_edge(alice(models=("llama-*",)), KeySettings(id="bob", key=BOB)) as edge:

        def calls() -> tuple[openai.NotFoundError, list[str], list[str], openai.NotFoundError]:
            with edge.openai(ALICE) as client:
                with pytest.raises(openai.NotFoundError) as info:
                    client.chat.completions.create(model="echo", messages=MESSAGES)
                listed = [model.id for model in client.models.list()]
                with pytest.raises(openai.NotFoundError) as one:
                    client.models.retrieve("echo")
            with edge.openai(BOB) as client:
                bobs = [model.id for model in client.models.list()]
            return info.value, listed, bobs, one.value

        error, listed, bobs, one = await in_thread(calls)
    assert error.code == "model_not_found"
    assert error.body["message"] == "model 'echo' does not exist"  # as for a model nobody serves
    assert listed == []
    assert bobs == ["echo"]
    assert one.code == "model_not_found"


async def test_usage_a_key_sees_its_own_and_the_admin_key_everything() -> None:
    prices = {"echo": PriceSettings(input_per_mtok=2.0, output_per_mtok=4.0)}
    async with open_edge(alice(), KeySettings(id="bob", key=BOB), prices=prices) as edge:
        await in_thread(chat, edge, ALICE)
        await in_thread(chat, edge, BOB)
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            mine = {"authorization": f"Bearer {BOB}", "x-request-id": CLIENT_ID}
            answered = await client.post("/v1/chat/completions", json=BODY, headers=mine)
            assert answered.status_code == 200

            async def usage(key: str, query: str = "") -> httpx.Response:
                return await client.get(f"/v1/usage{query}", headers={"x-api-key": key})

            own = (await usage(ALICE)).json()
            other = await usage(ALICE, "?attribution=bob")
            everything = (await usage(ADMIN)).json()
            by_day = (await usage(ADMIN, "?group_by=day,key")).json()
            one = (await usage(ADMIN, f"?client_request_id={CLIENT_ID}&group_by=key")).json()
            bad = await usage(ADMIN, "?group_by=colour")
    assert {row["attribution"] for row in own["rows"]} == {"alice"}
    assert [group["key"] for group in own["groups"]] == ["alice"]
    assert other.status_code == 403
    assert other.json()["error"]["type"] == "permission_error"
    groups = {group["key"]: group for group in everything["groups"]}
    assert set(groups) == {"alice", "bob"}
    bob = groups["bob"]
    assert bob["model"] == "echo"
    assert bob["route"] == "/v1/chat/completions"
    assert bob["requests"] == 2
    expected = (bob["prompt_tokens"] * 2.0 + bob["completion_tokens"] * 4.0) / 1e6
    assert bob["cost_usd"] == pytest.approx(expected)
    assert everything["cost_usd"] == pytest.approx(sum(g["cost_usd"] for g in groups.values()))
    assert by_day["group_by"] == ["day", "key"]
    fields = (
        "requests", "attempts", "prompt_tokens", "completion_tokens", "total_tokens",
        "cached_tokens", "cache_write_tokens", "reasoning_tokens",
    )  # fmt: skip
    assert {tuple(g) for g in by_day["groups"]} == {("day", "key", *fields, "billable", "cost_usd")}
    assert [(g["key"], g["requests"]) for g in one["groups"]] == [("bob", 1)]
    assert bad.status_code == 400
    assert "group_by" in bad.json()["error"]["message"]


# ------------------------------------------------------------------ models between nodes


async def test_a_model_a_key_names_is_unavailable_to_it_and_unknown_to_others() -> None:
    """No node serves ``gpt-x``: alice's key names it exactly, so she gets a retryable 503
    ``model_unavailable`` (it is hers, it may come); bob's key may use any model and gets
    the 404 a name nobody configured gets -- alice's list tells him nothing."""
    keys = (alice(models=("gpt-x", "echo")), KeySettings(id="bob", key=BOB))
    async with open_edge(*keys) as edge, httpx.AsyncClient(base_url=edge.url) as client:
        answers = {
            key: await client.post(
                "/v1/chat/completions",
                json={"model": "gpt-x", "messages": MESSAGES},
                headers={"authorization": f"Bearer {key}"},
            )
            for key in (ALICE, BOB)
        }
    assert answers[ALICE].status_code == 503, answers[ALICE].text
    assert answers[ALICE].headers["retry-after"] == "2"
    error = answers[ALICE].json()["error"]
    assert error["code"] == "model_unavailable"
    assert error["message"] == (
        "no node serves model 'gpt-x' right now (your key's allowed models name it); retry shortly"
    )
    assert answers[BOB].status_code == 404, answers[BOB].text
    assert answers[BOB].json()["error"]["code"] == "model_not_found"
