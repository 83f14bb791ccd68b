"""``--log-format json`` on the real ``dispatcher serve`` and ``dispatcher node`` in
subprocesses: every stderr line is one JSON object with the stable keys, the edge's access
log among them; the default text format writes the access line as ``key=value``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from .test_cli_startup import STARTUP_TIMEOUT, echo, environment, start_edge


def json_lines(stderr: str) -> list[dict[str, Any]]:
    documents = []
    for line in stderr.splitlines():
        document = json.loads(line)  # every line, not only ours
        assert list(document)[:4] == ["ts", "level", "logger", "message"], line
        documents.append(document)
    return documents


def test_serve_and_node_log_json(tmp_path: Path) -> None:
    edge = start_edge(tmp_path, "--log-format", "json", "serve", "--port", "0", "--no-local-node")
    node: subprocess.Popen[str] | None = None
    try:
        ws = edge.base_url.replace("http://", "ws://") + "/v1/nodes/connect"
        node = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", "node", "--edge", ws, "--log-format", "json"],
            cwd=tmp_path,
            env=environment(tmp_path),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        with httpx.Client(base_url=edge.base_url, timeout=30) as client:
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while not client.get("/v1/models").json()["data"]:
                assert time.monotonic() < deadline, "the node never joined"
                time.sleep(0.1)
            answer = echo(client, "logged as json")
            assert answer.status_code == 200, answer.text
        node.send_signal(signal.SIGTERM)
        _, node_stderr = node.communicate(timeout=STARTUP_TIMEOUT)
    finally:
        if node is not None and node.poll() is None:
            node.kill()
        status, stderr = edge.stop()
    assert status == 0, stderr
    edge_logs = json_lines(stderr)
    [access] = [
        d
        for d in edge_logs
        if d["logger"] == "dispatcher.access" and d["route"] == "/v1/chat/completions"
    ]
    assert access["request_id"] == answer.headers["x-dispatcher-request-id"]
    assert (access["status"], access["outcome"], access["attempts"]) == (200, "completed", 1)
    assert access["message"] == "POST /v1/chat/completions 200"
    assert any(d["logger"] == "dispatcher.nodes" for d in edge_logs)  # the node joined
    node_logs = json_lines(node_stderr)
    assert node_logs, "the node logged nothing"
    assert all(d["logger"].startswith(("nodes", "dispatcher")) for d in node_logs), node_logs


def test_text_access_line(tmp_path: Path) -> None:
    edge = start_edge(tmp_path, "serve", "--port", "0")
    try:
        with httpx.Client(base_url=edge.base_url, timeout=30) as client:
            answer = echo(client, "logged as text")
            assert answer.status_code == 200, answer.text
    finally:
        status, stderr = edge.stop()
    assert status == 0, stderr
    [line] = [line for line in stderr.splitlines() if " dispatcher.access: POST " in line]
    request_id = answer.headers["x-dispatcher-request-id"]
    assert f"dispatcher.access: POST /v1/chat/completions 200 request_id={request_id} " in line
    assert " model=echo key_id=- stream=false state=answering node=local provider=" in line
    assert " status=200 outcome=completed error_code=- error=- attempts=1 " in line
    assert re.search(r" started_at=\d+\.\d+$", line)
