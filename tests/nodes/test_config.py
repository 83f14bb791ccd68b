from __future__ import annotations

import logging
from pathlib import Path

import attrs
import pytest
import trio

from dispatcher import wire
from nodes import load_node_config
from nodes.agent import serve_node
from nodes.config import (
    DEFAULT_EDGE_URL,
    ModelConfig,
    NodeConfig,
    NodeConfigError,
    ProviderConfig,
    check_edge_url,
    default_node_config,
    hello_from_config,
    suggest_edge_url,
)

VALID = """
[node]
id = "gpu-box-1"
label = "the box under the desk"
edge_url = "wss://edge.example:8700/v1/nodes/connect"
token_env = "NODE_TOKEN"
heartbeat_timeout_factor = 4
reconnect_min_backoff = 1
reconnect_max_backoff = 60

[[providers]]
id = "echo"
type = "echo"
options = { token_delay = 0.01, reply = "hi" }

  [[providers.models]]
  name = "echo"
  slots = 8

[[providers]]
id = "local-vllm"
type = "openai"
path = "tunnel"
base_url = "http://127.0.0.1:8000/v1"
api_key_env = "VLLM_KEY"

  [[providers.models]]
  name = "llama-3-8b"
  served_name = "meta-llama/Meta-Llama-3-8B-Instruct"
  slots = 4
  long_context_slots = 1
  context_window = 8192
  capabilities = ["tools", "json"]

[[providers]]
id = "llamafile"
type = "cli"
command = "llamafile --cli -m 'my model.gguf'"

  [[providers.models]]
  name = "tiny"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_default_config_serves_echo() -> None:
    config = default_node_config("n1")
    assert config.node_id == "n1"
    assert config.edge_url == DEFAULT_EDGE_URL
    assert config.token is None
    (provider,) = config.providers
    assert (provider.id, provider.type, provider.path) == ("echo", "echo", "normalized")
    (model,) = provider.models
    assert model == ModelConfig(
        name="echo", served_name="echo", slots=8, capabilities=("tools", "json")
    )
    assert default_node_config().node_id  # the host name


def test_load_valid_config(tmp_path: Path) -> None:
    config = load_node_config(write(tmp_path, VALID), environ={"NODE_TOKEN": "s3cret"})
    assert config.node_id == "gpu-box-1"
    assert config.label == "the box under the desk"
    assert config.edge_url == "wss://edge.example:8700/v1/nodes/connect"
    assert config.token == "s3cret"
    assert config.heartbeat_timeout_factor == 4.0
    assert (config.reconnect_min_backoff, config.reconnect_max_backoff) == (1.0, 60.0)
    echo, vllm, cli = config.providers
    assert echo.options == {"token_delay": 0.01, "reply": "hi"}
    assert echo.models == (ModelConfig(name="echo", slots=8),)
    assert vllm == ProviderConfig(
        id="local-vllm",
        type="openai",
        path="tunnel",
        base_url="http://127.0.0.1:8000/v1",
        api_key_env="VLLM_KEY",
        models=(
            ModelConfig(
                name="llama-3-8b",
                served_name="meta-llama/Meta-Llama-3-8B-Instruct",
                slots=4,
                long_context_slots=1,
                context_window=8192,
                capabilities=("tools", "json"),
            ),
        ),
    )
    assert cli.command == ("llamafile", "--cli", "-m", "my model.gguf")
    assert cli.models == (ModelConfig(name="tiny", served_name="tiny", slots=1),)


def test_minimal_config_uses_defaults(tmp_path: Path) -> None:
    config = load_node_config(
        write(
            tmp_path, '[[providers]]\nid = "e"\ntype = "echo"\n[[providers.models]]\nname = "m"\n'
        )
    )
    assert config.edge_url == DEFAULT_EDGE_URL
    assert config.node_id
    assert config.token is None
    assert config.heartbeat_timeout_factor == 3.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            VALID.replace("slots = 4", "slots = 'x'"),
            "providers[1].models[0].slots: expected a positive integer, got 'x'",
        ),
        (
            VALID.replace("slots = 8", "slots = 0"),
            "providers[0].models[0].slots: expected a positive integer, got 0",
        ),
        (
            VALID.replace("slots = 8", "slots = true"),
            "providers[0].models[0].slots: expected a positive integer, got True",
        ),
        (
            VALID.replace('type = "cli"', 'type = "llamacpp"'),
            "providers[2].type: expected one of echo, ollama, openai, cli, anthropic, "
            "got 'llamacpp'",
        ),
        (
            VALID.replace('label = "the box', 'lable = "the box'),
            "node.lable: unknown key",
        ),
        (
            VALID.replace("capabilities =", "capabilites ="),
            "providers[1].models[0].capabilites: unknown key",
        ),
        (
            VALID.replace('name = "tiny"', ""),
            "providers[2].models[0].name: missing",
        ),
        (
            VALID.replace("token_delay = 0.01", "token_delay = -1"),
            "providers[0].options.token_delay: expected a number >= 0, got -1",
        ),
        (
            VALID.replace("token_delay = 0.01", "tokn_delay = 1"),
            "providers[0].options.tokn_delay: unknown echo option",
        ),
        (
            VALID.replace('id = "llamafile"', 'id = "echo"'),
            "providers[2].id: duplicate provider id 'echo'",
        ),
        (
            VALID.replace('"wss://edge.example', '"https://edge.example'),
            "node.edge_url: expected a ws:// or wss:// URL, got 'https://edge.example:8700/v1/nodes/connect'",
        ),
        (
            VALID.replace("/v1/nodes/connect", ""),
            "node.edge_url: expected a URL ending in /v1/nodes/connect, got "
            "'wss://edge.example:8700' (try wss://edge.example:8700/v1/nodes/connect)",
        ),
        (
            VALID.replace('api_key_env = "VLLM_KEY"', 'api_key_env = "sk-abc123"'),
            "providers[1].api_key_env: expected the name of an environment variable, "
            "got 'sk-abc123'",
        ),
        (
            VALID.replace("long_context_slots = 1", "long_context_slots = 9"),
            "providers[1].models[0].long_context_slots: must not exceed slots (4), got 9",
        ),
        (
            VALID.replace("reconnect_max_backoff = 60", "reconnect_max_backoff = 0.5"),
            "node.reconnect_max_backoff: must be at least reconnect_min_backoff (1.0), got 0.5",
        ),
        (
            VALID.replace(
                'id = "echo"\ntype = "echo"', 'id = "echo"\ntype = "echo"\npath = "tunnel"'
            ),
            "providers[0].path: a 'echo' provider can only run normalized, not tunnel",
        ),
        ("[node]\nid = 'x'\n", "providers: expected at least one [[providers]] table"),
        (
            '[[providers]]\nid = "e"\ntype = "echo"\n',
            "providers[0].models: expected at least one [[providers.models]] table",
        ),
        ("providers = 3\n", "providers: expected an array of tables, got 3"),
        ("[node\n", "invalid TOML"),
        (
            VALID.replace('id = "gpu-box-1"', 'id = "gpu box 1"'),
            "node.id: expected letters, digits and . _ : - (starting with a letter or digit), "
            "got 'gpu box 1'",
        ),
        (
            VALID.replace('id = "llamafile"', 'id = "llama file"'),
            "providers[2].id: expected letters, digits and . _ : -",
        ),
        (
            VALID.replace("[node]\n", '[node]\nedges = ["ws://a:8700/v1/nodes/connect"]\n'),
            "node.edges: give edge_url (one edge) or edges (several), not both",
        ),
        (
            VALID.replace('edge_url = "wss://edge.example:8700/v1/nodes/connect"', "edges = []"),
            "node.edges: expected at least one edge URL",
        ),
        (
            VALID.replace(
                'edge_url = "wss://edge.example:8700/v1/nodes/connect"',
                'edges = ["ws://a:8700/v1/nodes/connect", "ws://a:8700/v1/nodes/connect"]',
            ),
            "node.edges[1]: 'ws://a:8700/v1/nodes/connect' is listed twice",
        ),
        (
            VALID.replace(
                'edge_url = "wss://edge.example:8700/v1/nodes/connect"',
                'edges = ["ws://a:8700/v1/nodes/connect", "ws://b:8700/v1/node/connect"]',
            ),
            "node.edges[1]: expected a URL ending in /v1/nodes/connect",
        ),
    ],
)
def test_invalid_config_names_file_key_and_reason(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(NodeConfigError) as info:
        load_node_config(path, environ={"NODE_TOKEN": "t"})
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_missing_token_env_variable(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    with pytest.raises(NodeConfigError) as info:
        load_node_config(path, environ={})
    assert info.value.key == "node.token_env"
    assert info.value.reason == "environment variable NODE_TOKEN is not set"
    assert info.value.source == str(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(NodeConfigError, match=r"node\.toml: cannot read the file"):
        load_node_config(tmp_path / "node.toml")


def test_hello_announces_everything_but_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    config = load_node_config(write(tmp_path, VALID), environ={"NODE_TOKEN": "s3cret"})
    hello = hello_from_config(config)
    assert hello.protocol == wire.PROTOCOL_VERSION
    assert (hello.node_id, hello.label, hello.token) == (
        "gpu-box-1",
        "the box under the desk",
        "s3cret",
    )
    assert [(p.id, p.type, p.adapter, p.path) for p in hello.providers] == [
        ("echo", "echo", "echo", "normalized"),
        ("local-vllm", "openai", "openai", "tunnel"),
        ("llamafile", "cli", "cli", "normalized"),
    ]
    assert hello.providers[1].models == (
        wire.ModelInfo(
            name="llama-3-8b",
            served_name="meta-llama/Meta-Llama-3-8B-Instruct",
            slots=4,
            long_context_slots=1,
            context_window=8192,
            capabilities=("tools", "json"),
        ),
    )
    encoded = wire.encode(hello)
    assert "VLLM_KEY" not in encoded  # the env var name stays on the node too
    assert "127.0.0.1:8000" not in encoded
    assert "s3cret" not in repr(config)
    assert "s3cret" not in repr(hello)
    assert "s3cret" not in caplog.text


def test_node_config_is_frozen() -> None:
    config = NodeConfig(node_id="n")
    with pytest.raises(AttributeError):
        config.node_id = "m"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ws://127.0.0.1:8700/v1/nodes/connect", None),
        ("wss://edge.example/prefix/v1/nodes/connect", None),
        (
            "http://edge:8700/v1/nodes/connect",
            "expected a ws:// or wss:// URL, got 'http://edge:8700/v1/nodes/connect' "
            "(try ws://edge:8700/v1/nodes/connect)",
        ),
        (
            "https://edge.example",
            "expected a ws:// or wss:// URL, got 'https://edge.example' "
            "(try wss://edge.example/v1/nodes/connect)",
        ),
        (
            "ws://edge:8700/",
            "expected a URL ending in /v1/nodes/connect, got 'ws://edge:8700/' "
            "(try ws://edge:8700/v1/nodes/connect)",
        ),
        (
            "edge:8700",
            "expected a ws:// or wss:// URL, got 'edge:8700' (try ws://edge:8700/v1/nodes/connect)",
        ),
        (
            "ws://edge:8700/v1/node/connect",
            "expected a URL ending in /v1/nodes/connect, got 'ws://edge:8700/v1/node/connect' "
            "(try ws://edge:8700/v1/nodes/connect)",
        ),
        ("ws:///v1/nodes/connect", "expected a ws:// or wss:// URL, got 'ws:///v1/nodes/connect'"),
    ],
)
def test_check_edge_url(url: str, reason: str | None) -> None:
    assert check_edge_url(url) == reason


@pytest.mark.parametrize(
    ("url", "suggestion"),
    [
        # A wrong path is replaced, not extended (issue #21).
        ("ws://host:8700/v1/node/connect", "ws://host:8700/v1/nodes/connect"),
        ("ws://host:8700/v1/nodes", "ws://host:8700/v1/nodes/connect"),
        ("ws://host:8700/nodes/connect", "ws://host:8700/v1/nodes/connect"),
        ("ws://host:8700/V1/Nodes/Connect", "ws://host:8700/v1/nodes/connect"),
        ("ws://host:8700/v1/node/connect/", "ws://host:8700/v1/nodes/connect"),
        # No path, a trailing slash.
        ("ws://host:8700", "ws://host:8700/v1/nodes/connect"),
        ("ws://host:8700/", "ws://host:8700/v1/nodes/connect"),
        ("ws://host:8700/v1/nodes/connect/", "ws://host:8700/v1/nodes/connect"),
        # The scheme: http(s) for ws(s), none, another.
        ("http://host:8700/v1/nodes/connect", "ws://host:8700/v1/nodes/connect"),
        ("https://edge.example", "wss://edge.example/v1/nodes/connect"),
        ("HTTPS://edge.example/v1/node/connect", "wss://edge.example/v1/nodes/connect"),
        ("host:8700", "ws://host:8700/v1/nodes/connect"),
        ("127.0.0.1:8700/v1/nodes/connect", "ws://127.0.0.1:8700/v1/nodes/connect"),
        ("tcp://host:8700", "ws://host:8700/v1/nodes/connect"),
        # A reverse proxy's prefix is kept; so are the query and an IPv6 host.
        ("wss://edge.example/llm/v1/node/connect", "wss://edge.example/llm/v1/nodes/connect"),
        ("wss://edge.example/llm", "wss://edge.example/llm/v1/nodes/connect"),
        ("ws://host/v1/connect?region=eu", "ws://host/v1/nodes/connect?region=eu"),
        ("ws://[::1]:8700/v1/node", "ws://[::1]:8700/v1/nodes/connect"),
        # Nothing to suggest without a host.
        ("ws:///v1/nodes/connect", None),
        ("", None),
    ],
)
def test_suggest_edge_url(url: str, suggestion: str | None) -> None:
    assert suggest_edge_url(url) == suggestion
    if suggestion is not None:
        assert check_edge_url(suggestion) is None


async def test_serve_node_refuses_a_bad_edge_url_before_dialling() -> None:
    config = attrs.evolve(default_node_config("n"), edge_url="http://127.0.0.1:1")
    with (
        trio.fail_after(5),  # at once: no dial, no retry loop
        pytest.raises(ValueError, match=r"^edge_url: expected a ws:// or wss:// URL"),
    ):
        await serve_node(config)


def test_several_edges(tmp_path: Path) -> None:
    """``edges`` names the edges a node serves at once; without it, ``edge_url`` alone."""
    urls = ("ws://a:8700/v1/nodes/connect", "wss://b:8700/v1/nodes/connect")
    text = VALID.replace(
        'edge_url = "wss://edge.example:8700/v1/nodes/connect"',
        f"edges = [{', '.join(repr(url) for url in urls)}]",
    )
    config = load_node_config(write(tmp_path, text), environ={"NODE_TOKEN": "t"})
    assert config.edges == urls
    assert config.edge_urls == urls
    one = load_node_config(write(tmp_path, VALID), environ={"NODE_TOKEN": "t"})
    assert one.edge_urls == ("wss://edge.example:8700/v1/nodes/connect",)
