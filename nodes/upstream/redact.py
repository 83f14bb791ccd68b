"""What is removed from a message about a request to a provider: its address and the node's
credentials (:class:`Redactor`); and a URL as the node's own log shows it (:func:`display_url`:
without credentials or query).

Messages about a provider's failures go to the edge and may reach the client, so they never
name the provider: the adapters and the tunnels compose them without its URL and pass every
one, the upstream's own text included (which may quote any of it), through the
:class:`Redactor` for the request. The node's own log keeps the URL.
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from collections.abc import Mapping
from typing import Final

import attrs
import httpx  # noqa: ASYNC127  (the project depends on httpx; see pyproject.toml)

_REDACTED_PLACE: Final = "<provider>"
_REDACTED_SECRET: Final = "<redacted>"
_SECRET_HEADERS: Final = frozenset({"authorization", "proxy-authorization", "api-key", "x-api-key"})
_STANDARD_SEGMENTS: Final = frozenset(
    {
        "", "v1", "api", "chat", "completions", "embeddings", "embed", "messages", "responses",
        "images", "generations", "edits", "variations", "audio", "transcriptions",
        "translations", "speech", "moderations", "rerank",
    }
)  # fmt: skip
"""Path segments every provider of a kind shares: a path made of these alone is no secret."""


@attrs.frozen
class Redactor:
    """Removes from text what locates the provider -- its URL (with and without credentials
    or query), origin, ``host:port``, host, and every leading part of its path that is more
    than the standard ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/messages``, the
    other OpenAI routes, ``/api/chat`` or ``/api/embed`` -- and the node's
    credentials (``Authorization`` and API-key header values, the URL's user info). A bare
    port number is left alone: it cannot be told apart from any other number."""

    _secrets: re.Pattern[str] | None
    _places: re.Pattern[str] | None

    @classmethod
    def for_request(cls, url: str, headers: Mapping[str, str]) -> Redactor:
        """The redactor for a request to ``url`` with ``headers``: built once per URL and
        secret header values, then shared (a tunnel's URL and key are the same on every
        request to a provider; building one parses the URL and compiles two patterns)."""
        secrets = tuple(
            sorted(
                value.strip()
                for name, value in headers.items()
                if name.lower() in _SECRET_HEADERS and value.strip()
            )
        )
        return _redactor(url, secrets)

    @classmethod
    def _build(cls, url: str, header_secrets: tuple[str, ...]) -> Redactor:
        secrets: set[str] = set()
        for value in header_secrets:
            secrets.add(value)
            token = value.partition(" ")[2].strip()
            if token:
                secrets.add(token)
        places = {url.rstrip("/")}
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            parsed = None
        if parsed is not None:
            userinfo = parsed.userinfo.decode("ascii", errors="replace")
            for secret in (userinfo, urllib.parse.unquote(userinfo), parsed.password):
                if secret:
                    secrets.add(secret)
            host = parsed.host
            port = parsed.port or {"http": 80, "https": 443}.get(parsed.scheme)
            netloc = parsed.netloc.decode("ascii", errors="replace")
            bracketed = f"[{host}]" if ":" in host else host
            origin = f"{parsed.scheme}://{netloc}"
            places |= {
                display_url(url).rstrip("/"),
                str(parsed).rstrip("/"),
                origin,
                netloc,
                host,
                f"{bracketed}:{port}",
            }
            for path in {parsed.path, parsed.raw_path.decode("ascii", errors="replace")}:
                segments = path.split("?", 1)[0].split("/")[1:]
                for end in range(1, len(segments) + 1):
                    prefix = "/" + "/".join(segments[:end])
                    places.add(origin + prefix)  # the base URL, whatever its suffix
                    if not set(segments[:end]) <= _STANDARD_SEGMENTS:
                        places.add(prefix)
        return cls(_alternation(secrets, names=False), _alternation(places, names=True))

    def __call__(self, text: str) -> str:
        if self._secrets is not None:
            text = self._secrets.sub(_REDACTED_SECRET, text)
        if self._places is not None:
            text = self._places.sub(_REDACTED_PLACE, text)
        return text


@functools.lru_cache(maxsize=256)
def _redactor(url: str, header_secrets: tuple[str, ...]) -> Redactor:
    return Redactor._build(url, header_secrets)


def _alternation(literals: set[str], *, names: bool) -> re.Pattern[str] | None:
    """One pattern matching any of ``literals``, longest first. ``names``: case-insensitive,
    and a literal must not be followed by a character that would make it part of a longer
    name (``10.0.0.5`` in ``10.0.0.55``, ``/team`` in ``/teams``) nor, when it starts with one,
    be preceded by one. Secrets are matched anywhere, exactly."""
    alternatives = []
    for literal in sorted((x for x in literals if x), key=len, reverse=True):
        if names:
            before = r"(?<![\w.-])" if literal[0].isalnum() else ""
            alternatives.append(rf"{before}{re.escape(literal)}(?![\w-])")
        else:
            alternatives.append(re.escape(literal))
    if not alternatives:
        return None
    return re.compile("|".join(alternatives), re.IGNORECASE if names else 0)


def display_url(url: str) -> str:
    """``url`` without credentials, for messages."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return "<invalid URL>"
    return str(parsed.copy_with(username=None, password=None, query=None))


@functools.lru_cache(maxsize=256)
def shown_url(url: str) -> str:
    """:func:`display_url`, worked out once per URL (it parses the URL: a tenth of a
    tunnel's CPU when its log line computed it at every request)."""
    return display_url(url)
