"""A client that gives up: the engine stops generating for it, on every path, streamed or not.

A chat completion of :data:`LONG` tokens (llama.cpp's ``ignore_eos``), sent over a raw socket
so that what the client does is exact: it sends the request, reads whatever comes for
:data:`GIVE_UP` seconds (a streamed answer's events; nothing, for a whole one, which the
engine sends only at its end), and closes the socket. The engine's slot must be free within
:data:`IDLE_BOUND` seconds of that -- the request sent to the engine directly, through the
edge's tunnel or through its normalized path.

How it is measured matters (issue #21): while the client is leaving, the engine is not asked
anything. llama-server looks at a non-streamed request's socket only after a second in which
it sent no result for any task, and each ``GET /slots`` is a task: polled, the engine never
notices, on any path. So the slot's end is read from the engine's log
(:class:`~tests.real.stack.EngineLog`); ``GET /slots`` is asked once, just before the client
leaves (the tokens decoded so far; the engine's one-second wait starts again there, so a whole
request is noticed about a second after the client left), and ``/metrics`` once the slot is
free.

The findings (seconds to the slot free, tokens decoded after the client left) are printed
with the numbers at the end of the run.
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from typing import Any

import orjson
import pytest

from .answers import ENGINE_MODEL, GAVE_UP, MESSAGES
from .stack import NORMALIZED, TUNNEL, Stack, seconds_until_idle, slots, tokens_predicted

LONG = 1500
"""max_tokens: at 50-100 tokens/s, 15-30 s of work, of which the client waits 3."""
GIVE_UP = 3.0
"""Seconds from sending the request to closing the socket."""
IDLE_BOUND = 3.0
"""Seconds from the client closing its socket to the engine's slot free: the engine's own
wait of a second for a non-streamed request, its current decoding step, the edge and the node
on a busy 2-core machine. Left alone, the engine would generate for 10 s more at least."""
START_BOUND = 30.0
"""Seconds the engine gets to take the request."""

DIRECT = "direct"
ROUTES = pytest.mark.parametrize("route", [DIRECT, TUNNEL, NORMALIZED])
STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


def _post(url: str, body: dict[str, Any]) -> tuple[tuple[str, int], bytes]:
    """Where to connect, and the raw HTTP/1.1 POST of ``body`` to ``url``'s chat route."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    data = orjson.dumps(body)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"host: {parts.hostname}:{parts.port}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    return (parts.hostname, parts.port), head.encode("ascii") + data


def _started(stack: Stack, launched_before: int) -> tuple[int, int]:
    """The (slot, task) the engine began after ``launched_before`` launches, from its log."""
    deadline = time.monotonic() + START_BOUND
    while len((log := stack.log).launched) <= launched_before:
        assert time.monotonic() < deadline, (
            "the engine logged no 'processing task' for the request (tests/real reads the "
            "engine's slots from llama-server's log)\n" + stack.diagnostics()
        )
        time.sleep(0.01)
    (started,) = log.launched[launched_before:]
    return started


def _read_until(sock: socket.socket, deadline: float) -> bytes:
    """What arrives before ``deadline`` (``time.monotonic()``)."""
    received = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        received += data
    return bytes(received)


@ROUTES
@STREAMED
def test_a_client_giving_up_frees_the_engine(idle_engine: Stack, route: str, stream: bool) -> None:
    stack = idle_engine
    label = f"{route}, {'streamed' if stream else 'whole'}, after {GIVE_UP:g} s"
    url = stack.engine_url if route == DIRECT else stack.edge_url
    body = {
        "model": ENGINE_MODEL if route == DIRECT else route,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }
    address, request = _post(url, body)
    predicted = tokens_predicted(stack)
    launched = len(stack.log.launched)
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(request)
        sent = time.monotonic()
        slot_id, task = _started(stack, launched)
        received = _read_until(sock, sent + GIVE_UP)
        if stream:  # the head at least (events too, unless the machine is very busy)
            assert received.startswith(b"HTTP/1.1 200"), received[:300]
        else:
            assert received == b"", f"a whole answer came early: {received[:300]!r}"
        (slot,) = [slot for slot in slots(stack) if int(slot["id"]) == slot_id]
        assert slot["is_processing"], f"{label}: the engine is not generating: {slot}"
        decoded_before = int(slot["next_token"][0]["n_decoded"])
        assert decoded_before > 0, f"{label}: the engine has not decoded a token: {slot}"
    # The socket is closed: the client is gone.
    idle_after = seconds_until_idle(stack, time.monotonic(), IDLE_BOUND)
    assert task in stack.log.released
    (slot,) = [slot for slot in slots(stack) if int(slot["id"]) == slot_id]
    assert not slot["is_processing"], f"the log says task {task} ended, /slots says {slot}"
    decoded = tokens_predicted(stack) - predicted
    GAVE_UP[label] = (idle_after, decoded - decoded_before, decoded_before)
    assert decoded < LONG, f"{label}: the engine decoded all {LONG} tokens"
