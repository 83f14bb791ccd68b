"""The configuration error walker both loaders use (dispatcher.config, nodes.config)."""

from __future__ import annotations

from typing import Any

import attrs
import cattrs
import pytest
from cattrs.preconf.tomllib import make_converter

from dispatcher.protocol.config_errors import Invalid, first_problem, key, problems, show


@attrs.frozen
class Model:
    name: str
    slots: int


@attrs.frozen
class Provider:
    id: str
    models: tuple[Model, ...] = ()


converter = make_converter(forbid_extra_keys=True)


def _slots(value: Any, _: Any) -> int:
    if type(value) is not int:
        raise Invalid(f"expected an integer, got {show(value)}")
    return value


converter.register_structure_hook(int, _slots)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"id": "p", "models": [{"name": "m", "slots": "8"}]},
            ("models[0].slots", "expected an integer, got '8'"),
        ),
        ({"id": "p", "models": [{"name": "m"}]}, ("models[0].slots", "missing")),
        ({"id": "p", "extra key": 1}, ('"extra key"', "unknown key")),
        ({"models": []}, ("id", "missing")),
    ],
)
def test_first_problem_names_the_toml_key(raw: dict[str, Any], expected: tuple[str, str]) -> None:
    with pytest.raises(cattrs.BaseValidationError) as info:
        converter.structure(raw, Provider)
    assert first_problem(info.value) == expected


def test_invalid_nests_under_its_path() -> None:
    inner = Invalid("expected a table, got an array", at="[2]")
    outer = Invalid(at="tokens", inner=inner)
    assert list(problems(outer, "edge")) == [("edge.tokens[2]", "expected a table, got an array")]
    assert list(problems(Invalid("bad", at="x"))) == [("x", "bad")]


def test_keys_are_quoted_only_when_toml_needs_it() -> None:
    assert key("", "models") == "models"
    assert key("models", "qwen2.5:7b") == 'models."qwen2.5:7b"'
    assert key("a", 'say "hi"') == 'a."say \\"hi\\""'
    assert key("providers", 3) == "providers[3]"
    assert (show({}), show([]), show("x"), show(3)) == ("a table", "an array", "'x'", "3")
