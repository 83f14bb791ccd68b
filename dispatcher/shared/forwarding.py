"""An attribute that is another object's: :class:`Forwarded`, a read-only descriptor.

::

    @attrs.frozen
    class DispatchResult:
        chosen: Candidate
        node_id = Forwarded[str]("chosen.node_id")    # result.node_id is result.chosen.node_id

Where a class shows the facts of an object it holds under its own names, one line says which,
instead of a property each (or a copy of each fact taken when it is built). A leaf: it imports
nothing else of ours.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Generic, Never, TypeVar, overload

T = TypeVar("T")


class Forwarded(property, Generic[T]):
    """A read-only attribute whose value is ``path`` (dotted, as :func:`operator.attrgetter`
    takes it) read off the instance. ``T`` is what the path reads: say it, the descriptor
    cannot check it (the tests of the class that holds it do).

    A :class:`property` whose getter is the :func:`operator.attrgetter` itself: a read runs
    no Python frame (these are read on every request's hot objects)."""

    def __init__(self, path: str) -> None:
        super().__init__(operator.attrgetter(path), self._refuse)
        self.path = path

    if TYPE_CHECKING:  # what a read gives, for the type checker (property's own at run time)

        @overload
        def __get__(self, instance: None, owner: type[Any]) -> Forwarded[T]: ...
        @overload
        def __get__(self, instance: object, owner: type[Any] | None = None) -> T: ...
        def __get__(
            self, instance: object | None, owner: type[Any] | None = None
        ) -> T | Forwarded[T]: ...
        def __set__(self, instance: object, value: Never) -> None: ...

    def _refuse(self, instance: object, value: Never) -> None:
        """Refused: a forwarded attribute is read-only (set it where it lives)."""
        raise AttributeError(f"{self.path} is forwarded: it is read-only here")

    def __repr__(self) -> str:
        return f"Forwarded({self.path!r})"


__all__ = ["Forwarded"]
