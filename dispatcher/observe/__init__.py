"""Watching the edge: :mod:`.traffic` (one record per request: the access log, the request
metrics, what is in flight, recent failures), :mod:`.metrics` and :mod:`.series` (the
Prometheus series and their exposition), :mod:`.status` (``GET /admin/status``'s document)
and :mod:`.logs` (the two log formats)."""
