"""Rendezvous (highest-random-weight) hashing for cache-aware routing (issue #26).

Sans-IO and pure. A request's affinity key ranks the candidates of its model group: each
candidate identity ``(node_id, provider_id, model)`` (no generation: a reconnect keeps
its keys) gets the weight ``mix(hash(key) ^ seed(identity))`` and the heaviest is the key's
*home*. The hashes are BLAKE2b (8 bytes), never Python's ``hash()`` (salted per process), so
every edge, in any process, ranks a key's candidates the same way without talking to the
others; and removing a candidate only moves the keys it ranked first (each key's ranking of
the others is unchanged), adding one only takes keys to itself.

The core (:mod:`._core`) caches a candidate's seed and a waiter's key hash, so a weight is
a few integer operations. It also remembers where it last placed each key (its *placement*)
and puts that candidate before the ranking (:func:`preference`): a turn that once spilled
stays where its prefix now is instead of going back home to evaluate it again. What the
core does with the ranking (the bounded load, the bounded wait) is described in "Affinity"
in ``docs/admission.md``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final, Literal, TypeAlias

from ._candidates import CandidateIdentity

AffinityResult: TypeAlias = Literal["hit", "over_load", "busy", "ineligible", "ejected", "unkeyed"]
"""How an admission of a group with affinity on went: ``hit`` (onto the key's preferred
candidate among the group's: where this core last placed it, else its home, the candidate
it ranks first), a spill to another candidate because that one was ``over_load`` (above
``affinity_load_factor`` x the group's average), ``busy`` (no free slot within
``affinity_wait_s``), ``ineligible`` (cannot serve this request: capability,
context window, exclusion, predicate, or no slot of its class) or ``ejected``; ``unkeyed``:
the request had no affinity key (selection as without affinity)."""
AFFINITY_RESULTS: Final[tuple[AffinityResult, ...]] = (
    "hit",
    "over_load",
    "busy",
    "ineligible",
    "ejected",
    "unkeyed",
)

_MASK: Final = (1 << 64) - 1


def key_hash(key: str) -> int:
    """A 64-bit hash of an affinity key, the same in every process."""
    data = key.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"affinity-key").digest())


def identity_seed(identity: CandidateIdentity) -> int:
    """A 64-bit seed of a candidate identity, the same in every process."""
    data = "\0".join((identity.node_id, identity.provider_id, identity.model))
    digest = hashlib.blake2b(
        data.encode("utf-8", "surrogatepass"), digest_size=8, person=b"affinity-node"
    ).digest()
    return int.from_bytes(digest)


def weight(key: int, seed: int) -> tuple[int, int]:
    """The rendezvous weight of a candidate (``seed``) for a key (``key``: its
    :func:`key_hash`): the heaviest is the key's home. MurmurHash3's 64-bit finalizer of
    ``key ^ seed`` (a bijection with full avalanche), then the seed itself to break the
    (astronomically rare) ties the same way everywhere."""
    x = key ^ seed
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK
    x ^= x >> 33
    return (x, seed)


_PLACED: Final = 1 << 64
"""Above every :func:`weight`: the rank of the candidate that last served a key."""


def preference(key: int, seed: int, placed: int | None) -> tuple[int, int]:
    """A candidate's (``seed``) place in ``key``'s order: the candidate that last served the
    key (its seed ``placed``, None when this core has not placed the key) before all, then
    the others by :func:`weight`. The engine behind the last one holds the key's prefix."""
    return (_PLACED, seed) if seed == placed else weight(key, seed)


def rendezvous_rank(key: str, identities: Iterable[CandidateIdentity]) -> list[CandidateIdentity]:
    """``identities`` in the order ``key`` ranks them, its home first (what the core uses,
    before load and health: for tests, tools and other edges to reproduce)."""
    hashed = key_hash(key)
    return sorted(identities, key=lambda i: weight(hashed, identity_seed(i)), reverse=True)
