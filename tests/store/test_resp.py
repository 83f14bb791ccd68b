"""The sans-IO RESP2 core (:mod:`dispatcher.store.resp`), with no event loop and no server:

* every kind of reply, nested at any depth, parses back to itself however its bytes are split
  (one byte at a time included), several replies in one stream in order;
* a command's bytes parse (as the server would read them) back to its arguments;
* garbage -- random bytes, or valid replies with random bytes spliced in -- ends in
  NEED_DATA or :class:`RespProtocolError`, nothing else, and the error sticks;
* the bounds: a bulk, an array or a line beyond its limit is refused before its body comes;
* a bulk's body is not followed by CRLF, a type byte is unknown, a length is not a number:
  protocol errors; a bool is refused as an argument.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.store.resp import (
    NEED_DATA,
    Arg,
    Reply,
    ReplyError,
    RespParser,
    RespProtocolError,
    encode_args,
    encode_command,
    encode_commands,
    encode_reply,
    join_command,
)

line_text = st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]))
leaf: st.SearchStrategy[Reply] = st.one_of(
    st.none(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.binary(max_size=64),
    line_text,
    line_text.map(ReplyError),
)
replies: st.SearchStrategy[Reply] = st.recursive(
    leaf, lambda inner: st.lists(inner, max_size=6), max_leaves=30
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def parse_all(chunks: list[bytes], parser: RespParser | None = None) -> list[Reply]:
    """Feed the chunks one by one, taking every reply as soon as it is whole."""
    parser = parser or RespParser()
    out: list[Reply] = []
    for chunk in chunks:
        parser.feed(chunk)
        while (reply := parser.next_reply()) is not NEED_DATA:
            out.append(reply)
    assert parser.buffered == 0 or parser.next_reply() is NEED_DATA
    return out


@given(st.lists(replies, max_size=5), st.lists(st.integers(min_value=0), max_size=12))
def test_replies_round_trip_in_any_chunking(sent: list[Reply], cuts: list[int]) -> None:
    data = b"".join(encode_reply(reply) for reply in sent)
    assert parse_all(split(data, cuts)) == sent


@given(replies)
def test_a_reply_fed_one_byte_at_a_time(reply: Reply) -> None:
    data = encode_reply(reply)
    parser = RespParser()
    for index in range(len(data) - 1):
        parser.feed(data[index : index + 1])
        assert parser.next_reply() is NEED_DATA
    parser.feed(data[-1:])
    assert parser.next_reply() == reply
    assert parser.next_reply() is NEED_DATA


args = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=20),
    st.integers(),
    st.floats(allow_nan=False),
)


@given(st.lists(st.lists(args, min_size=1, max_size=6), min_size=1, max_size=4))
def test_commands_parse_back_to_their_arguments(commands: list[list[Arg]]) -> None:
    parsed = parse_all([encode_commands(commands)])
    expected = [[arg if isinstance(arg, bytes) else str(arg).encode() for arg in command]
                for command in commands]  # fmt: skip
    assert parsed == expected  # a float as its repr (str), which reads back as it


@given(st.lists(st.lists(args, max_size=4), min_size=1, max_size=4).filter(lambda p: any(p)))
def test_a_command_joined_from_parts_is_the_command(parts: list[list[Arg]]) -> None:
    """Parts encoded apart (as the Redis limits keep a script's SHA1 and a tenant's limits)
    and joined make the bytes of the whole command."""
    joined = join_command(*[encode_args(*part) for part in parts])
    assert joined == encode_command(*[arg for part in parts for arg in part])


def test_a_command_of_no_parts() -> None:
    with pytest.raises(ValueError, match="its name"):
        join_command(encode_args())


def drain_garbage(chunks: list[bytes]) -> None:
    """Feed and parse; only replies, NEED_DATA or the documented error may come out."""
    parser = RespParser(max_bulk=1024, max_array=64, max_line=128)
    try:
        for chunk in chunks:
            parser.feed(chunk)
            while parser.next_reply() is not NEED_DATA:
                pass
    except RespProtocolError:
        with pytest.raises(RespProtocolError):  # it sticks
            parser.next_reply()


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0), max_size=8))
def test_garbage_ends_in_need_data_or_a_protocol_error(data: bytes, cuts: list[int]) -> None:
    drain_garbage(split(data, cuts))


@given(st.lists(replies, max_size=3), st.binary(max_size=20), st.integers(min_value=0))
def test_replies_with_garbage_spliced_in(sent: list[Reply], noise: bytes, at: int) -> None:
    data = b"".join(encode_reply(reply) for reply in sent)
    at %= len(data) + 1
    drain_garbage([data[:at] + noise + data[at:]])


def test_every_kind_of_reply() -> None:
    stream = (
        b"+OK\r\n-NOSCRIPT No matching script\r\n:-42\r\n$5\r\nhe\r\no\r\n$0\r\n\r\n$-1\r\n"
        b"*-1\r\n*0\r\n*3\r\n:1\r\n*2\r\n$1\r\na\r\n$-1\r\n+x\r\n"
    )
    got = parse_all([stream])
    assert got == [
        "OK",
        ReplyError("NOSCRIPT No matching script"),
        -42,
        b"he\r\no",
        b"",
        None,
        None,
        [],
        [1, [b"a", None], "x"],
    ]
    error = got[1]
    assert isinstance(error, ReplyError)
    assert error.code == "NOSCRIPT"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"$536870913\r\n", "bulk string of length 536870913"),
        (b"*1048577\r\n", "array of length 1048577"),
        (b"$-2\r\n", "bulk string of length -2"),
        (b"*-5\r\n", "array of length -5"),
        (b"+" + b"x" * 70_000, "line longer than"),
        (b"$3\r\nabcX\r\n", "not followed by CRLF"),
        (b"?what\r\n", "cannot start with byte 0x3f"),
        (b":12a\r\n", "not an integer"),
        (b":\r\n", "not an integer"),
        (b"$ 3\r\n", "not an integer"),
        (b":" + b"9" * 30 + b"\r\n", "not an integer"),
        (b"+a\rb\r\n", "CR or LF inside a line"),
    ],
)
def test_protocol_errors(data: bytes, why: str) -> None:
    parser = RespParser()
    parser.feed(data)
    with pytest.raises(RespProtocolError, match=why):
        parser.next_reply()


def test_a_big_bulk_header_waits_for_its_body_without_taking_it() -> None:
    parser = RespParser()
    parser.feed(b"$536870912\r\n" + b"x" * 10)
    assert parser.next_reply() is NEED_DATA
    assert parser.buffered == 10


def test_an_array_arriving_in_pieces_is_not_reparsed() -> None:
    """The elements already parsed leave the buffer: what is buffered is only the partial
    element, however long the array."""
    parser = RespParser()
    parser.feed(b"*100000\r\n")
    for _ in range(99_999):
        parser.feed(b":7\r\n")
        assert parser.next_reply() is NEED_DATA
    assert parser.buffered == 0
    parser.feed(b":7\r\n")
    assert parser.next_reply() == [7] * 100_000


def test_arguments() -> None:
    assert encode_command("SET", b"k\x00", 12, 0.5) == (
        b"*4\r\n$3\r\nSET\r\n$2\r\nk\x00\r\n$2\r\n12\r\n$3\r\n0.5\r\n"
    )
    with pytest.raises(TypeError, match="bool"):
        encode_command("SET", "k", True)
    with pytest.raises(TypeError, match="not list"):
        encode_command("SET", "k", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="its name"):
        encode_command()
