"""One request's attempts: :mod:`.attempts` (the gate: attempts, the commit point, recovery
before it, an explicit error after it), :mod:`.rules` (its decisions as pure functions),
:mod:`.accounting` (one usage row per dispatched attempt), :mod:`.pool` (one admission over a
model's provider pool, then the candidate's path) and :mod:`.catalog` (node sessions as
candidates, the configuration as a policy snapshot)."""
