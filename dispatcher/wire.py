"""The wire protocol: now :mod:`dispatcher.protocol` (messages, codec and the session state
machine). This module re-exports its public names -- exactly ``dispatcher.protocol.__all__``,
so the list lives in one place -- under the name the edge's code imports::

    from dispatcher import wire
    wire.decode(frame)          # a message, or wire.ProtocolError
"""

from __future__ import annotations

from .protocol import *  # noqa: F403  (a re-export shim: the names are the protocol's __all__)
from .protocol import __all__ as __all__
