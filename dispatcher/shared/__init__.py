"""What the edge shares with its nodes beyond the wire protocol: the token estimator
(:mod:`.tokens`), exception-group walkers (:mod:`.excgroups`), a configuration error's TOML key
path (:mod:`.config_errors`), the message connection both sides speak over
(:mod:`.transport`) and the :class:`~.forwarding.Forwarded` descriptor.

Leaves: nothing here imports anything else of ours, and ``nodes/`` may import all of it.
"""
