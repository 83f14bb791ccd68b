"""A one-task wake-up primitive, cheaper than an Event per wait."""

from __future__ import annotations

import trio


class Waiter:
    """Lets one task sleep until another wakes it.

    A wake with nobody waiting does nothing: callers re-check their condition in a loop
    (``while not ready: await waiter.wait()``), and since Trio only switches tasks at
    checkpoints there is no window between the check and the wait.
    """

    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None

    async def wait(self) -> None:
        """Sleep until :meth:`wake` (a checkpoint; cancellable)."""
        if self._task is not None:
            await trio.lowlevel.checkpoint()
            raise trio.BusyResourceError("another task is already waiting here")
        self._task = trio.lowlevel.current_task()

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def wake(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)
