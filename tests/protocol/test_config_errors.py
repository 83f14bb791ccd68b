"""The configuration error walker both loaders use (dispatcher.config, nodes.config)."""

from __future__ import annotations

from typing import Any

import attrs
import cattrs
import pytest
from cattrs.preconf.tomllib import make_converter

from dispatcher.shared.config_errors import (
    ConfigFileError,
    Invalid,
    Problem,
    first_problem,
    key,
    problems,
    show,
    structure_all,
    structure_each,
)


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
    inner = Invalid("expected a table, got an array", at=2)
    outer = Invalid(at="tokens", inner=inner)
    assert list(problems(outer, "edge")) == [("edge.tokens[2]", "expected a table, got an array")]
    assert list(problems(Invalid("bad", at="x"))) == [("x", "bad")]
    assert list(problems(Invalid("bad", at=("models", "qwen2.5:7b")))) == [
        ('models."qwen2.5:7b"', "bad")
    ]


def test_keys_are_quoted_only_when_toml_needs_it() -> None:
    assert key("", "models") == "models"
    assert key("models", "qwen2.5:7b") == 'models."qwen2.5:7b"'
    assert key("a", 'say "hi"') == 'a."say \\"hi\\""'
    assert key("providers", 3) == "providers[3]"
    assert (show({}), show([]), show("x"), show(3)) == ("a table", "an array", "'x'", "3")


def test_structure_all_reports_every_problem_and_structures_the_rest() -> None:
    models: list[dict[str, Any]] = [{"name": "a", "slots": 1}, {"name": "b", "slots": "8"}]
    raw = {"id": "p", "extra": 1, "models": [*models, {"slots": 2}]}
    structured = structure_all(lambda doc: converter.structure(doc, Provider), raw)
    assert structured.problems == [
        (("extra",), "unknown key"),
        (("models", 1, "slots"), "expected an integer, got '8'"),
        (("models", 2, "name"), "missing"),
    ]
    # What could not be kept was left out (an array item's table is left out by its array:
    # indexes stay what the file says), the rest structured for the checks that follow.
    assert structured.value == Provider(id="p")
    assert models[1] == {"name": "b", "slots": "8"}  # the caller's document untouched
    assert structured.unrelated("id")
    assert not structured.unrelated("models[0].name")  # models were left out
    assert not structured.unrelated("extra")


def test_structure_all_without_a_required_top_level_key() -> None:
    structured = structure_all(lambda doc: converter.structure(doc, Provider), {"models": []})
    assert structured.problems == [(("id",), "missing")]
    assert structured.value is None


def test_structure_each_raises_every_item_at_its_index() -> None:
    def positive(value: Any) -> int:
        if type(value) is not int or value < 1:
            raise Invalid(f"expected a positive integer, got {show(value)}")
        return value

    assert structure_each(positive, [1, 2]) == (1, 2)
    with pytest.raises(ExceptionGroup) as info:
        structure_each(positive, [1, "x", 0])
    assert list(problems(info.value, "slots")) == [
        ("slots[1]", "expected a positive integer, got 'x'"),
        ("slots[2]", "expected a positive integer, got 0"),
    ]


def test_a_config_error_holds_every_problem() -> None:
    error = ConfigFileError.of(
        [Problem("edge.toml", "port", "expected an integer"), Problem("edge.toml", "", "bad")]
    )
    assert (error.source, error.key, error.reason) == ("edge.toml", "port", "expected an integer")
    assert error.lines() == ["edge.toml: port: expected an integer", "edge.toml: bad"]
    assert str(error) == "edge.toml: port: expected an integer; edge.toml: bad"
