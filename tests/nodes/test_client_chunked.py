"""The upstream client's chunked-body reader (``nodes.upstream.client._ChunkedBody``) against
h11, whose rules it keeps: the same body from any chunking and any split into reads, the same
verdict (a body, or a framing error) on arbitrary bytes."""

from __future__ import annotations

import h11
from hypothesis import given, settings
from hypothesis import strategies as st

from nodes.upstream.client import _ChunkedBody

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def by_h11(wire: bytes) -> tuple[bytes, bool] | None:
    """h11's reading of a chunked body: (the body, ended) or None (a framing error)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(HEAD + wire)
    body = b""
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return body, True
            elif event is h11.NEED_DATA:
                return body, False
    except h11.RemoteProtocolError:
        return None


def by_us(reads: list[bytes]) -> tuple[bytes, bool, bytes] | None:
    decoder = _ChunkedBody(keep_alive=True)
    pieces: list[bytes | bytearray] = []
    try:
        for read in reads:
            if decoder.feed(read, pieces):
                return b"".join(pieces), True, decoder.leftover
    except h11.RemoteProtocolError:
        return None
    return b"".join(pieces), False, b""


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts})
    reads, last = [], 0
    for point in points:
        reads.append(data[last:point])
        last = point
    reads.append(data[last:])
    return [read for read in reads if read]


chunk = st.binary(min_size=1, max_size=40)
extension = st.sampled_from([b"", b";name=value", b";x", b"  ", b"\t"])


@st.composite
def chunked(draw: st.DrawFn) -> tuple[bytes, bytes]:
    pieces = draw(st.lists(chunk, max_size=8))
    wire = b""
    for piece in pieces:
        digits = b"%x" % len(piece)
        if draw(st.booleans()):
            digits = digits.upper().rjust(draw(st.integers(1, 6)), b"0")
        wire += digits + draw(extension) + b"\r\n" + piece + b"\r\n"
    wire += b"0" + draw(extension) + b"\r\n"
    if draw(st.booleans()):
        wire += b"x-trailer: yes\r\n"
    wire += b"\r\n"
    return wire, b"".join(pieces)


@settings(max_examples=300)
@given(chunked(), st.lists(st.integers(0, 400), max_size=12), st.binary(max_size=5))
def test_any_chunking_in_any_reads_gives_the_body(
    encoded: tuple[bytes, bytes], cuts: list[int], after: bytes
) -> None:
    wire, body = encoded
    result = by_us(split(wire + after, cuts))
    assert result is not None
    assert result[:2] == (body, True)
    assert after.startswith(result[2])  # what came in the same read as the end
    if cuts == [] and after:
        assert result[2] == after  # one read: all of it
    assert by_h11(wire) == (body, True)


@settings(max_examples=500)
@given(
    st.lists(
        st.sampled_from(
            [
                b"1\r\n",
                b"a\r\n",
                b"x",
                b"\r\n",
                b"0\r\n",
                b"z",
                b"\r",
                b"\n",
                b";",
                b"k:v",
                b" ",
                b"\t",
            ]
        ),
        max_size=12,
    ),
    st.lists(st.integers(0, 60), max_size=6),
)
def test_the_same_verdict_as_h11_on_arbitrary_framing(parts: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(parts)
    ours = by_us(split(wire, cuts))
    theirs = by_h11(wire)
    if theirs is None:
        assert ours is None
        return
    assert ours is not None
    body, ended = theirs
    assert ours[1] == ended
    if ended:
        assert ours[0] == body
    else:  # data h11 has not yet given (a chunk's data waits for its size) may come later
        assert body.startswith(ours[0]) or ours[0].startswith(body)


def test_a_byte_at_a_time() -> None:
    wire = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n"
    assert by_us([wire[i : i + 1] for i in range(len(wire))]) == (b"hello world", True, b"")


def test_framing_errors() -> None:
    assert by_us([b"z1\r\nx\r\n"]) is None  # not hex
    assert by_us([b"1\r\nxy\r\n0\r\n\r\n"]) is None  # a chunk without its CRLF
    assert by_us([b"0\r\nno colon\r\n\r\n"]) is None  # a trailer that is not a header
    assert by_us([b"1" * 21 + b"\r\n"]) is None  # more than 20 digits
