"""Configuration errors' places and reasons, from cattrs structuring failures over parsed
TOML. What the edge's and the node's configuration loaders (``dispatcher.config``,
``nodes.config``) share: they validate different files with their own converters and hooks,
and report problems the same way, each as a TOML key path and a reason, **all of them** in
one go (a file with four mistakes needs one run, not four)::

    structured = structure_all(lambda doc: converter.structure(doc, Config), raw)
    structured.problems    # [(("providers", 2, "models", 0, "slots"), "missing"), ...]
    structured.value       # the document structured without the values at fault, or None

A hook raises :class:`Invalid` for a value it refuses (or to say where, inside the value it
was given, a nested failure happened), or an ``ExceptionGroup`` of them for several;
cattrs' own errors (with ``detailed_validation``, the preconf converters' default: every
field's failure) are walked as they are. The checks that span values run on
``structured.value`` next, and :func:`unrelated` drops what they say about a value already
reported. Sans-IO.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import reduce
from typing import Any, Final, Generic, Self, TypeVar

import attrs
import cattrs

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+\Z")
"""A TOML key that needs no quotes."""

KeyPath = tuple[str | int, ...]
"""A place in a TOML document: table keys and array indexes, from the top."""


@attrs.frozen
class Problem:
    """One mistake in a configuration: ``str()`` is ``"<file>: <key>: <reason>"`` (just
    ``"<file>: <reason>"`` without a key)."""

    source: str
    key: str
    reason: str

    def __str__(self) -> str:
        if self.key:
            return f"{self.source}: {self.key}: {self.reason}"
        return f"{self.source}: {self.reason}"


class ConfigFileError(Exception):
    """An unusable configuration file, with every problem found in it (``problems``, in the
    order found; ``source``, ``key`` and ``reason`` are the first's). ``str()`` is each
    problem's line, joined by ``"; "`` (one line, for a log or an API error);
    :meth:`lines` gives them one per line. The base of each loader's own error."""

    def __init__(self, source: str, key: str, reason: str, *, more: Iterable[Problem] = ()):
        self.problems: tuple[Problem, ...] = (Problem(source, key, reason), *more)
        super().__init__("; ".join(self.lines()))
        self.source = source
        self.key = key
        self.reason = reason

    @classmethod
    def of(cls, problems: Sequence[Problem]) -> Self:
        """The error for ``problems`` (at least one)."""
        first, *more = problems
        return cls(first.source, first.key, first.reason, more=more)

    def lines(self) -> list[str]:
        """One line per problem: ``<file>: <key>: <reason>``."""
        return [str(problem) for problem in self.problems]


class Invalid(Exception):
    """A problem at ``at`` (relative to where the hook was called: a table key, an array
    index, a path of them, or nothing), either a ``reason`` or a nested structuring error
    ``inner``."""

    def __init__(
        self,
        reason: str = "",
        *,
        at: str | int | KeyPath = (),
        inner: BaseException | None = None,
    ):
        super().__init__(reason)
        self.reason = reason
        self.at: KeyPath = at if isinstance(at, tuple) else (at,)
        self.inner = inner


_T = TypeVar("_T")
_K = TypeVar("_K")


def structure_each(structure: Callable[[Any], _T], items: Iterable[Any]) -> tuple[_T, ...]:
    """Each item of an array (of tables) structured; the failures, each :class:`Invalid` at
    its index, raised together (the edge's ``[[keys]]``, the node's ``[[providers]]``...)."""
    return tuple(_each(structure, enumerate(items)).values())


def structure_named(structure: Callable[[Any], _T], tables: Mapping[str, Any]) -> dict[str, _T]:
    """Each value of a table of tables structured (``[models.NAME]``); the failures, each
    :class:`Invalid` at its name, raised together."""
    return _each(structure, tables.items())


def _each(structure: Callable[[Any], _T], items: Iterable[tuple[_K, Any]]) -> dict[_K, _T]:
    structured: dict[_K, _T] = {}
    failures: list[Invalid] = []
    for name, item in items:
        try:
            structured[name] = structure(item)
        except Exception as exc:
            at: str | int = name if isinstance(name, str | int) else str(name)
            failures.append(Invalid(at=at, inner=exc))
    if len(failures) == 1:
        raise failures[0]
    if failures:
        raise ExceptionGroup("invalid items", failures)
    return structured


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


def render(path: KeyPath, prefix: str = "") -> str:
    """A key path as TOML writes it: ``providers[2].models[0]``, ``models."qwen2.5:7b"``."""
    return reduce(key, path, prefix)


def located(exc: BaseException, path: KeyPath = ()) -> Iterator[tuple[KeyPath, str]]:
    """(key path, reason) for every problem in a structuring error, unknown keys first."""
    if isinstance(exc, Invalid):
        where = path + exc.at
        if exc.inner is not None:
            yield from located(exc.inner, where)
        else:
            yield where, exc.reason
    elif isinstance(exc, cattrs.ClassValidationError | cattrs.IterableValidationError):
        with_notes, without = exc.group_exceptions()
        for bare in without:
            yield from located(bare, path)
        for noted, note in with_notes:
            name = note.index if isinstance(note, cattrs.IterableValidationNote) else note.name
            yield from located(noted, (*path, name))
    elif isinstance(exc, cattrs.ForbiddenExtraKeysError):
        for name in sorted(exc.extra_fields):
            yield (*path, name), "unknown key"
    elif isinstance(exc, BaseExceptionGroup):  # several problems from one hook
        for each in exc.exceptions:
            yield from located(each, path)
    elif isinstance(exc, KeyError):
        yield path, "missing"
    elif isinstance(exc, AttributeError):
        yield path, "expected a table"
    else:
        yield path, str(exc) or type(exc).__name__


def problems(exc: BaseException, path: str = "") -> Iterator[tuple[str, str]]:
    """(key path, reason) for every problem in a structuring error, the path rendered
    (after ``path``)."""
    for where, reason in located(exc):
        yield render(where, path), reason


def first_problem(exc: BaseException) -> tuple[str, str]:
    """The first (key path, reason) of a failed structuring of a whole document."""
    return next(problems(exc), ("", str(exc)))


MAX_PRUNING_ROUNDS: Final = 8
"""How many times :func:`structure_all` leaves out what failed and structures again."""


@attrs.frozen
class Structured(Generic[_T]):
    """What :func:`structure_all` found: every problem, and ``value``, the document
    structured without the values at fault (None when even that failed)."""

    value: _T | None
    problems: list[tuple[KeyPath, str]]
    left_out: list[KeyPath]
    """Where values were left out to structure the rest (their defaults apply in
    ``value``): what the checks that follow may not judge."""

    def unrelated(self, key: str) -> bool:
        """Whether a later problem at ``key`` (rendered) is about something else than the
        values already reported or left out (neither inside nor around one of them)."""
        reported = {render(path) for path, _ in self.problems}
        reported.update(render(path) for path in self.left_out)
        return not any(_related(key, other) for other in reported)


def _related(a: str, b: str) -> bool:
    if not a or not b:
        return True  # the whole document
    short, long = sorted((a, b), key=len)
    return long == short or long.startswith((f"{short}.", f"{short}["))


def structure_all(structure: Callable[[Any], _T], document: Mapping[str, Any]) -> Structured[_T]:
    """``structure(document)``, with every problem when it fails, and the document
    structured anyway for the checks that follow: each value at fault is left out (its
    default applies; a table missing a required key is left out whole; an item of an array
    is not: its array is), and the rest structured again, a few rounds at most."""
    try:
        return Structured(structure(document), [], [])
    except Exception as exc:
        found = list(located(exc))
    pruned = copy.deepcopy(dict(document))
    left_out: list[KeyPath] = []
    current = found
    for _ in range(MAX_PRUNING_ROUNDS):
        for path, reason in current:
            if any(path[: len(out)] == out for out in left_out):
                continue  # inside what is already left out
            cut = _leave_out(pruned, path[:-1] if reason == "missing" else path)
            if cut is None:
                return Structured(None, found, left_out)
            left_out.append(cut)
        try:
            return Structured(structure(pruned), found, left_out)
        except Exception as exc:
            current = list(located(exc))
    return Structured(None, found, left_out)


def _leave_out(document: dict[str, Any], path: KeyPath) -> KeyPath | None:
    """Delete the value at ``path`` (or the nearest table key above it: an array keeps its
    items' places); where it was, or None when only the whole document could go."""
    while path:
        if isinstance(path[-1], int):
            path = path[:-1]
            continue
        parent: Any = document
        for part in path[:-1]:
            try:
                parent = parent[part]
            except (KeyError, IndexError, TypeError):
                break
        else:
            if isinstance(parent, dict) and path[-1] in parent:
                del parent[path[-1]]
                return path
        path = path[:-1]
    return None
