"""The soak's processes: each one a real child process (``python -m dispatcher serve``,
``python -m dispatcher node``, ``python -m tests.chaos.upstream``) run from the repository
root, so it runs this working tree's code, with its stdout and stderr in files.

:class:`Processes` owns every child it spawns: :meth:`Processes.close` (the fixture calls it
however the test ends) stops the ones still running -- SIGTERM, then SIGKILL after a bound --
and reaps them all. Nothing here waits without a bound.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import trio

REPO_ROOT = Path(__file__).resolve().parents[2]

TERM_GRACE = 5.0
"""Seconds a child gets after SIGTERM before SIGKILL at teardown."""


@attrs.define(eq=False)
class Proc:
    """One child process (one incarnation: a restarted node is a new ``Proc``)."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path
    started_at: float
    killed: bool = False
    """SIGKILLed by the soak (on purpose)."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def rss_kib(self) -> int | None:
        """``VmRSS`` from ``/proc/<pid>/status`` (KiB), None if it cannot be read."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        match = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.MULTILINE)
        return int(match.group(1)) if match else None

    def stdout(self) -> str:
        return _read(self.stdout_path)

    def stderr(self) -> str:
        return _read(self.stderr_path)

    async def wait_for_stdout(self, pattern: str, timeout: float) -> re.Match[str]:
        """Poll the stdout file until ``pattern`` matches; fail (with the stderr tail) if the
        process exits or ``timeout`` passes first."""
        regex = re.compile(pattern, re.MULTILINE)
        with trio.move_on_after(timeout):
            while True:
                match = regex.search(self.stdout())
                if match:
                    return match
                if not self.running:
                    break
                await trio.sleep(0.02)
        raise AssertionError(
            f"{self.name} (pid {self.pid}) did not print {pattern!r} within {timeout} s "
            f"(exit status {self.popen.poll()}); stderr tail:\n{self.stderr()[-3000:]}"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


@attrs.define(eq=False)
class Processes:
    """Spawns children into ``workdir`` (``<name>.out`` / ``<name>.err``) and owns them."""

    workdir: Path
    procs: list[Proc] = attrs.field(factory=list)

    def spawn(self, name: str, args: list[str], *, env: dict[str, str] | None = None) -> Proc:
        stdout_path = self.workdir / f"{name}.out"
        stderr_path = self.workdir / f"{name}.err"
        argv = [sys.executable, *args]
        child_env = {**os.environ, **(env or {})}
        child_env.pop("PYTHONWARNINGS", None)
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
            popen = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=child_env,
            )
        proc = Proc(name, argv, popen, stdout_path, stderr_path, time.monotonic())
        self.procs.append(proc)
        return proc

    def kill(self, proc: Proc) -> None:
        """SIGKILL ``proc`` (on purpose) and reap it."""
        proc.killed = True
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(timeout=10)

    def close(self) -> None:
        """Stop every child still running (SIGTERM, SIGKILL after :data:`TERM_GRACE`) and
        reap them all. Idempotent; never raises for a child that is already gone."""
        running = [p for p in self.procs if p.running]
        for proc in running:
            try:
                proc.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + TERM_GRACE
        for proc in running:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)


TRACEBACK = re.compile(r"^Traceback \(most recent call last\):$", re.MULTILINE)


def tracebacks(text: str, *, context: int = 25) -> list[str]:
    """Each traceback in ``text``: the log line before it and up to ``context`` lines."""
    found = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if TRACEBACK.match(line):
            start = max(0, index - 1)
            found.append("\n".join(lines[start : index + context]))
    return found
