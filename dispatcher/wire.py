"""The wire protocol between the edge and its nodes. Sans-IO: no sockets, no Trio.

Control messages and run events are JSON text frames ``{"type": ..., ...}``; tunnel body
bytes travel in binary frames (:func:`encode_tunnel_data` / :func:`decode_binary`) so they
are never base64-inflated.

Direction::

    node -> edge   hello, capacity, pong, run.started, run.delta, run.usage,
                   run.completed, run.failed, run.cancelled,
                   tunnel.start, tunnel.end, (binary) tunnel data, node.draining
    edge -> node   welcome, ping, run.request, run.cancel,
                   tunnel.request, tunnel.credit, tunnel.cancel, (binary) tunnel data,
                   edge.draining

Every run event carries the ``run_id`` the edge chose and a per-run ``seq`` starting at 0.
Exactly one terminal event (completed, failed, cancelled) ends a run.

:func:`decode` turns bytes or text into a message or raises :class:`ProtocolError` with a
readable reason, whatever the input.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, ClassVar, Final, Literal, TypeAlias

import attrs
import cattrs
import orjson
from cattrs.preconf.orjson import make_converter
from cattrs.strategies import configure_tagged_union

PROTOCOL_VERSION: Final = 1
MAX_FRAME_SIZE: Final = 4 * 1024 * 1024
"""Largest frame either side sends or accepts, text or binary, in bytes."""
MAX_TUNNEL_CHUNK: Final = 64 * 1024
"""Largest tunnel body piece in one binary frame."""
DEFAULT_TUNNEL_WINDOW: Final = 256 * 1024
"""Response body bytes a node may send on a tunnel before the edge grants more
(``tunnel.request.window``, then ``tunnel.credit``)."""

ExecutionPath: TypeAlias = Literal["normalized", "tunnel"]
JSONObject: TypeAlias = dict[str, Any]


class ProtocolError(Exception):
    """A frame that is not a valid message of this protocol. ``str()`` says why."""


# --------------------------------------------------------------------------- node -> edge


@attrs.frozen(kw_only=True)
class ModelInfo:
    """One model a provider serves. ``name`` is the public model group name clients use."""

    name: str
    served_name: str
    slots: int
    long_context_slots: int = 0
    context_window: int | None = None
    capabilities: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class ProviderInfo:
    id: str
    type: str
    adapter: str
    path: ExecutionPath = "normalized"
    models: tuple[ModelInfo, ...] = ()


@attrs.frozen(kw_only=True)
class Hello:
    TYPE: ClassVar[str] = "hello"
    protocol: int
    node_id: str
    label: str = ""
    token: str | None = attrs.field(default=None, repr=False)
    providers: tuple[ProviderInfo, ...] = ()


@attrs.frozen(kw_only=True)
class Capacity:
    """A change of one model's slot counts on one provider, without reconnecting."""

    TYPE: ClassVar[str] = "capacity"
    provider_id: str
    model: str
    slots: int
    long_context_slots: int = 0


@attrs.frozen(kw_only=True)
class Pong:
    TYPE: ClassVar[str] = "pong"
    nonce: int


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    estimated: bool = False
    """The node estimated these counts (its adapter reported none); False when the engine or
    provider measured them."""


@attrs.frozen(kw_only=True)
class RunStarted:
    TYPE: ClassVar[str] = "run.started"
    run_id: str
    seq: int


@attrs.frozen(kw_only=True)
class RunDelta:
    """Generated text (one or more tokens). ``tool_calls`` is room for tool-call deltas in
    OpenAI's chunk shape."""

    TYPE: ClassVar[str] = "run.delta"
    run_id: str
    seq: int
    text: str = ""
    tool_calls: tuple[JSONObject, ...] = ()


@attrs.frozen(kw_only=True)
class RunUsage:
    TYPE: ClassVar[str] = "run.usage"
    run_id: str
    seq: int
    usage: Usage


@attrs.frozen(kw_only=True)
class RunCompleted:
    TYPE: ClassVar[str] = "run.completed"
    run_id: str
    seq: int
    finish_reason: str = "stop"


@attrs.frozen(kw_only=True)
class RunFailed:
    TYPE: ClassVar[str] = "run.failed"
    run_id: str
    seq: int
    code: str
    message: str
    retryable: bool = False
    status: int | None = None
    """The upstream's HTTP status when the failure is its answer to the request (an upstream
    4xx is the client's error: the edge relays the status, does not retry, and does not count
    it against the node)."""


@attrs.frozen(kw_only=True)
class RunCancelled:
    """The node's confirmation of ``run.cancel``, with the partial usage it knows."""

    TYPE: ClassVar[str] = "run.cancelled"
    run_id: str
    seq: int
    usage: Usage | None = None


@attrs.frozen(kw_only=True)
class TunnelStart:
    TYPE: ClassVar[str] = "tunnel.start"
    tunnel_id: str
    status: int
    headers: tuple[tuple[str, str], ...] = ()


@attrs.frozen(kw_only=True)
class TunnelEnd:
    """End of a tunnel's response body; ``error`` set when it ended abnormally."""

    TYPE: ClassVar[str] = "tunnel.end"
    tunnel_id: str
    error: str | None = None
    retryable: bool = False


@attrs.frozen(kw_only=True)
class NodeDraining:
    """The node is draining (its operator stopped it): route no new runs or tunnels to it;
    what it runs now it finishes, then it leaves."""

    TYPE: ClassVar[str] = "node.draining"
    grace: float = 0.0
    """How long the node gives its in-flight work before it leaves, in seconds."""


# --------------------------------------------------------------------------- edge -> node


@attrs.frozen(kw_only=True)
class EdgeDraining:
    """The edge is draining (shutting down): it sends no new work, lets what runs finish
    within ``grace`` seconds, then closes. The node should not treat the close as a fault."""

    TYPE: ClassVar[str] = "edge.draining"
    grace: float = 0.0


@attrs.frozen(kw_only=True)
class Welcome:
    TYPE: ClassVar[str] = "welcome"
    protocol: int
    generation: int
    heartbeat_interval: float


@attrs.frozen(kw_only=True)
class Ping:
    TYPE: ClassVar[str] = "ping"
    nonce: int


@attrs.frozen(kw_only=True)
class RunRequest:
    """Run ``body`` (an OpenAI chat-completions request body, ``model`` already replaced by
    the served name) on provider ``provider_id``."""

    TYPE: ClassVar[str] = "run.request"
    run_id: str
    provider_id: str
    model: str
    served_model: str
    body: JSONObject


@attrs.frozen(kw_only=True)
class RunCancel:
    TYPE: ClassVar[str] = "run.cancel"
    run_id: str
    reason: str = ""


@attrs.frozen(kw_only=True)
class TunnelRequest:
    TYPE: ClassVar[str] = "tunnel.request"
    tunnel_id: str
    provider_id: str
    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: str = ""
    """The request body as text (the OpenAI routes we tunnel all take JSON)."""
    window: int = DEFAULT_TUNNEL_WINDOW
    """Response body bytes the node may send before it is granted more by ``tunnel.credit``;
    more than granted is a protocol error."""


@attrs.frozen(kw_only=True)
class TunnelCredit:
    """The edge consumed ``bytes`` more of the tunnel's response body: the node may send that
    many more."""

    TYPE: ClassVar[str] = "tunnel.credit"
    tunnel_id: str
    bytes: int


@attrs.frozen(kw_only=True)
class TunnelCancel:
    TYPE: ClassVar[str] = "tunnel.cancel"
    tunnel_id: str


RunEvent: TypeAlias = RunStarted | RunDelta | RunUsage | RunCompleted | RunFailed | RunCancelled
TerminalEvent: TypeAlias = RunCompleted | RunFailed | RunCancelled
TERMINAL_EVENTS: Final = (RunCompleted, RunFailed, RunCancelled)

NodeMessage: TypeAlias = (
    Hello
    | Capacity
    | Pong
    | RunStarted
    | RunDelta
    | RunUsage
    | RunCompleted
    | RunFailed
    | RunCancelled
    | TunnelStart
    | TunnelEnd
    | NodeDraining
)
EdgeMessage: TypeAlias = (
    Welcome
    | Ping
    | RunRequest
    | RunCancel
    | TunnelRequest
    | TunnelCredit
    | TunnelCancel
    | EdgeDraining
)
Message: TypeAlias = NodeMessage | EdgeMessage

MESSAGE_TYPES: Final[tuple[type[Any], ...]] = (
    Hello,
    Capacity,
    Pong,
    RunStarted,
    RunDelta,
    RunUsage,
    RunCompleted,
    RunFailed,
    RunCancelled,
    TunnelStart,
    TunnelEnd,
    NodeDraining,
    Welcome,
    Ping,
    RunRequest,
    RunCancel,
    TunnelRequest,
    TunnelCredit,
    TunnelCancel,
    EdgeDraining,
)
_BY_TAG: Final[Mapping[str, type[Any]]] = {cls.TYPE: cls for cls in MESSAGE_TYPES}


@attrs.frozen
class TunnelData:
    """A piece of a tunnel body (a binary frame)."""

    tunnel_id: str
    data: bytes


# --------------------------------------------------------------------------- the converter


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
    return converter


converter: Final = _make_converter()


def encode(message: Message) -> str:
    """A message as the text of one JSON frame."""
    return orjson.dumps(converter.unstructure(message, Message)).decode()


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
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    try:
        message: Message = converter.structure(raw, Message)  # type: ignore[arg-type]
    except Exception as exc:  # cattrs raises several kinds; all mean the same to a peer
        raise ProtocolError(f"invalid {tag!r} message: {_describe(exc)}") from None
    return message


def _describe(exc: BaseException) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path="$"))
    return str(exc) or type(exc).__name__


def is_terminal(event: RunEvent) -> bool:
    return isinstance(event, TERMINAL_EVENTS)
