"""``dispatcher --version`` and ``dispatcher check-config`` as a subprocess: every TOML example
in ``docs/`` passes (or fails with the message its page shows), a valid file is described
without a secret, a broken one is exit status 2 and one line naming the file, the key and the
reason."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
import trustme

from tests.test_cli_startup import assert_one_line_failure, dispatcher, write
from tests.test_config_docs import ENVIRON, ERROR, EXAMPLES, expected_errors, kind_of

EXAMPLE_ENVIRON = {
    **ENVIRON,
    # The provider keys the node examples name (the daemon reads them when it starts).
    "VLLM_KEY": "sk-vllm",
    "VLLM_API_KEY": "sk-vllm",
    "ANTHROPIC_API_KEY": "sk-ant",
    "OPENAI_API_KEY": "sk-openai",
}


def test_version(tmp_path: Path) -> None:
    result = dispatcher(tmp_path, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"trio-dispatcher {importlib.metadata.version('trio-dispatcher')}\n"


def named_files(block: str) -> tuple[list[str], list[str]]:
    """The TLS files an example names: (certificates and keys, CA files)."""
    try:
        document = tomllib.loads(block)
    except tomllib.TOMLDecodeError:
        return [], []
    http, node = document.get("http", {}), document.get("node", {})
    own = [http[key] for key in ("tls_certificate", "tls_private_key") if key in http]
    return own, [node["edge_ca_file"]] if "edge_ca_file" in node else []


def write_examples(tmp_path: Path, *, errors: bool) -> list[tuple[str, str, str]]:
    """Each docs example (the error ones or the others) as ``NN/edge.toml`` or
    ``NN/node.toml``: (its path, its kind, the error its page shows or ""). The TLS files an
    example names are made for it (relative to the directory check-config runs in), a
    certificate and key from a test CA, and that CA's certificate."""
    written: list[tuple[str, str, str]] = []
    ca = trustme.CA()
    issued = ca.issue_cert("edge.internal")
    for index, (doc, _, block) in enumerate(EXAMPLES):
        if block.startswith(ERROR) != errors:
            continue
        own, cas = named_files(block)
        for name, pem in [(n, issued.private_key_and_cert_chain_pem) for n in own] + [
            (n, ca.cert_pem) for n in cas
        ]:
            assert not Path(name).is_absolute(), f"{doc}: name TLS files relatively: {name}"
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            pem.write_to_path(str(tmp_path / name))
        kind = kind_of(doc, block)
        (tmp_path / f"{index:02}").mkdir()
        path = write(tmp_path, f"{index:02}/{kind}.toml", block)
        written.append((path, kind, "\n".join(expected_errors(block))))
    return written


def test_every_docs_example_passes(tmp_path: Path) -> None:
    examples = write_examples(tmp_path, errors=False)
    assert len(examples) >= 10
    assert {kind for _, kind, _ in examples} == {"edge", "node"}
    result = dispatcher(tmp_path, "check-config", *(p for p, _, _ in examples), env=EXAMPLE_ENVIRON)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    verdicts = [line for line in result.stdout.splitlines() if not line.startswith("  ")]
    assert verdicts == [f"{path}: a valid {kind} config" for path, kind, _ in examples]


def test_every_docs_error_example_fails_with_its_message(tmp_path: Path) -> None:
    examples = write_examples(tmp_path, errors=True)
    assert len(examples) >= 8
    result = dispatcher(tmp_path, "check-config", *(p for p, _, _ in examples), env=EXAMPLE_ENVIRON)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines == [
        f"dispatcher: {path.partition('/')[0]}/{line}"
        for path, _, expected in examples
        for line in expected.splitlines()
    ]


def test_one_bad_file_among_good_ones_is_status_2(tmp_path: Path) -> None:
    good = write(tmp_path, "edge.toml", "port = 0\n")
    bad = write(tmp_path, "bad.toml", 'port = "x"\n')
    result = dispatcher(tmp_path, "check-config", good, bad)
    assert result.returncode == 2
    assert result.stdout.startswith("edge.toml: a valid edge config\n")
    assert result.stderr == "dispatcher: bad.toml: port: expected an integer, got 'x'\n"


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[str, str, str]:
    """A CA's certificate, and a certificate and key it issued for 127.0.0.1."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "edge.internal")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    issued.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    issued.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    return "ca.pem", "cert.pem", "key.pem"


EDGE = """\
host = "0.0.0.0"
port = 8443
api_keys = ["sk-client-secret"]
admin_keys_env = "ADMIN_KEYS"
usage_db = "{data}/ledger/usage.sqlite3"

[http]
tls_certificate = "cert.pem"
tls_private_key = "key.pem"
shutdown_grace = 20

[nodes]
tokens = ["shared-node-secret", {{ value = "bound-node-secret", ids = ["gpu-*"] }}]

[metrics]
token_env = "METRICS_TOKEN"
listen = "127.0.0.1:9700"

[admission]
max_queue = 100

[models.llama-3-8b]
queue_timeout_s = 5
max_attempts = 2
aliases = ["gpt-4o-mini", "llama"]
"""


def test_an_edge_is_described_without_its_secrets(
    tmp_path: Path, tls_files: tuple[str, str, str]
) -> None:
    write(tmp_path, "edge.toml", EDGE.format(data=tmp_path))
    env = {"ADMIN_KEYS": "admin-secret", "METRICS_TOKEN": "metrics-secret"}
    result = dispatcher(tmp_path, "check-config", "edge.toml", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "edge.toml: a valid edge config",
        "  listen: https://0.0.0.0:8443/v1 (nodes dial wss://0.0.0.0:8443/v1/nodes/connect)",
        "  TLS: on (certificate cert.pem, key key.pem)",
        "  client auth: on (1 key)",
        "  admin auth: on (1 key)",
        "  node auth: on (2 tokens: 1 for any node id, 1 bound to node ids)",
        "  metrics auth: on (the metrics token or an admin key)",
        "  metrics listener: http://127.0.0.1:9700/metrics and /healthz, no auth (metrics.listen)",
        f"  data dir: {tmp_path}/data/trio-dispatcher",
        "  limits and budgets: in memory (this edge only)",
        f"  usage ledger: {tmp_path}/ledger/usage.sqlite3",
        "  stored responses: SQLite, beside the ledger",
        "  in-process node: on (model echo)",
        "  drain: in-flight requests get 20 s (http.shutdown_grace)",
        "  node heartbeat: every 5 s, lost after 15 s",
        "  admission defaults: max_queue = 100",
        "  model llama-3-8b: max_attempts = 2, queue_timeout_s = 5; aliases gpt-4o-mini, llama",
    ]
    assert "secret" not in result.stdout
    assert not (tmp_path / "ledger").exists()  # checking creates nothing


SHARED_EDGE = """\
port = 8701
data_dir = "{data}"

[store]
redis_url_env = "EDGE_REDIS_URL"
database_url = "postgresql://dispatcher:db-secret@db.internal:5432/dispatcher?sslmode=require"
on_store_error = "local"
edge_count = 3
edge_id = "edge-1"
"""


def test_an_edge_on_shared_backends_names_them_without_their_passwords(tmp_path: Path) -> None:
    write(tmp_path, "edge.toml", SHARED_EDGE.format(data=tmp_path / "data"))
    env = {"EDGE_REDIS_URL": "redis://:redis-secret@cache.internal:6379/2"}
    result = dispatcher(tmp_path, "check-config", "edge.toml", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index(
        "  limits and budgets: Redis redis://cache.internal:6379/2 (shared; "
        "decided within 0.5 s, else local (limits / 3 per edge); a dead "
        "edge's holds return within 60 s)"
    )
    assert lines[start + 1 : start + 4] == [
        "  usage ledger: PostgreSQL postgresql://db.internal:5432/dispatcher?... (shared; "
        f"outbox {tmp_path}/data/outbox.sqlite3)",
        "  stored responses: PostgreSQL postgresql://db.internal:5432/dispatcher?... (shared)",
        "  cluster: this edge is edge-1, heartbeat every 5 s",
    ]
    assert "secret" not in result.stdout


def test_a_store_url_of_the_wrong_kind_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "edge.toml", '[store]\nredis_url = "postgresql://db/x"\n')
    result = dispatcher(tmp_path, "check-config", "edge.toml")
    assert result.returncode == 2
    assert result.stderr == (
        "dispatcher: edge.toml: store.redis_url: expected a URL starting redis:// or unix://\n"
    )


def test_a_node_url_that_is_not_a_node_endpoint_is_refused(tmp_path: Path) -> None:
    write(tmp_path, "edge.toml", '[store]\nnode_url = "http://edge-a:8700/v1/nodes"\n')
    result = dispatcher(tmp_path, "check-config", "edge.toml")
    assert result.returncode == 2
    assert result.stderr == (
        "dispatcher: edge.toml: store.node_url: expected a ws:// or wss:// URL ending in "
        "/v1/nodes/connect, got 'http://edge-a:8700/v1/nodes'\n"
    )


NODE = """\
[node]
id = "gpu-1"
label = "the big box"
edge_url = "wss://edge.internal:8443/v1/nodes/connect"
edge_ca_file = "ca.pem"
edge_tls_server_name = "edge.internal"
token_env = "NODE_TOKEN"
drain_grace = 45

[[providers]]
id = "vllm"
type = "openai"
path = "tunnel"
base_url = "http://user:password-secret@127.0.0.1:8000/v1"
api_key_env = "VLLM_KEY"

[[providers.models]]
name = "llama-3-8b"
served_name = "meta-llama/Meta-Llama-3-8B-Instruct"
slots = 8
long_context_slots = 2
context_window = 8192

[[providers]]
id = "echo"
type = "echo"

[[providers.models]]
name = "echo"
capabilities = ["tools", "json"]
"""


def test_a_node_is_described_without_its_secrets(
    tmp_path: Path, tls_files: tuple[str, str, str]
) -> None:
    write(tmp_path, "gpu.toml", NODE)
    env = {"NODE_TOKEN": "node-token-secret", "VLLM_KEY": "sk-vllm-secret"}
    result = dispatcher(tmp_path, "check-config", "gpu.toml", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "gpu.toml: a valid node config",
        "  node id: gpu-1 (the big box)",
        "  edge: wss://edge.internal:8443/v1/nodes/connect "
        "(TLS: CA file ca.pem, certificate name edge.internal)",
        "  token: set (not shown)",
        "  drain: in-flight runs and tunnels get 45 s (drain_grace)",
        "  provider vllm: type openai, tunnel, http://127.0.0.1:8000/v1, key from $VLLM_KEY",
        "    model llama-3-8b (served as meta-llama/Meta-Llama-3-8B-Instruct): 8 slots, "
        "2 long-context, context window 8192",
        "  provider echo: type echo, normalized",
        "    model echo: 1 slot, capabilities tools, json",
    ]
    assert "secret" not in result.stdout


@pytest.mark.parametrize(
    ("text", "args", "env", "expected"),
    [
        ("port = \n", (), {}, "edge.toml: invalid TOML: Invalid value (at line 1, column 8)"),
        (
            '[http]\ntls_certificate = "missing.pem"\ntls_private_key = "key.pem"\n',
            (),
            {},
            "http.tls_certificate: cannot read missing.pem: no such file or directory",
        ),
        (
            NODE,
            (),
            {"NODE_TOKEN": "t"},
            "edge.toml: providers[0].api_key_env: environment variable VLLM_KEY is not set",
        ),
        (
            NODE.replace('"ca.pem"', '"nowhere.pem"'),
            (),
            {"NODE_TOKEN": "t", "VLLM_KEY": "k"},
            "edge.toml: node.edge_ca_file: cannot load nowhere.pem: no such file or directory",
        ),
        (
            '[node]\nid = "n"\n\n[[providers]]\nid = "echo"\ntype = "echo"\n',
            (),
            {},
            "edge.toml: providers[0].models: expected at least one [[providers.models]] table",
        ),
        (
            '[http]\nshutdown_grace = 1\n\n[[providers]]\nid = "echo"\ntype = "echo"\n'
            '[[providers.models]]\nname = "echo"\n',
            ("--kind", "node"),
            {},
            "edge.toml: http: unknown key",
        ),
    ],
    ids=["toml", "tls-file", "provider-key", "ca-file", "no-models", "kind"],
)
def test_a_broken_file_is_one_line_and_status_2(
    tmp_path: Path,
    tls_files: tuple[str, str, str],
    text: str,
    args: tuple[str, ...],
    env: dict[str, str],
    expected: str,
) -> None:
    write(tmp_path, "edge.toml", text)
    result = dispatcher(tmp_path, "check-config", *args, "edge.toml", env=env)
    assert_one_line_failure(result, expected)
    assert result.stdout == ""


# -- every mistake in one run (issue #21) ------------------------------------------------

FOUR_EDGE_MISTAKES = """\
port = "8700"

[nodes]
lable = "edge one"
heartbeat_timeout = 1

[[keys]]
id = "team-a"
key_env = "TEAM_A_KEY"
rpm = "many"
"""

FOUR_EDGE_LINES = [
    "dispatcher: edge.toml: port: expected an integer, got '8700'",
    "dispatcher: edge.toml: nodes.lable: unknown key",
    "dispatcher: edge.toml: keys[0].rpm: expected an integer, got 'many'",
    "dispatcher: edge.toml: nodes.heartbeat_timeout: must be longer than nodes.heartbeat_interval",
]

FOUR_NODE_MISTAKES = """\
[node]
edge_url = "ws://edge.example:8700/v1/node/connect"
reconect_max_backoff = 60

[[providers]]
id = "box"
type = "llamacpp"
  [[providers.models]]
  name = "tiny"
  slots = "4"
"""

FOUR_NODE_LINES = [
    "dispatcher: node.toml: node.reconect_max_backoff: unknown key",
    "dispatcher: node.toml: providers[0].models[0].slots: expected a positive integer, got '4'",
    "dispatcher: node.toml: node.edge_url: expected a URL ending in /v1/nodes/connect, got "
    "'ws://edge.example:8700/v1/node/connect' (try ws://edge.example:8700/v1/nodes/connect)",
    "dispatcher: node.toml: providers[0].type: expected one of echo, ollama, openai, cli, "
    "anthropic, got 'llamacpp'",
]


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("edge.toml", FOUR_EDGE_MISTAKES, FOUR_EDGE_LINES),
        ("node.toml", FOUR_NODE_MISTAKES, FOUR_NODE_LINES),
    ],
    ids=["edge", "node"],
)
def test_check_config_reports_every_mistake_in_one_run(
    tmp_path: Path, name: str, text: str, expected: list[str]
) -> None:
    """Four distinct mistakes (a value of the wrong type, an unknown key, one inside an
    array of tables, one across values) are four lines of one run, not four runs."""
    write(tmp_path, name, text)
    result = dispatcher(tmp_path, "check-config", name, env={"TEAM_A_KEY": "sk-a"})
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == expected


def test_serve_reports_every_mistake_too(tmp_path: Path) -> None:
    write(tmp_path, "edge.toml", FOUR_EDGE_MISTAKES)
    result = dispatcher(tmp_path, "serve", "--config", "edge.toml", env={"TEAM_A_KEY": "sk-a"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == FOUR_EDGE_LINES
