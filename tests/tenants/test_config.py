"""``[[keys]]`` and ``[prices]`` in the edge config: validated with clear messages, secrets
from the environment or as a hash, never shown; the tenants they make."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dispatcher.config import EdgeConfig, KeySettings
from dispatcher.tenants import (
    Limits,
    Price,
    legacy_key_id,
    tenant_policy_from_config,
)

from ..test_config_edge import error, load

SHA = hashlib.sha256(b"sk-hashed").hexdigest()


def test_keys_become_tenants(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        f"""
api_keys = ["sk-legacy"]
admin_keys = ["sk-admin"]

[[keys]]
id = "team-a"
name = "Team A"
key_env = "TEAM_A_KEY"
models = ["llama-*", "echo"]
priority = 2
weight = 3.0
rpm = 60
tpm = 100000
max_concurrent = 4
budget_tokens_day = 1000000
budget_usd_month = 250.0

[[keys]]
id = "batch"
key_sha256 = "{SHA.upper()}"

[prices."llama-70b"]
input_per_mtok = 0.5
output_per_mtok = 1.5

[prices."qwen-*"]
output_per_mtok = 2.0
""",
        {"TEAM_A_KEY": "sk-team-a"},
    )
    (team, _) = config.keys
    assert team.key == "sk-team-a"
    assert team.key_env is None
    policy = tenant_policy_from_config(config)
    found = policy.keys.client(b"sk-team-a")
    assert found is not None
    assert (found.id, found.name, found.priority, found.weight) == ("team-a", "Team A", 2, 3.0)
    assert found.limits == Limits(
        rpm=60,
        tpm=100000,
        max_concurrent=4,
        budget_tokens_day=1000000,
        budget_usd_month=250.0,
    )
    assert found.allows("llama-70b")
    assert found.allows("echo")
    assert not found.allows("qwen")
    hashed = policy.keys.client(b"sk-hashed")
    assert hashed is not None
    assert hashed.id == "batch"
    assert hashed.name == "batch"
    assert hashed.allows("anything")
    legacy = policy.keys.client(b"sk-legacy")
    assert legacy is not None
    assert legacy.id == legacy_key_id(b"sk-legacy")
    assert legacy.limits == Limits()
    assert not legacy.own_usage
    assert policy.keys.client(b"sk-admin") is None
    assert policy.keys.admin(b"sk-admin")
    assert not policy.keys.admin(b"sk-team-a")
    assert policy.prices.price("llama-70b") == Price(0.5, 1.5)
    assert policy.prices.price("qwen-7b") == Price(0.0, 2.0)
    shown = repr(config) + repr(team) + repr(policy)
    assert "sk-team-a" not in shown
    assert SHA.upper() not in shown


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[keys]]\nid = 'a'\n", "keys[0]: give exactly one of key_env, key_sha256 or key"),
        (
            "[[keys]]\nid = 'a'\nkey = 'k'\nkey_sha256 = '" + SHA + "'\n",
            "keys[0]: give exactly one of key_env, key_sha256 or key",
        ),
        (
            "[[keys]]\nid = 'a'\nkey_sha256 = 'abc'\n",
            "keys[0].key_sha256: expected the key's SHA-256 as 64 hex digits",
        ),
        ("[[keys]]\nkey = 'k'\n", "keys[0].id: missing"),
        ("[[keys]]\nid = 'a b'\nkey = 'k'\n", "keys[0].id: expected 1 to 64 of"),
        (
            "[[keys]]\nid = 'a'\nkey = 'k1'\n[[keys]]\nid = 'a'\nkey = 'k2'\n",
            "keys[1].id: 'a' is also the id of keys[0]",
        ),
        (
            "[[keys]]\nid = 'a'\nkey = 'k1'\n[[keys]]\nid = 'b'\nkey = 'k1'\n",
            "keys[1]: the same key is also in keys[0]",
        ),
        ("api_keys = ['k1']\n[[keys]]\nid = 'a'\nkey = 'k1'\n", "api_keys: the same key is"),
        ("admin_keys = ['k1']\n[[keys]]\nid = 'a'\nkey = 'k1'\n", "admin_keys: the same key is"),
        ("[[keys]]\nid = 'a'\nkey = 'k'\nrpm = 0\n", "keys[0].rpm: must be > 0"),
        ("[[keys]]\nid = 'a'\nkey = 'k'\nbudget_usd_day = -1.0\n", "keys[0].budget_usd_day"),
        ("[[keys]]\nid = 'a'\nkey = 'k'\nweight = 0\n", "keys[0].weight: must be a number > 0"),
        ("[[keys]]\nid = 'a'\nkey = 'k'\nweight = inf\n", "keys[0].weight: must be a number > 0"),
        ("[[keys]]\nid = 'a'\nkey = 'k'\nweight = nan\n", "keys[0].weight: must be a number > 0"),
        ("[[keys]]\nid = 'a'\nkey = 'k'\nmodels = []\n", "keys[0].models: expected at least"),
        ("[[keys]]\nid = 'a'\nkey = 'k'\nrpm = '60'\n", "keys[0].rpm: expected an integer"),
        ("[[keys]]\nid = 'a'\nkey = 'k'\nrmp = 60\n", "keys[0].rmp: unknown key"),
        ("keys = 'k'\n", "keys: expected an array of tables ([[keys]]), got a string"),
        ("[[keys]]\nid = 'a'\nkey_env = 'NOPE'\n", "keys[0].key_env: environment variable NOPE"),
        ("[prices.m]\ninput_per_mtok = -1\n", "prices.m.input_per_mtok: must be >= 0"),
        ("[prices.m]\ninput = 1\n", "prices.m.input: unknown key"),
    ],
)
def test_key_and_price_errors(tmp_path: Path, text: str, message: str) -> None:
    found = error(tmp_path, text)
    assert found.startswith(message), found


def test_a_key_is_never_in_an_error(tmp_path: Path) -> None:
    found = error(tmp_path, "[[keys]]\nid = 'a'\nkey = 'sk-visible'\nkey_sha256 = 'x'\n")
    assert "sk-visible" not in found


def test_a_python_config_resolves_key_env_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_TENANT_KEY", "sk-from-env")
    config = EdgeConfig(keys=(KeySettings(id="a", key_env="MY_TENANT_KEY"),))
    policy = tenant_policy_from_config(config)
    tenant = policy.keys.client(b"sk-from-env")
    assert tenant is not None
    assert tenant.id == "a"
