"""The ``cli`` adapter with small Python scripts as the command, driven by the real runner."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from dispatcher import wire
from nodes.adapters import build_adapters, estimate_tokens, validate_options
from nodes.adapters.cli import CLIAdapter, CLIOptions
from nodes.config import ModelConfig, NodeConfigError, OptionsError, ProviderConfig
from nodes.runner import open_runner
from tests.nodes._helpers import Recorder, assert_well_formed, request

TICKER = """
import os, sys, time
print(os.getpid(), flush=True)
while True:
    print("tick", flush=True)
    time.sleep(0.05)
"""

STUBBORN_TICKER = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), flush=True)
while True:
    try:
        print("tick", flush=True)
    except OSError:  # our end of stdout is closed once the run is cancelled: carry on
        pass
    time.sleep(0.05)
"""


def script(source: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-c", textwrap.dedent(source), *args)


def adapter(source: str, **options: Any) -> CLIAdapter:
    return CLIAdapter(command=script(source), options=CLIOptions.from_mapping(options))


async def run(cli: CLIAdapter, req: wire.RunRequest | None = None) -> Recorder:
    req = req or request(provider_id="cli", text="say hello")
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"cli": cli}) as runner:
            runner.start(req)
            await rec.wait_terminal(req.run_id)
    assert_well_formed(rec.events(req.run_id))
    return rec


def usage_of(rec: Recorder, run_id: str = "r1") -> wire.Usage:
    usages = [e.usage for e in rec.events(run_id) if isinstance(e, wire.RunUsage)]
    assert len(usages) == 1
    usage: wire.Usage = usages[0]
    return usage


def assert_gone(pid: int) -> None:
    """No such process: it exited *and* was waited for (a zombie still answers kill 0)."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def wait_gone_or_zombie(pid: int) -> None:
    """For a grandchild, reaped by whoever adopted it: gone, or a zombie (dead)."""
    with trio.fail_after(5):
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            except FileNotFoundError:
                return
            if state in ("Z", "X"):
                return
            await trio.sleep(0.01)


def pid_of(rec: Recorder) -> int:
    return int(rec.text("r1").split("\n", 1)[0])


async def test_stdin_prompt_line_chunks_and_usage() -> None:
    rec = await run(adapter("import sys; sys.stdout.write(sys.stdin.read())"))
    # the prompt is the last user message, then a newline, then end of input
    assert rec.text("r1") == "say hello\n"
    assert usage_of(rec) == wire.Usage(
        prompt_tokens=estimate_tokens("say hello"),
        completion_tokens=estimate_tokens("say hello\n"),
        estimated=True,
    )
    terminal = rec.terminal("r1")
    assert isinstance(terminal, wire.RunCompleted)
    assert terminal.finish_reason == "stop"


async def test_prompt_is_the_last_user_message() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "two\n"}],
        },
    ]
    req = request(provider_id="cli", messages=messages)
    rec = await run(adapter("import sys; print(repr(sys.stdin.read()))"), req)
    assert rec.text("r1") == repr("line one\ntwo\n") + "\n"


async def test_argument_prompt() -> None:
    rec = await run(
        adapter("import sys; print(sys.argv[1:]); print(sys.stdin.read() == '')", prompt="argument")
    )
    assert rec.text("r1") == "['say hello']\nTrue\n"


async def test_each_line_streams_before_the_child_exits() -> None:
    source = """
    import sys, time
    for word in sys.stdin.read().split():
        print(word.upper(), flush=True)
        time.sleep(0.02)
    sys.stdin.close()
    time.sleep(60)
    """
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"cli": adapter(source)}) as runner:
            runner.start(request(provider_id="cli", text="one two three"))
            await rec.wait_text("r1", "ONE\nTWO\nTHREE\n")
            runner.cancel("r1")
            assert isinstance(await rec.wait_terminal("r1"), wire.RunCancelled)


async def test_raw_chunks_decode_utf8_split_across_reads() -> None:
    source = """
    import sys, time
    data = "héllo wörld ✓".encode()
    for i in range(len(data)):
        sys.stdout.buffer.write(data[i:i + 1]); sys.stdout.flush(); time.sleep(0.002)
    """
    rec = await run(adapter(source, chunk="raw"))
    assert rec.text("r1") == "héllo wörld ✓"


async def test_big_prompt_and_output_do_not_deadlock() -> None:
    source = """
    import sys
    sys.stdout.write("x" * 300_000 + "\\n"); sys.stdout.flush()
    print(len(sys.stdin.read()))
    """
    prompt = "y" * 300_000
    rec = await run(adapter(source), request(provider_id="cli", text=prompt))
    assert rec.text("r1") == "x" * 300_000 + "\n" + f"{len(prompt) + 1}\n"


async def test_nonzero_exit_reports_status_and_stderr_tail() -> None:
    source = """
    import sys
    print("partial output", flush=True)
    sys.stderr.write("A" * 3000 + "B" * 1000 + " THE END\\n")
    sys.exit(3)
    """
    rec = await run(adapter(source))
    failed = rec.terminal("r1")
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.retryable) == ("cli_exit", False)
    assert "exited with status 3" in failed.message
    assert "B" * 1000 + " THE END" in failed.message
    assert "A" * 1100 not in failed.message  # only the last ~2 KB of stderr
    assert rec.text("r1") == "partial output\n"
    assert rec.types("r1")[-2:] == ["run.usage", "run.failed"]


async def test_killed_by_a_signal() -> None:
    rec = await run(adapter("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    failed = rec.terminal("r1")
    assert failed.code == "cli_exit"
    assert "killed by signal 9" in failed.message
    assert "stderr: (empty)" in failed.message


async def test_cancel_terminates_and_reaps_the_child() -> None:
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"cli": adapter(TICKER)}) as runner:
            runner.start(request(provider_id="cli"))
            await rec.wait_for(lambda: "tick" in rec.text("r1"))
            pid = pid_of(rec)
            os.kill(pid, 0)  # alive
            runner.cancel("r1", "client gone")
            terminal = await rec.wait_terminal("r1")
            assert_gone(pid)  # the run ended only after the child was waited for
    assert isinstance(terminal, wire.RunCancelled)
    assert_well_formed(rec.events("r1"))
    assert terminal.usage is not None
    assert terminal.usage.completion_tokens > 0


async def test_cancel_kills_a_child_that_ignores_sigterm_after_the_grace() -> None:
    rec = Recorder()
    cli = adapter(STUBBORN_TICKER, terminate_grace=0.2)
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"cli": cli}) as runner:
            runner.start(request(provider_id="cli"))
            await rec.wait_for(lambda: "tick" in rec.text("r1"))
            pid = pid_of(rec)
            cancelled_at = trio.current_time()
            runner.cancel("r1")
            terminal = await rec.wait_terminal("r1")
            waited = trio.current_time() - cancelled_at
            assert_gone(pid)
    assert isinstance(terminal, wire.RunCancelled)
    assert waited >= 0.2  # SIGTERM was ignored; SIGKILL came after the grace


async def test_cancel_reaches_grandchildren_through_the_process_group() -> None:
    source = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    while True:
        print("tick", flush=True)
        time.sleep(0.05)
    """
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"cli": adapter(source)}) as runner:
            runner.start(request(provider_id="cli"))
            await rec.wait_for(lambda: "tick" in rec.text("r1"))
            grandchild = pid_of(rec)
            runner.cancel("r1")
            await rec.wait_terminal("r1")
        await wait_gone_or_zombie(grandchild)


async def test_leaving_the_runner_kills_the_child() -> None:
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"cli": adapter(TICKER)}) as runner:
            runner.start(request(provider_id="cli"))
            await rec.wait_for(lambda: "tick" in rec.text("r1"))
            pid = pid_of(rec)
    assert_gone(pid)
    assert rec.terminal("r1") is None  # the connection is gone: nothing more was sent


async def test_command_that_cannot_start(tmp_path: Path) -> None:
    cli = CLIAdapter(command=(str(tmp_path / "no-such-program"),))
    rec = await run(cli)
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("cli_start_failed", False)
    assert "no-such-program" in failed.message


async def test_no_user_message() -> None:
    req = request(provider_id="cli", messages=[{"role": "system", "content": "hi"}])
    rec = await run(adapter("print('never')"), req)
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("invalid_request", False)


def test_from_provider_and_options() -> None:
    provider = ProviderConfig(
        id="c",
        type="cli",
        command=("llamafile", "--cli"),
        options={"prompt": "argument", "chunk": "raw", "terminate_grace": 0},
        models=(ModelConfig(name="m"),),
    )
    built = build_adapters([provider])["c"]
    assert built == CLIAdapter(
        command=("llamafile", "--cli"),
        options=CLIOptions(prompt="argument", chunk="raw", terminate_grace=0.0),
    )
    with pytest.raises(NodeConfigError, match="needs a command"):
        CLIAdapter.from_provider(
            ProviderConfig(id="c", type="cli", models=(ModelConfig(name="m"),))
        )
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "file"}, "prompt"),
        ({"chunk": "word"}, "chunk"),
        ({"terminate_grace": -1}, "terminate_grace"),
        ({"terminate_grace": True}, "terminate_grace"),
        ({"shell": True}, "shell"),
    ]
    for bad, key in cases:
        with pytest.raises(OptionsError) as info:
            validate_options("cli", bad)
        assert info.value.key == key
