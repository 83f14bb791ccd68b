"""The edge config: secrets are arrays (never a string split into characters), the
``*_env`` variables and their ``DISPATCHER_*`` defaults fail closed, and every error is
``<file>: <key path>: <reason>``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatcher.admission import MODEL_LINGER_S
from dispatcher.config import (
    ConfigError,
    EdgeConfig,
    NodeSettings,
    NodeToken,
    load_edge_config,
    parse_edge_config,
)
from dispatcher.config.summary import describe_edge
from dispatcher.gate.catalog import gate_policies, policy_snapshot_from_config


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> EdgeConfig:
    path = tmp_path / "edge.toml"
    path.write_text(text)
    return load_edge_config(path, environ={} if environ is None else environ)


def error(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, environ)
    prefix = f"{tmp_path / 'edge.toml'}: "
    lines = info.value.lines()
    assert all(line.startswith(prefix) for line in lines), lines
    # Every problem the file has, each without the file's name.
    return "; ".join(line.removeprefix(prefix) for line in lines)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('api_keys = "k1"', "api_keys: expected an array of strings, got a string"),
        ('admin_keys = "k1"', "admin_keys: expected an array of strings, got a string"),
        (
            '[nodes]\ntokens = "t1"',
            "nodes.tokens: expected an array of tokens (strings or tables), got a string",
        ),
        ("api_keys = 5", "api_keys: expected an array of strings, got an integer"),
        ('api_keys = ["ok", 5]', "api_keys[1]: expected a string, got an integer"),
        ('api_keys = ["ok", " "]', "api_keys[1]: expected a non-empty string"),
        (
            '[nodes]\ntokens = ["t", 1.5]',
            "nodes.tokens[1]: expected a string or a table, got a float",
        ),
    ],
)
def test_secrets_are_arrays_of_strings(tmp_path: Path, text: str, message: str) -> None:
    assert error(tmp_path, text) == message


def test_a_secret_is_never_echoed_in_an_error(tmp_path: Path) -> None:
    assert "sk-very-secret" not in error(tmp_path, 'api_keys = "sk-very-secret"')
    assert "sk-very-secret" not in error(tmp_path, 'api_keys = ["sk-very-secret", 3]')


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[http]\nmax_body_size = 'big'", "http.max_body_size: expected an integer, got 'big'"),
        ("port = 99999", "port: 99999 is not a TCP port"),
        ("port = '80'", "port: expected an integer, got '80'"),
        ("local_node = 'yes'", "local_node: expected true or false, got 'yes'"),
        ("lable = 1", "lable: unknown key"),
        ("[nodes]\ntokenz = []", "nodes.tokenz: unknown key"),
        ("http = 5", "http: expected a table, got 5"),
        ("[models.echo]\nmax_queue = 'a'", "models.echo.max_queue: expected an integer, got 'a'"),
        ('[models."org/m"]\nmax_queue = -1', 'models."org/m".max_queue: must be >= 0'),
        (
            "[models.echo]\naliases = 'x'",
            "models.echo.aliases: expected an array of strings, got a string",
        ),
        (
            "[nodes]\nheartbeat_interval = 20",
            "nodes.heartbeat_timeout: must be longer than nodes.heartbeat_interval",
        ),
        (
            "api_keys_env = 'sk-abc'",
            "api_keys_env: expected the name of an environment variable, got 'sk-abc'",
        ),
        ("[admission]\nmodel_linger_s = -1", "admission.model_linger_s: must be >= 0"),
        (
            "[models.echo]\nmodel_linger_s = 10",
            "models.echo.model_linger_s: only in [admission]: a model named in [models] "
            "always waits for a node",
        ),
    ],
)
def test_errors_name_the_key_path_and_the_reason(tmp_path: Path, text: str, message: str) -> None:
    assert error(tmp_path, text) == message


def test_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=r"missing\.toml: cannot read the file: No such file"):
        load_edge_config(missing)
    assert error(tmp_path, "[http\n").startswith("invalid TOML: ")
    (tmp_path / "edge.toml").write_bytes(b"host = '\xff'\n")
    with pytest.raises(ConfigError, match="the file is not UTF-8 text"):
        load_edge_config(tmp_path / "edge.toml", environ={})


# -- the *_env variables -------------------------------------------------------------


def test_named_variables_are_read_at_load(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        'api_keys = ["inline"]\napi_keys_env = "MY_KEYS"\nadmin_keys_env = "MY_ADMIN"\n'
        '[nodes]\ntokens_env = "MY_TOKENS"\n',
        {"MY_KEYS": "k1, k2,", "MY_ADMIN": "a1", "MY_TOKENS": "t1,t2"},
    )
    assert config.client_api_keys() == ("inline", "k1", "k2")
    assert config.admin_api_keys() == ("a1",)
    assert config.node_tokens() == ("t1", "t2")
    assert config.api_keys_env is None  # resolved: the values are in the config now
    assert "k1" not in repr(config)


@pytest.mark.parametrize(
    ("text", "environ", "message"),
    [
        ('api_keys_env = "MY_KEYS"', {}, "api_keys_env: environment variable MY_KEYS is not set"),
        (
            'api_keys_env = "MY_KEYS"',
            {"MY_KEYS": " , "},
            "api_keys_env: environment variable MY_KEYS is empty",
        ),
        (
            'admin_keys_env = "MY_ADMIN"',
            {},
            "admin_keys_env: environment variable MY_ADMIN is not set",
        ),
        (
            '[nodes]\ntokens_env = "MY_TOKENS"',
            {"MY_TOKENS": ""},
            "nodes.tokens_env: environment variable MY_TOKENS is empty",
        ),
        (
            '[[nodes.tokens]]\nvalue_env = "NODE_A_TOKEN"\nids = ["a"]',
            {},
            "nodes.tokens[0].value_env: environment variable NODE_A_TOKEN is not set",
        ),
    ],
)
def test_a_named_variable_that_is_unset_or_empty_is_an_error(
    tmp_path: Path, text: str, environ: dict[str, str], message: str
) -> None:
    assert error(tmp_path, text, environ) == message


def test_the_default_variables_are_read(tmp_path: Path) -> None:
    environ = {
        "DISPATCHER_API_KEYS": "sk-x",
        "DISPATCHER_ADMIN_KEYS": "adm",
        "DISPATCHER_NODE_TOKENS": "t1, t2",
    }
    for config in (load(tmp_path, "", environ), load_edge_config(None, environ=environ)):
        assert config.client_api_keys() == ("sk-x",)
        assert config.admin_api_keys() == ("adm",)
        assert config.node_tokens() == ("t1", "t2")
    # Unset defaults: no keys, no error.
    assert load_edge_config(None, environ={}).client_api_keys() == ()


def test_a_named_variable_replaces_the_default(tmp_path: Path) -> None:
    environ = {"DISPATCHER_API_KEYS": "default-key", "MINE": "my-key"}
    config = load(tmp_path, 'api_keys_env = "MINE"', environ)
    assert config.client_api_keys() == ("my-key",)


@pytest.mark.parametrize(
    "name", ["DISPATCHER_API_KEYS", "DISPATCHER_ADMIN_KEYS", "DISPATCHER_NODE_TOKENS"]
)
def test_a_default_variable_set_but_empty_is_an_error(name: str) -> None:
    # Most often a template that did not fill it in: running open would be silent.
    with pytest.raises(ConfigError) as info:
        load_edge_config(None, environ={name: " "})
    assert str(info.value) == (
        f"environment: {name}: is set but empty: unset it to run without, or give the values"
    )


def test_a_python_config_reads_only_what_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPATCHER_API_KEYS", "from-env")
    assert EdgeConfig().client_api_keys() == ()  # embedding: no implicit environment
    monkeypatch.setenv("MY_KEYS", "mine")
    assert EdgeConfig(api_keys_env="MY_KEYS").client_api_keys() == ("mine",)
    monkeypatch.delenv("MY_KEYS")
    with pytest.raises(ConfigError, match="api_keys_env: environment variable MY_KEYS is not set"):
        EdgeConfig(api_keys_env="MY_KEYS").client_api_keys()


# -- node tokens bound to node ids ----------------------------------------------------


def test_node_tokens_bound_to_ids(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
[nodes]
tokens = [
  "shared-any-id",
  { value_env = "NODE_A_TOKEN", ids = ["gpu-*"] },
  { value = "inline-b", ids = ["cpu-1", "cpu-[23]"] },
]
""",
        {"NODE_A_TOKEN": "secret-a"},
    )
    assert config.node_tokens() == (
        "shared-any-id",
        NodeToken(value="secret-a", ids=("gpu-*",)),
        NodeToken(value="inline-b", ids=("cpu-1", "cpu-[23]")),
    )
    assert "secret-a" not in repr(config)
    assert "inline-b" not in repr(config.node_tokens())


def test_array_of_tables_syntax(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        '[[nodes.tokens]]\nvalue_env = "A"\nids = ["a-*"]\n'
        '[[nodes.tokens]]\nvalue_env = "B"\nids = ["b-*"]\n',
        {"A": "ta", "B": "tb"},
    )
    assert config.node_tokens() == (
        NodeToken(value="ta", ids=("a-*",)),
        NodeToken(value="tb", ids=("b-*",)),
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('value = "x"', "nodes.tokens[0].ids: missing"),
        (
            'value = "x"\nids = []',
            'nodes.tokens[0].ids: expected at least one node id or glob pattern (["*"] for any id)',
        ),
        (
            'value = "x"\nids = "gpu-*"',
            "nodes.tokens[0].ids: expected an array of strings, got a string",
        ),
        (
            'value = "x"\nids = ["gpu 1"]',
            "nodes.tokens[0].ids[0]: expected a node id or a glob pattern of one, got 'gpu 1'",
        ),
        ('ids = ["a"]', "nodes.tokens[0]: give either value or value_env (exactly one)"),
        (
            'value = "x"\nvalue_env = "X"\nids = ["a"]',
            "nodes.tokens[0]: give either value or value_env (exactly one)",
        ),
        (
            'value = "x"\nid = ["a"]',
            "nodes.tokens[0].id: unknown key; nodes.tokens[0].ids: missing",
        ),
    ],
)
def test_node_token_table_errors(tmp_path: Path, table: str, message: str) -> None:
    assert error(tmp_path, f"[[nodes.tokens]]\n{table}\n", {"X": "x"}) == message


def test_settings_in_python() -> None:
    settings = NodeSettings(tokens=("any", NodeToken(value="b", ids=("gpu-*",))))
    assert EdgeConfig(nodes=settings).node_tokens() == settings.tokens


def test_parse_edge_config_source_default() -> None:
    with pytest.raises(ConfigError, match=r"^<config>: api_keys: expected an array"):
        parse_edge_config({"api_keys": "k1"}, environ={})


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = (
        'port = 70000\nhost = 3\napi_keys_env = "UNSET_KEYS"\n'
        "[http]\nmax_body_size = 0\n"
        '[models."m.1"]\nmax_queue = -1\nbogus = 1\n'
        '[[keys]]\nid = "a"\nkey = "k1"\nrpm = "x"\n'
        '[[keys]]\nid = "a"\nkey = "k1"\n'
    )
    assert error(tmp_path, text).split("; ") == [
        # The values, as structuring finds them...
        "host: expected a string, got 3",
        'models."m.1".bogus: unknown key',
        "keys[0].rpm: expected an integer, got 'x'",
        # ...then the checks across values, on the rest...
        "port: 70000 is not a TCP port",
        "http.max_body_size: must be > 0",
        'models."m.1".max_queue: must be >= 0',
        "keys[1].id: 'a' is also the id of keys[0]",
        # ...the secrets, and the keys' uniqueness.
        "api_keys_env: environment variable UNSET_KEYS is not set",
        "keys[1]: the same key is also in keys[0]",
    ]


def test_a_value_reported_is_not_judged_again(tmp_path: Path) -> None:
    # key_sha256 of the wrong type is left out to check the rest: the tenant then has no
    # secret, which is not a second mistake (a check of a table one of whose values was
    # reported waits for the next run).
    text = '[[keys]]\nid = "a"\nkey_sha256 = 5\n'
    assert error(tmp_path, text) == "keys[0].key_sha256: expected a string, got 5"


def test_what_admission_takes_of_models_nobody_serves(tmp_path: Path) -> None:
    """``[admission] model_linger_s``, and the models each key's ``models`` names exactly
    (not a pattern): while no node serves one, that key's requests for it are 503
    ``model_unavailable`` rather than 404."""
    digest = "0" * 64
    config = load(
        tmp_path,
        "[admission]\nmodel_linger_s = 12.5\n"
        f'[[keys]]\nid = "team"\nkey_sha256 = "{digest}"\nmodels = ["gpt-x", "llama-*"]\n'
        f'[[keys]]\nid = "all"\nkey_sha256 = "{"1" * 64}"\n'
        '[prices."claude-y"]\ninput_per_mtok = 1.0\n'
        "[models.echo]\nqueue_timeout_s = 5.0\n",
    )
    snapshot = policy_snapshot_from_config(config)
    assert snapshot.model_linger_s == 12.5
    assert snapshot.tenant_models == {"team": {"gpt-x"}, "all": set()}
    assert snapshot.policy_for("echo").queue_timeout_s == 5.0
    assert policy_snapshot_from_config(EdgeConfig()).model_linger_s == MODEL_LINGER_S == 60


def test_an_alias_has_its_groups_gate_policy_through_the_one_resolver() -> None:
    """The gate's policy of an alias is its group's, resolved by the admission policy of the
    same config (one alias map for admission, the gate and the metrics' label)."""
    config = parse_edge_config(
        {
            "admission": {"max_attempts": 2},
            "models": {"llama": {"aliases": ["gpt-4o"], "max_attempts": 5}},
        }
    )
    snapshot = policy_snapshot_from_config(config)
    policy_for = gate_policies(config, snapshot)
    assert snapshot.resolve("gpt-4o") == "llama"
    assert policy_for("gpt-4o").max_attempts == 5
    assert policy_for("llama").max_attempts == 5
    assert policy_for("other").max_attempts == 2


def test_affinity_settings_reach_the_policy_and_are_checked(tmp_path: Path) -> None:
    """``affinity``, ``affinity_wait_ms`` (milliseconds in the file, seconds in the policy)
    and ``affinity_load_factor``, in ``[admission]`` and per model (issue #26)."""
    config = load(
        tmp_path,
        "[admission]\naffinity_wait_ms = 80\n"
        "[models.llama]\naffinity = true\naffinity_load_factor = 2.0\n",
    )
    snapshot = policy_snapshot_from_config(config)
    assert (snapshot.default.affinity, snapshot.default.affinity_wait_s) == (False, 0.08)
    llama = snapshot.policy_for("llama")
    assert (llama.affinity, llama.affinity_wait_s, llama.affinity_load_factor) == (True, 0.08, 2.0)
    default = policy_snapshot_from_config(EdgeConfig()).default
    assert (default.affinity, default.affinity_wait_s, default.affinity_load_factor) == (
        False,
        0.05,
        1.25,
    )
    assert error(
        tmp_path,
        '[admission]\naffinity = "yes"\naffinity_wait_ms = -5\n'
        "[models.llama]\naffinity_load_factor = 0.5\n",
    ) == (
        "admission.affinity: expected true or false, got 'yes'; "
        "admission.affinity_wait_ms: must be a number of milliseconds >= 0; "
        "models.llama.affinity_load_factor: must be a number >= 1 "
        "(1.25: 25% above the group's average load)"
    )
    lines = describe_edge(config, auth=[], usage_db=":memory:")
    assert "admission defaults: affinity_wait_ms = 80" in lines
    assert "model llama: affinity = true, affinity_load_factor = 2" in lines
