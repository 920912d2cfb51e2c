"""An engine's worker ranks, as its sidecar sees them (tensor parallelism).

Each rank holds its shard of every block (its KV heads) in its own memory, registers it with its
own transport and copies it into and out of its own history slots. A reader's rank reads the
heads it holds from whichever ranks of the source hold them (`read_plan`). The sidecar sends every
decision to every rank, and a read, a staging, a demotion or a restore is one fact for the core
once every rank has reported it: ok only when every rank's part was, so a request whose KV one
rank failed to move is recomputed whole, never run on part of its KV.
"""

from __future__ import annotations

import collections
from typing import Hashable

import msgspec

# Facts waiting for other ranks, at most: far more reads and copies than are ever in flight. A
# rank that stops answering kills its engine (vLLM ends an engine whose worker died), so entries
# are only ever dropped here when something else already went badly wrong.
MAX_PENDING = 1 << 16


class RankFanIn:
    """Combines the ranks' reports of one thing into one outcome."""

    def __init__(self, ranks: int, limit: int = MAX_PENDING) -> None:
        self.ranks = ranks
        self.limit = limit
        self.pending: collections.OrderedDict[Hashable, tuple[frozenset[int], bool]] = collections.OrderedDict()
        self.dropped = 0  # entries forgotten at the limit (their thing never completes here)

    def note(self, key: Hashable, rank: int, ok: bool) -> bool | None:
        """Rank `rank` reported `key` ended (`ok`): the combined outcome once every rank has
        reported, None before (and for a rank's second report of the same key)."""

        if self.ranks == 1:
            return ok
        if not 0 <= rank < self.ranks:
            return None
        reported, all_ok = self.pending.get(key, (frozenset(), True))
        if rank in reported:
            return None
        reported, all_ok = reported | {rank}, all_ok and ok
        if len(reported) == self.ranks:
            self.pending.pop(key, None)
            return all_ok
        self.pending[key] = (reported, all_ok)
        while len(self.pending) > self.limit:
            self.pending.popitem(last=False)
            self.dropped += 1
        return None


# What one rank of a reader reads: (the source engine's rank, the share of that rank's KV heads
# read, the share of this rank's heads written), each share as (part, parts).
Source = tuple[int, tuple[int, int], tuple[int, int]]


def read_plan(source_ranks: int, ranks: int) -> list[list[Source]] | None:
    """For each rank of a reader with `ranks` ranks, what it reads from a source engine with
    `source_ranks` ranks; None when one size does not divide the other. Equal sizes: rank r
    reads rank r's whole shard. A source with k times more ranks: rank r reads ranks rk ...
    rk+k-1, each into its share of r's heads. A source with k times fewer ranks: rank r reads
    its share of rank r // k's heads."""

    if source_ranks == ranks:
        return [[(rank, (0, 1), (0, 1))] for rank in range(ranks)]
    if source_ranks > ranks and source_ranks % ranks == 0:
        k = source_ranks // ranks
        return [[(rank * k + j, (0, 1), (j, k)) for j in range(k)] for rank in range(ranks)]
    if ranks > source_ranks and ranks % source_ranks == 0:
        k = ranks // source_ranks
        return [[(rank // k, (rank % k, k), (0, 1))] for rank in range(ranks)]
    return None


def pack_metadata(per_rank: list[bytes]) -> bytes:
    """An engine's transport metadata, one entry per rank, as peers receive it."""

    return msgspec.msgpack.encode(per_rank)


def unpack_metadata(metadata: bytes) -> list[bytes] | None:
    """The per-rank metadata a peer sent (None when it is not a list of byte strings)."""

    try:
        return msgspec.msgpack.decode(metadata, type=list[bytes])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
