"""Reloading the edge config (issue #14, acceptance 3): keys, limits, prices and per-model
policy change at once under load, no request fails, new requests see the new values, a
request keeps what it was admitted under; a broken file changes nothing."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from dispatcher.config import EdgeConfig, load_edge_config
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server

from .fakes import wait_until

ADMIN = {"authorization": "Bearer sk-admin"}
ALICE = {"authorization": "Bearer sk-alice"}
BOB = {"authorization": "Bearer sk-bob"}


def edge_toml(*, rpm: int, price: float, attempts: int, bob: bool = False) -> str:
    text = f"""
admin_keys = ["sk-admin"]

[[keys]]
id = "alice"
key = "sk-alice"
rpm = {rpm}

[prices.echo]
input_per_mtok = {price}
output_per_mtok = {price}

[models.echo]
max_attempts = {attempts}
"""
    if bob:
        text += '\n[[keys]]\nid = "bob"\nkey = "sk-bob"\n'
    return text


@attrs.frozen
class Edge:
    dispatcher: Dispatcher
    server: Server
    path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"


def load(path: Path) -> EdgeConfig:
    return attrs.evolve(load_edge_config(path), port=0, local_node=False)


@asynccontextmanager
async def open_edge(tmp_path: Path, text: str) -> AsyncIterator[Edge]:
    path = tmp_path / "edge.toml"
    path.write_text(text, encoding="utf-8")
    async with open_dispatcher(load(path)) as dispatcher, trio.open_nursery() as nursery:
        dispatcher.config_source = lambda: load(path)
        await dispatcher.attach_local_node()
        server: Server = await nursery.start(dispatcher.serve)
        yield Edge(dispatcher, server, path)
        server.shutdown()


def chat(text: str = "one two three", **extra: object) -> dict[str, object]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}], **extra}


@attrs.frozen
class Answered:
    status: int
    limit: str | None
    request_id: str
    started_after_reload: bool


async def test_reload_under_load_swaps_limits_prices_and_policy_at_once(tmp_path: Path) -> None:
    async with open_edge(tmp_path, edge_toml(rpm=100_000, price=1.0, attempts=2)) as edge:
        assert edge.dispatcher.gate.policy_for("echo").max_attempts == 2
        answered: list[Answered] = []
        reloaded = trio.Event()
        stop = trio.Event()

        async def load_one(client: httpx.AsyncClient, worker: int) -> None:
            count = 0
            while not stop.is_set():
                count += 1
                after = reloaded.is_set()
                body = chat(f"worker {worker} request {count}", stream=count % 2 == 0)
                response = await client.post("/v1/chat/completions", json=body, headers=ALICE)
                answered.append(
                    Answered(
                        response.status_code,
                        response.headers.get("x-ratelimit-limit-requests"),
                        response.headers["x-dispatcher-request-id"],
                        after,
                    )
                )

        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            async with trio.open_nursery() as nursery:
                for worker in range(4):
                    nursery.start_soon(load_one, client, worker)
                await wait_until(lambda: len(answered) >= 20, timeout=30)
                edge.path.write_text(edge_toml(rpm=50_000, price=3.0, attempts=3, bob=True))
                response = await client.post("/admin/reload", headers=ADMIN)
                reloaded.set()
                before = len(answered)
                await wait_until(lambda: len(answered) >= before + 20, timeout=30)
                stop.set()
            assert response.status_code == 200, response.text
            assert response.json() == {"status": "reloaded", "restart_required": []}
            new_key = await client.post("/v1/chat/completions", json=chat(), headers=BOB)
            usage = (await client.get("/v1/usage?limit=10000", headers=ADMIN)).json()
        assert edge.dispatcher.gate.policy_for("echo").max_attempts == 3
    assert new_key.status_code == 200  # a key the reload added
    assert [a for a in answered if a.status != 200] == []  # no request failed
    assert {a.limit for a in answered} == {"100000", "50000"}
    assert {a.limit for a in answered if a.started_after_reload} == {"50000"}
    # Each request's cost is at the prices it was admitted under: the old limit and the old
    # price go together, the new ones too (one swap, never half of it).
    rows = {row["request_id"]: row for row in usage["rows"]}
    for answer in answered:
        row = rows[answer.request_id]
        tokens = row["prompt_tokens"] + row["completion_tokens"]
        price = 1.0 if answer.limit == "100000" else 3.0
        assert row["cost_usd"] == pytest.approx(tokens * price / 1e6), (answer, row)


async def test_a_lowered_limit_counts_what_was_admitted_before(tmp_path: Path) -> None:
    async with (
        open_edge(tmp_path, edge_toml(rpm=100, price=0.0, attempts=2)) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as client,
    ):
        for _ in range(3):
            ok = await client.post("/v1/chat/completions", json=chat(), headers=ALICE)
            assert ok.status_code == 200
        edge.path.write_text(edge_toml(rpm=3, price=0.0, attempts=2))
        assert (await client.post("/admin/reload", headers=ADMIN)).status_code == 200
        refused = await client.post("/v1/chat/completions", json=chat(), headers=ALICE)
    # The counters are the tenant's and survived the reload: 3 in the window, limit 3.
    assert refused.status_code == 429
    assert refused.headers["x-ratelimit-limit-requests"] == "3"


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("[[keys]]\nid = 'alice'\nkey = 'sk-alice'\nrpm = -1\n", "keys[0].rpm: must be > 0"),
        ("[[keys]\n", "invalid TOML"),
        ("[[keys]]\nid = 'alice'\nkey_env = 'NOT_SET_ANYWHERE'\n", "is not set"),
        ("[[keys]]\nid = 'alice'\nkey = 'sk-alice'\nrmp = 3\n", "keys[0].rmp: unknown key"),
    ],
)
async def test_a_broken_file_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str, message: str
) -> None:
    caplog.set_level(logging.INFO, logger="dispatcher")
    async with (
        open_edge(tmp_path, edge_toml(rpm=100, price=1.0, attempts=2)) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as client,
    ):
        policy = edge.dispatcher.tenants.policy
        edge.path.write_text(broken)
        response = await client.post("/admin/reload", headers=ADMIN)
        after = await client.post("/v1/chat/completions", json=chat(), headers=ALICE)
        assert edge.dispatcher.tenants.policy is policy
        assert edge.dispatcher.gate.policy_for("echo").max_attempts == 2
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_config"
    assert message in error["message"]
    assert after.status_code == 200
    assert after.headers["x-ratelimit-limit-requests"] == "100"
    refusals = [r.getMessage() for r in caplog.records if "reload refused" in r.getMessage()]
    assert len(refusals) == 1
    assert message in refusals[0]
    assert "sk-alice" not in caplog.text


async def test_settings_that_need_a_restart_are_named_and_not_applied(tmp_path: Path) -> None:
    async with (
        open_edge(tmp_path, edge_toml(rpm=100, price=1.0, attempts=2)) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as client,
    ):
        edge.dispatcher.config_source = lambda: attrs.evolve(
            load(edge.path),
            port=9,
            http=attrs.evolve(load(edge.path).http, max_body_size=1),
            store=attrs.evolve(load(edge.path).store, redis_url="redis://127.0.0.1:9/0"),
        )
        response = await client.post("/admin/reload", headers=ADMIN)
        assert edge.dispatcher.config.port == 0
        assert edge.dispatcher.config.http.max_body_size > 1
        assert edge.dispatcher.config.store.redis_url is None
    assert response.json() == {
        "status": "reloaded",
        "restart_required": ["port", "http", "store"],
    }


async def test_reload_needs_an_admin_key_and_a_config_file(tmp_path: Path) -> None:
    async with (
        open_edge(tmp_path, edge_toml(rpm=100, price=1.0, attempts=2)) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as client,
    ):
        as_client = await client.post("/admin/reload", headers=ALICE)
        edge.dispatcher.config_source = None
        without_file = await client.post("/admin/reload", headers=ADMIN)
    assert as_client.status_code == 401
    assert without_file.status_code == 409
    assert without_file.json()["error"]["code"] == "no_config_file"


async def test_a_removed_key_is_refused_after_the_reload(tmp_path: Path) -> None:
    async with (
        open_edge(tmp_path, edge_toml(rpm=100, price=1.0, attempts=2, bob=True)) as edge,
        httpx.AsyncClient(base_url=edge.url, timeout=30) as client,
    ):
        assert (await client.post("/v1/chat/completions", json=chat(), headers=BOB)).is_success
        edge.path.write_text(edge_toml(rpm=100, price=1.0, attempts=2))
        assert (await client.post("/admin/reload", headers=ADMIN)).status_code == 200
        gone = await client.post("/v1/chat/completions", json=chat(), headers=BOB)
    assert gone.status_code == 401
