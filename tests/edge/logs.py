"""The edge's log records in a test: :class:`Captured` holds every record of the
``dispatcher`` loggers (DEBUG and up, the access log included); the ``logs`` fixture
(``tests/edge/conftest.py``) attaches one for a test."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from dispatcher.observe.logs import FIELDS


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, logger: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.name == logger]

    def access(self) -> list[dict[str, Any]]:
        """Every access line's fields, in order."""
        return [dict(getattr(r, FIELDS)) for r in self.records if r.name == "dispatcher.access"]

    def line_of(self, request_id: str) -> dict[str, Any]:
        """The one access line of the request ``request_id``."""
        lines = [fields for fields in self.access() if fields["request_id"] == request_id]
        assert len(lines) == 1, lines
        return lines[0]

    def line_for(self, path: str) -> dict[str, Any]:
        """The one access line of a request to ``path``."""
        [line] = [fields for fields in self.access() if fields["path"] == path]
        return line


def captured() -> Iterator[Captured]:
    """Attach a :class:`Captured` to the ``dispatcher`` loggers at DEBUG, for the block."""
    logger = logging.getLogger("dispatcher")
    handler = Captured()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
