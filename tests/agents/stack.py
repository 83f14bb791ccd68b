"""An edge and a node (``python -m dispatcher serve`` / ``node``, this tree's code) as real
processes, the node serving ``node.toml``'s echo models, and the two agent clients run
against them as a user runs them: their own config in a scratch ``HOME``, non-interactive,
their default settings, every run bounded in time.

Codex CLI: a custom model provider (``wire_api = "responses"``) whose ``base_url`` is the
edge, ``codex exec``. Claude Code: ``ANTHROPIC_BASE_URL`` the edge, ``claude -p``. Both are
told not to phone home (they would fail here without ending the run, and slowly).
"""

from __future__ import annotations

import os
import string
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx

from tests.real.stack import Stack, start_edge, start_node

HERE = Path(__file__).resolve().parent
MARKER_TEXT = "hi-from-marker-file-7731"
"""The line of the file the agents' tool reads (what the replay fixtures were captured with)."""
RUN_TIMEOUT = 120.0
"""The longest one client run may take."""

EDGE_TOML = """\
host = "127.0.0.1"
port = 0
local_node = false
data_dir = "{data}"
"""

CODEX_TOML = """\
model_provider = "dispatcher"

[model_providers.dispatcher]
name = "trio-dispatcher"
base_url = "{edge}/v1"
wire_api = "responses"
env_key = "DISPATCHER_API_KEY"
"""

QUIET: dict[str, str] = {
    # Claude Code: no calls to other hosts (they fail here, slowly, without ending the run)
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "NO_COLOR": "1",
}


@attrs.frozen
class Run:
    """One client run: its exit status and what it printed (stdout and stderr together)."""

    status: int
    output: str


@attrs.define(eq=False)
class AgentStack:
    stack: Stack
    clients: Path
    """The folder with the ``codex`` and ``claude`` executables."""
    work: Path
    """The clients' working directory, with the marker file."""
    home: Path

    @property
    def edge_url(self) -> str:
        return self.stack.edge_url

    @property
    def marker(self) -> Path:
        return self.work / "marker.txt"

    def _run(self, argv: list[str], env: dict[str, str]) -> Run:
        child_env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            **QUIET,
            **env,
        }
        try:
            done = subprocess.run(
                argv,
                cwd=self.work,
                env=child_env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=RUN_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            printed = (exc.output or b"").decode(errors="replace")[-3000:]
            raise AssertionError(
                f"{argv[0]} did not end within {RUN_TIMEOUT:g} s\n{printed}\n"
                + self.stack.diagnostics()
            ) from None
        output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        return Run(done.returncode, output)

    def codex(self, model: str, prompt: str, **env: str) -> Run:
        """``codex exec`` with ``model`` on the edge (its default sandbox and approvals)."""
        argv = [str(self.clients / "codex"), "exec", "--skip-git-repo-check", "-m", model, prompt]
        return self._run(argv, {"DISPATCHER_API_KEY": "unused", **env})

    def claude(self, model: str, prompt: str, **env: str) -> Run:
        """``claude -p`` with ``model`` on the edge (its default permissions)."""
        argv = [str(self.clients / "claude"), "-p", prompt, "--model", model]
        environment = {
            "ANTHROPIC_BASE_URL": self.edge_url,
            "ANTHROPIC_API_KEY": "unused",
            **env,
        }
        return self._run(argv, environment)

    def usage_rows(self, model: str, route: str) -> list[dict[str, Any]]:
        """The usage ledger's rows of ``model`` on ``route``, newest first."""
        answer = httpx.get(f"{self.edge_url}/v1/usage", params={"model": model}, timeout=10)
        answer.raise_for_status()
        return [row for row in answer.json()["rows"] if row["route"] == route]


@contextmanager
def open_stack(workdir: Path, clients: Path) -> Iterator[AgentStack]:
    """Start the edge and the node in ``workdir``; stop and reap them on the way out."""
    for name in ("codex", "claude"):
        assert (clients / name).exists(), f"no {name} in {clients}"
    stack = Stack(workdir)
    try:
        data = workdir / "edge-data"
        data.mkdir()
        start_edge(stack, EDGE_TOML.format(data=data))
        work = workdir / "work"
        work.mkdir()
        marker = work / "marker.txt"
        marker.write_text(MARKER_TEXT + "\n")
        node_toml = string.Template((HERE / "node.toml").read_text()).substitute(
            edge_url=stack.edge_url.replace("http://", "ws://") + "/v1/nodes/connect",
            marker=str(marker),
        )
        start_node(stack, node_toml, ("echo", "echo-codex-tool", "echo-claude-tool", "echo-fail"))

        home = workdir / "home"
        (home / ".codex").mkdir(parents=True)
        (home / ".codex" / "config.toml").write_text(CODEX_TOML.format(edge=stack.edge_url))
        yield AgentStack(stack, clients, work, home)
    finally:
        stack.close()
