"""The ownership rule of ``dispatcher.lease``: how a lease's end reason is derived (a pure
function, tested as a table), what both paths count (one statistics shape), and that the
tunnel route, which no longer judges frame order itself, still sees every out-of-order
sequence end the node's session as a protocol error (the session machine's call).
"""

from __future__ import annotations

import pytest
import trio

from dispatcher import wire
from dispatcher.errors import TunnelFailed
from dispatcher.gate.pool import DispatchRequest
from dispatcher.paths.lease import (
    EndReason,
    LeaseStatistics,
    NodeEnd,
    SendFailure,
    end_reason,
)

from .fakes import wait_until
from .test_tunnel import closed_by_edge, open_scripted_tunnel, scripted_edge

_CANCELLED = trio.Cancelled._create()  # how trio makes one; a test needs only its type


@pytest.mark.parametrize(
    ("node_end", "sent", "send_failure", "left_by", "expected"),
    [
        # The node's end decides, however the block was left.
        ("completed", True, None, None, "completed"),
        ("failed", True, None, ValueError(), "failed"),
        ("node_lost", True, None, _CANCELLED, "node_lost"),
        ("stale_generation", False, None, None, "stale_generation"),
        ("cancelled", True, None, None, "cancelled"),
        # A request that never reached the node: its send's failure, else unsent.
        ("node_lost", False, "send_error", NameError(), "send_error"),
        (None, False, "withdrawn", _CANCELLED, "withdrawn"),
        (None, False, None, None, "unsent"),
        (None, False, None, _CANCELLED, "unsent"),
        # Sent and left before the node's end: how the block was left.
        (None, True, None, _CANCELLED, "cancelled"),
        (None, True, None, None, "abandoned"),
        (None, True, None, RuntimeError(), "error"),
        # A send that failed and was then retried successfully is sent.
        (None, True, "send_error", None, "abandoned"),
    ],
)
def test_end_reason(
    node_end: NodeEnd | None,
    sent: bool,
    send_failure: SendFailure | None,
    left_by: BaseException | None,
    expected: EndReason,
) -> None:
    assert (
        end_reason(node_end=node_end, sent=sent, send_failure=send_failure, left_by=left_by)
        == expected
    )


def _ordering(tunnel_id: str) -> list[tuple[list[wire.Message | bytes], str]]:
    start = wire.TunnelStart(tunnel_id=tunnel_id, status=200)
    end = wire.TunnelEnd(tunnel_id=tunnel_id)
    return [
        ([b"x"], f"tunnel {tunnel_id!r}: body frame before tunnel.start"),
        ([start, start], f"tunnel {tunnel_id!r}: tunnel.start after the response started or ended"),
        ([end, start], f"tunnel {tunnel_id!r}: tunnel.start after the response started or ended"),
        ([start, end, b"x"], f"tunnel {tunnel_id!r}: body frame after tunnel.end"),
        ([start, end, end], f"tunnel {tunnel_id!r}: a second tunnel.end"),
    ]


@pytest.mark.parametrize("case", range(5))
async def test_tunnel_frames_out_of_order_close_the_session(
    nursery: trio.Nursery, case: int
) -> None:
    async with scripted_edge() as (dispatcher, node):
        results, request = await open_scripted_tunnel(dispatcher, node, nursery)
        frames, reason = _ordering(request.tunnel_id)[case]
        for frame in frames:
            if isinstance(frame, bytes):
                await node.conn.send(wire.encode_tunnel_data(request.tunnel_id, frame))
            else:
                await node.send(frame)
        closed = await closed_by_edge(node)
        assert closed.code == 1002
        assert reason in closed.reason
        # The tunnel ended (the session's loss, if the node had not ended it), and the
        # edge gave every slot back.
        got = [await results.receive()]
        while not isinstance(got[-1], TunnelFailed) and got[-1] != "end":
            got.append(await results.receive())
        await wait_until(lambda: dispatcher.tunnels.statistics().open == 0)
        assert dispatcher.admission.statistics().in_use == 0
        assert "scripted" not in dispatcher.registry.sessions


async def test_a_tunnel_left_unsent_gives_its_slot_back_and_counts_once() -> None:
    """Nothing reached the node, so nothing is cancelled or drained: the slot is released."""
    async with scripted_edge() as (dispatcher, node):
        request = DispatchRequest(model="t", body={"model": "t"}, route="/v1/embeddings")
        async with dispatcher.open_dispatch(request) as dispatch:
            tunnel = dispatch.tunnel
            assert tunnel is not None
            assert dispatcher.tunnels.statistics().open_tunnels == 1
            assert dispatcher.admission.statistics().in_use == 1
        assert tunnel.end_reason == "unsent"
        assert not tunnel.sent
        stats = dispatcher.tunnels.statistics()
        assert isinstance(stats, LeaseStatistics)
        assert (stats.opened, stats.open, stats.ended, stats.cancels_sent) == (
            1,
            0,
            {"unsent": 1},
            0,
        )
        assert dispatcher.admission.statistics().in_use == 0
        assert dispatcher.admission.statistics().draining == 0
        assert node.seen == [node.welcome]
        # The run path counts the same shape (its older spellings kept).
        runs = dispatcher.runs.statistics()
        assert isinstance(runs, LeaseStatistics)
        assert (runs.opened, runs.open_runs, runs.ended, runs.cancels_sent) == (0, 0, {}, 0)
        assert dispatcher.runs.stats == runs
        assert stats.open_tunnels == stats.open
