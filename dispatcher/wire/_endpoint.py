"""Where the protocol runs: the edge's websocket endpoint a node connects to, and the close
codes a session ends with (``docs/wire-protocol.md``, "Close codes"). Both sides name them
from here: the edge closes with them, the node reads them."""

from __future__ import annotations

import re
from typing import Final

ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
"""A node id or a provider id, as the edge accepts it in a ``hello`` (and a node's config
checks it before dialling)."""
MAX_ID_LENGTH: Final = 128
"""The longest node id, provider id or model name a ``hello`` may carry."""

NODE_CONNECT_PATH: Final = "/v1/nodes/connect"
"""The edge's websocket endpoint for nodes; an edge URL's path ends with it (a reverse proxy
may put a prefix before it)."""

CLOSE_GOING_AWAY: Final = 1001
"""The edge is shutting down, or the session ended (the node sends it when it shuts down)."""
CLOSE_PROTOCOL_ERROR: Final = 1002
"""A protocol error; the reason says which (a bad hello, an unsupported version ...)."""
CLOSE_POLICY: Final = 1008
"""No ``hello`` in time, or the node stopped reading (its outbox overflowed)."""
CLOSE_AUTH_FAILED: Final = 4001
"""A missing or invalid node token, or a token not allowed this node id."""
CLOSE_SUPERSEDED: Final = 4002
"""Superseded by a newer connection of the same node id (and credential)."""
CLOSE_HEARTBEAT: Final = 4003
"""No pong within the heartbeat timeout."""
CLOSE_NODE_ID_IN_USE: Final = 4004
"""The node id is held by a live session that authenticated with another credential (the
node retries with backoff)."""
