"""The wire protocol: round trips for every message, and decode never raises anything but
ProtocolError."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher import wire

text = st.text(max_size=20)
small_int = st.integers(min_value=-(2**40), max_value=2**40)
json_scalars = (
    st.none() | st.booleans() | small_int | st.floats(allow_nan=False, allow_infinity=False) | text
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(text, json_values, max_size=5)


def message_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Build any instance of an attrs message class, field by field."""
    fields = {}
    for field in attrs.fields(cls):
        fields[field.name] = _for_type(field.type)
    return st.builds(cls, **fields)


def _for_type(tp: Any) -> st.SearchStrategy[Any]:
    import typing

    if tp is str or tp == "str":
        return text
    if tp is int:
        return small_int
    if tp is bool:
        return st.booleans()
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if tp == wire.JSONObject:
        return json_objects
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_for_type(args[0]), max_size=3).map(tuple)
        return st.tuples(*(_for_type(a) for a in args))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return st.one_of(*(_for_type(a) for a in args))
    if tp is type(None):
        return st.none()
    if origin is typing.Literal:
        return st.sampled_from(args)
    if attrs.has(tp):
        return message_strategy(tp)
    raise AssertionError(f"no strategy for {tp!r}")


def _resolved(cls: type[Any]) -> type[Any]:
    attrs.resolve_types(cls, globalns=vars(wire))
    return cls


for _cls in (*wire.MESSAGE_TYPES, wire.ModelInfo, wire.ProviderInfo, wire.Usage):
    _resolved(_cls)


@pytest.mark.parametrize("cls", wire.MESSAGE_TYPES, ids=lambda c: c.TYPE)
@given(data=st.data())
def test_round_trip(cls: type[Any], data: st.DataObject) -> None:
    message = data.draw(message_strategy(cls))
    frame = wire.encode(message)
    assert wire.decode(frame) == message
    assert wire.decode(frame.encode()) == message


@given(st.binary(max_size=200))
def test_decode_arbitrary_bytes(frame: bytes) -> None:
    try:
        message = wire.decode(frame)
    except wire.ProtocolError as exc:
        assert str(exc)
    else:
        assert isinstance(message, wire.MESSAGE_TYPES)


@given(st.sampled_from([c.TYPE for c in wire.MESSAGE_TYPES]) | text, json_objects)
def test_decode_arbitrary_json_objects(tag: str, fields: dict[str, Any]) -> None:
    import orjson

    frame = orjson.dumps({**fields, "type": tag})
    try:
        message = wire.decode(frame)
    except wire.ProtocolError as exc:
        assert str(exc)
    else:
        assert isinstance(message, wire.MESSAGE_TYPES)
        assert message.TYPE == tag


@given(json_values)
def test_decode_arbitrary_json(value: Any) -> None:
    import orjson

    try:
        wire.decode(orjson.dumps(value))
    except wire.ProtocolError:
        pass


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not an object"),
        ('{"type": "nope"}', "unknown message type 'nope'"),
        ('{"nonce": 1}', "unknown message type None"),
        ('{"type": "pong", "nonce": "1"}', "$.nonce"),
        ('{"type": "pong", "nonce": true}', "$.nonce"),
        ('{"type": "hello", "protocol": 1}', "$.node_id"),
        ('{"type": "run.delta", "run_id": "r", "seq": 0, "text": 5}', "$.text"),
    ],
)
def test_decode_reasons(frame: str, reason: str) -> None:
    with pytest.raises(wire.ProtocolError, match=None) as info:
        wire.decode(frame)
    assert reason in str(info.value)


def test_decode_rejects_oversized_frame() -> None:
    frame = '{"type": "pong", "nonce": 1, "pad": "' + "x" * wire.MAX_FRAME_SIZE + '"}'
    with pytest.raises(wire.ProtocolError, match="over"):
        wire.decode(frame)


@given(tunnel_id=st.text(alphabet="abcdef0123456789-", min_size=1, max_size=40), data=st.binary())
def test_tunnel_data_round_trip(tunnel_id: str, data: bytes) -> None:
    assert wire.decode_binary(wire.encode_tunnel_data(tunnel_id, data)) == wire.TunnelData(
        tunnel_id, data
    )


@given(st.binary(max_size=100))
def test_decode_binary_arbitrary(frame: bytes) -> None:
    try:
        chunk = wire.decode_binary(frame)
    except wire.ProtocolError:
        pass
    else:
        assert isinstance(chunk, wire.TunnelData)


def test_hello_repr_hides_token() -> None:
    hello = wire.Hello(protocol=1, node_id="n", token="s3cret")
    assert "s3cret" not in repr(hello)
