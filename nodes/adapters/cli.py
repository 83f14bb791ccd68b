"""The ``cli`` adapter: runs the provider's ``command`` once per run and streams its stdout.

The prompt is the text of the **last message whose role is ``user``** (its string ``content``,
or the ``text`` parts of a list ``content`` joined with newlines); system prompts, earlier
turns, images and sampling parameters are not passed. A request without a user message fails
with ``invalid_request``. Options:

* ``prompt = "stdin"`` (default): the prompt is written to the child's stdin, followed by a
  newline unless it already ends with one, and stdin is closed; ``"argument"``: the prompt is
  appended to the command as its last argument (stdin is ``/dev/null``);
* ``chunk = "line"`` (default): each stdout line (with its newline) is one delta;
  ``"raw"``: whatever each read of stdout returns is one delta. Output is decoded as UTF-8
  (invalid bytes become U+FFFD);
* ``terminate_grace`` (seconds, default 2): on cancellation the child's process group gets
  SIGTERM, and SIGKILL after this long; the run ends only once the child has been waited for.

The child runs in its own session (process group), in the node's working directory and
environment. Exit status 0 -> finish reason ``stop``; any other -> ``run.failed`` code
``cli_exit`` (not retryable) with the status and the last ~2 KB of stderr. A command that
cannot be started -> code ``cli_start_failed`` (not retryable). Usage is estimated
(:func:`~nodes.adapters.base.estimate_tokens`): the prompt sent, and the output so far,
reported after every delta.
"""

from __future__ import annotations

import codecs
import math
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Final, Literal

import attrs
import trio

from dispatcher import wire
from nodes.adapters.base import (
    AdapterError,
    RunOutput,
    TokenEstimator,
    estimate_tokens,
    message_text,
)
from nodes.config import NodeConfigError, OptionsError, ProviderConfig

STDERR_TAIL: Final = 2048
"""Bytes of the end of stderr kept for a ``cli_exit`` message."""
MAX_LINE: Final = 64 * 1024
"""A stdout line longer than this (in bytes) is emitted in pieces."""
STDERR_AFTER_EXIT: Final = 1.0
"""How long to keep reading stderr after the child exited (a grandchild may hold it)."""
_READ_SIZE: Final = 64 * 1024


@attrs.frozen(kw_only=True)
class CLIOptions:
    """The ``options`` table of a ``cli`` provider."""

    prompt: Literal["stdin", "argument"] = "stdin"
    chunk: Literal["line", "raw"] = "line"
    terminate_grace: float = 2.0

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> CLIOptions:
        fields: dict[str, Any] = {}
        for key, value in raw.items():
            if key == "prompt":
                if value not in ("stdin", "argument"):
                    raise OptionsError(key, f"expected 'stdin' or 'argument', got {value!r}")
                fields[key] = value
            elif key == "chunk":
                if value not in ("line", "raw"):
                    raise OptionsError(key, f"expected 'line' or 'raw', got {value!r}")
                fields[key] = value
            elif key == "terminate_grace":
                if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                    raise OptionsError(key, f"expected a number >= 0, got {value!r}")
                fields[key] = float(value)
            else:
                raise OptionsError(key, "unknown cli option")
        return cls(**fields)


def prompt_of(body: wire.JSONObject) -> str:
    """The text of the last user message; raises ``invalid_request`` when there is none."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise AdapterError("invalid_request", "messages: expected an array")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise AdapterError("invalid_request", "a cli provider needs a user message")
    return message_text(users[-1])


@attrs.frozen(kw_only=True)
class CLIAdapter:
    command: tuple[str, ...]
    options: CLIOptions = CLIOptions()

    @classmethod
    def from_provider(cls, provider: ProviderConfig) -> CLIAdapter:
        if not provider.command:
            raise NodeConfigError(
                f"provider {provider.id!r}", "command", "a cli provider needs a command"
            )
        return cls(command=provider.command, options=CLIOptions.from_mapping(provider.options))

    async def run(self, request: wire.RunRequest, out: RunOutput) -> None:
        prompt = prompt_of(request.body)
        options = self.options
        argv = [*self.command, prompt] if options.prompt == "argument" else list(self.command)
        prompt_tokens = estimate_tokens(prompt)
        generated = TokenEstimator()
        out.usage(prompt_tokens, 0, estimated=True)

        async def emit(text: str) -> None:
            if text:
                generated.add(text)
                await out.delta(text)
                out.usage(prompt_tokens, generated.tokens, estimated=True)

        # AdapterErrors are raised outside the nursery: Trio would wrap them in a group.
        returncode: int | None = None
        start_error: OSError | None = None
        stderr_tail = bytearray()
        async with trio.open_nursery() as nursery:
            try:
                # run_process under nursery.start: the child belongs to this nursery. When
                # the run is cancelled, run_process calls _deliver_cancel and then waits for
                # the child (shielded), so no zombie is left behind.
                process: trio.Process = await nursery.start(
                    partial(
                        trio.run_process,
                        argv,
                        stdin=subprocess.PIPE if options.prompt == "stdin" else subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        check=False,
                        start_new_session=True,
                        deliver_cancel=partial(_deliver_cancel, grace=options.terminate_grace),
                    )
                )
            except OSError as exc:
                start_error = exc
            else:
                returncode = await _converse(
                    process,
                    prompt,
                    emit,
                    line_mode=options.chunk == "line",
                    stderr_tail=stderr_tail,
                )
        if start_error is not None:
            raise AdapterError(
                "cli_start_failed",
                f"cannot start {self.command[0]!r}: {start_error.strerror or start_error}",
                retryable=False,
            )
        assert returncode is not None
        if returncode != 0:
            tail = bytes(stderr_tail).decode("utf-8", errors="replace").strip()
            status = (
                f"was killed by signal {-returncode}"
                if returncode < 0
                else f"exited with status {returncode}"
            )
            raise AdapterError(
                "cli_exit",
                f"{self.command[0]} {status}; stderr: {tail or '(empty)'}",
                retryable=False,
            )
        out.finish("stop")


async def _converse(
    process: trio.Process,
    prompt: str,
    emit: Callable[[str], Awaitable[None]],
    *,
    line_mode: bool,
    stderr_tail: bytearray,
) -> int:
    """Feed stdin, keep stderr's tail, stream stdout to ``emit``; the exit status."""
    assert process.stdout is not None
    assert process.stderr is not None
    with trio.CancelScope() as helpers:
        async with trio.open_nursery() as io:
            io.start_soon(_collect_tail, process.stderr, stderr_tail)
            if process.stdin is not None:
                text = prompt if prompt.endswith("\n") else prompt + "\n"
                io.start_soon(_feed, process.stdin, text.encode())
            await _pump(process.stdout, emit, line_mode=line_mode)
            returncode = await process.wait()
            # stdout is done and the child is gone: give stderr a moment to drain (a
            # grandchild may still hold it open), then stop the helpers.
            helpers.deadline = trio.current_time() + STDERR_AFTER_EXIT
    return returncode


async def _pump(
    stream: trio.abc.ReceiveStream, emit: Callable[[str], Awaitable[None]], *, line_mode: bool
) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = b""
    async with stream:
        while True:
            data = await stream.receive_some(_READ_SIZE)
            if not data:
                break
            if not line_mode:
                await emit(decoder.decode(data))
                continue
            pending += data
            while True:
                end = pending.find(b"\n")
                if end < 0:
                    break
                line, pending = pending[: end + 1], pending[end + 1 :]
                await emit(decoder.decode(line))
            if len(pending) > MAX_LINE:
                await emit(decoder.decode(pending))
                pending = b""
    await emit(decoder.decode(pending, final=True))


async def _collect_tail(stream: trio.abc.ReceiveStream, tail: bytearray) -> None:
    async with stream:
        while data := await stream.receive_some(_READ_SIZE):
            tail += data
            del tail[:-STDERR_TAIL]


async def _feed(stream: trio.abc.SendStream, data: bytes) -> None:
    async with stream:
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the child exited or closed its stdin without reading everything


async def _deliver_cancel(process: trio.Process, *, grace: float) -> None:
    """SIGTERM to the child's process group; SIGKILL after ``grace`` seconds."""
    _signal_group(process, signal.SIGTERM)
    await trio.sleep(grace)
    _signal_group(process, signal.SIGKILL)


def _signal_group(process: trio.Process, signum: signal.Signals) -> None:
    # The group outlives its leader while any member is alive, and its id cannot be reused
    # until then: signalling it after the leader was reaped still reaches the stragglers.
    if sys.platform == "win32":
        if signum == signal.SIGTERM:
            process.terminate()
        else:
            process.kill()
        return
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:
        process.send_signal(signum)
