"""RESP2, the protocol Redis speaks by default, sans-IO: the bytes of commands
(:func:`encode_command`, :func:`encode_commands`; a command's parts encoded once and kept:
:func:`encode_args`, :func:`join_command`) and an incremental parser of replies
(:class:`RespParser`: :meth:`~RespParser.feed` it what the socket gave,
:meth:`~RespParser.next_reply` answers one reply or :data:`NEED_DATA`). No I/O, no clock, no
Trio: :mod:`.redis_link` drives it on a socket, the tests drive it with random chunkings.

A reply (:data:`Reply`) is, by its type byte:

* ``+`` a simple string (a status such as ``OK``): :class:`str`;
* ``-`` an error: a :class:`ReplyError` *value* (the parser never raises it: in a pipeline an
  error answers one command, the others stand);
* ``:`` an integer: :class:`int`;
* ``$`` a bulk string: :class:`bytes`, or None for the null bulk (``$-1``);
* ``*`` an array: a :class:`list` of replies (nested at any depth), or None (``*-1``).

Simple strings and error messages are decoded as UTF-8 with ``surrogateescape`` (lossless:
any byte but CR and LF round-trips). The parser is bounded: a bulk longer than
``max_bulk`` bytes, an array of more than ``max_array`` elements, a line (a status, an error,
a length) longer than ``max_line`` bytes, or any byte sequence that is not RESP2 raises
:class:`RespProtocolError`, and keeps raising it: the connection it came from is unusable.
Nothing else escapes it; a partial reply is :data:`NEED_DATA` until the rest is fed. It never
re-reads what it has already parsed (an array arriving in many pieces costs its length once).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Final, TypeAlias

import attrs

__all__ = [
    "MAX_RESP_ARRAY",
    "MAX_RESP_BULK",
    "MAX_RESP_LINE",
    "NEED_DATA",
    "Arg",
    "EncodedArgs",
    "NeedData",
    "Reply",
    "ReplyError",
    "RespParser",
    "RespProtocolError",
    "encode_args",
    "encode_command",
    "encode_commands",
    "encode_reply",
    "join_command",
]

MAX_RESP_BULK: Final = 512 * 1024 * 1024
"""Redis's own limit on a string (``proto-max-bulk-len``)."""
MAX_RESP_ARRAY: Final = 1024 * 1024
"""Elements of one array (at any depth) the parser accepts."""
MAX_RESP_LINE: Final = 64 * 1024
"""Bytes of a line (a status, an error message, a number) the parser accepts."""


class RespProtocolError(Exception):
    """The bytes are not a RESP2 reply (or exceed the parser's bounds): the connection they
    came from is out of step and must be closed."""


@attrs.frozen
class ReplyError:
    """An error reply (``-ERR ...``, ``-NOSCRIPT ...``), as a value."""

    message: str

    @property
    def code(self) -> str:
        """The message's first word, Redis's error code by convention (``ERR``,
        ``NOSCRIPT``, ``WRONGTYPE``, ``NOAUTH``)."""
        return self.message.split(" ", 1)[0]


Reply: TypeAlias = "str | ReplyError | int | bytes | list[Reply] | None"
Arg: TypeAlias = str | bytes | int | float
"""An argument of a command: str is sent as UTF-8, int and float as their decimal text."""


class NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = NeedData.NEED_DATA
""":meth:`RespParser.next_reply`'s answer when no whole reply has been fed yet."""

_CRLF: Final = b"\r\n"


def _arg_bytes(arg: Arg) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):  # an int, but True is neither "1" nor "True" to Redis
        raise TypeError("a Redis argument cannot be a bool: send 1/0 or a string")
    if isinstance(arg, int):
        return b"%d" % arg
    if isinstance(arg, float):
        return repr(arg).encode()
    raise TypeError(f"a Redis argument is str, bytes, int or float, not {type(arg).__name__}")


def encode_command(*args: Arg) -> bytes:
    """One command as RESP2 sends it: an array of bulk strings."""
    if not args:
        raise ValueError("a Redis command needs at least its name")
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if type(arg) is str else _arg_bytes(arg)
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def encode_commands(commands: Iterable[Sequence[Arg]]) -> bytes:
    """Several commands in one write (a pipeline), in order."""
    return b"".join([encode_command(*command) for command in commands])


@attrs.frozen
class EncodedArgs:
    """Some of a command's arguments as RESP2 sends them (:func:`encode_args`): a part that a
    caller encodes once and keeps, to make commands of with :func:`join_command`."""

    count: int
    data: bytes


def encode_args(*args: Arg) -> EncodedArgs:
    """Arguments of a command (its name among them, if first), without the command's header."""
    parts = []
    for arg in args:
        data = arg.encode() if type(arg) is str else _arg_bytes(arg)
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return EncodedArgs(len(args), b"".join(parts))


def join_command(*parts: EncodedArgs) -> bytes:
    """One command made of encoded parts, in order: the same bytes as :func:`encode_command`
    of their arguments."""
    count = sum(part.count for part in parts)
    if not count:
        raise ValueError("a Redis command needs at least its name")
    return b"".join([b"*%d\r\n" % count, *[part.data for part in parts]])


def encode_reply(reply: Reply) -> bytes:
    """A reply as the server sends it (the tests' fake server, the parser's round trips).
    A status or an error message must not contain CR or LF."""
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, bytes):
        return b"$%d\r\n%s\r\n" % (len(reply), reply)
    if isinstance(reply, str):
        return _line(b"+", reply)
    if isinstance(reply, ReplyError):
        return _line(b"-", reply.message)
    if isinstance(reply, bool):
        raise TypeError("a reply is never a bool")
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    return b"*%d\r\n" % len(reply) + b"".join([encode_reply(item) for item in reply])


def _line(kind: bytes, text: str) -> bytes:
    data = text.encode("utf-8", "surrogateescape")
    if b"\r" in data or b"\n" in data:
        raise ValueError("a status or an error message cannot hold CR or LF")
    return kind + data + _CRLF


@attrs.define(eq=False)
class _Open:
    """An array whose header was read and whose elements are still arriving."""

    items: list[Reply]
    expected: int


class RespParser:
    """Replies out of a byte stream, incrementally (see the module docstring)."""

    def __init__(
        self,
        *,
        max_bulk: int = MAX_RESP_BULK,
        max_array: int = MAX_RESP_ARRAY,
        max_line: int = MAX_RESP_LINE,
    ) -> None:
        self._buffer = bytearray()
        self._pos = 0
        """Where the unparsed bytes start in :attr:`_buffer`."""
        self._bulk = -1
        """The length of a bulk string whose header was read and whose body has not come."""
        self._open: list[_Open] = []
        """The arrays being filled, outermost first."""
        self._broken: RespProtocolError | None = None
        self._max_bulk = max_bulk
        self._max_array = max_array
        self._max_line = max_line

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes the connection received, in order (any split, empty included)."""
        if self._pos:
            del self._buffer[: self._pos]  # CPython drops a bytearray's head in O(1)
            self._pos = 0
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet parsed into a reply."""
        return len(self._buffer) - self._pos

    def next_reply(self) -> Reply | NeedData:
        """The next whole reply, or :data:`NEED_DATA`. Raises :class:`RespProtocolError`
        (every time, once it has) if the stream is not RESP2 or exceeds the bounds."""
        if self._broken is not None:
            raise self._broken
        try:
            return self._next()
        except RespProtocolError as exc:
            self._broken = exc
            raise

    def _next(self) -> Reply | NeedData:
        buffer = self._buffer
        while True:
            value: Reply
            if self._bulk >= 0:
                end = self._pos + self._bulk
                if len(buffer) < end + 2:
                    return NEED_DATA
                if buffer[end : end + 2] != _CRLF:
                    raise RespProtocolError("a bulk string is not followed by CRLF")
                value = bytes(buffer[self._pos : end])
                self._pos = end + 2
                self._bulk = -1
            else:
                start = self._pos
                eol = buffer.find(_CRLF, start, start + self._max_line + 3)
                if eol < 0:
                    if len(buffer) - start > self._max_line + 2:
                        raise RespProtocolError(f"a line longer than {self._max_line} bytes")
                    return NEED_DATA
                kind = buffer[start]
                self._pos = eol + 2
                if kind == 0x24:  # $
                    length = _number(buffer, start + 1, eol)
                    if length == -1:
                        value = None
                    elif 0 <= length <= self._max_bulk:
                        self._bulk = length
                        continue
                    else:
                        raise RespProtocolError(f"a bulk string of length {length}")
                elif kind == 0x2A:  # *
                    length = _number(buffer, start + 1, eol)
                    if length == -1:
                        value = None
                    elif length == 0:
                        value = []
                    elif 0 < length <= self._max_array:
                        self._open.append(_Open([], length))
                        continue
                    else:
                        raise RespProtocolError(f"an array of length {length}")
                elif kind == 0x3A:  # :
                    value = _number(buffer, start + 1, eol)
                elif kind == 0x2B:  # +
                    value = _text(buffer, start + 1, eol)
                elif kind == 0x2D:  # -
                    value = ReplyError(_text(buffer, start + 1, eol))
                else:
                    raise RespProtocolError(f"a reply cannot start with byte {kind:#04x}")
            # a value is complete: it ends the reply or fills its arrays
            while self._open:
                top = self._open[-1]
                top.items.append(value)
                if len(top.items) < top.expected:
                    break
                self._open.pop()
                value = top.items
            else:
                return value


def _number(buffer: bytearray, start: int, end: int) -> int:
    digits = buffer[start:end]
    body = digits[1:] if digits[:1] == b"-" else digits
    if not body.isdigit() or len(body) > 20:  # bytes' isdigit is ASCII digits only
        raise RespProtocolError(f"not an integer: {bytes(digits[:40])!r}")
    return int(digits)


def _text(buffer: bytearray, start: int, end: int) -> str:
    line = buffer[start:end]
    if b"\r" in line or b"\n" in line:  # a lone CR or LF is not a RESP line's
        raise RespProtocolError("a CR or LF inside a line")
    return line.decode("utf-8", "surrogateescape")
