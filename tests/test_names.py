"""One name per thing: no public name is defined in two modules of ``dispatcher/`` or
``nodes/``, so a name a reader meets means one thing wherever it is imported from.

A module's definitions are its top-level classes, functions (``def`` and ``async def``) and
assignments to a name (plain or annotated, so TypeVars and type aliases count too). Imports and
re-exports are not definitions: a package's ``__init__`` naming what one of its modules defines
is the same thing under one name. Names starting with ``_`` are private to their module and
``__all__`` and ``__version__`` are module metadata; none of these is counted.

Two names are defined in many modules on purpose, by convention:

- ``log``: each module's logger (``logging.getLogger(...)``), one per module by design;
- ``FRONT_END``: what each API front-end module exports by contract (``api/app.py`` registers
  every module's ``FRONT_END``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dispatcher", "nodes")

# The conventions named in the module docstring: one per module by design.
CONVENTIONS = frozenset({"log", "FRONT_END"})
METADATA = frozenset({"__all__", "__version__"})


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def assigned_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in assigned_names(element)]
    return []


def top_level_definitions(body: list[ast.stmt]) -> set[str]:
    """The names a module's body defines, including under a top-level ``if`` or ``try``
    (``if TYPE_CHECKING:``, a fallback), but not inside a class or a function."""
    names: set[str] = set()
    for statement in body:
        match statement:
            case ast.ClassDef(name=name) | ast.FunctionDef(name=name):
                names.add(name)
            case ast.AsyncFunctionDef(name=name):
                names.add(name)
            case ast.Assign(targets=targets):
                names.update(name for target in targets for name in assigned_names(target))
            case ast.AnnAssign(target=target):
                names.update(assigned_names(target))
            case ast.If(body=inner, orelse=orelse):
                names |= top_level_definitions(inner) | top_level_definitions(orelse)
            case ast.Try(body=inner, handlers=handlers, orelse=orelse, finalbody=final):
                for block in (inner, orelse, final, *(handler.body for handler in handlers)):
                    names |= top_level_definitions(block)
    return names


def public_definitions() -> dict[str, list[str]]:
    """Each public name defined at the top level of a module, with the modules defining it."""
    defined: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for name in top_level_definitions(tree.body):
                if name.startswith("_") or name in METADATA or name in CONVENTIONS:
                    continue
                defined[name].append(module_name(path))
    return defined


def test_the_walk_finds_definitions_and_skips_imports() -> None:
    tree = ast.parse(
        "from x import Imported\n"
        "import y as Aliased\n"
        "class K: pass\n"
        "def f(): pass\n"
        "async def g(): pass\n"
        "A = 1\n"
        "B: int = 2\n"
        "C, D = 3, 4\n"
        "T = TypeVar('T')\n"
        "_private = 5\n"
        "if TYPE_CHECKING:\n"
        "    from z import Hinted\n"
        "    E: TypeAlias = int\n"
        "def outer():\n"
        "    inner = 1\n"
        "class Outer:\n"
        "    attribute = 1\n"
    )
    assert top_level_definitions(tree.body) == {
        *("K", "f", "g", "outer", "Outer"),
        *("A", "B", "C", "D", "E", "T", "_private"),
    }


def test_the_walk_sees_both_packages() -> None:
    defined = public_definitions()
    modules = {module for owners in defined.values() for module in owners}
    assert "dispatcher.edge" in modules
    assert "nodes.agent" in modules


def test_no_public_name_is_defined_in_two_modules() -> None:
    doubles = {
        name: sorted(modules) for name, modules in public_definitions().items() if len(modules) > 1
    }
    listing = "\n".join(f"  {name} -> {', '.join(doubles[name])}" for name in sorted(doubles))
    assert not doubles, (
        "public names defined in more than one module (rename one to say what it is, define a "
        f"shared one once and import it, or make a module-internal one private):\n{listing}"
    )
