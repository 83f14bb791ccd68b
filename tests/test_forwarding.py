"""Forwarded: a read-only attribute that reads a path off the instance."""

from __future__ import annotations

import attrs
import pytest

from dispatcher.shared.forwarding import Forwarded


@attrs.frozen
class _Inner:
    value: int
    nested: _Inner | None = None


@attrs.define
class _Outer:
    inner: _Inner
    value = Forwarded[int]("inner.value")
    deep = Forwarded[int]("inner.nested.value")


def test_reads_the_path_off_the_instance_each_time() -> None:
    outer = _Outer(_Inner(1, _Inner(2)))
    assert (outer.value, outer.deep) == (1, 2)
    outer.inner = _Inner(3, _Inner(4))
    assert (outer.value, outer.deep) == (3, 4)  # never a copy


def test_on_the_class_it_is_the_descriptor() -> None:
    assert isinstance(_Outer.value, Forwarded)
    assert repr(_Outer.deep) == "Forwarded('inner.nested.value')"
    assert [field.name for field in attrs.fields(_Outer)] == ["inner"]  # not a field


def test_a_missing_step_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        _ = _Outer(_Inner(1)).deep  # inner.nested is None


def test_it_is_read_only() -> None:
    outer = _Outer(_Inner(1))
    with pytest.raises(AttributeError, match=r"inner\.value is forwarded"):
        outer.value = 2  # type: ignore[assignment]
    assert outer.inner.value == 1
