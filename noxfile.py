"""Developer tasks. ``nox -s tests`` is the test command of the README and of CI.

Sessions run on the interpreter that runs nox (Python 3.11 or newer).
"""

from __future__ import annotations

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
    session.run(
        "pytest", "-m", "not slow", *session.posargs, env={"HYPOTHESIS_PROFILE": "fuzz"}
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (with the ASYNC rules) and flake8-async, which adds ASYNC102 and friends."""
    session.install("ruff>=0.8", "flake8-async>=24.9")
    session.run("ruff", "check", *SOURCES)
    session.run("ruff", "format", "--check", *SOURCES)
    session.run("flake8-async", "dispatcher", "nodes")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the code, the tests and the benchmarks."""
    session.install(".[test]", "mypy>=1.13", "nox")
    session.run("mypy", "--strict")


@nox.session
def bench(session: nox.Session) -> None:
    """Print the performance numbers (see bench/README.md)."""
    session.install(".[test]", "psutil")
    session.run("python", "-m", "bench", *session.posargs)
