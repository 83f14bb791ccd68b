"""The wire protocol's messages: frozen attrs classes, one per message type, and the unions
that name who sends what. Sans-IO: no sockets, no Trio.

Direction::

    node -> edge   hello, capacity, pong, run.started, run.delta, run.embeddings, run.usage,
                   run.completed, run.failed, run.cancelled,
                   tunnel.start, tunnel.end, (binary) tunnel data, node.draining
    edge -> node   welcome, ping, run.request, run.cancel,
                   tunnel.request, (binary) its request body when ``body_size`` says so,
                   tunnel.credit, tunnel.cancel, edge.draining, demand

Slots are the node's to grant (protocol 2): a node may serve several edges, so what its
``hello`` announces for a model is this edge's grant, not the node's whole capacity, and
each ``capacity`` that follows is a new grant (numbered by ``serial``). The edge reports its
``demand`` per provider and model (requests waiting, slots in use, the last grant applied),
from which the node shares its slots between its edges (``nodes/grants.py``).

Every run event carries the ``run_id`` the edge chose and a per-run ``seq`` starting at 0.
Exactly one terminal event (completed, failed, cancelled) ends a run.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Iterable
from typing import Any, ClassVar, Final, Literal, TypeAlias, get_args

import attrs

PROTOCOL_VERSION: Final = 3
"""2: slots are granted per edge (``capacity.serial``, ``demand``). 3: a provider announces the
``routes`` it serves; ``usage`` carries cached, cache-write and reasoning tokens."""
MAX_FRAME_SIZE: Final = 4 * 1024 * 1024
"""Largest frame either side sends or accepts, text or binary, in bytes."""
MAX_TUNNEL_CHUNK: Final = 64 * 1024
"""Largest tunnel body piece in one binary frame (a response's, or a request's)."""
DEFAULT_TUNNEL_WINDOW: Final = 256 * 1024
"""Response body bytes a node may send on a tunnel before the edge grants more
(``tunnel.request.window``, then ``tunnel.credit``)."""

ExecutionPath: TypeAlias = Literal["normalized", "tunnel"]

RouteName: TypeAlias = Literal[
    "chat", "completions", "embeddings", "responses", "messages",
    "images", "audio", "moderations", "rerank",
]  # fmt: skip
"""An API a provider serves, by the edge's routes: ``chat`` (``/v1/chat/completions``),
``completions``, ``embeddings``, ``responses`` (``/v1/responses``), ``messages``
(``/v1/messages``, Anthropic's), ``images`` (``/v1/images/*``), ``audio`` (``/v1/audio/*``),
``moderations``, ``rerank``."""
ROUTES: Final[tuple[RouteName, ...]] = get_args(RouteName)
DEFAULT_TUNNEL_ROUTES: Final[tuple[RouteName, ...]] = ("chat", "completions", "embeddings")
"""What a tunnel provider that declares no ``routes`` serves: an OpenAI-compatible server's
chat completions, completions and embeddings."""
NORMALIZED_ROUTES: Final[tuple[RouteName, ...]] = ("chat", "responses", "messages")
"""What every normalized provider serves: the edge translates the Responses and Messages APIs
to the normalized run. An adapter that can do more (embeddings) announces it too."""
JSONObject: TypeAlias = dict[str, Any]


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
    """One provider of a node's ``hello``: its ``id`` (unique on the node), ``type`` and
    ``adapter``, whether the edge runs it ``normalized`` or relays to it through a ``tunnel``,
    and the models it serves. Never its credentials."""

    id: str
    type: str
    adapter: str
    path: ExecutionPath = "normalized"
    models: tuple[ModelInfo, ...] = ()
    routes: tuple[RouteName, ...] = ()
    """The APIs it serves (:data:`RouteName`); empty: the default of its path
    (:data:`DEFAULT_TUNNEL_ROUTES`, :data:`NORMALIZED_ROUTES`). The edge offers it only for
    these."""

    @property
    def served_routes(self) -> tuple[RouteName, ...]:
        """:attr:`routes`, or its path's default when it declares none."""
        if self.routes:
            return self.routes
        return DEFAULT_TUNNEL_ROUTES if self.path == "tunnel" else NORMALIZED_ROUTES


@attrs.frozen(kw_only=True)
class Hello:
    """The node's first message: who it is (``node_id``, ``label``, the node ``token`` when
    the edge wants one) and everything it serves. The edge answers ``welcome``, or closes."""

    TYPE: ClassVar[str] = "hello"
    protocol: int
    node_id: str
    label: str = ""
    token: str | None = attrs.field(default=None, repr=False)
    providers: tuple[ProviderInfo, ...] = ()


@attrs.frozen(kw_only=True)
class Capacity:
    """A new grant of one model's slots on one provider to this edge, without reconnecting:
    the edge admits at most ``slots`` on it from now on (what already runs finishes)."""

    TYPE: ClassVar[str] = "capacity"
    provider_id: str
    model: str
    slots: int
    long_context_slots: int = 0
    serial: int = 0
    """This grant's number, increasing over the session (the ``hello``'s grants are 0): the
    edge's ``demand`` says the last one it applied."""


@attrs.frozen(kw_only=True)
class Pong:
    """The node's answer to ``ping``, with its ``nonce``."""

    TYPE: ClassVar[str] = "pong"
    nonce: int


@attrs.frozen(kw_only=True)
class Usage:
    """A run's token counts, as the node knows them."""

    prompt_tokens: int
    """Every input token, as OpenAI counts them: those read from a cache and those written to
    one included (Anthropic's ``input_tokens`` + ``cache_read_input_tokens`` +
    ``cache_creation_input_tokens``)."""
    completion_tokens: int
    """Every output token, reasoning included."""
    estimated: bool = False
    """The node estimated these counts (its adapter reported none); False when the engine or
    provider measured them."""
    cached_tokens: int = 0
    """Of :attr:`prompt_tokens`, those read from the engine's or provider's prompt cache
    (OpenAI ``prompt_tokens_details.cached_tokens``, Anthropic ``cache_read_input_tokens``,
    llama.cpp ``timings.cache_n``)."""
    cache_write_tokens: int = 0
    """Of :attr:`prompt_tokens`, those written to the provider's cache (Anthropic
    ``cache_creation_input_tokens``)."""
    reasoning_tokens: int = 0
    """Of :attr:`completion_tokens`, those spent reasoning
    (``completion_tokens_details.reasoning_tokens``)."""


@attrs.frozen(kw_only=True)
class _RunFields:
    """What every message about one run carries first: the ``run_id`` the edge chose. Not a
    message itself (nor are the other ``_...Fields`` bases)."""

    TYPE: ClassVar[str]
    run_id: str


@attrs.frozen(kw_only=True)
class _RunEventFields(_RunFields):
    """A run event: the run, then the event's ``seq`` in it (0, 1, 2...)."""

    seq: int


@attrs.frozen(kw_only=True)
class _TunnelFields:
    """What every message about one tunnel carries first: the ``tunnel_id`` the edge chose."""

    TYPE: ClassVar[str]
    tunnel_id: str


@attrs.frozen(kw_only=True)
class RunStarted(_RunEventFields):
    """The node began the run (always the run's first event, ``seq`` 0)."""

    TYPE: ClassVar[str] = "run.started"


@attrs.frozen(kw_only=True)
class RunDelta(_RunEventFields):
    """Generated text (one or more tokens). ``tool_calls`` is room for tool-call deltas in
    OpenAI's chunk shape. ``usage``, on a run's first delta only: what the engine counted
    before it produced anything (the prompt's tokens), so the edge knows it when the answer
    starts; the run's usage is still its last ``run.usage``."""

    TYPE: ClassVar[str] = "run.delta"
    text: str = ""
    tool_calls: tuple[JSONObject, ...] = ()
    usage: Usage | None = None


@attrs.frozen(kw_only=True)
class RunEmbeddings(_RunEventFields):
    """Vectors of an ``embeddings`` run (``run.request.route``): those of its inputs
    ``index``, ``index + 1``..., each the base64 of its little-endian float32 values
    (:func:`encode_vector`; what OpenAI answers ``encoding_format: "base64"`` with). A run's
    vectors come in input order, split over as many events as keep each frame well under
    :data:`MAX_FRAME_SIZE` (:data:`MAX_EMBEDDINGS_CHARS`), then its ``run.usage`` and
    ``run.completed``; the edge renders floats or base64 as its client asked."""

    TYPE: ClassVar[str] = "run.embeddings"
    index: int
    vectors: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class RunUsage(_RunEventFields):
    """The run's latest known usage; sent before ``run.completed`` always, and before
    ``run.failed`` when anything is known."""

    TYPE: ClassVar[str] = "run.usage"
    usage: Usage


@attrs.frozen(kw_only=True)
class RunCompleted(_RunEventFields):
    """Terminal: the run is done, for ``finish_reason`` (``stop``, ``length``,
    ``tool_calls``, ...)."""

    TYPE: ClassVar[str] = "run.completed"
    finish_reason: str = "stop"
    stop_sequence: str | None = None
    """The stop sequence that ended the text, when the engine says which (finish reason
    ``stop``; Anthropic's ``stop_sequence``); left out of the frame when None."""


@attrs.frozen(kw_only=True)
class RunFailed(_RunEventFields):
    """Terminal: the run failed with ``code`` and ``message`` (which never name the
    provider's URL or host); ``retryable`` says the edge may try the request again."""

    TYPE: ClassVar[str] = "run.failed"
    code: str
    message: str
    retryable: bool = False
    status: int | None = None
    """The upstream's HTTP status when the failure is its answer to the request (an upstream
    4xx is the client's error: the edge relays the status, does not retry, and does not count
    it against the node)."""


@attrs.frozen(kw_only=True)
class RunCancelled(_RunEventFields):
    """The node's confirmation of ``run.cancel``, with the partial usage it knows."""

    TYPE: ClassVar[str] = "run.cancelled"
    usage: Usage | None = None


@attrs.frozen(kw_only=True)
class TunnelStart(_TunnelFields):
    """The provider answered a ``tunnel.request``: its status and headers (without the
    hop-by-hop ones and ``Content-Length``). Body frames follow."""

    TYPE: ClassVar[str] = "tunnel.start"
    status: int
    headers: tuple[tuple[str, str], ...] = ()


@attrs.frozen(kw_only=True)
class TunnelEnd(_TunnelFields):
    """End of a tunnel's response body; ``error`` set when it ended abnormally."""

    TYPE: ClassVar[str] = "tunnel.end"
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
class EdgePeer:
    """Another edge sharing this one's stores: its id and where nodes dial it."""

    id: str
    node_url: str


@attrs.frozen(kw_only=True)
class Welcome:
    """The edge accepted the node's ``hello``: the protocol version it speaks, the session's
    fresh ``generation``, and how often it pings (``<= 0`` turns the node's heartbeat check
    off); ``edge_id``, this edge's name among several, and ``edges``, the other live edges
    sharing its stores, for the node to serve them too."""

    TYPE: ClassVar[str] = "welcome"
    protocol: int
    generation: int
    heartbeat_interval: float
    edge_id: str = ""
    edges: tuple[EdgePeer, ...] = ()


@attrs.frozen(kw_only=True)
class Ping:
    """A heartbeat; the node answers ``pong`` with the same ``nonce``."""

    TYPE: ClassVar[str] = "ping"
    nonce: int


@attrs.frozen(kw_only=True)
class Demand:
    """What this edge wants of one provider's model on the node: ``waiting`` requests queued
    that it could serve, ``in_use`` slots this edge holds on it (admitted, whether or not
    their ``run.request`` was sent yet), as of the node's grants up to ``serial`` (applied
    before this was sent). The edge sends it when these change; the node shares its slots
    between its edges by it, and trusts a smaller grant only once a ``demand`` with its
    serial confirms it."""

    TYPE: ClassVar[str] = "demand"
    provider_id: str
    model: str
    waiting: int
    in_use: int
    serial: int


@attrs.frozen(kw_only=True)
class RunRequest(_RunFields):
    """Run ``body`` (``model`` already replaced by the served name) on provider
    ``provider_id``: for ``route`` ``chat``, an OpenAI chat-completions body (the Responses
    and Messages APIs arrive translated to one), answered with text and tool-call deltas;
    for ``embeddings``, an OpenAI embeddings body (``input``, ``encoding_format``,
    ``dimensions``), answered with ``run.embeddings`` (one vector per input,
    :func:`embedding_inputs`). A node refuses a route its provider's adapter does not serve
    (``run.failed`` code ``unsupported_route``)."""

    TYPE: ClassVar[str] = "run.request"
    provider_id: str
    model: str
    served_model: str
    body: JSONObject
    route: RouteName = "chat"


@attrs.frozen(kw_only=True)
class RunCancel(_RunFields):
    """Stop the run (``reason`` says why, e.g. its client left): the node answers
    ``run.cancelled`` with the partial usage, or ignores it for a run it already ended."""

    TYPE: ClassVar[str] = "run.cancel"
    reason: str = ""


@attrs.frozen(kw_only=True)
class TunnelRequest(_TunnelFields):
    """Perform this HTTP request on the tunnel provider ``provider_id``; ``headers`` come
    without the hop-by-hop ones and the client's ``Authorization`` (the node adds the
    provider's credentials)."""

    TYPE: ClassVar[str] = "tunnel.request"
    provider_id: str
    model: str = ""
    """The model group whose slot the tunnel holds (the node counts it against that grant)."""
    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: str = ""
    """The request body as text (a JSON body), when it travels inside this message."""
    body_size: int = 0
    """The request body's length in bytes when it travels instead as binary frames after this
    message (each at most :data:`MAX_TUNNEL_CHUNK` bytes: a multipart upload, a body too
    large for one frame): exactly this many bytes follow, and ``body`` is empty. The node
    performs the request once it has them all."""
    window: int = DEFAULT_TUNNEL_WINDOW
    """Response body bytes the node may send before it is granted more by ``tunnel.credit``;
    more than granted is a protocol error."""


@attrs.frozen(kw_only=True)
class TunnelCredit(_TunnelFields):
    """The edge consumed ``bytes`` more of the tunnel's response body: the node may send that
    many more."""

    TYPE: ClassVar[str] = "tunnel.credit"
    bytes: int


@attrs.frozen(kw_only=True)
class TunnelCancel(_TunnelFields):
    """Stop the tunnel now: the node closes the upstream request and answers ``tunnel.end``
    (``error`` ``"cancelled"``)."""

    TYPE: ClassVar[str] = "tunnel.cancel"


RunEvent: TypeAlias = (
    RunStarted | RunDelta | RunEmbeddings | RunUsage | RunCompleted | RunFailed | RunCancelled
)
TerminalEvent: TypeAlias = RunCompleted | RunFailed | RunCancelled
TERMINAL_EVENTS: Final = (RunCompleted, RunFailed, RunCancelled)

NodeMessage: TypeAlias = (
    Hello
    | Capacity
    | Pong
    | RunStarted
    | RunDelta
    | RunEmbeddings
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
    | Demand
)
Message: TypeAlias = NodeMessage | EdgeMessage

NODE_MESSAGE_TYPES: Final[tuple[type[NodeMessage], ...]] = get_args(NodeMessage)
"""The classes of :data:`NodeMessage`, for ``isinstance`` and lookups."""
EDGE_MESSAGE_TYPES: Final[tuple[type[EdgeMessage], ...]] = get_args(EdgeMessage)
MESSAGE_TYPES: Final[tuple[type[Any], ...]] = (*NODE_MESSAGE_TYPES, *EDGE_MESSAGE_TYPES)


@attrs.frozen
class TunnelData:
    """A piece of a tunnel body (a binary frame)."""

    tunnel_id: str
    data: bytes


def is_terminal(event: RunEvent) -> bool:
    return isinstance(event, TERMINAL_EVENTS)


RUN_EVENT_TYPES: Final = frozenset(
    (RunStarted, RunDelta, RunEmbeddings, RunUsage, *TERMINAL_EVENTS)
)
"""The run event classes, for a lookup by ``type(message)`` (exact classes: messages are
frozen and never subclassed)."""
TERMINAL_EVENT_TYPES: Final = frozenset(TERMINAL_EVENTS)


# --------------------------------------------------------------------------- embeddings

MAX_EMBEDDINGS_CHARS: Final = 1024 * 1024
"""Most characters of base64 vectors in one ``run.embeddings`` (a quarter of
:data:`MAX_FRAME_SIZE`): a batch over it is split over several events, so any batch fits;
one vector over it (more than 196,608 dimensions) cannot be sent (``embedding_too_large``)."""


def embedding_inputs(body: JSONObject) -> list[str | list[int]]:
    """The inputs of an OpenAI embeddings body, one per vector of its answer: ``input`` as a
    string is one, an array of token ids is one, an array of strings or of token id arrays
    is one each. Anything else (the edge validated the body) is no input."""
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        return []
    if all(type(item) is int for item in value):
        return [value]
    return [item for item in value if isinstance(item, str | list)]


def encode_vector(values: Iterable[float]) -> str:
    """A vector as ``run.embeddings`` carries it (and OpenAI's ``encoding_format:
    "base64"``): the base64 of its values as little-endian float32."""
    packed = array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def decode_vector(text: str) -> list[float]:
    """The values of an :func:`encode_vector` string; raises ``ValueError`` for anything that
    is not base64 of a whole number of float32 values."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes are not a whole number of float32 values")
    values = array("f")
    values.frombytes(raw)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()
