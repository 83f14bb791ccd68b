"""The codec: one cattrs converter, :func:`encode` / :func:`decode` for JSON text frames and
:func:`encode_tunnel_data` / :func:`decode_binary` for binary tunnel body frames (never
base64-inflated). Sans-IO.

:func:`decode` turns bytes or text into a message or raises :class:`ProtocolError` with a
readable reason, whatever the input.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any, Final

import cattrs
import orjson
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.preconf.orjson import make_converter
from cattrs.strategies import configure_tagged_union

from ._errors import ProtocolError
from ._messages import (
    MAX_FRAME_SIZE,
    MESSAGE_TYPES,
    JSONObject,
    Message,
    RunCompleted,
    RunDelta,
    TunnelData,
)


def _strict(kind: type[Any]) -> Any:
    def structure(value: Any, _: Any) -> Any:
        # bool is an int subclass in Python but not in JSON.
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return structure


def _structure_json_object(value: Any, _: Any) -> JSONObject:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value


def _make_converter() -> cattrs.Converter:
    converter = make_converter(forbid_extra_keys=False)
    for kind in (str, int, float, bool):
        converter.register_structure_hook(kind, _strict(kind))
    converter.register_structure_hook_func(lambda t: t == JSONObject, _structure_json_object)
    tags: dict[type[Any], str] = {cls: cls.TYPE for cls in MESSAGE_TYPES}
    configure_tagged_union(Message, converter, tag_generator=tags.__getitem__, tag_name="type")
    # A delta's usage is on a run's first delta at most: left out of the others' frames
    # (an edge of before it ignores the key, as any key it does not know).
    converter.register_unstructure_hook(
        RunDelta,
        make_dict_unstructure_fn(RunDelta, converter, usage=override(omit_if_default=True)),
    )
    converter.register_unstructure_hook(
        RunCompleted,
        make_dict_unstructure_fn(
            RunCompleted, converter, stop_sequence=override(omit_if_default=True)
        ),
    )
    return converter


converter: Final = _make_converter()

# Each message class's own hooks, looked up once: a frame is structured and unstructured as
# the tagged union does it (the class's hook, then the tag), without the union's dispatch.
_BY_TAG: Final[Mapping[str, tuple[type[Any], Callable[[Any, Any], Any]]]] = {
    cls.TYPE: (cls, converter.get_structure_hook(cls)) for cls in MESSAGE_TYPES
}
_UNSTRUCTURE: Final[Mapping[type[Any], Callable[[Any], dict[str, Any]]]] = {
    cls: converter.get_unstructure_hook(cls) for cls in MESSAGE_TYPES
}


def encode(message: Message) -> str:
    """A message as the text of one JSON frame."""
    raw = _UNSTRUCTURE[type(message)](message)
    raw["type"] = message.TYPE
    return orjson.dumps(raw).decode()


def encode_tunnel_data(tunnel_id: str, data: bytes) -> bytes:
    """A binary frame: 1-byte id length, the id (ASCII), then the raw bytes."""
    raw_id = tunnel_id.encode("ascii")
    return struct.pack("B", len(raw_id)) + raw_id + data


def decode_binary(frame: bytes) -> TunnelData:
    if not frame:
        raise ProtocolError("empty binary frame")
    if len(frame) > MAX_FRAME_SIZE:
        raise ProtocolError(f"binary frame of {len(frame)} bytes is over {MAX_FRAME_SIZE}")
    size = frame[0]
    if size == 0 or len(frame) < 1 + size:
        raise ProtocolError("binary frame with a truncated tunnel id")
    try:
        tunnel_id = frame[1 : 1 + size].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("binary frame tunnel id is not ASCII") from None
    return TunnelData(tunnel_id, bytes(frame[1 + size :]))


def decode(frame: str | bytes) -> Message:
    """Parse one JSON frame. Raises :class:`ProtocolError`, and nothing else, if it is not a
    valid message."""
    if len(frame) > MAX_FRAME_SIZE:
        raise ProtocolError(f"frame of {len(frame)} bytes is over {MAX_FRAME_SIZE}")
    try:
        raw = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"frame is a JSON {type(raw).__name__}, not an object")
    tag = raw.get("type")
    known = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if known is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    cls, structure = known
    try:
        message: Message = structure(raw, cls)
    except Exception as exc:  # cattrs raises several kinds; all mean the same to a peer
        raise ProtocolError(f"invalid {tag!r} message: {_describe(exc)}") from None
    return message


def _describe(exc: BaseException) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path="$"))
    return str(exc) or type(exc).__name__
