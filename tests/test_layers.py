"""The layers contracts of ``pyproject.toml`` are the map of ``dispatcher/`` and of ``nodes/``:
every module and package of them sits in one layer of its container's contract -- the top
level's, and each package's own -- so a new one is placed on purpose, not left out of the map
(import-linter itself ignores a module no layer names)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The packages whose modules are ordered by a contract of their own (the others -- api,
# admission, tenants, http, wire, config -- hide their insides behind their __init__).
LAYERED_PACKAGES = ("gate", "paths", "link", "observe", "store", "shared")
# nodes/'s likewise: the adapters (the engines over their shared bases), the HTTP client to the
# providers. Each container of nodes/ is checked as dispatcher's are.
NODES_CONTAINERS = ("nodes", "nodes.adapters", "nodes.upstream")


def layers_contracts() -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts: dict[str, list[str]] = {}
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] != "layers":
            continue
        (container,) = contract["containers"]
        assert container not in contracts, f"two layers contracts for {container}"
        names = [name.strip() for layer in contract["layers"] for name in layer.split("|")]
        contracts[container] = names
    return contracts


def children(package: Path) -> set[str]:
    return {
        path.stem if path.is_file() else path.name
        for path in package.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__")
        or (path.is_dir() and (path / "__init__.py").exists())
    }


@pytest.mark.parametrize(
    "container", ["dispatcher", *(f"dispatcher.{p}" for p in LAYERED_PACKAGES)]
)
def test_every_module_is_in_one_layer(container: str) -> None:
    assert_every_module_in_one_layer(container)


@pytest.mark.parametrize("container", NODES_CONTAINERS)
def test_every_module_of_nodes_is_in_one_layer(container: str) -> None:
    assert_every_module_in_one_layer(container)


def assert_every_module_in_one_layer(container: str) -> None:
    names = layers_contracts()[container]
    modules = children(ROOT.joinpath(*container.split(".")))
    assert sorted(modules - set(names)) == [], "modules in no layer (add them to pyproject.toml)"
    assert sorted(set(names) - modules) == [], "layers naming no module"
    assert len(names) == len(set(names)), "a module in two layers"


def test_every_layered_package_has_its_contract() -> None:
    contracts = layers_contracts()
    assert set(contracts) == {
        "dispatcher",
        *(f"dispatcher.{p}" for p in LAYERED_PACKAGES),
        *NODES_CONTAINERS,
    }


def test_the_top_level_holds_a_handful_of_modules() -> None:
    """The top level is the storefront, the CLI, the assembly and packages by job: a new
    module goes into the package of its job."""
    modules = {p.stem for p in (ROOT / "dispatcher").glob("*.py")}
    assert modules == {"__init__", "__main__", "cli", "edge", "errors", "service"}


def test_no_function_level_import_but_the_documented_one() -> None:
    """An import inside a function dodges a cycle or hides a dependency; the ones allowed keep
    ``dispatcher --help`` and ``dispatcher node`` from loading the edge (``cli._serve``,
    ``cli._migrate_command``), and
    the shared backends' client libraries (an optional extra: coredis, psycopg) from loading
    unless ``[store]`` names them (``store.backends``: the limits, the ledger, the stored
    responses, and the cluster's heartbeats and reloads on Redis, ``_open_cluster``)."""
    found = []
    for path in sorted((ROOT / "dispatcher").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found.append(f"{path.relative_to(ROOT)}:{function.name}")
    assert sorted(set(found)) == [
        "dispatcher/cli.py:_migrate_command",
        "dispatcher/cli.py:_serve",
        "dispatcher/store/backends.py:_open_cluster",
        "dispatcher/store/backends.py:_open_ledger",
        "dispatcher/store/backends.py:_open_limits",
        "dispatcher/store/backends.py:_open_responses",
        "dispatcher/store/backends.py:migrate_database",
    ]


def _module_of(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports at import time (not under TYPE_CHECKING, not
    inside functions), an import of a package's name counted as an import of the package."""
    modules = {}
    for root in ("dispatcher", "nodes"):
        for path in (ROOT / root).rglob("*.py"):
            modules[_module_of(path)[0]] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = _module_of(path)[1]
        base = name.split(".") if package else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                start = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
                source = ".".join(filter(None, [start, node.module or ""]))
                targets = [source]
                targets += [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules and not name.startswith(f"{target}."):
                    edges.add(target)  # an ancestor package is imported first anyway
        graph[name] = edges - {name}
    return graph


def test_no_import_cycle() -> None:
    """Layers order the packages; this checks every module, inside packages too: no chain of
    module-level imports leads back to where it started."""
    graph = import_graph()
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph[module]):
            assert target not in on_path, " -> ".join([*path[path.index(target) :], target])
            if target not in done:
                visit(target)
        path.pop()
        on_path.discard(module)
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    assert len(done) > 100  # the walk saw the whole tree
