"""Just enough of ``multipart/form-data`` (RFC 7578 over RFC 2046's multipart syntax) for the
uploads the edge relays through a tunnel (``/v1/audio/transcriptions``, ``/v1/images/edits``
...): check a body's structure, find a text field (``model``, ``stream``), and replace one
field's value in place -- every other byte as the client sent it. Sans-IO, pure functions
over the bytes the edge already holds (the request-body limit bounds them).

Not a general form parser: part bodies are never decoded (``Content-Transfer-Encoding`` is
not used by HTTP clients, RFC 7578 section 4.7), file contents are never copied, and the one
thing read from a part's headers is its ``Content-Disposition`` (``form-data``, ``name``,
``filename``). What is malformed is refused with a 400 naming the fault
(``invalid_multipart``): a missing or bad boundary, a part without ``form-data`` disposition
or name, an unterminated body, too many parts or too large a part head.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

import attrs

from ...errors import BadRequest

MAX_PARTS: Final = 256
"""The most parts a form may have (OpenAI's forms have a dozen fields at most)."""
MAX_PART_HEAD: Final = 8 * 1024
"""The longest a part's header block may be."""
_CODE: Final = "invalid_multipart"
_BOUNDARY: Final = re.compile(rb"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]\Z")
"""RFC 2046 section 5.1.1: 1 to 70 of these, not ending in a space."""
_PARAM: Final = re.compile(
    rb'\s*;\s*([!#$%&\'*+\-.^_`|~0-9A-Za-z]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))\s*'
)
_CRLF: Final = b"\r\n"


def _bad(message: str) -> BadRequest:
    return BadRequest(f"multipart/form-data body: {message}", code=_CODE)


def _params(rest: bytes) -> dict[bytes, bytes]:
    """``; key=value`` parameters (values quoted or not; names lower-cased)."""
    out: dict[bytes, bytes] = {}
    at = 0
    while at < len(rest):
        match = _PARAM.match(rest, at)
        if match is None or match.end() == at:
            raise _bad(f"cannot read the parameters {rest[at : at + 40]!r}")
        key, quoted, plain = match.groups()
        value = re.sub(rb"\\(.)", rb"\1", quoted) if quoted is not None else plain
        out[key.lower()] = value
        at = match.end()
    return out


def is_multipart(content_type: bytes | None) -> bool:
    """Whether a ``Content-Type`` header says ``multipart/form-data``."""
    if content_type is None:
        return False
    return content_type.split(b";", 1)[0].strip().lower() == b"multipart/form-data"


def boundary_of(content_type: bytes) -> bytes:
    """The boundary of a ``multipart/form-data`` ``Content-Type``; 400 when it has none or a
    malformed one."""
    _, _, rest = content_type.partition(b";")
    boundary = _params(b";" + rest if rest else b"").get(b"boundary")
    if boundary is None:
        raise _bad("the Content-Type has no boundary parameter")
    if not _BOUNDARY.match(boundary):
        raise _bad("the Content-Type's boundary is not 1 to 70 allowed characters")
    return boundary


@attrs.frozen
class Part:
    """One part of a form: its field ``name``, its ``filename`` (None for a text field), and
    where its content is in the body (``body[start:end]``)."""

    name: str
    filename: str | None
    start: int
    end: int


def parse_form(body: bytes, boundary: bytes) -> list[Part]:
    """The parts of a ``multipart/form-data`` ``body``, in order; 400 when it is malformed.
    A preamble before the first delimiter and an epilogue after the last are allowed (and
    ignored), as RFC 2046 says."""
    delimiter = b"--" + boundary
    if body.startswith(delimiter):
        at = len(delimiter)
    else:
        first = body.find(_CRLF + delimiter)
        if first < 0:
            raise _bad("no part starts with the boundary the Content-Type names")
        at = first + 2 + len(delimiter)
    next_delimiter = _CRLF + delimiter
    parts: list[Part] = []
    while True:
        if body.startswith(b"--", at):
            return parts  # the close delimiter
        at = _line_end(body, at)
        if len(parts) >= MAX_PARTS:
            raise _bad(f"more than {MAX_PARTS} parts")
        head_end = body.find(_CRLF + _CRLF, at - 2, at + MAX_PART_HEAD)
        if head_end < 0:
            if body.find(_CRLF + _CRLF, at - 2) < 0:
                raise _bad("a part's headers never end")
            raise _bad(f"a part's headers are over {MAX_PART_HEAD} bytes")
        name, filename = _disposition(body[at:head_end])
        start = head_end + 4
        # From the header block's last line break: a part without content is its headers,
        # then the delimiter's own CRLF.
        end = body.find(next_delimiter, start - 2)
        if end < 0:
            raise _bad(f"the part {name!r} is not closed by the boundary (truncated body?)")
        parts.append(Part(name, filename, min(start, end), end))
        at = end + len(next_delimiter)


def _line_end(body: bytes, at: int) -> int:
    """After a delimiter: optional whitespace (RFC 2046's transport padding), then CRLF;
    where the next line starts."""
    end = body.find(_CRLF, at)
    if end < 0 or body[at:end].strip(b" \t"):
        raise _bad("a boundary delimiter is not followed by a line break")
    return end + 2


def _disposition(head: bytes) -> tuple[str, str | None]:
    """The field name and file name of a part's header block."""
    for line in head.split(_CRLF):
        key, colon, value = line.partition(b":")
        if not colon or key.strip().lower() != b"content-disposition":
            continue
        kind, _, rest = value.strip().partition(b";")
        if kind.strip().lower() != b"form-data":
            raise _bad(f"a part's Content-Disposition is {kind.strip()!r}, not form-data")
        params = _params(b";" + rest if rest else b"")
        name = params.get(b"name")
        if name is None:
            raise _bad("a part's Content-Disposition has no name")
        filename = params.get(b"filename")
        return _text(name), None if filename is None else _text(filename)
    raise _bad("a part has no Content-Disposition header")


def _text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("a part's name is not UTF-8") from None


def fields(parts: Sequence[Part], name: str) -> list[Part]:
    """The parts named ``name``."""
    return [part for part in parts if part.name == name]


def text_field(body: bytes, parts: Sequence[Part], name: str) -> str | None:
    """The value of the text field ``name`` (None when the form has none); 400 when it is
    a file, given twice, or not UTF-8."""
    found = fields(parts, name)
    if not found:
        return None
    if len(found) > 1:
        raise BadRequest(f"'{name}' is given {len(found)} times", param=name, code=_CODE)
    (part,) = found
    if part.filename is not None:
        raise BadRequest(f"'{name}' must be a text field, not a file", param=name, code=_CODE)
    try:
        return body[part.start : part.end].decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(f"'{name}' is not UTF-8 text", param=name, code=_CODE) from None


def replace_field(body: bytes, boundary: bytes, part: Part, value: str) -> bytes:
    """``body`` with ``part``'s content replaced by ``value`` (UTF-8), every other byte as it
    was. A value that would contain the boundary's delimiter is refused (ValueError): it
    would end the part."""
    raw = value.encode("utf-8")
    if b"--" + boundary in raw or b"\r" in raw or b"\n" in raw:
        raise ValueError(f"{value!r} cannot be a field's value in this form")
    return b"".join((body[: part.start], raw, body[part.end :]))


__all__ = [
    "MAX_PARTS",
    "MAX_PART_HEAD",
    "Part",
    "boundary_of",
    "fields",
    "is_multipart",
    "parse_form",
    "replace_field",
    "text_field",
]
