"""Exception groups, walked once and correctly.

Trio's nurseries wrap what their tasks raise in (possibly nested) exception groups. Code that
must ask "does this hold a ``ConnectionClosed``?" or "which errors are really in here?" uses
these helpers instead of walking ``.exceptions`` by hand: a hand-written walker that looks at
one level only is how a nested group turned into an ``AssertionError`` on the node.
Sans-IO; ``nodes/`` imports it too (it lives in ``dispatcher.wire``, the one package of the
edge a node may import besides ``dispatcher.shared.transport``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def iter_leaves(exc: BaseException) -> Iterator[BaseException]:
    """Every exception in ``exc`` that is not itself a group, depth first, in order."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from iter_leaves(inner)
    else:
        yield exc


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions in ``exc`` (``[exc]`` when it is not a group), flattened."""
    return list(iter_leaves(exc))


def first_leaf(exc: BaseException, kind: type[E] | tuple[type[E], ...]) -> E | None:
    """The first exception of ``kind`` in ``exc`` at any depth, or None."""
    for leaf in iter_leaves(exc):
        if isinstance(leaf, kind):
            return leaf
    return None


def holds(
    exc: BaseException | None, kind: type[BaseException] | tuple[type[BaseException], ...]
) -> bool:
    """Whether ``exc`` is, or holds at any depth, an exception of ``kind``."""
    return exc is not None and first_leaf(exc, kind) is not None


__all__ = ["first_leaf", "holds", "iter_leaves", "leaves"]
