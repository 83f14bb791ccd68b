"""Log formatting for the daemons: the readable default and ``--log-format json``.

Both are stdlib :class:`logging.Formatter` subclasses, so every logger in the process (ours,
Trio's, trio-websocket's) goes through them unchanged; a record may carry structured
fields under :data:`FIELDS` (``log.info(msg, extra={FIELDS: {...}})``), as the access log
(``dispatcher.access``, :mod:`dispatcher.observe.traffic`) does.

* ``text``: ``<time> <LEVEL> <logger>: <message> key=value ...``. A value is written bare when
  it is made only of :data:`_BARE` characters, else double-quoted with ``"``, ``\\`` and every
  unprintable character escaped (``\\r``, ``\\n``, ``\\u2028`` ...); the message itself has
  its unprintable characters escaped too. What a client or a node sent can therefore never
  end a line early or forge a second one. A traceback (``exc_info``) follows on its own lines,
  as usual.
* ``json``: one JSON object per line, ASCII only (every non-ASCII and control character
  ``\\u``-escaped), with the stable keys ``ts`` (UTC, ISO 8601 with milliseconds), ``level``
  (lower case), ``logger``, ``message``, then the record's fields, then ``exception`` (the
  traceback's text) when there is one. A field named like one of the fixed keys is written
  as ``field_<name>``.

No third-party logging library: the two formatters are short, they need nothing beyond
``logging`` and ``json``, and they format the records of every library as they are.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import Final, Literal, TextIO

__all__ = [
    "FIELDS",
    "LOG_FORMATS",
    "JsonFormatter",
    "LogFormat",
    "TextFormatter",
    "configure_logging",
    "escape_text",
    "format_value",
]

FIELDS: Final = "fields"
"""The ``extra`` key of a record's structured fields (a mapping of name to value)."""

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")

TEXT_FORMAT: Final = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

_BARE = re.compile(r"[A-Za-z0-9._:/@+~{}*-]+")
"""A ``key=value`` value written as it is; anything else is quoted."""

_UNPRINTABLE = re.compile(r"[^\x20-\x7e\u00a0-\u2027\u202a-\ufffd\U00010000-\U0010ffff]")
"""What :func:`escape_text` escapes: C0 and C1 controls, DEL, and the Unicode line and
paragraph separators (what some log viewers split lines on)."""

_JSON_KEYS: Final = frozenset({"ts", "level", "logger", "message", "exception"})


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    named = {"\r": "\\r", "\n": "\\n", "\t": "\\t"}.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_text(text: str) -> str:
    """``text`` with every unprintable character escaped (``\\r``, ``\\n``, ``\\x1b``,
    ``\\u2028`` ...): safe in one line. A backslash is left alone (it cannot end a line)."""
    return _UNPRINTABLE.sub(_escape_char, text)


def format_value(value: object) -> str:
    """One ``key=value`` value: ``-`` for None, numbers as they are, a string bare when it is
    made of safe characters, else quoted (``"``, ``\\`` and unprintables escaped)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if _BARE.fullmatch(text):
        return text
    return '"' + escape_text(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


def _fields(record: logging.LogRecord) -> Mapping[str, object]:
    fields = getattr(record, FIELDS, None)
    return fields if isinstance(fields, Mapping) else {}


class TextFormatter(logging.Formatter):
    """The readable default (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        # The time, level and logger name are printable: escaping the line escapes the message.
        line = escape_text(super().formatMessage(record))
        fields = _fields(record)
        if not fields:
            return line
        pairs = " ".join(f"{key}={format_value(value)}" for key, value in fields.items())
        return f"{line} {pairs}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        created = time.gmtime(record.created)
        millis = int(record.msecs)
        document: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", created) + f".{millis:03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            document[f"field_{key}" if key in _JSON_KEYS else key] = value
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            document["exception"] = record.exc_text
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return json.dumps(document, ensure_ascii=True, separators=(",", ":"), default=str)


QUIET_LIBRARIES: Final = {"coredis": logging.WARNING, "psycopg.pool": logging.ERROR}
"""Libraries' loggers and the level below which they are not shown: their lines say what our
own WARNINGs already say once (coredis logs every retry of a connection to a Redis that is
down at INFO, several a second; psycopg's pool every failed connection at WARNING)."""


def configure_logging(
    level: str | int = "INFO", log_format: LogFormat = "text", stream: TextIO | None = None
) -> logging.Handler:
    """Send every log record of the process to ``stream`` (stderr) in ``log_format``, at
    ``level`` and above (replacing the root logger's handlers); returns the handler."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for chatty, shown in QUIET_LIBRARIES.items():
        logging.getLogger(chatty).setLevel(max(shown, root.level))
    return handler
