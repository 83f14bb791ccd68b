"""What the edge keeps, behind the storage seam.

* :mod:`.seam` -- the ``Protocol`` classes the gate, the API and the tenants see: the usage ledger,
  the response store, the limit store (and the ledger's database as its writer drives it);
* :mod:`.backends` -- :func:`~.backends.open_stores`, the one place the backends are chosen
  from the configuration;
* the embedded backends: :mod:`.ledger` (a batched writer) over :mod:`.usage_sqlite`,
  :mod:`.responses` (SQLite), :mod:`.limits` (memory, over a sans-IO core);
* :mod:`.usage` -- the ledger's rows and queries as plain data;
* :mod:`.redis_link` -- one pipelined Redis connection driven by Trio, over :mod:`.resp`
  (RESP2, sans-IO).

Every backend passes the contract suite in ``tests/store/``.
"""
