"""One process, one file (issue #25): ``dispatcher serve --config edge.toml`` with
``[[providers]]`` pointing at fake OpenAI servers on 127.0.0.1 answers through them with no
node process; the keys come from the environment, reach the fakes as ``Authorization:
Bearer`` and appear nowhere in the edge's output or ``check-config``'s; a fallback model
serves when the first model's only provider fails (HTTP 500, connection refused), with a
usage row for each attempt; no fallback after the commit; a fallback cycle, a key's variable
unset: the edge does not start."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from tests.nodes.fake_providers import FakeOpenAI, refused_base_url, serve_fake_openai

from .test_drain_process import BOUND, dispatcher_process, edge_port, wait_for

MAIN_KEY = "sk-main-0f1e2d3c4b5a69788796a5b4"
BACKUP_KEY = "sk-backup-a1b2c3d4e5f60718293a4b5c"
KEYS = {"EDGE_TEST_MAIN_KEY": MAIN_KEY, "EDGE_TEST_BACKUP_KEY": BACKUP_KEY}


def edge_toml(tmp_path: Path, main: str, backup: str, *, extra: str = "") -> Path:
    config = tmp_path / "edge.toml"
    config.write_text(
        f"""
usage_db = "{tmp_path / "usage.sqlite3"}"

[[providers]]
id = "main"
type = "openai"
base_url = "{main}/v1"
api_key_env = "EDGE_TEST_MAIN_KEY"
  [[providers.models]]
  name = "gpt-main"
  served_name = "fake-main-model"
  slots = 4

[[providers]]
id = "backup"
type = "openai"
base_url = "{backup}/v1"
api_key_env = "EDGE_TEST_BACKUP_KEY"
  [[providers.models]]
  name = "gpt-backup"

[[providers]]
id = "gone"
type = "openai"
base_url = "{refused_base_url()}/v1"
  [[providers.models]]
  name = "gpt-gone"

[models.gpt-main]
fallbacks = ["gpt-backup"]

[models.gpt-gone]
fallbacks = ["gpt-backup"]
{extra}"""
    )
    return config


def chat(model: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


async def rows_of(client: httpx.AsyncClient, client_request_id: str, count: int) -> list[Any]:
    """The usage rows of one request (by the client's ``x-request-id``), once ``count``
    are written."""

    async def written() -> list[Any]:
        response = await client.get("/v1/usage", params={"client_request_id": client_request_id})
        rows: list[Any] = response.json()["rows"]
        return rows if len(rows) >= count else []

    rows = await wait_for(written)
    return sorted(
        ((r["attempt"], r["model_group"], r["provider_id"], r["outcome"]) for r in rows),
    )


async def test_one_process_one_file_with_a_hosted_key_and_fallbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    async with trio.open_nursery() as fakes:
        main: FakeOpenAI = await fakes.start(
            serve_fake_openai, FakeOpenAI(api_key=MAIN_KEY, reply="from the main provider")
        )
        backup: FakeOpenAI = await fakes.start(
            serve_fake_openai, FakeOpenAI(api_key=BACKUP_KEY, reply="from the backup")
        )
        config = edge_toml(tmp_path, main.base_url, backup.base_url)
        args = ("serve", "--config", str(config), "--port", "0", "--log-level", "DEBUG")
        async with dispatcher_process(tmp_path, "edge", *args) as edge:
            port = await edge_port(edge)
            await edge.wait_stdout(r"^  Ctrl-C")
            assert "  models: echo, gpt-backup, gpt-gone, gpt-main" in edge.stdout
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                # Through the main provider, its key from the environment.
                answered = await client.post("/v1/chat/completions", json=chat("gpt-main"))
                assert answered.status_code == 200, answered.text
                body = answered.json()
                assert body["choices"][0]["message"]["content"] == "from the main provider"
                assert body["model"] == "gpt-main"
                assert answered.headers["x-dispatcher-model"] == "gpt-main"
                (seen,) = main.requests
                assert seen.authorization == f"Bearer {MAIN_KEY}"
                assert seen.json["model"] == "fake-main-model"

                # A stream that breaks after its first content: an explicit error, no
                # [DONE], and no fallback (the answer had started).
                main.fail_after_chunks, main.fail_mode = 2, "abort"
                headers = {"x-request-id": "midway"}
                async with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json=chat("gpt-main", stream=True),
                    headers=headers,
                ) as stream:
                    assert stream.status_code == 200
                    lines = [line async for line in stream.aiter_lines() if line]
                assert all(line.startswith("data: ") for line in lines)
                assert any('"content":"from ' in line for line in lines[:-1])  # it had started
                assert lines[-1] != "data: [DONE]"
                error = orjson.loads(lines[-1].removeprefix("data: "))["error"]
                assert error["code"] == "upstream_disconnected", error
                assert backup.requests == []
                assert await rows_of(client, "midway", 1) == [(1, "gpt-main", "main", "failed")]
                main.fail_after_chunks = None

                # The main provider answers 500: the backup model serves, as gpt-main.
                main.status = 500
                headers = {"x-request-id": "after-500"}
                served = await client.post(
                    "/v1/chat/completions", json=chat("gpt-main"), headers=headers
                )
                assert served.status_code == 200, served.text
                body = served.json()
                assert body["choices"][0]["message"]["content"] == "from the backup"
                assert body["model"] == "gpt-main"  # the name the client asked for
                assert served.headers["x-dispatcher-model"] == "gpt-backup"
                assert served.headers["x-dispatcher-attempts"] == "2"
                assert backup.requests[-1].authorization == f"Bearer {BACKUP_KEY}"
                assert await rows_of(client, "after-500", 2) == [
                    (1, "gpt-main", "main", "aborted"),
                    (2, "gpt-backup", "backup", "completed"),
                ]

                # A provider nothing listens for (connection refused): the same.
                headers = {"x-request-id": "refused"}
                served = await client.post(
                    "/v1/chat/completions", json=chat("gpt-gone", stream=True), headers=headers
                )
                assert served.status_code == 200, served.text
                assert served.headers["x-dispatcher-model"] == "gpt-backup"
                assert "from the backup" in "".join(
                    orjson.loads(line.removeprefix("data: "))["choices"][0]["delta"].get(
                        "content", ""
                    )
                    for line in served.text.splitlines()
                    if line.startswith("data: {") and '"choices":[{' in line
                )
                assert served.text.rstrip().endswith("data: [DONE]")
                assert await rows_of(client, "refused", 2) == [
                    (1, "gpt-gone", "gone", "aborted"),
                    (2, "gpt-backup", "backup", "completed"),
                ]
            edge.signal(signal.SIGTERM)
            assert await edge.wait_exit() == 0
        output = "\n".join(edge.stdout) + edge.stderr
        assert "upstream_5xx" in output  # the log does say what happened (at INFO) ...
        for key in KEYS.values():
            assert key not in output  # ... and never with a key, even at DEBUG
        fakes.cancel_scope.cancel()

    # check-config: the providers, the variables their keys come from, never a key.
    checked = await run_dispatcher(tmp_path, "check-config", str(config))
    assert checked.returncode == 0, checked.stderr
    out = checked.stdout.decode()
    assert "  in-process node: on (model echo, provider main, provider backup, provider gone)" in (
        out.splitlines()
    )
    assert "key from $EDGE_TEST_MAIN_KEY" in out
    assert "model gpt-main: the defaults; fallbacks gpt-backup" in out
    for key in KEYS.values():
        assert key not in out + checked.stderr.decode()


async def run_dispatcher(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(BOUND):
        return await trio.run_process(
            [sys.executable, "-m", "dispatcher", *args],
            cwd=tmp_path,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


async def test_an_unset_key_variable_or_a_fallback_cycle_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGE_TEST_MAIN_KEY", MAIN_KEY)
    monkeypatch.delenv("EDGE_TEST_BACKUP_KEY", raising=False)
    config = edge_toml(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:9")
    unset = "providers[1].api_key_env: environment variable EDGE_TEST_BACKUP_KEY is not set"
    for command in ("serve", "check-config"):
        args = ("serve", "--config", str(config)) if command == "serve" else (command, str(config))
        result = await run_dispatcher(tmp_path, *args)
        assert result.returncode == 2
        assert result.stderr.decode().splitlines() == [f"dispatcher: {config}: {unset}"]
        assert MAIN_KEY not in result.stdout.decode() + result.stderr.decode()

    monkeypatch.setenv("EDGE_TEST_BACKUP_KEY", BACKUP_KEY)
    cycle = '\n[models.gpt-backup]\nfallbacks = ["gpt-gone"]\n'
    config = edge_toml(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:9", extra=cycle)
    result = await run_dispatcher(tmp_path, "serve", "--config", str(config), "--port", "0")
    assert result.returncode == 2
    assert result.stderr.decode().splitlines() == [
        f"dispatcher: {config}: models.gpt-backup.fallbacks: a cycle of fallbacks: "
        "gpt-backup -> gpt-gone -> gpt-backup"
    ]
