"""A streamed body split as it arrives, a whole read at a time: into lines
(:class:`LineSplitter`: Ollama's NDJSON) and into server-sent events (:class:`SSEDecoder`:
OpenAI-compatible streams, over the same lines). Sans-IO: fed the body's pieces, they give
what each piece completed."""

from __future__ import annotations


class LineSplitter:
    """A body's lines, from its bytes as they arrive: :meth:`feed` gives the lines each piece
    completes (without their ends: ``\\n``, ``\\r\\n`` or a lone ``\\r``, as httpx's
    ``aiter_lines`` splits), :meth:`flush` the unterminated last one. Works on whole reads
    (one ``split`` per read), not byte by byte nor through a text decoder."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._rest + data if self._rest else data
        tail = b""
        if b"\r" in buffer:
            if buffer.endswith(b"\r"):  # maybe the first half of a \r\n
                buffer, tail = buffer[:-1], b"\r"
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buffer.split(b"\n")
        self._rest = lines.pop() + tail
        return lines

    def flush(self) -> bytes | None:
        """The last line, if the body did not end with an end of line."""
        rest, self._rest = self._rest.removesuffix(b"\r"), b""
        return rest or None


class SSEDecoder:
    """Server-sent events from a body's bytes: :meth:`feed` each piece of the body as it
    arrives; it returns the ``data`` of every event the piece completed (an event's
    ``data:`` lines joined by newlines, ended by a blank line), :meth:`flush` the last one
    at the end of the body. Comments, ``event:``, ``id:`` and ``retry:`` fields are
    ignored."""

    __slots__ = ("_data", "_lines")

    def __init__(self) -> None:
        self._lines = LineSplitter()
        self._data: list[bytes] = []

    def feed(self, piece: bytes) -> list[bytes]:
        if not self._data and not self._lines._rest and piece.endswith(b"\n\n"):
            simple = _simple_events(piece)
            if simple is not None:
                return simple
        events: list[bytes] = []
        data = self._data
        for line in self._lines.feed(piece):
            if not line:
                if data:
                    events.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data.clear()
            elif line.startswith(b"data"):
                self._field(line)
        return events

    def _field(self, line: bytes) -> None:
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value[1:] if value.startswith(b" ") else value)

    def flush(self) -> bytes | None:
        """The pending event's data at the end of the stream (None if there is none)."""
        last = self._lines.flush()
        if last is not None and last.startswith(b"data"):
            self._field(last)
        if not self._data:
            return None
        data = b"\n".join(self._data)
        self._data.clear()
        return data


def _simple_events(piece: bytes) -> list[bytes] | None:
    """The events of ``piece`` when it is whole events of one ``data: `` line each (what
    OpenAI-compatible servers send), found by a few scans of the whole piece rather than line
    by line; None for anything else (the general path decodes it)."""
    if not piece.startswith(b"data: ") or b"\r" in piece:
        return None
    parts = piece[:-2].split(b"\n\n")
    # Every part one line (no other newline: two per part, its end) starting ``data: ``.
    if piece.count(b"\n") != 2 * len(parts) or piece.count(b"\n\ndata: ") != len(parts) - 1:
        return None
    return [part[6:] for part in parts]
