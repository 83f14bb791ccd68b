"""The two paths to a node, on the one ownership primitive: :mod:`.lease` (a slot and a route,
released however the block is left), :mod:`.runs` (a normalized run's events),
:mod:`.tunnel` (raw provider HTTP under a credit window) and :mod:`.tunnel_http` (a tunnel
attempt's header rules, SSE sniffing and its phase before the commit point)."""
