"""The protocol's two errors: the peer broke it, or we did."""

from __future__ import annotations


class ProtocolError(Exception):
    """A frame that is not a valid message of this protocol, or a message the peer may not
    send now. ``str()`` says why (the reason a session is closed with)."""


class LocalProtocolError(Exception):
    """*This* side tried to send what the protocol forbids in its state: a bug here, not the
    peer's fault (``h11.LocalProtocolError``). Never a :class:`ProtocolError`, so code that
    handles a hostile peer cannot swallow our own bug."""
