"""``/metrics`` for a Prometheus scraper without the admin key (``[metrics]``,
``docs/metrics.md``): a metrics token that opens ``/metrics`` and nothing else, and a listener
of its own that serves only ``/metrics`` and ``/healthz``, with no key. Against real edges on
127.0.0.1 (port 0); the config's ``[metrics]`` table through the real loader."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.config import (
    ConfigError,
    EdgeConfig,
    MetricsSettings,
    load_edge_config,
)
from dispatcher.edge import open_dispatcher
from dispatcher.http import Server

CLIENT_KEY = "sk-client-scrape-1"
ADMIN_KEY = "sk-admin-scrape-2"
METRICS_TOKEN = "metrics-token-scrape-3"
OTHER_TOKEN = "metrics-token-rotated-4"

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


@asynccontextmanager
async def serving(config: EdgeConfig) -> AsyncIterator[tuple[str, Server]]:
    """The edge (with its in-process echo node) on 127.0.0.1 port 0: its URL and server."""
    async with open_dispatcher(attrs.evolve(config, port=0)) as dispatcher:
        await dispatcher.attach_local_node()
        async with trio.open_nursery() as nursery:
            server: Server = await nursery.start(dispatcher.serve)
            yield f"http://127.0.0.1:{server.address.port}", server
            nursery.cancel_scope.cancel()


async def call(url: str, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = CHAT if method == "POST" and path.startswith("/v1/") else None
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.request(method, path, headers=headers, json=body)


def series(text: str) -> set[str]:
    """The metric families of a scrape, parsed with prometheus_client's own parser."""
    return {family.name for family in text_string_to_metric_families(text)}


# -- the metrics token ----------------------------------------------------------------

EDGES = {
    # Every kind of key, and the metrics token.
    "all": EdgeConfig(
        api_keys=(CLIENT_KEY,),
        admin_keys=(ADMIN_KEY,),
        metrics=MetricsSettings(token=METRICS_TOKEN),
    ),
    # Client keys and the token, no admin key (admin routes then refuse everyone).
    "clients": EdgeConfig(api_keys=(CLIENT_KEY,), metrics=MetricsSettings(token=METRICS_TOKEN)),
    # Only the token: the edge is open, but /metrics is not.
    "token only": EdgeConfig(metrics=MetricsSettings(token=METRICS_TOKEN)),
}

ACCESS = [
    # (edge, method, path, key, status)
    ("all", "GET", "/metrics", METRICS_TOKEN, 200),
    ("all", "GET", "/metrics", ADMIN_KEY, 200),
    ("all", "GET", "/metrics", CLIENT_KEY, 401),
    ("all", "GET", "/metrics", None, 401),
    ("all", "GET", "/metrics", OTHER_TOKEN, 401),
    # The token opens nothing else: no admin route, no client route.
    ("all", "GET", "/admin/status", METRICS_TOKEN, 401),
    ("all", "POST", "/admin/reload", METRICS_TOKEN, 401),
    ("all", "GET", "/v1/usage", METRICS_TOKEN, 401),
    ("all", "GET", "/v1/models", METRICS_TOKEN, 401),
    ("all", "POST", "/v1/chat/completions", METRICS_TOKEN, 401),
    ("all", "GET", "/admin/status", ADMIN_KEY, 200),
    ("clients", "GET", "/metrics", METRICS_TOKEN, 200),
    ("clients", "GET", "/metrics", CLIENT_KEY, 200),  # as without a token: a client key
    ("clients", "GET", "/metrics", None, 401),
    ("clients", "GET", "/admin/status", METRICS_TOKEN, 401),
    ("clients", "POST", "/v1/chat/completions", METRICS_TOKEN, 401),
    ("token only", "GET", "/metrics", METRICS_TOKEN, 200),
    ("token only", "GET", "/metrics", None, 401),
    ("token only", "GET", "/metrics", OTHER_TOKEN, 401),
    ("token only", "GET", "/v1/models", None, 200),  # the open edge stays open
]


async def test_the_metrics_token_opens_metrics_and_nothing_else() -> None:
    seen: list[tuple[str, str, str, str | None, int]] = []
    bodies: dict[tuple[str, str | None], httpx.Response] = {}
    for name, config in EDGES.items():
        async with serving(config) as (url, _):
            for edge, method, path, key, _status in ACCESS:
                if edge != name:
                    continue
                response = await call(url, method, path, key)
                seen.append((edge, method, path, key, response.status_code))
                bodies[(edge + path, key)] = response
    assert seen == ACCESS
    scraped = bodies[("all/metrics", METRICS_TOKEN)]
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "dispatcher_connected_nodes" in series(scraped.text)
    refused = bodies[("all/metrics", OTHER_TOKEN)]
    assert refused.json()["error"]["message"] == (
        "invalid key: /metrics takes the metrics token or an admin key"
    )
    assert refused.headers["www-authenticate"] == "Bearer"
    assert bodies[("token only/metrics", None)].json()["error"]["code"] == "invalid_api_key"


async def test_a_reload_rotates_the_metrics_token_and_keeps_the_listener() -> None:
    config = EdgeConfig(
        port=0,
        admin_keys=(ADMIN_KEY,),
        metrics=MetricsSettings(token=METRICS_TOKEN, listen="127.0.0.1:0"),
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server: Server = await nursery.start(dispatcher.serve)
        url = f"http://127.0.0.1:{server.address.port}"
        assert (await call(url, "GET", "/metrics", METRICS_TOKEN)).status_code == 200
        rotated = MetricsSettings(token=OTHER_TOKEN, listen="127.0.0.1:9799")
        kept = dispatcher.reload(attrs.evolve(config, metrics=rotated))
        old = await call(url, "GET", "/metrics", METRICS_TOKEN)
        new = await call(url, "GET", "/metrics", OTHER_TOKEN)
        nursery.cancel_scope.cancel()
    assert kept == ("metrics.listen",)
    assert (old.status_code, new.status_code) == (401, 200)
    # The token changed at once; the listener's address waits for a restart.
    assert dispatcher.config.metrics == MetricsSettings(token=OTHER_TOKEN, listen="127.0.0.1:0")


# -- the metrics listener ---------------------------------------------------------------


async def test_the_metrics_listener_serves_metrics_and_healthz_without_a_key_only() -> None:
    config = EdgeConfig(
        api_keys=(CLIENT_KEY,),
        admin_keys=(ADMIN_KEY,),
        metrics=MetricsSettings(listen="127.0.0.1:0"),
    )
    answers: dict[tuple[str, str, str | None], httpx.Response] = {}
    async with open_dispatcher(attrs.evolve(config, port=0)) as dispatcher:
        await dispatcher.attach_local_node()
        async with trio.open_nursery() as nursery:
            main: Server = await nursery.start(dispatcher.serve)
            scraper: Server = await nursery.start(dispatcher.serve_metrics)
            url = f"http://127.0.0.1:{main.address.port}"
            scrape_url = f"http://127.0.0.1:{scraper.address.port}"
            assert scraper.address.port not in (0, main.address.port)
            for method, path, key in (
                ("GET", "/metrics", None),
                ("HEAD", "/metrics", None),
                ("GET", "/healthz", None),
                ("GET", "/admin/status", None),
                ("GET", "/admin/status", ADMIN_KEY),
                ("GET", "/v1/usage", ADMIN_KEY),
                ("POST", "/admin/reload", ADMIN_KEY),
                ("GET", "/", None),
                ("GET", "/readyz", None),
                ("GET", "/v1/models", CLIENT_KEY),
                ("POST", "/v1/chat/completions", CLIENT_KEY),
                ("GET", "/v1/nodes/connect", None),
            ):
                answers[(method, path, key)] = await call(scrape_url, method, path, key)
            on_main = await call(url, "GET", "/metrics", None)
            nursery.cancel_scope.cancel()

    statuses = {request: response.status_code for request, response in answers.items()}
    assert statuses == {
        ("GET", "/metrics", None): 200,
        ("HEAD", "/metrics", None): 200,
        ("GET", "/healthz", None): 200,
        # Nothing else is there, whatever key is sent.
        ("GET", "/admin/status", None): 404,
        ("GET", "/admin/status", ADMIN_KEY): 404,
        ("GET", "/v1/usage", ADMIN_KEY): 404,
        ("POST", "/admin/reload", ADMIN_KEY): 404,
        ("GET", "/", None): 404,
        ("GET", "/readyz", None): 404,
        ("GET", "/v1/models", CLIENT_KEY): 404,
        ("POST", "/v1/chat/completions", CLIENT_KEY): 404,
        ("GET", "/v1/nodes/connect", None): 404,
    }
    scraped = answers[("GET", "/metrics", None)]
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert {"dispatcher_connected_nodes", "dispatcher_slots_total"} <= series(scraped.text)
    assert answers[("GET", "/healthz", None)].json() == {"status": "ok", "nodes": 1}
    assert answers[("GET", "/admin/status", ADMIN_KEY)].json()["error"]["code"] == "unknown_url"
    # The main listener's /metrics keeps its rule: an admin key.
    assert on_main.status_code == 401


async def test_serve_metrics_needs_an_address() -> None:
    async with open_dispatcher(EdgeConfig(port=0, local_node=False)) as dispatcher:
        with pytest.raises(ValueError, match=r"metrics\.listen"):
            await dispatcher.serve_metrics()


# -- the [metrics] table ----------------------------------------------------------------


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> EdgeConfig:
    path = tmp_path / "edge.toml"
    path.write_text(text)
    return load_edge_config(path, environ={} if environ is None else environ)


def test_the_metrics_table_loads(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        '[metrics]\ntoken_env = "SCRAPE_TOKEN"\nlisten = "[::1]:9700"\n',
        {"SCRAPE_TOKEN": " the-token \n"},
    )
    assert config.metrics == MetricsSettings(token="the-token", listen="[::1]:9700")
    assert config.metrics.listen_address() == ("::1", 9700)
    assert "the-token" not in repr(config)
    assert load(tmp_path, "").metrics == MetricsSettings()
    inline = load(tmp_path, '[metrics]\ntoken = "inline"\nlisten = "127.0.0.1:0"\n')
    assert inline.metrics_token() == "inline"
    assert inline.metrics.listen_address() == ("127.0.0.1", 0)


@pytest.mark.parametrize(
    ("text", "environ", "message"),
    [
        (
            '[metrics]\ntoken = "a"\ntoken_env = "SCRAPE_TOKEN"',
            {"SCRAPE_TOKEN": "b"},
            "metrics: give token_env or token, not both",
        ),
        ('[metrics]\ntoken = " "', {}, "metrics.token: expected a non-empty string"),
        (
            '[metrics]\ntoken_env = "SCRAPE_TOKEN"',
            {},
            "metrics.token_env: environment variable SCRAPE_TOKEN is not set",
        ),
        (
            '[metrics]\ntoken_env = "SCRAPE_TOKEN"',
            {"SCRAPE_TOKEN": "  "},
            "metrics.token_env: environment variable SCRAPE_TOKEN is empty",
        ),
        (
            '[metrics]\ntoken_env = "not a name"',
            {},
            "metrics.token_env: expected the name of an environment variable, got 'not a name'",
        ),
        (
            '[metrics]\nlisten = "9700"',
            {},
            'metrics.listen: expected "host:port" (e.g. "127.0.0.1:9700"), got \'9700\'',
        ),
        (
            '[metrics]\nlisten = "::1:9700"',
            {},
            'metrics.listen: expected "host:port" (e.g. "127.0.0.1:9700"), got \'::1:9700\'',
        ),
        (
            '[metrics]\nlisten = "127.0.0.1:70000"',
            {},
            'metrics.listen: expected "host:port" (e.g. "127.0.0.1:9700"), got \'127.0.0.1:70000\'',
        ),
        ("[metrics]\nport = 9700", {}, "metrics.port: unknown key"),
        # The token must not be a key with other rights (it would open more than /metrics).
        (
            'admin_keys = ["shared"]\n[metrics]\ntoken = "shared"',
            {},
            "metrics.token: the same key is also in admin_keys",
        ),
        (
            'api_keys = ["shared"]\n[metrics]\ntoken = "shared"',
            {},
            "metrics.token: the same key is also in api_keys",
        ),
    ],
)
def test_metrics_table_errors(
    tmp_path: Path, text: str, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, environ)
    assert str(info.value) == f"{tmp_path / 'edge.toml'}: {message}"
