"""Our HTTP/1.1 + websocket server on h11 and wsproto under Trio (see docs/http-server.md)."""

from ._server import Server as Server
from ._server import serve_http as serve_http
from ._server import serve_http_until_signal as serve_http_until_signal
from ._types import Address as Address
from ._types import BodyTooLarge as BodyTooLarge
from ._types import ErrorPage as ErrorPage
from ._types import Handler as Handler
from ._types import Headers as Headers
from ._types import HTTPError as HTTPError
from ._types import HTTPStream as HTTPStream
from ._types import MalformedBody as MalformedBody
from ._types import PeerGone as PeerGone
from ._types import Request as Request
from ._types import RequestTimeout as RequestTimeout
from ._types import Responder as Responder
from ._types import ServerLimits as ServerLimits
from ._types import ShutdownHook as ShutdownHook
from ._types import WebSocket as WebSocket
from ._types import WebSocketClosed as WebSocketClosed
