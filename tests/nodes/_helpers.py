"""Test doubles shared by the node tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import trio

from dispatcher import wire


class Recorder:
    """A ``send`` for the runner that records messages; optionally slow."""

    def __init__(self, delay: float = 0.0) -> None:
        self.messages: list[wire.NodeMessage] = []
        self.delay = delay
        self._lot = trio.lowlevel.ParkingLot()

    async def send(self, message: wire.NodeMessage) -> None:
        if self.delay:
            await trio.sleep(self.delay)
        else:
            await trio.lowlevel.checkpoint()
        self.messages.append(message)
        self._lot.unpark_all()

    def events(self, run_id: str) -> list[Any]:
        return [m for m in self.messages if getattr(m, "run_id", None) == run_id]

    def types(self, run_id: str) -> list[str]:
        return [m.TYPE for m in self.events(run_id)]

    def text(self, run_id: str) -> str:
        return "".join(e.text for e in self.events(run_id) if isinstance(e, wire.RunDelta))

    def terminal(self, run_id: str) -> Any:
        terminals = [e for e in self.events(run_id) if isinstance(e, wire.TERMINAL_EVENTS)]
        assert len(terminals) <= 1, terminals
        return terminals[0] if terminals else None

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._lot.park()

    async def wait_terminal(self, run_id: str) -> Any:
        await self.wait_for(lambda: self.terminal(run_id) is not None)
        return self.terminal(run_id)

    async def wait_text(self, run_id: str, text: str) -> None:
        await self.wait_for(lambda: self.text(run_id) == text)


def request(
    run_id: str = "r1",
    text: str = "hello world",
    *,
    provider_id: str = "echo",
    messages: list[dict[str, Any]] | None = None,
    **body: Any,
) -> wire.RunRequest:
    if messages is None:
        messages = [{"role": "user", "content": text}]
    return wire.RunRequest(
        run_id=run_id,
        provider_id=provider_id,
        model="echo",
        served_model="echo",
        body={"model": "echo", "messages": messages, **body},
    )


def assert_well_formed(events: list[Any]) -> None:
    """seq 0..n in order, run.started first, exactly one terminal and it is last."""
    assert [e.seq for e in events] == list(range(len(events)))
    assert isinstance(events[0], wire.RunStarted)
    terminals = [e for e in events if isinstance(e, wire.TERMINAL_EVENTS)]
    assert len(terminals) == 1
    assert events[-1] is terminals[0]


def assert_no_address(message: str, base_url: str) -> None:
    """``message`` (a run.failed message, which may reach a client) names nothing of where the
    provider is: not its URL, host, ``host:port`` nor port."""
    url = httpx.URL(base_url)
    for leak in (base_url, f"{url.host}:{url.port}", url.host, str(url.port)):
        assert leak not in message, (leak, message)
