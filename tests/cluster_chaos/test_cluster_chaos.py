"""The cluster soak (issue #24, acceptance 2): Redis, PostgreSQL, two edges and three nodes
each serving both edges, under the official openai SDK's load, with a node SIGKILLed every
~300 requests, an edge SIGKILLed once and Redis restarted once (:mod:`tests.cluster_chaos.soak`;
the checks: :mod:`tests.cluster_chaos.checks`).

The test command runs it with ``CLUSTER_CHAOS_REQUESTS`` unset: 300 requests (about 30 s on
a 2-core machine). ``nox -s cluster-chaos`` runs it at full length (2,000 requests, or its own
``CLUSTER_CHAOS_REQUESTS``) and prints its summary. ``CLUSTER_CHAOS_SEED`` picks the plan,
``CLUSTER_CHAOS_CONCURRENCY`` the clients at once (16). The work directory (configs, every
process's log, ``soak.json``) is kept under pytest's tmp_path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.processes import Processes
from tests.cluster.cluster import new_database
from tests.store.redis_server import RedisServer, own_server

from .checks import run_checks, summary
from .soak import SoakRun, dump, make_events, make_plans, run_load, settle, start_topology

pytestmark = pytest.mark.slow

REQUESTS = int(os.environ.get("CLUSTER_CHAOS_REQUESTS", "300"))
SEED = int(os.environ.get("CLUSTER_CHAOS_SEED", "20241124"))
CONCURRENCY = int(os.environ.get("CLUSTER_CHAOS_CONCURRENCY", "16"))


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """Owns every child process of the soak: all are stopped and reaped however it ends."""
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.close()


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with own_server() as server:
        yield server


@pytest.mark.timeout(max(300, REQUESTS // 2 + 240))
async def test_cluster_soak(processes: Processes, redis: RedisServer, tmp_path: Path) -> None:
    print(
        f"\ncluster soak: CLUSTER_CHAOS_SEED={SEED} CLUSTER_CHAOS_REQUESTS={REQUESTS} "
        f"CLUSTER_CHAOS_CONCURRENCY={CONCURRENCY}; work directory {tmp_path}",
        flush=True,
    )
    topology = await start_topology(processes, tmp_path, redis, new_database(), SEED)
    run = SoakRun(
        seed=SEED,
        count=REQUESTS,
        concurrency=CONCURRENCY,
        plans=make_plans(REQUESTS, SEED),
        events=make_events(REQUESTS),
    )
    await run_load(topology, run)
    await settle(topology, run)
    dump(run, tmp_path / "soak.json")
    checks = run_checks(run)
    print(summary(run, checks), flush=True)
    failed = [check for check in checks if not check.ok]
    assert not failed, (
        f"{len(failed)} of {len(checks)} cluster soak checks failed (CLUSTER_CHAOS_SEED={SEED} "
        f"CLUSTER_CHAOS_REQUESTS={REQUESTS}; logs in {tmp_path}):\n"
        + "\n".join(check.report() for check in failed)
    )
