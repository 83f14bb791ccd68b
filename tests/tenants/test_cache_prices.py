"""Cached and cache-written input at their own prices (issue #25): ``cached_input_per_mtok``
and ``cache_write_per_mtok``, each the input price when left out; a row's cost is
``(prompt - cached - cache_write) * input + cached * cached_input + cache_write *
cache_write + completion * output`` per million tokens."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.config import parse_edge_config
from dispatcher.config.summary import describe_edge
from dispatcher.store.limits import MemoryLimits
from dispatcher.tenants import Price, PriceTable, TenantPolicy, Tenants, tenant_policy_from_config

from ..test_config_edge import error, load

# Prices and counts whose products and sums are exact in binary floating point: the
# expected costs below are exact, not approximations.
PRICE = Price(
    input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.25, cache_write_per_mtok=3.75
)


def test_each_part_at_its_price_exactly() -> None:
    cost = PRICE.cost(10_000, 2_000, cached_tokens=6_000, cache_write_tokens=1_000)
    # 3000 uncached * 3 + 6000 * 0.25 + 1000 * 3.75 + 2000 * 15
    assert cost == (9_000.0 + 1_500.0 + 3_750.0 + 30_000.0) / 1e6 == 0.04425
    assert PRICE.cost(10_000, 2_000) == (30_000.0 + 30_000.0) / 1e6  # nothing cached
    everything_cached = PRICE.cost(10_000, 0, cached_tokens=10_000)
    assert everything_cached == 2_500.0 / 1e6


def test_a_cache_price_left_out_is_the_input_price() -> None:
    """Exactly today's cost, ``prompt * input + completion * output``, whatever is cached,
    for prices that are not exact in binary too."""
    plain = Price(0.6, 0.8)
    for cached, written in ((0, 0), (700, 0), (0, 300), (700, 300)):
        assert (
            plain.cost(1_000, 50, cached_tokens=cached, cache_write_tokens=written)
            == (1_000 * 0.6 + 50 * 0.8) / 1e6
        )
    reads_only = Price(3.0, 15.0, cached_input_per_mtok=0.25)
    assert (
        reads_only.cost(10_000, 0, cached_tokens=6_000, cache_write_tokens=1_000)
        == (1_500.0 + 4_000 * 3.0) / 1e6
    )
    writes_only = Price(3.0, 15.0, cache_write_per_mtok=3.75)
    assert (
        writes_only.cost(10_000, 0, cached_tokens=6_000, cache_write_tokens=1_000)
        == (3_750.0 + 9_000 * 3.0) / 1e6
    )


@pytest.mark.parametrize(
    ("prompt", "completion", "cached", "written"),
    [(1, 1, 1, 0), (1_234_567, 89_012, 1_000_000, 34_567), (999, 1, 0, 999), (7, 0, 3, 4)],
)
def test_real_prices_within_a_rounding_of_the_exact_cost(
    prompt: int, completion: int, cached: int, written: int
) -> None:
    """Prices as written in a config (0.6 is not exact in binary): the float cost is within
    a few ulps of the cost computed exactly from the decimal prices."""
    price = Price(0.6, 2.4, cached_input_per_mtok=0.15, cache_write_per_mtok=0.75)
    exact = (
        (prompt - cached - written) * Fraction("0.6")
        + cached * Fraction("0.15")
        + written * Fraction("0.75")
        + completion * Fraction("2.4")
    ) / 1_000_000
    found = price.cost(prompt, completion, cached_tokens=cached, cache_write_tokens=written)
    assert found == pytest.approx(float(exact), rel=1e-14, abs=0)


def test_the_table_passes_the_parts_on() -> None:
    table = PriceTable({"claude": PRICE}, (("llama-*", Price(1.0, 1.0)),))
    assert table.cost(
        ("claude",), 10_000, 2_000, cached_tokens=6_000, cache_write_tokens=1_000
    ) == (0.04425)
    assert table.cost(("llama-8b",), 10, 10, cached_tokens=10) == 20.0 / 1e6
    assert table.cost(("none",), 10, 10, cached_tokens=10) == 0.0


async def test_the_tenants_price_a_row_with_its_parts() -> None:
    """The gate's pricing hook (``Tenants.price``) and a row priced after the fact
    (``Tenants.observe``) both price the cache's parts; a client's row spends that."""
    limits = MemoryLimits()
    tenants = Tenants(TenantPolicy(prices=PriceTable({"claude": PRICE})), limits)
    cost = tenants.price(
        "r1", 1, "claude", "t1", "client", 10_000, 2_000,
        cached_tokens=6_000, cache_write_tokens=1_000,
    )  # fmt: skip
    assert cost == 0.04425
    assert limits.spent("t1").usd_day == 0.04425
    operator = tenants.price("r2", 1, "claude", "t1", "operator", 10_000, 0, cached_tokens=10_000)
    assert operator == 2_500.0 / 1e6


def test_the_config_takes_cache_prices(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
[prices."claude-*"]
input_per_mtok = 3.0
output_per_mtok = 15.0
cached_input_per_mtok = 0.3
cache_write_per_mtok = 3.75

[prices."gpt-4o"]
input_per_mtok = 2.5
output_per_mtok = 10.0
cached_input_per_mtok = 1.25
""",
    )
    policy = tenant_policy_from_config(config)
    assert policy.prices.price("claude-sonnet") == Price(3.0, 15.0, 0.3, 3.75)
    assert policy.prices.price("gpt-4o") == Price(2.5, 10.0, 1.25, None)


@pytest.mark.parametrize("name", ["cached_input_per_mtok", "cache_write_per_mtok"])
def test_a_negative_cache_price_is_refused(tmp_path: Path, name: str) -> None:
    found = error(tmp_path, f"[prices.m]\ninput_per_mtok = 1\n{name} = -0.5\n")
    assert found.startswith(f"prices.m.{name}: must be >= 0"), found
    found = error(tmp_path, f"[prices.m]\n{name} = 'cheap'\n")
    assert found.startswith(f"prices.m.{name}: expected"), found


def test_check_config_shows_the_prices() -> None:
    config = parse_edge_config(
        {
            "prices": {
                "claude-*": {
                    "input_per_mtok": 3.0,
                    "output_per_mtok": 15.0,
                    "cached_input_per_mtok": 0.3,
                    "cache_write_per_mtok": 3.75,
                },
                "llama-70b": {"input_per_mtok": 0.6, "output_per_mtok": 0.8},
            }
        }
    )
    lines = describe_edge(config, auth=[], usage_db=":memory:")
    assert "price claude-*: input 3, cached input 0.3, cache write 3.75, output 15 USD/Mtok" in (
        lines
    )
    assert (
        "price llama-70b: input 0.6, cached input 0.6, cache write 0.6, output 0.8 USD/Mtok "
        "(cache prices: the input's)"
    ) in lines


_tokens = st.integers(min_value=0, max_value=10**9)
_price = st.floats(min_value=0, max_value=1000, allow_nan=False)


@given(_tokens, _tokens, _tokens, _tokens, _price, _price, _price, _price)
def test_the_cost_is_the_sum_of_its_parts(
    prompt: int,
    completion: int,
    cached: int,
    written: int,
    input_price: float,
    output_price: float,
    cached_price: float,
    write_price: float,
) -> None:
    """For any counts (the parts within the prompt) and prices: without cache prices the cost
    is exactly today's; with them, within rounding of the exact sum of the four terms; and
    a cache price at the input's costs what no cache price costs."""
    cached = min(cached, prompt)
    written = min(written, prompt - cached)
    parts = {"cached_tokens": cached, "cache_write_tokens": written}
    plain = Price(input_price, output_price)
    assert (
        plain.cost(prompt, completion, **parts)
        == plain.cost(prompt, completion)
        == (prompt * input_price + completion * output_price) / 1e6
    )
    priced = Price(input_price, output_price, cached_price, write_price)
    exact = (
        (prompt - cached - written) * Fraction(input_price)
        + cached * Fraction(cached_price)
        + written * Fraction(write_price)
        + completion * Fraction(output_price)
    ) / 1_000_000
    assert priced.cost(prompt, completion, **parts) == pytest.approx(float(exact), rel=1e-12)
    same = Price(input_price, output_price, input_price, input_price)
    assert same.cost(prompt, completion, **parts) == pytest.approx(
        plain.cost(prompt, completion), rel=1e-12, abs=1e-18
    )
