"""``dispatcher serve`` reloads its config file on SIGHUP: a raised limit applies to the next
requests; a broken file is refused with one log line and the old config keeps serving."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx

from .test_cli_startup import echo, start_edge, write

KEY = "sk-tenant-a"


def config(rpm: int) -> str:
    return f'port = 0\n[[keys]]\nid = "team-a"\nkey_env = "TEAM_A_KEY"\nrpm = {rpm}\n'


def wait_for(predicate: object, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_sighup_reloads_the_config_file(tmp_path: Path) -> None:
    path = write(tmp_path, "edge.toml", config(rpm=1))
    edge = start_edge(tmp_path, "serve", "--config", path, env={"TEAM_A_KEY": KEY})
    try:
        assert "  client auth: on (1 key)" in edge.banner
        with httpx.Client(base_url=edge.base_url, timeout=30) as client:
            assert echo(client, "first", key=KEY).status_code == 200
            assert echo(client, "second", key=KEY).status_code == 429
            write(tmp_path, "edge.toml", config(rpm=3))
            edge.process.send_signal(signal.SIGHUP)
            assert wait_for(lambda: echo(client, "again", key=KEY).status_code == 200)
            write(tmp_path, "edge.toml", "port = 0\n[[keys]]\nid = 'team-a'\n")  # no secret
            edge.process.send_signal(signal.SIGHUP)
            time.sleep(1.0)  # the refusal is logged; nothing changed meanwhile
            answer = echo(client, "still served", key=KEY)
            assert answer.headers["x-ratelimit-limit-requests"] == "3"
    finally:
        status, stderr = edge.stop()
    assert status == 0, stderr
    assert "Traceback" not in stderr
    assert stderr.count("reloaded the config") == 1
    refused = [line for line in stderr.splitlines() if "reload refused" in line]
    assert len(refused) == 1
    assert "keys[0]: give exactly one of key_env, key_sha256 or key" in refused[0]
    assert KEY not in stderr
