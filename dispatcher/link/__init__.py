"""The edge's side of a node connection: :mod:`.session` serves one node's websocket (hello,
welcome, the receive loop, the parting), :mod:`.registry` holds the sessions, their
generations and the routes their messages are delivered to, with one writer per session."""
