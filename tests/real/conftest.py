"""``tests/real``: the edge and a node in front of a real ``llama-server`` (``nox -s real``,
docs/real-engine.md). Everything here is skipped unless ``DISPATCHER_REAL_ENGINE`` names a
``llama-server`` binary and ``DISPATCHER_REAL_MODEL`` a GGUF file, which the nox session sets
(the test command, ``nox -s tests``, does not).

The stack is started once per session (:func:`stack`); each test compares an answer through
the edge with the engine answered directly. The numbers the measuring tests record
(:data:`NUMBERS`) are printed as a table at the end of the run.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.optional import deselect_unless

from .answers import CANCELS, GAVE_UP, NUMBERS, REPORT, client
from .stack import Stack, busy_slots, start_edge_and_node, start_engine

ENGINE_ENV = "DISPATCHER_REAL_ENGINE"
MODEL_ENV = "DISPATCHER_REAL_MODEL"
TEMPLATE_ENV = "DISPATCHER_REAL_TEMPLATE"


HERE = Path(__file__).resolve().parent
REASON = f"the real engine: run `nox -s real` (or set {ENGINE_ENV} and {MODEL_ENV})"


def _configured() -> bool:
    return bool(os.environ.get(ENGINE_ENV) and os.environ.get(MODEL_ENV))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without the engine, these tests are deselected from a wider run, and skipped with the
    reason when they are all that was asked for (``pytest tests/real``)."""
    deselect_unless(_configured(), HERE, REASON, config, items)


@pytest.fixture(scope="session")
def real_engine() -> tuple[str, str]:
    """The engine binary and the model file."""
    if not _configured():
        pytest.skip(REASON)
    engine, model = os.environ[ENGINE_ENV], os.environ[MODEL_ENV]
    for what, path in ((ENGINE_ENV, engine), (MODEL_ENV, model)):
        if not Path(path).is_file():
            pytest.fail(f"{what}={path}: no such file")
    return engine, model


@pytest.fixture(scope="session")
def stack(
    real_engine: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    engine, model = real_engine
    running = Stack(tmp_path_factory.mktemp("real"))
    try:
        start_engine(running, engine, model, os.environ.get(TEMPLATE_ENV) or None)
        start_edge_and_node(running)
        yield running
    finally:
        running.close()


@pytest.fixture(scope="session")
def direct(stack: Stack) -> Iterator[openai.OpenAI]:
    """The ``openai`` SDK on the engine itself."""
    with client(stack.engine_url) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def edge(stack: Stack) -> Iterator[openai.OpenAI]:
    """The ``openai`` SDK on the edge."""
    with client(stack.edge_url) as sdk:
        yield sdk


@pytest.fixture
def idle_engine(stack: Stack) -> Stack:
    """The stack, once the engine has no slot busy (a previous test's cancelled generation
    may still be winding down)."""
    for _ in range(300):
        if not busy_slots(stack):
            return stack
        time.sleep(0.1)
    raise AssertionError(f"the engine's slots stayed busy: {busy_slots(stack)}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORT:
        terminalreporter.section("real engines: cache-aware routing (test_affinity)")
        for line in REPORT:
            terminalreporter.write_line(line)
    if not NUMBERS and not CANCELS and not GAVE_UP:
        return
    terminalreporter.section("real engine: direct vs through the edge")
    if NUMBERS:
        _numbers(terminalreporter)
    for route, (seconds, decoded, asked) in CANCELS.items():
        terminalreporter.write_line(
            f"client left mid-stream ({route}): the engine's slot idle {seconds:.2f} s later, "
            f"{decoded} tokens decoded of {asked}"
        )
    for route, (seconds, after, before) in GAVE_UP.items():
        terminalreporter.write_line(
            f"client gave up ({route}): the engine's slot idle {seconds:.2f} s "
            f"later, {after} tokens decoded after it left ({before} before)"
        )


def _numbers(terminalreporter: pytest.TerminalReporter) -> None:
    measures = [
        ("ttft_ms", "TTFT p50 (ms)"),
        ("total_ms", "64 tokens p50 (ms)"),
        ("decode_tps", "decode tok/s p50"),
        ("e2e_tps", "end-to-end tok/s p50"),
    ]
    header = ["route", *(title for _, title in measures), "n"]
    rows = [header]
    for label, samples in NUMBERS.items():
        count = max((len(v) for v in samples.values()), default=0)
        cells = [label]
        for key, _ in measures:
            values = samples.get(key)
            cells.append(f"{statistics.median(values):.1f}" if values else "-")
        cells.append(str(count))
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        line = "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        terminalreporter.write_line(line)
        if index == 0:
            terminalreporter.write_line("-" * len(line))
