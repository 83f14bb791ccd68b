"""A slot handed from a busy edge to an idle one at the busy edge's *first* run end, when
that edge has requests waiting and its runs end at different times (issue #24; found by
the ``cluster`` bench section, ``bench/cluster_bench.py``).

``nodes/grants.py`` asks the node's sessions to send the grants ``Allocator.run_ended``
returns *before* telling the edge the run ended, so that an edge whose grant was lowered
learns it before it sees the slot free. When the node sent the ``run.completed`` first (the
session's ``send_grants`` task wrote the lowered grant after it), the busy edge refilled the
freed slot from its own queue, and the idle edge was served only at the busy edge's *second*
run end; ``_Link.send`` now writes the grants before the end. ``test_several_edges``'
hand-over test did not see it: its busy edge's runs all end at the same moment. Virtual
time, in-memory connections.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.edge.fakes import wait_until
from tests.nodes.test_several_edges import SLOTS, Running, slots, two_edges_one_node


async def test_the_idle_edge_is_served_at_the_first_run_end_of_staggered_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    assert SLOTS == 4
    running = Running()
    async with two_edges_one_node() as (a, b, _), trio.open_nursery() as nursery:
        # Edge a holds every slot, its runs ending 5, 20, 30 and 40 s after they start
        # (1 s a token), and four more of its requests wait.
        for tokens in (5, 20, 30, 40):
            nursery.start_soon(running.run, a, tokens, 1.0)
        await wait_until(lambda: slots(a) == SLOTS and running.now == SLOTS, timeout=30)
        started = trio.current_time()
        for _ in range(4):
            nursery.start_soon(running.run, a, 40, 1.0)
        await wait_until(lambda: a.admission.statistics().waiting == 4, timeout=1)
        await running.run(b, 1, 0.0)
        served = trio.current_time() - started
        # At a's first run end (5 s), not at its second (20 s).
        assert served <= 5.0 + 1.0, f"served {served:g} s in: not at a's first run end"
        nursery.cancel_scope.cancel()
