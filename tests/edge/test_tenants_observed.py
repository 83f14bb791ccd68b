"""What an operator sees of a request a tenant's limit refused: its access-log line names the
model it asked for, and it is not one of the queue's refusals on the status page (the queue
did not refuse it: the key's limit did, before admission)."""

from __future__ import annotations

import httpx

from dispatcher.config import KeySettings

from .logs import Captured
from .test_tenants_http import ADMIN, ALICE, open_edge


async def test_a_rate_limited_request_is_logged_with_its_model_and_not_as_a_queue_refusal(
    logs: Captured,
) -> None:
    keys = KeySettings(id="alice", key=ALICE, rpm=1)
    async with open_edge(keys) as edge, httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
        body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
        alice = {"authorization": f"Bearer {ALICE}"}
        first = await client.post("/v1/chat/completions", json=body, headers=alice)
        second = await client.post("/v1/chat/completions", json=body, headers=alice)
        status = await client.get("/admin/status", headers={"authorization": f"Bearer {ADMIN}"})
    assert (first.status_code, second.status_code) == (200, 429)
    refused = logs.line_of(second.headers["x-dispatcher-request-id"])
    assert (refused["model"], refused["status"], refused["key_id"]) == ("echo", 429, "alice")
    assert refused["error_code"] == "rate_limit_exceeded"
    [queue] = [q for q in status.json()["queues"] if q["model"] == "echo"]
    assert queue["refused_429"] == 0
