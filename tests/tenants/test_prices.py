"""The tenants' prices: exact model names first, then patterns in their order."""

from __future__ import annotations

import pytest

from dispatcher.tenants import Price, PriceTable


def test_prices_exact_names_first_then_patterns_in_order() -> None:
    table = PriceTable(
        {"llama-70b": Price(1.0, 1.0)},
        (("llama-*", Price(2.0, 2.0)), ("*", Price(3.0, 3.0))),
    )
    assert table.price("llama-70b") == Price(1.0, 1.0)
    assert table.price("llama-8b") == Price(2.0, 2.0)
    assert table.price("qwen") == Price(3.0, 3.0)
    assert table.price("llama-8b", "llama-70b") == Price(1.0, 1.0)  # exact before pattern
    assert PriceTable().cost(("m",), 10, 10) == 0.0
    assert Price(2.0, 4.0).cost(500_000, 250_000) == pytest.approx(2.0)
