"""What the limit store's failure mode decides without a server
(:mod:`dispatcher.store.limits_guard`): this edge's share of a key's limits, and how the
logs name a store (never with its password)."""

from __future__ import annotations

from dispatcher.config import Limits
from dispatcher.store.limits_guard import edge_share, store_place
from dispatcher.store.seam import Spent

NOTHING = Spent(0, 0.0, 0, 0.0)


def test_each_limit_is_divided_by_the_edge_count_rounded_up_and_at_least_one() -> None:
    limits = Limits(
        rpm=5,
        tpm=1001,
        max_concurrent=1,
        budget_tokens_day=10,
        budget_tokens_month=3,
        budget_usd_day=1.0,
    )
    share, spent = edge_share(limits, 2, NOTHING)
    assert share == Limits(
        rpm=3,
        tpm=501,
        max_concurrent=1,
        budget_tokens_day=5,
        budget_tokens_month=2,
        budget_usd_day=0.5,
    )
    assert spent == NOTHING


def test_a_budgets_share_starts_from_this_edges_share_of_what_was_spent() -> None:
    share, spent = edge_share(Limits(budget_tokens_day=1000), 4, Spent(400, 2.0, 801, 4.0))
    assert share.budget_tokens_day == 250
    assert spent == Spent(100, 0.5, 200, 1.0)  # 250 - 100: a quarter of the 600 left


def test_one_edge_keeps_the_limits() -> None:
    limits = Limits(rpm=7)
    assert edge_share(limits, 1, Spent(5, 1.0, 5, 1.0)) == (limits, Spent(5, 1.0, 5, 1.0))


def test_a_store_is_named_without_its_password() -> None:
    assert store_place("redis://:s3cret@cache.internal:6380/2") == "redis://cache.internal:6380/2"
    assert store_place("rediss://user:pw@[::1]:6379/0") == "rediss://[::1]:6379/0"
    assert store_place("redis://localhost") == "redis://localhost"
