"""The real ``dispatcher`` command in a subprocess: every startup failure is one line on
stderr naming the thing, exit status 2, no traceback; node tokens work with the in-process
node; the banner says who may use the edge."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 60.0


def environment(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCHER_")}
    env.update(
        PYTHONPATH=str(REPO),  # this checkout, not an installed copy
        XDG_DATA_HOME=str(tmp_path / "data"),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def dispatcher(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dispatcher", *args],
        cwd=tmp_path,
        env=environment(tmp_path, env),
        capture_output=True,
        text=True,
        timeout=STARTUP_TIMEOUT,
        check=False,
    )


def assert_one_line_failure(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"dispatcher: {expected}"], result.stderr


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def write(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return name


def test_port_in_use(tmp_path: Path, busy_port: int) -> None:
    result = dispatcher(tmp_path, "serve", "--port", str(busy_port))
    assert_one_line_failure(
        result, f"cannot listen on 127.0.0.1:{busy_port}: address already in use"
    )


def test_tls_files_missing(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "edge.toml",
        'port = 0\n[http]\ntls_certificate = "cert.pem"\ntls_private_key = "key.pem"\n',
    )
    result = dispatcher(tmp_path, "serve", "--config", config)
    assert_one_line_failure(
        result, "http.tls_certificate: cannot read cert.pem: no such file or directory"
    )


def test_tls_files_unreadable(tmp_path: Path) -> None:
    write(tmp_path, "cert.pem", "not a certificate\n")
    write(tmp_path, "key.pem", "not a key\n")
    config = write(
        tmp_path,
        "edge.toml",
        'port = 0\n[http]\ntls_certificate = "cert.pem"\ntls_private_key = "key.pem"\n',
    )
    result = dispatcher(tmp_path, "serve", "--config", config)
    assert_one_line_failure(
        result,
        "http.tls_certificate: cannot load cert.pem with key.pem: "
        "not a PEM certificate and key (SSL: PEM_LIB)",
    )


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        (
            'api_keys = "k1"\n',
            {},
            "edge.toml: api_keys: expected an array of strings, got a string",
        ),
        (
            '[nodes]\ntokens = "t1"\n',
            {},
            "edge.toml: nodes.tokens: expected an array of tokens (strings or tables), "
            "got a string",
        ),
        (
            'api_keys_env = "MY_UNSET_KEYS"\n',
            {},
            "edge.toml: api_keys_env: environment variable MY_UNSET_KEYS is not set",
        ),
        (
            "port = 0\n",
            {"DISPATCHER_API_KEYS": ""},
            "environment: DISPATCHER_API_KEYS: is set but empty: unset it to run without, "
            "or give the values",
        ),
        ("lable = 1\n", {}, "edge.toml: lable: unknown key"),
        (
            "[http\n",
            {},
            "edge.toml: invalid TOML: "
            "Expected ']' at the end of a table declaration (at line 1, column 6)",
        ),
    ],
)
def test_config_errors(tmp_path: Path, text: str, env: dict[str, str], expected: str) -> None:
    config = write(tmp_path, "edge.toml", text)
    assert_one_line_failure(dispatcher(tmp_path, "serve", "--config", config, env=env), expected)


def test_missing_config_file(tmp_path: Path) -> None:
    result = dispatcher(tmp_path, "serve", "--config", "nope.toml")
    assert_one_line_failure(result, "nope.toml: cannot read the file: No such file or directory")


def test_usage_db_directory_cannot_be_created(tmp_path: Path) -> None:
    write(tmp_path, "a-file", "")
    config = write(tmp_path, "edge.toml", 'port = 0\nusage_db = "a-file/sub/usage.sqlite3"\n')
    result = dispatcher(tmp_path, "serve", "--config", config)
    assert_one_line_failure(
        result, "usage_db: cannot create the directory a-file/sub: not a directory"
    )


# -- the node ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edge", "expected"),
    [
        (
            "http://127.0.0.1:8700/v1/nodes/connect",
            "--edge: expected a ws:// or wss:// URL, got 'http://127.0.0.1:8700/v1/nodes/connect'"
            " (try ws://127.0.0.1:8700/v1/nodes/connect)",
        ),
        (
            "https://edge.example",
            "--edge: expected a ws:// or wss:// URL, got 'https://edge.example'"
            " (try wss://edge.example/v1/nodes/connect)",
        ),
        (
            "ws://127.0.0.1:8700",
            "--edge: expected a URL ending in /v1/nodes/connect, got 'ws://127.0.0.1:8700'"
            " (try ws://127.0.0.1:8700/v1/nodes/connect)",
        ),
        (
            # A typo in the path: the hint replaces it (it once appended the right one).
            "ws://127.0.0.1:8700/v1/node/connect",
            "--edge: expected a URL ending in /v1/nodes/connect, got "
            "'ws://127.0.0.1:8700/v1/node/connect' (try ws://127.0.0.1:8700/v1/nodes/connect)",
        ),
    ],
)
def test_node_edge_url(tmp_path: Path, edge: str, expected: str) -> None:
    assert_one_line_failure(dispatcher(tmp_path, "node", "--edge", edge), expected)


ECHO_PROVIDER = '\n[[providers]]\nid = "echo"\ntype = "echo"\nmodels = [{ name = "echo" }]\n'
"""A node config's one provider, so that an example's one mistake is its only one."""


def test_node_config_edge_url(tmp_path: Path) -> None:
    config = write(tmp_path, "node.toml", '[node]\nedge_url = "ws://edge:8700/"\n' + ECHO_PROVIDER)
    assert_one_line_failure(
        dispatcher(tmp_path, "node", "--config", config),
        "node.toml: node.edge_url: expected a URL ending in /v1/nodes/connect, got "
        "'ws://edge:8700/' (try ws://edge:8700/v1/nodes/connect)",
    )


def test_node_provider_api_key_env_unset(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "node.toml",
        """
[[providers]]
id = "echo"
type = "echo"
  [[providers.models]]
  name = "echo"

[[providers]]
id = "vllm"
type = "openai"
path = "tunnel"
base_url = "http://127.0.0.1:8000/v1"
api_key_env = "MY_UNSET_VLLM_KEY"
  [[providers.models]]
  name = "llama"
""",
    )
    assert_one_line_failure(
        dispatcher(tmp_path, "node", "--config", config),
        "node.toml: providers[1].api_key_env: environment variable MY_UNSET_VLLM_KEY is not set",
    )


def test_a_node_that_never_gets_in_exits_3_saying_why(tmp_path: Path) -> None:
    """Issue #21: an edge URL with nothing behind it (a closed port) is not retried for
    ever: the node warns, gives up (here at once: --give-up-after 0, after its few
    attempts), and says why in its last line, exit status 3."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused, and not reused
        port = closed.getsockname()[1]
        edge = f"ws://127.0.0.1:{port}/v1/nodes/connect"
        result = dispatcher(tmp_path, "node", "--edge", edge, "--give-up-after", "0")
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    last = lines[-1]
    assert " ERROR " in last, result.stderr
    assert f"gave up: it never got in to the edge at {edge} (3 attempts in " in last
    assert (
        f"connection refused at 127.0.0.1:{port}: is the edge running, and is the port right?"
    ) in last
    assert "--keep-trying" in last
    retries = [line for line in lines if "reconnecting to" in line]
    assert len(retries) == 2, result.stderr
    assert all(f"connection refused at 127.0.0.1:{port}" in line for line in retries)


def test_node_config_error(tmp_path: Path) -> None:
    config = write(tmp_path, "node.toml", "[node]\nlable = 'x'\n" + ECHO_PROVIDER)
    assert_one_line_failure(
        dispatcher(tmp_path, "node", "--config", config), "node.toml: node.lable: unknown key"
    )


# -- a running edge ------------------------------------------------------------------


class Edge:
    """``dispatcher serve`` running; ``banner`` is what it printed once listening."""

    def __init__(self, process: subprocess.Popen[str], banner: list[str]) -> None:
        self.process = process
        self.banner = banner
        url = banner[0].removeprefix("trio-dispatcher edge listening on ")
        self.base_url = url.removesuffix("/v1")

    def stop(self) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        _, stderr = self.process.communicate(timeout=STARTUP_TIMEOUT)
        return self.process.returncode, stderr


def start_edge(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Edge:
    process = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", *args],
        cwd=tmp_path,
        env=environment(tmp_path, env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout = process.stdout
    assert stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    # A thread reads: the banner's lines arrive in one write, and a select() on the pipe
    # would not see those already in the file object's buffer.
    def read() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    banner: list[str] = []
    while not any(line.startswith("  Ctrl-C") for line in banner):
        try:
            banner.append(lines.get(timeout=STARTUP_TIMEOUT).rstrip("\n"))
        except queue.Empty:
            process.kill()
            pytest.fail(f"no banner: {banner} {process.communicate()}")
    return Edge(process, banner)


def echo(client: httpx.Client, text: str, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return client.post(
        "/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": text}]},
        headers=headers,
    )


def test_node_tokens_with_the_in_process_node(tmp_path: Path) -> None:
    """Node tokens configured: the in-process node needs none; the edge serves echo."""
    config = write(
        tmp_path,
        "edge.toml",
        'port = 0\n[nodes]\ntokens = ["t0k3n", { value = "gpu-token", ids = ["gpu-*"] }]\n',
    )
    edge = start_edge(tmp_path, "serve", "--config", config, "--log-level", "DEBUG")
    try:
        assert "  models: echo" in edge.banner
        assert "  node auth: on (2 tokens: 1 for any node id, 1 bound to node ids)" in edge.banner
        with httpx.Client(base_url=edge.base_url, timeout=30) as client:
            answer = echo(client, "through the local node")
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == "through the local node"
    finally:
        status, stderr = edge.stop()
    assert status == 0, stderr
    assert "Traceback" not in stderr
    assert " DEBUG   dispatcher.cli: edge config: EdgeConfig(" in stderr  # --log-level took
    assert "gpu-token" not in stderr  # effect after the subcommand; no secret in it
    assert "t0k3n" not in stderr


def test_default_api_keys_variable_turns_client_auth_on(tmp_path: Path) -> None:
    edge = start_edge(tmp_path, "serve", "--port", "0", env={"DISPATCHER_API_KEYS": "sk-x, sk-y"})
    try:
        assert "  client auth: on (2 keys)" in edge.banner
        assert (
            "  admin auth: on (no admin key configured: GET /v1/usage refuses everyone)"
            in edge.banner
        )
        assert "  node auth: OFF — any node may join and take over any node id" in edge.banner
        with httpx.Client(base_url=edge.base_url, timeout=30) as client:
            assert echo(client, "hi").status_code == 401
            assert echo(client, "hi", key="sk-y").status_code == 200
    finally:
        status, stderr = edge.stop()
    assert status == 0, stderr
    assert "WARNING" not in stderr  # loopback


def test_open_edge_banner_and_warning_off_loopback(tmp_path: Path) -> None:
    edge = start_edge(tmp_path, "serve", "--host", "0.0.0.0", "--port", "0", "--no-local-node")
    try:
        assert "  client auth: OFF — anyone can use this edge" in edge.banner
        assert "  admin auth: OFF — anyone can read GET /v1/usage and /admin/status" in edge.banner
    finally:
        status, stderr = edge.stop()
    assert status == 0, stderr
    warnings = [line for line in stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 2, stderr
    assert "with NO client API key" in warnings[0]
    assert "with NO node token" in warnings[1]


def test_metrics_for_a_scraper_token_and_listener(tmp_path: Path) -> None:
    """``[metrics]``: the token reads the edge's ``/metrics`` (and no admin route), the
    listener serves ``/metrics`` with no key; the banner says both, never the token."""
    config = write(
        tmp_path,
        "edge.toml",
        'port = 0\nadmin_keys = ["sk-admin"]\n'
        '[metrics]\ntoken_env = "SCRAPE_TOKEN"\nlisten = "127.0.0.1:0"\n',
    )
    edge = start_edge(tmp_path, "serve", "--config", config, env={"SCRAPE_TOKEN": "scrape-t0k3n"})
    try:
        assert "  metrics auth: on (the metrics token or an admin key)" in edge.banner
        prefix = "  metrics listener (no auth): "
        (listener,) = [line.removeprefix(prefix) for line in edge.banner if line.startswith(prefix)]
        assert re.fullmatch(r"http://127\.0\.0\.1:[0-9]+/metrics", listener), listener
        elsewhere = listener.removesuffix("/metrics") + "/admin/status"
        token = {"authorization": "Bearer scrape-t0k3n"}
        with httpx.Client(base_url=edge.base_url, timeout=30) as client:
            scraped = client.get(listener)
            assert scraped.status_code == 200, scraped.text
            assert "dispatcher_connected_nodes 1.0" in scraped.text
            assert client.get("/metrics", headers=token).status_code == 200
            assert client.get("/metrics").status_code == 401
            assert client.get("/admin/status", headers=token).status_code == 401
            assert client.get(elsewhere).status_code == 404
    finally:
        status, stderr = edge.stop()
    assert status == 0, stderr
    assert "scrape-t0k3n" not in stderr
    assert "scrape-t0k3n" not in "\n".join(edge.banner)
    assert "WARNING" not in stderr  # both listeners on loopback


def test_metrics_listener_port_in_use(tmp_path: Path, busy_port: int) -> None:
    config = write(
        tmp_path, "edge.toml", f'port = 0\n[metrics]\nlisten = "127.0.0.1:{busy_port}"\n'
    )
    assert_one_line_failure(
        dispatcher(tmp_path, "serve", "--config", config),
        f"metrics.listen: cannot listen on 127.0.0.1:{busy_port}: address already in use",
    )
