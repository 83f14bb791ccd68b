"""The one exception-group walker."""

from __future__ import annotations

import pytest

from dispatcher.shared.excgroups import first_leaf, holds, leaves


class Closed(Exception):
    pass


def test_leaves_flatten_nested_groups_in_order() -> None:
    a, b, c = ValueError("a"), Closed("b"), KeyError("c")
    group = ExceptionGroup("outer", [ExceptionGroup("inner", [a, b]), c])
    assert leaves(group) == [a, b, c]
    assert leaves(a) == [a]


def test_first_leaf_finds_at_any_depth() -> None:
    closed = Closed("deep")
    group = ExceptionGroup(
        "o", [ValueError(), ExceptionGroup("i", [ExceptionGroup("j", [closed])])]
    )
    assert first_leaf(group, Closed) is closed
    assert first_leaf(group, KeyError) is None
    assert first_leaf(closed, Closed) is closed


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (None, False),
        (Closed(), True),
        (ValueError(), False),
        (BaseExceptionGroup("g", [KeyboardInterrupt(), ExceptionGroup("h", [Closed()])]), True),
    ],
)
def test_holds(exc: BaseException | None, expected: bool) -> None:
    assert holds(exc, Closed) is expected
