"""The layers contract of ``pyproject.toml`` is the map of ``dispatcher/``: every module and
package of it sits in one layer, so a new one is placed on purpose, not left out of the map
(import-linter itself ignores a module no layer names)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layered() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert contract["containers"] == ["dispatcher"]
    return [name.strip() for layer in contract["layers"] for name in layer.split("|")]


def test_every_module_of_dispatcher_is_in_one_layer() -> None:
    package = ROOT / "dispatcher"
    modules = {
        path.stem if path.is_file() else path.name
        for path in package.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__")
        or (path.is_dir() and (path / "__init__.py").exists())
    }
    names = layered()
    assert sorted(modules - set(names)) == [], "modules in no layer (add them to pyproject.toml)"
    assert sorted(set(names) - modules) == [], "layers naming no module"
    assert len(names) == len(set(names)), "a module in two layers"
