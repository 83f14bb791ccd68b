"""When a node dials the edge again, when it warns, when it gives up: sans-IO.

:func:`nodes.agent.serve_node` tells a :class:`Reconnect` what happened to each attempt and
carries out the :class:`Retry` or :class:`GiveUp` it gets back; nothing here sleeps, logs or
reads a clock (``now`` comes in with each call), so the whole policy is tested without an
event loop.

The policy, for attempts that did not get in (no ``welcome``):

* the delay before the next attempt is a :class:`Backoff` (exponential, full jitter, a floor);
* the first :data:`WARN_AFTER_FAILURES` - 1 failures in a row are reported at INFO; the
  :data:`WARN_AFTER_FAILURES`-th at WARNING, naming the cause in words a person can act on
  (:func:`advice`); after that one WARNING per :data:`WARN_INTERVAL` seconds, the attempts
  in between at DEBUG: a node that cannot reach its edge for a
  day writes a line a minute, not one per attempt;
* a node that was **never welcomed** gives up ``give_up_after`` seconds after its first
  attempt (and after at least :data:`GIVE_UP_MIN_ATTEMPTS` attempts): the delay before the
  last attempt is cut to end at that bound, and the failure after it is :class:`GiveUp`.
  With ``give_up_after=None`` (``keep_trying``) it never does;
* a node that was welcomed once and lost the edge reconnects forever: the edge restarting or
  a network outage is not a misconfiguration. It warns as above.

Why an attempt failed is a :class:`DialCause`: what :mod:`nodes.dial` found (a refused
connection, a name that does not resolve, a TLS handshake that failed, an HTTP status for the
upgrade ...), typed, never read back from an error's text.
"""

from __future__ import annotations

import logging
import random
import urllib.parse
from typing import Final, Literal

import attrs

from dispatcher.wire import NODE_CONNECT_PATH
from nodes.config import suggest_edge_url

WARN_AFTER_FAILURES: Final = 3
"""Failed attempts in a row after which the node warns (at WARNING, naming the cause)."""
WARN_INTERVAL: Final = 60.0
"""Seconds between two warnings while the attempts keep failing."""
GIVE_UP_MIN_ATTEMPTS: Final = 3
"""A node that never got in gives up only after at least this many attempts, however small
its ``give_up_after``."""

CauseKind = Literal[
    "refused", "dns", "unreachable", "timeout", "tls", "certificate", "closed", "http", "other"
]


@attrs.frozen(kw_only=True)
class DialCause:
    """Why one attempt to reach the edge failed.

    ``kind``: ``refused`` (nothing listens at host:port), ``dns`` (the host name does not
    resolve), ``unreachable`` (no route to the host), ``timeout`` (no answer in time;
    ``stage`` says to what), ``tls`` (the TLS handshake failed), ``certificate`` (the edge's
    certificate did not verify), ``closed`` (the connection was closed during the websocket
    upgrade), ``http`` (the upgrade was answered with HTTP ``status``), ``other`` (anything
    else: ``detail`` says what). ``detail`` is the underlying error's text."""

    kind: CauseKind
    host: str = ""
    port: int = 0
    detail: str = ""
    status: int | None = None
    stage: str = ""

    @classmethod
    def other(cls, detail: str) -> DialCause:
        return cls(kind="other", detail=detail)


def advice(cause: DialCause, url: str) -> str:
    """``cause`` in words a person can act on, for the node dialling ``url``."""
    where = f"{cause.host}:{cause.port}"
    parts = urllib.parse.urlsplit(url)
    if cause.kind == "refused":
        return f"connection refused at {where}: is the edge running, and is the port right?"
    if cause.kind == "dns":
        return (
            f"the host name {cause.host!r} does not resolve ({cause.detail}): "
            "check the host in the edge URL"
        )
    if cause.kind == "unreachable":
        return f"no route to {where} ({cause.detail}): check the address and the network"
    if cause.kind == "timeout":
        return _timeout_advice(cause, parts)
    if cause.kind == "tls":
        plain = urllib.parse.urlunsplit(parts._replace(scheme="ws"))
        return (
            f"the TLS handshake with {where} failed ({cause.detail}): is the edge serving "
            f"TLS? If not, use ws:// ({plain})"
        )
    if cause.kind == "certificate":
        return (
            f"the edge's TLS certificate did not verify ({cause.detail}): give the node its "
            "CA (edge_ca_file), or the name it carries (edge_tls_server_name)"
        )
    if cause.kind == "closed":
        text = f"{where} closed the connection during the websocket upgrade ({cause.detail})"
        return _upgrade_advice(text, parts)
    if cause.kind == "http":
        return _http_advice(cause, url)
    return cause.detail


def _upgrade_advice(text: str, parts: urllib.parse.SplitResult) -> str:
    """``text`` (what went wrong with the websocket upgrade) with what to try: over ``ws://``,
    the edge may serve TLS (its ``wss://`` URL); over ``wss://``, it may not be the edge."""
    if parts.scheme.lower() == "ws":
        tls = urllib.parse.urlunsplit(parts._replace(scheme="wss"))
        return f"{text}: if the edge serves TLS, use wss:// ({tls})"
    return f"{text}: is it the edge?"


def _timeout_advice(cause: DialCause, parts: urllib.parse.SplitResult) -> str:
    where = f"{cause.host}:{cause.port}"
    if cause.stage == "websocket upgrade":
        # What an edge serving TLS does with a plain request: waits for a TLS hello.
        text = f"{where} took the connection but did not answer the websocket upgrade in time"
        return _upgrade_advice(text, parts)
    if cause.stage == "TLS handshake":
        return f"{where} did not answer the TLS handshake in time: is the edge serving TLS?"
    return (
        f"{where} did not answer (connect timed out): is the address right, or does a "
        "firewall drop the connection?"
    )


def _http_advice(cause: DialCause, url: str) -> str:
    status = cause.status
    if status in (401, 403):
        return (
            f"the edge refused the node (HTTP {status} to the websocket upgrade): check the "
            "node's token (--token, token_env) against the edge's nodes.tokens, or what a "
            "proxy in front of it asks for"
        )
    if status == 404:
        parts = urllib.parse.urlsplit(url)
        root = urllib.parse.urlunsplit(parts._replace(path=NODE_CONNECT_PATH, query=""))
        text = f"{parts.path} is not a node endpoint at {cause.host}:{cause.port} (HTTP 404)"
        if parts.path != NODE_CONNECT_PATH:
            return f"{text}: is the path right? The edge itself serves nodes at {root}"
        suggestion = suggest_edge_url(url) or url
        return f"{text}: is it the edge? The edge serves nodes at {suggestion}"
    if status == 503:
        return "the edge answered the websocket upgrade with HTTP 503 (draining, or not ready)"
    return f"the edge answered the websocket upgrade with HTTP {status}"


class Backoff:
    """Exponential backoff with full jitter above a floor: after the n-th consecutive failure
    (n = 1, 2, ...) the delay is uniform in ``[minimum, min(maximum, minimum * 2**n)]``.
    The floor keeps a failing dial from ever busy-looping."""

    def __init__(self, minimum: float, maximum: float, *, rng: random.Random | None = None) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.failures = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        self.failures += 1
        ceiling = min(self.maximum, self.minimum * 2.0 ** min(self.failures, 60))
        return self._rng.uniform(self.minimum, max(self.minimum, ceiling))

    def reset(self) -> None:
        self.failures = 0


@attrs.frozen
class Retry:
    """Dial again after ``delay`` seconds; report this end at ``level`` (a ``logging``
    level). ``failures`` is how many attempts in a row did not get in (0 after a welcomed
    session ended); ``failing_for`` how long since the first of them."""

    delay: float
    level: int
    failures: int
    failing_for: float
    gives_up_in: float | None
    """Seconds until the node gives up, None when it never will."""


@attrs.frozen
class GiveUp:
    """Stop: the node never got in, for ``failing_for`` seconds and ``failures`` attempts."""

    failures: int
    failing_for: float


@attrs.define
class Reconnect:
    """The reconnect policy of one node (see the module docstring). ``give_up_after`` None:
    never give up (``keep_trying``). ``reset_after``: a welcomed session longer than this
    resets the backoff."""

    backoff: Backoff
    give_up_after: float | None
    reset_after: float
    welcomed_once: bool = False
    failures: int = 0
    """Attempts in a row that did not get in."""
    _failing_since: float | None = None
    _first_attempt: float | None = None
    _warned_at: float | None = None

    def dialling(self, now: float) -> None:
        """An attempt starts."""
        if self._first_attempt is None:
            self._first_attempt = now

    def welcomed(self) -> None:
        """The edge welcomed the node: it got in."""
        self.welcomed_once = True
        self.failures = 0
        self._failing_since = None
        self._warned_at = None

    def session_ended(self, now: float, *, connected_at: float) -> Retry:
        """A welcomed session (connected at ``connected_at``) ended: reconnect, at INFO."""
        if now - connected_at > self.reset_after:
            self.backoff.reset()
        return Retry(self.backoff.next_delay(), logging.INFO, 0, 0.0, None)

    def failed(self, now: float) -> Retry | GiveUp:
        """An attempt did not get in (the caller knows why: :func:`advice`)."""
        self.failures += 1
        if self._failing_since is None:
            self._failing_since = now
        failing_for = now - self._failing_since
        deadline = self._deadline()
        if deadline is not None and now >= deadline and self.failures >= GIVE_UP_MIN_ATTEMPTS:
            first = now if self._first_attempt is None else self._first_attempt
            return GiveUp(self.failures, now - first)
        delay = self.backoff.next_delay()
        if deadline is not None:
            # The last attempt comes at the bound, not a whole backoff after it; never
            # sooner than the floor.
            delay = min(delay, max(deadline - now, self.backoff.minimum))
        gives_up_in = None if deadline is None else max(deadline - now, delay)
        return Retry(delay, self._level(now), self.failures, failing_for, gives_up_in)

    def _deadline(self) -> float | None:
        if self.welcomed_once or self.give_up_after is None or self._first_attempt is None:
            return None
        return self._first_attempt + self.give_up_after

    def _level(self, now: float) -> int:
        if self.failures < WARN_AFTER_FAILURES:
            return logging.INFO
        if self._warned_at is not None and now - self._warned_at < WARN_INTERVAL:
            return logging.DEBUG
        self._warned_at = now
        return logging.WARNING
