"""What the edge keeps: the usage ledger (:mod:`.ledger`) and the Responses API's stored
responses (:mod:`.responses`)."""
