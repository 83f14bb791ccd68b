"""Observability against a real edge on 127.0.0.1 port 0: the access log (one line per
request, its fields, what clients and nodes sent escaped in both formats), the request
metrics after real traffic (parsed with prometheus_client's own parser), ``GET /admin/status``
(nodes, queues, requests in flight, recent failures; its access rule; no secrets), and
``docs/metrics.md`` / ``docs/grafana-dashboard.json`` against what ``/metrics`` exports."""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dispatcher import wire
from dispatcher.admission import Policy, PolicySnapshot
from dispatcher.api.app import key_id
from dispatcher.config import EdgeConfig, QueuePolicySettings
from dispatcher.edge import open_dispatcher
from dispatcher.http import Server
from dispatcher.observe.logs import FIELDS, JsonFormatter, TextFormatter
from dispatcher.observe.status import MAX_IN_FLIGHT
from dispatcher.observe.traffic import RECENT_FAILURES

from . import test_admission_http, test_tunnel
from .fakes import ScriptedNode, connect, hello, wait_until
from .logs import Captured

DOCS = Path(__file__).resolve().parents[2] / "docs"

CLIENT_KEY = "sk-client-secret-1"
ADMIN_KEY = "sk-admin-secret-2"
NODE_TOKEN = "node-token-secret-3"

ACCESS_FIELDS = (
    "request_id",
    "client_request_id",
    "method",
    "path",
    "route",
    "model",
    "key_id",
    "stream",
    "state",
    "node",
    "provider",
    "status",
    "outcome",
    "error_code",
    "error",
    "attempts",
    "queue_wait_s",
    "ttft_s",
    "duration_s",
    "input_tokens",
    "output_tokens",
    "tokens_source",
    "dropped_tools",
    "started_at",
)


@attrs.frozen
class Edge(test_admission_http.Edge):
    def client(self, key: str | None = ADMIN_KEY) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)

    async def status(self) -> dict[str, Any]:
        async with self.client() as client:
            response = await client.get("/admin/status")
        assert response.status_code == 200, response.text
        document: dict[str, Any] = response.json()
        return document


@asynccontextmanager
async def open_edge(*, local_node: bool = True, **policy: object) -> AsyncIterator[Edge]:
    config = EdgeConfig(
        port=0,
        local_node=False,
        api_keys=(CLIENT_KEY,),
        admin_keys=(ADMIN_KEY,),
        admission=QueuePolicySettings(**policy),  # type: ignore[arg-type]
        models={"m": QueuePolicySettings()},
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        if local_node:
            await dispatcher.attach_local_node()
        server: Server = await nursery.start(dispatcher.serve)
        yield Edge(dispatcher, server)
        server.shutdown()


def chat(model: str = "echo", content: str = "the quick brown fox", **extra: object) -> Any:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def both_formats(record: logging.LogRecord) -> tuple[str, dict[str, Any]]:
    """``record`` as the text format writes it and as the JSON format's line parses; both
    are asserted to be one line."""
    text = TextFormatter().format(record)
    line = JsonFormatter().format(record)
    if not record.exc_info:  # a traceback follows the text line on lines of its own
        assert re.search(r"[\r\n]", text) is None, text
    assert re.search(r"[\r\n]", line) is None, line
    document: dict[str, Any] = json.loads(line)
    return text, document


# -- the access log ---------------------------------------------------------------------


async def test_access_log_one_line_per_request_with_its_fields(logs: Captured) -> None:
    async with open_edge() as edge:
        base = f"{edge.url}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key=CLIENT_KEY, max_retries=0) as sdk:
            raw = await sdk.chat.completions.with_raw_response.create(
                model="echo",
                messages=[{"role": "user", "content": "the quick brown fox"}],
                extra_headers={"x-request-id": "client-1"},
            )
            completion = raw.parse()
            with pytest.raises(openai.NotFoundError):
                await sdk.chat.completions.create(
                    model="no-such-model", messages=[{"role": "user", "content": "hi"}]
                )

        def stream() -> str:
            with openai.OpenAI(base_url=base, api_key=CLIENT_KEY) as client:
                response = client.chat.completions.with_raw_response.create(
                    model="echo",
                    messages=[{"role": "user", "content": "one two three four five"}],
                    stream=True,
                    extra_headers={"x-request-id": "client-2"},
                )
                for _ in response.parse():
                    pass
                return response.headers["x-dispatcher-request-id"]

        streamed_id = await trio.to_thread.run_sync(stream)
        async with edge.client(CLIENT_KEY) as client:
            models = await client.get("/v1/models")
        async with edge.client(None) as client:
            unauthorized = await client.get("/v1/models")
        async with edge.client(CLIENT_KEY) as client:
            unknown_path = await client.get("/v1/nowhere")

    access = logs.access()
    assert len(access) == 6  # one line per request, nothing else
    for fields in access:
        assert tuple(fields) == ACCESS_FIELDS

    line = logs.line_of(raw.headers["x-dispatcher-request-id"])
    usage = completion.usage
    assert usage is not None
    assert line["client_request_id"] == "client-1"
    assert (line["method"], line["path"], line["route"]) == (
        "POST",
        "/v1/chat/completions",
        "/v1/chat/completions",
    )
    assert (line["model"], line["node"], line["stream"]) == ("echo", "local", False)
    assert line["key_id"] == key_id(CLIENT_KEY.encode())
    assert (line["status"], line["outcome"], line["attempts"]) == (200, "completed", 1)
    assert (line["error_code"], line["error"]) == (None, None)
    assert (line["input_tokens"], line["output_tokens"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert line["tokens_source"] == "reported"
    assert 0 <= line["queue_wait_s"] <= line["ttft_s"] <= line["duration_s"]
    assert line["state"] == "answering"

    streamed = logs.line_of(streamed_id)
    assert (streamed["client_request_id"], streamed["stream"]) == ("client-2", True)
    assert (streamed["status"], streamed["outcome"], streamed["node"]) == (
        200,
        "completed",
        "local",
    )
    assert streamed["output_tokens"] == 5
    assert streamed["ttft_s"] is not None

    listing = logs.line_of(models.headers["x-dispatcher-request-id"])
    assert (listing["route"], listing["status"], listing["outcome"]) == (
        "/v1/models",
        200,
        "completed",
    )
    assert (listing["model"], listing["attempts"], listing["input_tokens"]) == (None, 0, None)

    refused = logs.line_of(unauthorized.headers["x-dispatcher-request-id"])
    assert (refused["status"], refused["outcome"], refused["key_id"]) == (401, "bad_request", None)
    assert refused["error_code"] == "invalid_api_key"

    nowhere = logs.line_of(unknown_path.headers["x-dispatcher-request-id"])
    assert (nowhere["route"], nowhere["status"], nowhere["error_code"]) == (
        None,
        404,
        "unknown_url",
    )

    [missing] = [f for f in access if f["model"] == "no-such-model"]
    assert (missing["status"], missing["outcome"]) == (404, "rejected")
    assert missing["error_code"] == "model_not_found"

    # The text format: the message, then every field as key=value.
    record = next(
        r for r in logs.records if getattr(r, FIELDS, {}).get("client_request_id") == "client-1"
    )
    text, document = both_formats(record)
    assert " INFO    dispatcher.access: POST /v1/chat/completions 200 request_id=req-" in text
    assert " route=/v1/chat/completions model=echo " in text
    assert " status=200 outcome=completed error_code=- error=- " in text
    assert document["message"] == "POST /v1/chat/completions 200"
    assert {k: document[k] for k in ACCESS_FIELDS} == line


async def test_quiet_routes_log_at_debug_unless_they_fail(logs: Captured) -> None:
    async with open_edge() as edge:
        async with edge.client() as client:
            health = await client.get("/healthz")
            metrics = await client.get("/metrics")
            status = await client.get("/admin/status")
        async with edge.client(CLIENT_KEY) as client:
            forbidden = await client.get("/admin/status")
    levels = {
        getattr(r, FIELDS)["request_id"]: r.levelno
        for r in logs.records
        if r.name == "dispatcher.access"
    }
    for response in (health, metrics, status):
        assert response.status_code == 200
        assert levels[response.headers["x-dispatcher-request-id"]] == logging.DEBUG
    assert forbidden.status_code == 401
    assert levels[forbidden.headers["x-dispatcher-request-id"]] == logging.INFO


FORGED = "bad\r\n2026-01-01 00:00:00,000 INFO    dispatcher.access: POST /v1/x 200 forged=1"


async def test_what_clients_and_nodes_send_is_escaped_in_both_formats(logs: Captured) -> None:
    async with open_edge(local_node=False) as edge, trio.open_nursery() as nursery:
        node = await connect(edge.dispatcher, hello("node-a", model="m"))

        async def fail_the_run() -> None:
            run = await node.receive_run()
            await node.emit(
                run.run_id,
                ("run.failed", {"code": "boom", "message": FORGED, "retryable": False}),
            )
            await node.answer_pings()

        nursery.start_soon(fail_the_run)
        async with edge.client(CLIENT_KEY) as client:
            failed = await client.post("/v1/chat/completions", json=chat("m"))
            forged_model = await client.post("/v1/chat/completions", json=chat(FORGED))
            status = (await edge.status())["recent_failures"]
        await node.conn.aclose()

    assert failed.status_code == 502
    assert forged_model.status_code == 404
    for record in logs.records:  # every line the edge logged, not only the access log
        both_formats(record)

    line = logs.line_of(failed.headers["x-dispatcher-request-id"])
    assert (line["node"], line["outcome"], line["error_code"]) == ("node-a", "failed", "boom")
    assert FORGED in line["error"]
    [record] = [
        r for r in logs.records if getattr(r, FIELDS, {}).get("request_id") == line["request_id"]
    ]
    text, document = both_formats(record)
    assert (
        "\\r\\n2026-01-01 00:00:00,000 INFO    dispatcher.access: POST /v1/x 200 forged=1" in text
    )
    assert FORGED in document["error"]  # the same text once parsed

    line = logs.line_of(forged_model.headers["x-dispatcher-request-id"])
    assert line["model"] == FORGED
    [record] = [
        r for r in logs.records if getattr(r, FIELDS, {}).get("request_id") == line["request_id"]
    ]
    text, document = both_formats(record)
    assert ' model="bad\\r\\n2026-01-01 00:00:00,000 INFO' in text
    assert document["model"] == FORGED

    # The status page has it as data: JSON-escaped by construction.
    assert FORGED in by_id(status, failed.headers["x-dispatcher-request-id"])["error"]
    assert by_id(status, forged_model.headers["x-dispatcher-request-id"])["model"] == FORGED


async def test_no_secret_is_logged(logs: Captured) -> None:
    async with open_edge() as edge:
        async with edge.client(CLIENT_KEY) as client:
            assert (await client.post("/v1/chat/completions", json=chat())).status_code == 200
        async with edge.client("sk-wrong-secret-4") as client:
            assert (await client.post("/v1/chat/completions", json=chat())).status_code == 401
        async with edge.client() as client:
            assert (await client.get("/admin/status")).status_code == 200
    written = "\n".join(
        line for record in logs.records for line in both_formats(record)[0].splitlines()
    )
    written += "\n".join(JsonFormatter().format(record) for record in logs.records)
    for secret in (CLIENT_KEY, ADMIN_KEY, "sk-wrong-secret-4", "the quick brown fox"):
        assert secret not in written


# -- metrics after real traffic ----------------------------------------------------------


def scrape(text: str) -> dict[str, list[Sample]]:
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(samples: dict[str, list[Sample]], family: str, name: str, **labels: str) -> float:
    found = [
        s.value
        for s in samples[family]
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (name, labels, samples[family])
    return found[0]


async def test_metrics_families_after_real_traffic() -> None:
    async with open_edge() as edge:
        async with openai.AsyncOpenAI(
            base_url=f"{edge.url}/v1", api_key=CLIENT_KEY, max_retries=0
        ) as sdk:
            usages = []
            for text in ("one two three", "four five six seven"):
                completion = await sdk.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": text}]
                )
                assert completion.usage is not None
                usages.append(completion.usage)
            with pytest.raises(openai.BadRequestError):
                await sdk.chat.completions.create(model="echo", messages=[])
        async with edge.client() as client:
            samples = scrape((await client.get("/metrics")).text)

    chat_route = {
        "gen_ai_request_model": "echo",
        "gen_ai_operation_name": "chat",
        "route": "/v1/chat/completions",
    }
    duration = "gen_ai_server_request_duration_seconds"
    assert value(samples, duration, f"{duration}_count", **chat_route, outcome="completed") == 2
    assert value(samples, duration, f"{duration}_sum", **chat_route, outcome="completed") > 0
    bad = {**chat_route, "gen_ai_request_model": "unknown", "outcome": "bad_request"}
    assert value(samples, duration, f"{duration}_count", **bad) == 1

    ttft = "gen_ai_server_time_to_first_token_seconds"
    assert value(samples, ttft, f"{ttft}_count", **chat_route) == 2
    assert value(samples, ttft, f"{ttft}_bucket", **chat_route, le="+Inf") == 2

    tokens = "gen_ai_client_token_usage"
    prompt = sum(u.prompt_tokens for u in usages)
    output = sum(u.completion_tokens for u in usages)
    assert (
        value(samples, tokens, f"{tokens}_sum", **chat_route, gen_ai_token_type="input") == prompt
    )
    assert (
        value(samples, tokens, f"{tokens}_sum", **chat_route, gen_ai_token_type="output") == output
    )
    assert value(samples, tokens, f"{tokens}_count", **chat_route, gen_ai_token_type="output") == 2

    assert value(samples, "dispatcher_attempts", "dispatcher_attempts_total", model="echo") == 2
    assert value(samples, "dispatcher_recoveries", "dispatcher_recoveries_total", model="echo") == 0
    assert value(samples, "dispatcher_connected_nodes", "dispatcher_connected_nodes") == 1
    for gauge in ("dispatcher_inflight_requests", "dispatcher_inflight_runs"):
        assert value(samples, gauge, gauge) == 0


async def test_attempts_and_recoveries(logs: Captured) -> None:
    async with open_edge(local_node=False) as edge, trio.open_nursery() as nursery:
        nodes = [await connect(edge.dispatcher, hello(name, model="m")) for name in "ab"]
        script = ["retry", "answer", "answer", "final"]  # what the runs get, in order

        async def answer(node: ScriptedNode) -> None:
            while True:
                run = await node.receive_run()
                action = script.pop(0)
                events: list[tuple[str, dict[str, object]]]
                if action == "answer":
                    events = [("run.delta", {"text": "ok"}), ("run.completed", {})]
                else:
                    retry = action == "retry"
                    failure = {"code": "overloaded", "message": "try another", "retryable": True}
                    final = {"code": "broken", "message": "no luck", "retryable": False}
                    events = [("run.failed", failure if retry else final)]
                await node.emit(run.run_id, *events)

        for node in nodes:
            nursery.start_soon(answer, node)
        async with edge.client(CLIENT_KEY) as client:
            recovered = await client.post("/v1/chat/completions", json=chat("m"))
            await client.post("/v1/chat/completions", json=chat("m"))
            given_up = await client.post("/v1/chat/completions", json=chat("m"))
        async with edge.client() as client:
            samples = scrape((await client.get("/metrics")).text)
        failures = (await edge.status())["recent_failures"]
        nursery.cancel_scope.cancel()
    assert recovered.status_code == 200
    assert recovered.headers["x-dispatcher-attempts"] == "2"
    assert given_up.status_code == 502
    line = logs.line_of(recovered.headers["x-dispatcher-request-id"])
    assert (line["attempts"], line["outcome"], line["error"]) == (2, "completed", None)
    # 2 + 1 + 1 attempts, the first request's second one a recovery.
    assert value(samples, "dispatcher_attempts", "dispatcher_attempts_total", model="m") == 4
    assert value(samples, "dispatcher_recoveries", "dispatcher_recoveries_total", model="m") == 1
    [failure] = failures
    assert failure["request_id"] == given_up.headers["x-dispatcher-request-id"]
    assert (failure["status"], failure["outcome"], failure["error_code"]) == (
        502,
        "failed",
        "broken",
    )
    assert "no luck" in failure["error"]
    assert failure["attempts"] == 1


# -- GET /admin/status -------------------------------------------------------------------


def by_id(items: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    [found] = [item for item in items if item["request_id"] == request_id]
    return found


async def test_status_shows_a_stream_in_flight_and_a_queued_request_then_neither() -> None:
    async with open_edge(local_node=False) as edge, trio.open_nursery() as nursery:
        node = await connect(edge.dispatcher, hello("node-a", model="m", slots=1))
        streamed: list[bytes] = []
        answered: list[httpx.Response] = []

        async def stream() -> None:
            async with edge.client(CLIENT_KEY) as client:
                body = chat("m", stream=True)
                headers = {"x-request-id": "streaming-1"}
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body, headers=headers
                ) as response:
                    async for chunk in response.aiter_bytes():
                        streamed.append(chunk)

        async def queued() -> None:
            async with edge.client(CLIENT_KEY) as client:
                headers = {"x-request-id": "queued-1"}
                answered.append(
                    await client.post("/v1/chat/completions", json=chat("m"), headers=headers)
                )

        nursery.start_soon(stream)
        run = await node.receive_run()
        usage = wire.Usage(prompt_tokens=11, completion_tokens=2)
        await node.emit(
            run.run_id, ("run.delta", {"text": "partial "}), ("run.usage", {"usage": usage})
        )
        await wait_until(lambda: streamed)
        nursery.start_soon(queued)
        await wait_until(lambda: edge.dispatcher.admission.statistics().waiting == 1)

        during = await edge.status()
        assert during["in_flight_total"] == 2
        ids = {item["client_request_id"]: item for item in during["in_flight"]}
        streaming, waiting = ids["streaming-1"], ids["queued-1"]
        assert streaming["state"] == "answering"
        assert (streaming["route"], streaming["model"], streaming["stream"]) == (
            "/v1/chat/completions",
            "m",
            True,
        )
        assert (streaming["node"], streaming["provider"], streaming["attempts"]) == (
            "node-a",
            "p1",
            1,
        )
        assert streaming["key_id"] == key_id(CLIENT_KEY.encode())
        assert (streaming["input_tokens"], streaming["output_tokens"]) == (11, 2)
        assert streaming["duration_s"] >= streaming["ttft_s"] >= 0
        assert (streaming["status"], streaming["outcome"]) == (200, None)
        assert waiting["state"] == "queued"
        assert (waiting["node"], waiting["attempts"], waiting["stream"]) == (None, 0, False)
        assert waiting["queue_wait_s"] >= 0
        [queue] = [q for q in during["queues"] if q["model"] == "m"]
        assert queue["depth"] == 1
        assert queue["oldest_wait_s"] is not None
        [seen] = during["nodes"]
        assert (seen["id"], seen["label"], seen["generation"]) == ("node-a", "node-a label", 1)
        assert (seen["slots_total"], seen["slots_in_use"], seen["draining"]) == (1, 1, False)
        assert seen["providers"][0]["models"][0]["slots_in_use"] == 1
        assert seen["providers"][0]["models"][0]["health"] == "healthy"
        assert seen["last_heard_s"] is not None
        assert seen["connected_at"] <= during["generated_at"]

        await node.send(wire.RunCompleted(run_id=run.run_id, seq=2))
        second = await node.receive_run()
        await node.emit(second.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))
        await wait_until(lambda: answered)
        after = await edge.status()
        await node.conn.aclose()

    assert answered[0].status_code == 200
    assert b"data: [DONE]" in b"".join(streamed)
    assert (after["in_flight_total"], after["in_flight"]) == (0, [])
    assert after["recent_failures"] == []
    [queue] = [q for q in after["queues"] if q["model"] == "m"]
    assert (queue["depth"], queue["oldest_wait_s"]) == (0, None)
    assert after["nodes"][0]["slots_in_use"] == 0


async def test_status_counts_recent_429_and_503_per_queue() -> None:
    async with (
        open_edge(local_node=False, max_queue=1, queue_timeout_s=0.3) as edge,
        trio.open_nursery() as nursery,
    ):
        node = await connect(edge.dispatcher, hello("node-a", model="m", slots=1))
        results: list[int] = []

        async def call() -> None:
            async with edge.client(CLIENT_KEY) as client:
                results.append(
                    (await client.post("/v1/chat/completions", json=chat("m"))).status_code
                )

        nursery.start_soon(call)  # holds the slot: the node never answers
        await node.receive_run()
        nursery.start_soon(call)  # queued, times out: 503
        await wait_until(lambda: edge.dispatcher.admission.statistics().waiting == 1)
        nursery.start_soon(call)  # the queue is full: 429
        await wait_until(lambda: sorted(results) == [429, 503])
        document = await edge.status()
        nursery.cancel_scope.cancel()
    [queue] = [q for q in document["queues"] if q["model"] == "m"]
    assert (queue["refused_429"], queue["refused_503"]) == (1, 1)
    assert queue["last_refused_at"] <= document["generated_at"]
    outcomes = {(f["status"], f["outcome"], f["error_code"]) for f in document["recent_failures"]}
    assert outcomes == {(429, "rejected", "queue_full"), (503, "rejected", "queue_timeout")}


async def test_status_access_follows_the_admin_routes() -> None:
    async with open_edge() as edge:
        for key, expected in ((None, 401), (CLIENT_KEY, 401), ("sk-nope", 401), (ADMIN_KEY, 200)):
            async with edge.client(key) as client:
                assert (await client.get("/admin/status")).status_code == expected
    config = EdgeConfig(port=0, local_node=False)
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        url = f"http://127.0.0.1:{server.address.port}"
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.get("/admin/status")  # no keys at all: open
        server.shutdown()
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    assert response.json()["nodes"] == []


async def test_status_holds_no_secret() -> None:
    config = EdgeConfig(
        port=0,
        local_node=False,
        api_keys=(CLIENT_KEY,),
        admin_keys=(ADMIN_KEY,),
        nodes=attrs.evolve(EdgeConfig().nodes, tokens=(NODE_TOKEN,)),
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        node = await connect(dispatcher, hello("node-a", model="m", token=NODE_TOKEN))
        nursery.start_soon(node.answer_pings)
        edge = Edge(dispatcher, server)
        async with edge.client(CLIENT_KEY) as client:
            body = chat("m", "a secret prompt")
            nursery.start_soon(functools.partial(client.post, "/v1/chat/completions", json=body))
            await node.receive_run()
            document = json.dumps(await edge.status())
            nursery.cancel_scope.cancel()
    assert '"node-a"' in document
    assert "/v1/chat/completions" in document
    for secret in (CLIENT_KEY, ADMIN_KEY, NODE_TOKEN, "a secret prompt"):
        assert secret not in document


async def test_status_lists_are_bounded() -> None:
    async with open_edge() as edge:
        traffic = edge.dispatcher.traffic
        for number in range(RECENT_FAILURES + 5):
            with pytest.raises(RuntimeError), traffic.open(f"req-{number}", None, "GET", "/x"):
                raise RuntimeError("unexpected")
        with ExitStack() as stack:
            for number in range(MAX_IN_FLIGHT + 3):
                record = stack.enter_context(traffic.open(f"open-{number}", None, "GET", "/x"))
                record.routed("/v1/chat/completions", work=True)
            document = await edge.dispatcher.status()
        assert traffic.in_flight == {}
    assert document.in_flight_total == MAX_IN_FLIGHT + 3
    assert len(document.in_flight) == MAX_IN_FLIGHT
    assert len(document.recent_failures) == RECENT_FAILURES
    assert document.recent_failures[0].request_id == f"req-{RECENT_FAILURES + 4}"  # newest first
    assert document.recent_failures[0].error == "RuntimeError: unexpected"


async def test_a_left_on_exception_is_the_client_leaving_not_an_internal_error() -> None:
    """The API opens its records with ``left_on=PeerGone``: a request that ends because its
    client went away is ``client_gone``, not a failure; another exception still is one."""

    class Gone(Exception):
        pass

    async with open_edge() as edge:
        traffic = edge.dispatcher.traffic
        with pytest.raises(Gone), traffic.open("left", None, "GET", "/x", left_on=Gone) as left:
            raise Gone
        with (
            pytest.raises(RuntimeError),
            traffic.open("broke", None, "GET", "/x", left_on=Gone) as broke,
        ):
            raise RuntimeError("unexpected")
        assert (left.outcome, left.left, left.error) == ("client_gone", True, None)
        assert (broke.outcome, broke.left) == ("failed", False)
        assert broke.error == "RuntimeError: unexpected"
        assert [summary.request_id for summary in traffic.failures] == ["broke"]


# -- the documented series and the dashboard ---------------------------------------------


def documented_families() -> set[str]:
    """The metric families docs/metrics.md's tables list (first column: the series, second:
    its type; a counter's family is its series without ``_total``)."""
    text = (DOCS / "metrics.md").read_text()
    names = set()
    for line in text.splitlines():
        match = re.match(r"\| `([a-z_:]+)`[^|]*\| (\w+)", line)
        if match:
            series, kind = match.groups()
            names.add(series.removesuffix("_total") if kind == "counter" else series)
    return names


async def test_docs_list_every_series_and_only_those() -> None:
    async with open_edge() as edge:
        async with edge.client(CLIENT_KEY) as client:
            assert (await client.post("/v1/chat/completions", json=chat())).status_code == 200
        async with edge.client() as client:
            text = (await client.get("/metrics")).text
    exported = {family.name for family in text_string_to_metric_families(text)}
    documented = documented_families()
    # The text format gives each recorded series' `_created` a family of its own; the docs
    # say it once for them all.
    created = {name for name in exported if name.removesuffix("_created") in documented}
    assert "gen_ai_server_request_duration_seconds_created" in created
    exported -= {name for name in created if name.endswith("_created")}
    assert exported - documented == set()  # exported but not in docs/metrics.md
    assert documented - exported == set()  # in docs/metrics.md but not exported


def test_grafana_dashboard_names_only_documented_series() -> None:
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    families = documented_families()
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    assert len(expressions) >= 8
    used = set()
    for expr in expressions:
        # Label names (in by (...) clauses and {...} matchers) are not series.
        series_only = re.sub(r"\b(by|without)\s*\([^)]*\)|\{[^}]*\}", "", expr)
        for name in re.findall(r"\b((?:dispatcher|gen_ai)_[a-z_]+)", series_only):
            base = name if name in families else re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert base in families, f"{name} in {expr!r} is not a documented series"
            used.add(base)
    # Every new family is on the dashboard.
    for family in (
        "gen_ai_server_request_duration_seconds",
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai_client_token_usage",
        "dispatcher_connected_nodes",
        "dispatcher_recoveries",
    ):
        assert family in used


async def test_tunnelled_requests_are_recorded(
    logs: Captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with test_tunnel.open_env(monkeypatch) as env, env.client() as client:
        model = test_tunnel.MODEL
        completed = await client.post(
            "/v1/completions", json={"model": model, "prompt": "once upon", "stream": True}
        )
        embedded = await client.post("/v1/embeddings", json={"model": model, "input": ["a b"]})
        scraped = await client.get("/metrics")
        usage = embedded.json()["usage"]
    assert (completed.status_code, embedded.status_code) == (200, 200)
    streamed = logs.line_of(completed.headers["x-dispatcher-request-id"])
    assert (streamed["route"], streamed["stream"], streamed["state"]) == (
        "/v1/completions",
        True,
        "answering",
    )
    assert (streamed["outcome"], streamed["attempts"], streamed["tokens_source"]) == (
        "completed",
        1,
        "reported",
    )
    assert streamed["ttft_s"] is not None
    line = logs.line_of(embedded.headers["x-dispatcher-request-id"])
    assert line["node"] == streamed["node"] is not None
    assert line["input_tokens"] == usage["prompt_tokens"]
    samples = scrape(scraped.text)
    tokens = "gen_ai_client_token_usage"
    for route, operation in (
        ("/v1/completions", "text_completion"),
        ("/v1/embeddings", "embeddings"),
    ):
        labels = {"gen_ai_request_model": model, "gen_ai_operation_name": operation, "route": route}
        assert value(samples, tokens, f"{tokens}_count", **labels, gen_ai_token_type="input") == 1
    embeddings = {"gen_ai_request_model": model, "gen_ai_operation_name": "embeddings"}
    assert (
        value(samples, tokens, f"{tokens}_sum", **embeddings, gen_ai_token_type="input")
        == usage["prompt_tokens"]
    )


async def test_status_shows_affinity_per_model_group() -> None:
    """``queues[].affinity``: a group with affinity on (issue #26) lists its admissions by
    result (what ``dispatcher_affinity_total`` counts); off, it is null."""
    async with open_edge(affinity=True) as edge:
        async with edge.client(CLIENT_KEY) as client:
            assert (await client.post("/v1/chat/completions", json=chat())).status_code == 200
        document = await edge.status()
        [queue] = [q for q in document["queues"] if q["model"] == "echo"]
        assert set(queue["affinity"]) == {
            "hit",
            "over_load",
            "busy",
            "ineligible",
            "ejected",
            "unkeyed",
        }
        assert sum(queue["affinity"].values()) == 1  # one admission, keyed or not
        edge.dispatcher.admission.set_policy(PolicySnapshot(groups={"m": Policy()}))
        document = await edge.status()
        [queue] = [q for q in document["queues"] if q["model"] == "echo"]
        assert queue["affinity"] is None
