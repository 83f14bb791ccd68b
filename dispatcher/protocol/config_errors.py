"""A configuration error's place and reason, from a cattrs structuring failure over parsed
TOML. What the edge's and the node's configuration loaders (``dispatcher.config``,
``nodes.config``) share: they validate different files with their own converters and hooks,
and report a problem the same way, as a TOML key path and a reason::

    try:
        config = converter.structure(raw, Config)
    except Exception as exc:
        key, reason = first_problem(exc)        # ("providers[2].models[0].slots", "missing")

A hook raises :class:`Invalid` for a value it refuses (or to say where, inside the value it
was given, a nested failure happened); cattrs' own errors are walked as they are. Sans-IO.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, TypeVar

import cattrs

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+\Z")
"""A TOML key that needs no quotes."""


class ConfigFileError(Exception):
    """An unusable configuration file: ``str()`` is ``"<file>: <key>: <reason>"`` (just
    ``"<file>: <reason>"`` without a key). The base of each loader's own error."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        super().__init__(f"{source}: {key}: {reason}" if key else f"{source}: {reason}")
        self.source = source
        self.key = key
        self.reason = reason


class Invalid(Exception):
    """A problem at ``at`` (a key path relative to where the hook was called: ``[2]``,
    ``name``, or empty), either a ``reason`` or a nested structuring error ``inner``."""

    def __init__(self, reason: str = "", *, at: str = "", inner: BaseException | None = None):
        super().__init__(reason)
        self.reason = reason
        self.at = at
        self.inner = inner


_T = TypeVar("_T")


def structure_each(structure: Callable[[Any], _T], items: Iterable[Any]) -> tuple[_T, ...]:
    """Each item of an array (of tables) structured, a failure :class:`Invalid` at its
    ``[index]`` (the edge's ``[[keys]]``, the node's ``[[providers]]``...)."""
    structured = []
    for index, item in enumerate(items):
        try:
            structured.append(structure(item))
        except Exception as exc:
            raise Invalid(at=f"[{index}]", inner=exc) from None
    return tuple(structured)


def show(value: object) -> str:
    """A value in an error message: ``'x'``, ``3``, ``a table``, ``an array``."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return repr(value)


def key(path: str, name: object) -> str:
    """``path`` extended by a table key (quoted when TOML needs it) or an array index."""
    if isinstance(name, int):
        return f"{path}[{name}]"
    text = str(name)
    part = text if _BARE_KEY.match(text) else '"' + text.replace('"', '\\"') + '"'
    return f"{path}.{part}" if path else part


def problems(exc: BaseException, path: str = "") -> Iterator[tuple[str, str]]:
    """(key path, reason) for every problem in a structuring error, unknown keys first."""
    if isinstance(exc, Invalid):
        if not exc.at or not path or exc.at.startswith("["):
            where = path + exc.at
        else:
            where = f"{path}.{exc.at}"
        if exc.inner is not None:
            yield from problems(exc.inner, where)
        else:
            yield where, exc.reason
    elif isinstance(exc, cattrs.ClassValidationError | cattrs.IterableValidationError):
        with_notes, without = exc.group_exceptions()
        for inner in without:
            yield from problems(inner, path)
        for inner, note in with_notes:
            name = note.index if isinstance(note, cattrs.IterableValidationNote) else note.name
            yield from problems(inner, key(path, name))
    elif isinstance(exc, cattrs.ForbiddenExtraKeysError):
        for name in sorted(exc.extra_fields):
            yield key(path, name), "unknown key"
    elif isinstance(exc, KeyError):
        yield path, "missing"
    elif isinstance(exc, AttributeError):
        yield path, "expected a table"
    else:
        yield path, str(exc) or type(exc).__name__


def first_problem(exc: BaseException) -> tuple[str, str]:
    """The (key path, reason) to report for a failed structuring of a whole document."""
    return next(problems(exc), ("", str(exc)))
