"""The protocol's errors: the peer broke it, or we did."""

from __future__ import annotations


class ProtocolError(Exception):
    """A frame that is not a valid message of this protocol, or a message the peer may not
    send now. ``str()`` says why (the reason a session is closed with)."""


class UnsupportedVersion(ProtocolError):
    """The peer's ``hello`` or ``welcome`` names a protocol version this side does not speak:
    unlike other violations, reconnecting cannot help."""


class LocalProtocolError(Exception):
    """*This* side tried to send what the protocol forbids in its state: a bug here, not the
    peer's fault (``h11.LocalProtocolError``). Never a :class:`ProtocolError`, so code that
    handles a hostile peer cannot swallow our own bug."""
