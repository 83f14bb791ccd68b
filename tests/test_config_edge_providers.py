"""The edge's own ``[[providers]]`` (the node's tables, checked by the node's code, served by
the in-process node) and model ``fallbacks`` (a known group, not itself, no cycle), as the
loader reads them; what ``check-config`` says of them."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.config import (
    ConfigError,
    EdgeConfig,
    fallback_chain,
    load_edge_config,
    parse_edge_config,
)
from dispatcher.config.summary import config_kind, describe_edge
from dispatcher.gate.catalog import gate_policies, policy_snapshot_from_config
from dispatcher.service import local_node_config, open_service
from nodes import load_node_config
from nodes.config import NodeConfigError

OPENAI = """
[[providers]]
id = "openai"
type = "openai"
base_url = "https://api.openai.com/v1"
api_key_env = "OPENAI_API_KEY"
  [[providers.models]]
  name = "gpt-4o"
  slots = 8
"""
KEY = "sk-edge-secret-0123456789"


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> EdgeConfig:
    path = tmp_path / "edge.toml"
    path.write_text(text)
    return load_edge_config(path, environ={"OPENAI_API_KEY": KEY} if environ is None else environ)


def errors(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, environ)
    return [line.removeprefix(f"{tmp_path / 'edge.toml'}: ") for line in info.value.lines()]


def node_errors(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(NodeConfigError) as info:
        load_node_config(path, environ={})
    return [line.removeprefix(f"{path}: ") for line in info.value.lines()]


# --------------------------------------------------------------------------- [[providers]]


def test_providers_are_served_by_the_in_process_node_beside_echo(tmp_path: Path) -> None:
    config = load(tmp_path, OPENAI)
    (provider,) = config.providers
    assert (provider.id, provider.type, provider.api_key_env) == (
        "openai",
        "openai",
        "OPENAI_API_KEY",
    )
    assert provider.models[0].slots == 8
    node = local_node_config(config)
    assert node is not None
    assert node.node_id == "local"
    assert [p.id for p in node.providers] == ["echo", "openai"]
    assert KEY not in repr(config)  # the key stays in the environment
    assert KEY not in repr(node)


def test_local_node_false_leaves_echo_out_and_the_providers_in(tmp_path: Path) -> None:
    config = load(tmp_path, "local_node = false\n" + OPENAI)
    node = local_node_config(config)
    assert node is not None
    assert [p.id for p in node.providers] == ["openai"]
    assert local_node_config(EdgeConfig(local_node=False)) is None
    default = local_node_config(EdgeConfig())
    assert default is not None
    assert [p.id for p in default.providers] == ["echo"]


@pytest.mark.parametrize(
    "provider",
    [
        'id = "x"\ntype = "nope"\n  [[providers.models]]\n  name = "m"',
        'id = "x"\ntype = "echo"\nslots = 3\n  [[providers.models]]\n  name = "m"',
        'id = "x"\ntype = "openai"',
        'id = "x y"\ntype = "echo"\n  [[providers.models]]\n  name = "m"',
        'id = "x"\ntype = "echo"\npath = "tunnel"\n  [[providers.models]]\n  name = "m"',
        'id = "x"\ntype = "echo"\n  [[providers.models]]\n  name = "m"\n  slots = 0',
    ],
)
def test_a_provider_is_checked_by_the_nodes_own_code(tmp_path: Path, provider: str) -> None:
    """The same table gives the same messages in an edge's file as in a node's."""
    text = f"[[providers]]\n{provider}\n"
    assert errors(tmp_path, text) == node_errors(tmp_path, text)


def test_duplicate_provider_ids_and_the_built_in_echo_id(tmp_path: Path) -> None:
    echo = '[[providers]]\nid = "echo"\ntype = "echo"\n  [[providers.models]]\n  name = "m"\n'
    assert errors(tmp_path, echo) == [
        "providers[0].id: 'echo' is the built-in echo provider's id (local_node = true): "
        "choose another, or set local_node = false"
    ]
    assert load(tmp_path, "local_node = false\n" + echo).providers[0].id == "echo"
    twice = OPENAI + OPENAI
    assert errors(tmp_path, twice) == ["providers[1].id: duplicate provider id 'openai'"]


def test_a_missing_key_variable_is_the_nodes_message(tmp_path: Path) -> None:
    assert errors(tmp_path, OPENAI, environ={}) == [
        "providers[0].api_key_env: environment variable OPENAI_API_KEY is not set"
    ]
    assert errors(tmp_path, OPENAI, environ={"OPENAI_API_KEY": ""}) == [
        "providers[0].api_key_env: environment variable OPENAI_API_KEY is not set"
    ]


def test_check_config_names_the_variable_never_the_key(tmp_path: Path) -> None:
    config = load(tmp_path, OPENAI)
    lines = describe_edge(config, auth=[], usage_db=":memory:")
    assert "in-process node: on (model echo, provider openai)" in lines
    assert (
        "provider openai: type openai, normalized, https://api.openai.com/v1, key from "
        "$OPENAI_API_KEY"
    ) in lines
    assert "  model gpt-4o: 8 slots" in lines
    assert not any(KEY in line for line in lines)


def test_which_kind_of_file() -> None:
    providers = tomllib.loads(OPENAI)
    assert config_kind(providers) == "node"  # a node's file may be [[providers]] alone
    assert config_kind({**providers, "local_node": True}) == "edge"
    assert config_kind({**providers, "models": {}}) == "edge"
    assert config_kind({**providers, "node": {}}) == "node"


# --------------------------------------------------------------------------- fallbacks


def test_fallbacks_are_resolved_and_followed(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        OPENAI
        + """
[models.gpt-4o]
fallbacks = ["small"]
[models.mini]
aliases = ["small"]
fallbacks = ["echo"]
""",
    )
    assert fallback_chain(config, "gpt-4o") == ("mini", "echo")
    assert fallback_chain(config, "mini") == ("echo",)
    assert fallback_chain(config, "echo") == ()
    policy_for = gate_policies(config, policy_snapshot_from_config(config))
    assert policy_for("gpt-4o").fallbacks == ("mini", "echo")
    assert policy_for("small").fallbacks == ("echo",)  # an alias: its group's
    assert policy_for("unconfigured").fallbacks == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[models.a]\nfallbacks = ["b"]',
            [
                "models.a.fallbacks[0]: unknown model group 'b': name a [models.NAME] table, "
                "an alias, or a model of this file's [[providers]]"
            ],
        ),
        (
            '[models.a]\nfallbacks = ["a"]',
            ["models.a.fallbacks[0]: 'a' is this model group itself"],
        ),
        (
            '[models.a]\naliases = ["aa"]\nfallbacks = ["aa"]',
            ["models.a.fallbacks[0]: 'aa' is this model group itself"],
        ),
        (
            '[models.a]\nfallbacks = ["echo", "echo"]',
            ["models.a.fallbacks[1]: 'echo' is listed twice (as 'echo')"],
        ),
        (
            '[admission]\nfallbacks = ["echo"]',
            ["admission.fallbacks: only in [models.NAME]: a fallback belongs to one model group"],
        ),
        (
            '[models.a]\nfallbacks = ["b"]\n[models.b]\nfallbacks = ["c"]\n'
            '[models.c]\nfallbacks = ["a"]',
            ["models.a.fallbacks: a cycle of fallbacks: a -> b -> c -> a"],
        ),
        (
            '[models.a]\nfallbacks = "b"',
            ["models.a.fallbacks: expected an array of strings, got a string"],
        ),
        (
            'local_node = false\n[models.a]\nfallbacks = ["echo"]',
            [
                "models.a.fallbacks[0]: unknown model group 'echo': name a [models.NAME] table, "
                "an alias, or a model of this file's [[providers]]"
            ],
        ),
    ],
)
def test_fallbacks_are_checked_at_load(tmp_path: Path, text: str, expected: list[str]) -> None:
    assert errors(tmp_path, text) == expected


GROUPS = [f"g{i}" for i in range(5)]


@given(
    edges=st.dictionaries(
        st.sampled_from(GROUPS), st.lists(st.sampled_from(GROUPS), unique=True, max_size=4)
    )
)
def test_a_file_is_refused_exactly_when_its_fallbacks_have_a_cycle(
    edges: dict[str, list[str]],
) -> None:
    """Over random fallback graphs: a cycle (a group reaching itself, itself included) is
    refused; else each group's chain is every group it reaches, once, depth first."""
    edges = {group: [t for t in targets if t != group] for group, targets in edges.items()}
    document = {"models": {g: {"fallbacks": edges.get(g, [])} for g in GROUPS}}

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(edges.get(start, []))
        while todo:
            group = todo.pop()
            if group not in seen:
                seen.add(group)
                todo.extend(edges.get(group, []))
        return seen

    cyclic = any(group in reach(group) for group in GROUPS)
    try:
        config = parse_edge_config(document, source="edge.toml", environ={})
    except ConfigError as exc:
        assert cyclic
        assert all("a cycle of fallbacks" in problem.reason for problem in exc.problems)
        return
    assert not cyclic
    for group in GROUPS:
        chain = fallback_chain(config, group)
        assert len(chain) == len(set(chain))
        assert set(chain) == reach(group)
        assert group not in chain
        # depth first: each group comes after one that names it (or is the first's own)
        for index, item in enumerate(chain):
            named_by = [group, *chain[:index]]
            assert any(item in edges.get(parent, []) for parent in named_by)


# --------------------------------------------------------------------------- reload


async def test_a_reload_applies_fallbacks_at_once_and_providers_at_the_next_start(
    tmp_path: Path,
) -> None:
    """Fallbacks are per-model policy (applied by a reload); ``[[providers]]`` are the
    in-process node's, whose keys are read from the environment at start: a reload that
    changes them says they need a restart and leaves the node as it is."""
    before = load(tmp_path, OPENAI + "[models.gpt-4o]\n")
    after = load(tmp_path, OPENAI.replace("slots = 8", "slots = 2") + FALLBACK)
    async with open_service(before) as service:
        assert service.gate.policy_for("gpt-4o").fallbacks == ()
        kept = service.reload(after)
        assert kept == ("providers",)
        assert service.gate.policy_for("gpt-4o").fallbacks == ("echo",)
        assert service.config.providers == before.providers
        assert service.config.models == after.models


FALLBACK = '[models.gpt-4o]\nfallbacks = ["echo"]\n'
