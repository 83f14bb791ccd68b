"""The adapter registry is the one place adapter types live: a type registered here, in the
test, is loadable from a config file and buildable, with nothing in ``nodes`` touched."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

from dispatcher import wire
from nodes import load_node_config
from nodes.adapters import ADAPTERS, AdapterSpec, RunOutput, build_adapters, validate_options
from nodes.config import (
    NodeConfigError,
    OptionsError,
    ProviderConfig,
    hello_from_config,
)
from nodes.runner import open_runner
from tests.nodes._helpers import Recorder, assert_well_formed, request


@attrs.frozen(kw_only=True)
class ToyOptions:
    greeting: str = "hello"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> ToyOptions:
        for key, value in raw.items():
            if key != "greeting":
                raise OptionsError(key, "unknown toy option")
            if not isinstance(value, str):
                raise OptionsError(key, f"expected a string, got {value!r}")
        return cls(**raw)


@attrs.frozen
class ToyAdapter:
    """Greets whoever the last message names."""

    options: ToyOptions

    @classmethod
    def from_provider(cls, provider: ProviderConfig) -> ToyAdapter:
        return cls(ToyOptions.from_mapping(provider.options))

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        await out.delta(f"{self.options.greeting}, {request.body['messages'][-1]['content']}")
        out.usage(1, 2)
        out.finish("stop")


REGISTRY = {**ADAPTERS, "toy": AdapterSpec(ToyAdapter.from_provider, ToyOptions)}

TOY = """
[[providers]]
id = "toybox"
type = "toy"
options = { greeting = "ahoy" }
  [[providers.models]]
  name = "toy-1"

[[providers]]
id = "echo"
type = "echo"
  [[providers.models]]
  name = "echo"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


async def test_a_type_registered_outside_the_package_loads_builds_and_runs(tmp_path: Path) -> None:
    config = load_node_config(write(tmp_path, TOY), adapters=REGISTRY)
    toybox, _ = config.providers
    assert (toybox.type, toybox.options) == ("toy", {"greeting": "ahoy"})
    assert [(p.id, p.adapter) for p in hello_from_config(config).providers] == [
        ("toybox", "toy"),
        ("echo", "echo"),
    ]

    adapters = build_adapters(config.providers, REGISTRY)
    assert adapters["toybox"] == ToyAdapter(ToyOptions(greeting="ahoy"))
    rec = Recorder()
    async with open_runner(rec.send, adapters=adapters) as runner:
        runner.start(request("r1", "sailor", provider_id="toybox"))
        terminal = await rec.wait_terminal("r1")
    assert_well_formed(rec.events("r1"))
    assert isinstance(terminal, wire.RunCompleted)
    assert rec.text("r1") == "ahoy, sailor"
    assert "toy" not in ADAPTERS  # the package's registry is untouched


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            TOY.replace('greeting = "ahoy"', "greeting = 3"),
            "providers[0].options.greeting: expected a string, got 3",
        ),
        (
            TOY.replace('greeting = "ahoy"', 'greting = "ahoy"'),
            "providers[0].options.greting: unknown toy option",
        ),
        (
            TOY.replace('type = "toy"', 'type = "toy"\npath = "tunnel"'),
            "providers[0].path: a 'toy' provider can only run normalized, not tunnel",
        ),
        (
            TOY.replace('type = "toy"', 'type = "robot"'),
            "providers[0].type: expected one of echo, ollama, openai, cli, anthropic, toy, "
            "got 'robot'",
        ),
    ],
)
def test_a_registered_type_is_validated_by_its_spec(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(NodeConfigError) as info:
        load_node_config(path, adapters=REGISTRY)
    assert str(info.value) == f"{path}: {message}"


def test_a_tunnelling_spec_allows_path_tunnel(tmp_path: Path) -> None:
    registry = {**REGISTRY, "toy": attrs.evolve(REGISTRY["toy"], tunnel=True)}
    text = TOY.replace('type = "toy"', 'type = "toy"\npath = "tunnel"')
    (toybox, _) = load_node_config(write(tmp_path, text), adapters=registry).providers
    assert toybox.path == "tunnel"


def test_the_default_registry_does_not_know_the_toy(tmp_path: Path) -> None:
    path = write(tmp_path, TOY)
    with pytest.raises(NodeConfigError) as info:
        load_node_config(path)
    assert str(info.value) == (
        f"{path}: providers[0].type: expected one of echo, ollama, openai, cli, anthropic, "
        "got 'toy'"
    )


def test_validate_options_uses_the_given_registry() -> None:
    validate_options("toy", {"greeting": "hi"}, REGISTRY)
    with pytest.raises(OptionsError, match="unknown toy option"):
        validate_options("toy", {"x": 1}, REGISTRY)
    validate_options("toy", {"x": 1})  # a type in no registry: nothing to check against
