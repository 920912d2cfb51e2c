"""What a P engine's history holds, told as KV events in vLLM's shape, for the router's index.

The sidecar feeds `ResidencyLog.update(key, state)` the history blocks each ledger event touched;
the log keeps, per key, the tier it last announced ("GPU", "CPU", or none) and turns each change
into a `BlockStored` / `BlockRemoved` event (`medium` = the tier, `ownership` = "kvbaton.history"),
numbered. Only restorable states count: a block being staged or demoted is not announced until
its copy lands (a restore could not use it before).

The router pulls them with the authenticated `Residency` peer call (`since` = the last number it
applied): a router that is new, behind the bounded log, or talking to a new sidecar instance gets
a snapshot of everything resident instead (`reset`), so the index never drifts for long.
"""

from __future__ import annotations

import collections
import time

import msgspec

HISTORY_OWNER = "kvbaton.history"
# Events kept for routers that are behind; older ones are answered with a snapshot.
MAX_LOG_EVENTS = 1 << 16
# Block hashes per answer (about 10 bytes each in msgpack); a router that is further behind asks again.
MAX_ANSWER_HASHES = 1 << 16
_TIERS = {"GPU": "GPU", "CPU": "CPU", "PROMOTING": "CPU"}  # promoting: read from its CPU slot
_MASK64 = (1 << 64) - 1
_ENCODER = msgspec.msgpack.Encoder()


def key_hash(key: str) -> int | None:
    """vLLM's int form of the block hash a history key names (`<layout>:<hash hex>`)."""

    _, _, digest = key.rpartition(":")
    try:
        return int.from_bytes(bytes.fromhex(digest), "big") & _MASK64
    except ValueError:
        return None


class ResidencyLog:
    def __init__(self, block_size: int, max_events: int = MAX_LOG_EVENTS) -> None:
        self.block_size = block_size
        self.tiers: dict[str, str] = {}  # key -> tier announced
        self.events: collections.deque[tuple[int, bool, str, int]] = collections.deque(maxlen=max_events)
        self.seq = 0  # number of the last event
        self.staging: dict[str, tuple[str, ...]] = {}  # ticket -> keys its stage copies

    def update(self, key: str, state: str | None) -> None:
        tier = _TIERS.get(state or "")
        old = self.tiers.get(key)
        if tier == old:
            return
        value = key_hash(key)
        if value is None:
            return
        if old is not None:
            self.seq += 1
            self.events.append((self.seq, False, old, value))
            del self.tiers[key]
        if tier is not None:
            self.seq += 1
            self.events.append((self.seq, True, tier, value))
            self.tiers[key] = tier

    def answer(self, since: int) -> tuple[bool, int, bytes]:
        """(reset, last number included, the batch) for a router that applied up to `since`."""

        oldest = self.events[0][0] if self.events else self.seq + 1
        if since < 0 or since > self.seq or since + 1 < oldest:
            return True, self.seq, self._snapshot()
        batch, last, count = [], since, 0
        for seq, stored, tier, value in self.events:
            if seq <= since:
                continue
            if count >= MAX_ANSWER_HASHES:
                break
            self._add(batch, stored, tier, value)
            last, count = seq, count + 1
        return False, last, _ENCODER.encode([time.time(), batch, None])

    def _snapshot(self) -> bytes:
        batch: list[dict] = []
        for key, tier in list(self.tiers.items())[-MAX_ANSWER_HASHES:]:
            value = key_hash(key)
            if value is not None:
                self._add(batch, True, tier, value)
        return _ENCODER.encode([time.time(), batch, None])

    def _add(self, batch: list[dict], stored: bool, tier: str, value: int) -> None:
        kind = "BlockStored" if stored else "BlockRemoved"
        last = batch[-1] if batch else None
        if last is not None and last["type"] == kind and last["medium"] == tier:
            last["block_hashes"].append(value)
            return
        event = {"type": kind, "block_hashes": [value], "medium": tier, "ownership": HISTORY_OWNER}
        if stored:
            event["block_size"] = self.block_size
        batch.append(event)
