"""Developer tasks. ``nox -s tests`` is the test command of the README and of CI.

Sessions run on the interpreter that runs nox (Python 3.11 or newer).
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

SOURCES = ["dispatcher", "nodes", "tests", "bench", "noxfile.py"]


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite against the installed package."""
    session.install(".[test]")
    session.run("pytest", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session
def fuzz(session: nox.Session) -> None:
    """Run the Hypothesis tests with many examples."""
    session.install(".[test]")
    # Thousands of examples per test: no per-test time limit, no faulthandler dumps.
    session.run(
        "pytest",
        "-m",
        "not slow",
        "-o",
        "timeout=0",
        "-o",
        "faulthandler_timeout=0",
        *session.posargs,
        env={"HYPOTHESIS_PROFILE": "fuzz"},
    )


@nox.session
def chaos(session: nox.Session) -> None:
    """The chaos soak at full length: CHAOS_REQUESTS (default 2,000) requests, its summary
    printed; CHAOS_SEED and CHAOS_CONCURRENCY pass through (see tests/chaos/test_chaos.py).
    The test command runs the 300-request version."""
    session.install(".[test]")
    requests = os.environ.get("CHAOS_REQUESTS", "2000")
    session.run(
        "pytest",
        "tests/chaos",
        "-m",
        "chaos",
        "-s",
        "-o",
        "faulthandler_timeout=0",
        *session.posargs,
        env={"CHAOS_REQUESTS": requests},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (with the ASYNC rules), flake8-async (ASYNC102 and friends) and the import
    contracts (import-linter)."""
    # import-linter: the import contracts in pyproject.toml ([tool.importlinter]).
    session.install("ruff>=0.8", "flake8-async>=24.9", "import-linter>=2.1")
    session.run("ruff", "check", *SOURCES)
    session.run("ruff", "format", "--check", *SOURCES)
    # flake8-async wants files, not directories; the startable list lets ASYNC113 check
    # that these are started with nursery.start, not start_soon.
    files = sorted(str(p) for d in ("dispatcher", "nodes") for p in Path(d).rglob("*.py"))
    startable = "run,serve,serve_edge,serve_http,serve_node,serve_node_session"
    session.run("flake8-async", f"--startable-in-context-manager={startable}", *files)
    session.run("lint-imports")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the code, the tests and the benchmarks."""
    session.install(".[test]", "mypy>=1.13", "nox")
    session.run("mypy", "--strict")


@nox.session
def bench(session: nox.Session) -> None:
    """Print the performance numbers (see bench/README.md). With BENCH_LITELLM=1 the LiteLLM
    proxy is installed too, for the peer section's LiteLLM column (a large install, so only
    when asked)."""
    session.install(".[test]", "psutil")
    if os.environ.get("BENCH_LITELLM") == "1":
        session.install("litellm[proxy]")
    session.run("python", "-m", "bench", *session.posargs)


@nox.session
def mutate(session: nox.Session) -> None:
    """Mutation testing of the admission core (mutmut); prints the score."""
    session.install(".[test]", "mutmut>=3.3")
    session.run("mutmut", "run", "--max-children", "2", env={"HYPOTHESIS_PROFILE": "ci"})
    session.run("mutmut", "results", success_codes=[0, 1])
