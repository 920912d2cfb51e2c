"""Tiered history (P side): recently prefilled prefixes kept in a GPU budget, spilled to CPU.

Rule 1: everything that decides which keys history holds, in which tier, lives in this file: the
block machine, admission, demotion, eviction, pins and byte accounting. The shell copies bytes when
told (`StageHistory`, `DemoteHistory`, `DropHistory`) and reports how the copies ended; the slots it
keeps mirror these decisions and never make their own.

Theory of operation. Keys are vLLM's chained block hashes (namespaced by the shell with model,
dtype, block size and KV layout), so a key names a whole prefix and `parent` is the key before it.
One record per resident key:

    (seen) PROBATION ──stage──▶ STAGING ──published──▶ GPU ──demote──▶ DEMOTING ──demoted──▶ CPU
                                   │ copy failed / deadline     ▲   │ (pinned: never)        │  │
                                   ▼                            │   ▼ evict (leaf, LRU)      ▼  │
                                EVICTED ◀───────────────────────┼───┴────────────────────────┘  │
                                   ▲        promoted            └──── PROMOTING ◀──promote──────┘
                                   └───────── promotion failed (with its subtree) ───┘

Policy, all deterministic:
* Admission is prefix-closed: walk a released ticket's keys in order; stop at the first key that is
  rejected or does not fit. A long prompt keeps its leading prefix.
* The GPU tier makes room by demoting its least recently used unpinned block to CPU; the CPU tier
  makes room by evicting its least recently used unpinned leaf (a block with no resident child),
  so the store stays prefix-closed by construction. Displacing retained content (an eviction)
  requires the new key to have been seen before (probation); demoting into free CPU room does not.
* A touch refreshes a chain tail first, so prefix heads stay newer than their tails.
* At most `retention_writers_max` retentions copy at once (the copier runs them in order); one
  that arrives while that many copy is dropped as busy, unless it copies a session's keys: those
  have `session_writers_max` more places, so a busy P still keeps what its agents asked for. A retention copies at most
  `candidate_bytes_max`, and only keys whose parent is no other retention's staging key (so a
  failed copy never orphans another chain); a staged copy that does not finish by the ticket's
  soft deadline is dropped (`session_retention_deadline_ns` for a copy of keys a session keeps).
  Every key not kept is counted by reason.
* Pinned blocks (a restore lease holds them) are never demoted or evicted.
* Kept blocks (an agent session keeps them, `session.py`) are never evicted and are demoted only
  when no other block can be; keeping a key needs no probation. Once no session keeps a block it
  goes to the old end of its tier's LRU: the first to leave. A session's prefetch promotes its
  CPU-tier blocks back to the GPU tier (head first), making room only by demoting blocks no session
  keeps; a promoting block is still restorable from its CPU slot. A promotion that failed (on any
  worker rank) drops the block and its subtree, as a failed demotion does: with tensor parallelism
  its ranks may disagree on where the block is, and a drop puts every rank in step. Where a lease
  pins the block or a block below it, it goes back to the CPU tier instead (a restore reads each
  rank's copy wherever it is; a rank whose copy succeeded holds one GPU slot more than these books
  until the block is dropped).
* A promoted block that a lease still pins keeps its CPU bytes charged (`cpu_held`) until the lease
  ends: a restore may still be reading its CPU slot, which the shell frees only after that read.

Byte accounting: STAGING and GPU blocks use the GPU budget; DEMOTING and CPU blocks use the CPU
budget (a demotion frees its GPU slot at once: the shell orders the demotion copy before any later
copy into that slot, see `StageHistory`). A PROMOTING block uses both until its copy ends.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from .common import Counters
from .effects import DemoteHistory, DropHistory, Effect, PromoteHistory
from .machine import Book, MachineSpec
from .reasons import Dropped, Reason

PROBATION = "PROBATION"
STAGING = "STAGING"
GPU = "GPU"
DEMOTING = "DEMOTING"
CPU = "CPU"
PROMOTING = "PROMOTING"
EVICTED = "EVICTED"

SPEC = MachineSpec(
    "history_block",
    states=[PROBATION, STAGING, GPU, DEMOTING, CPU, PROMOTING, EVICTED],
    initial=PROBATION,
    terminal=[EVICTED],
    transitions=[
        {"trigger": "stage", "source": PROBATION, "dest": STAGING},
        {"trigger": "published", "source": STAGING, "dest": GPU},
        {"trigger": "stage_failed", "source": STAGING, "dest": EVICTED},
        {"trigger": "demote", "source": GPU, "dest": DEMOTING},
        {"trigger": "demoted", "source": DEMOTING, "dest": CPU},
        {"trigger": "demote_failed", "source": DEMOTING, "dest": EVICTED},
        {"trigger": "promote", "source": CPU, "dest": PROMOTING},
        {"trigger": "promoted", "source": PROMOTING, "dest": GPU},
        # A failed promotion drops the block with its subtree; one a lease pins (or pins below)
        # goes back to the CPU tier instead.
        {"trigger": "promote_failed", "source": PROMOTING, "dest": EVICTED},
        {"trigger": "promote_failed", "source": PROMOTING, "dest": CPU},
        # Evicting a promoting block happens only with a subtree, when an ancestor's demotion or
        # promotion failed (the LRUs never name one).
        {"trigger": "evict", "source": [GPU, CPU, PROMOTING], "dest": EVICTED},
        {"trigger": "seen_again", "source": EVICTED, "dest": PROBATION},
    ],
)

RESIDENT = frozenset({STAGING, GPU, DEMOTING, CPU, PROMOTING})
# A promoting block is read from its CPU slot until its copy ends (the shell looks a key up where
# it is when the restore starts, and holds the slot it reads).
RESTORABLE = {GPU: "gpu", CPU: "cpu", PROMOTING: "cpu"}


class HistoryBlock(msgspec.Struct):
    key: str
    parent: str
    state: str
    pins: int = 0
    children: int = 0
    writer: str = ""  # the ticket whose retention is staging this block
    # Promoted while pinned: its CPU slot may still be read by the lease's restore, so its CPU
    # bytes stay charged until the last pin goes.
    cpu_held: bool = False


class HistoryStore(Book):
    """The resident keys of one engine's history, their tiers and the admission policy.

    A book without deadlines: a block leaves the store when it is evicted (the record is deleted
    and its key remembered on probation), so EVICTED is never a resident state.
    """

    spec = SPEC
    noun = "history"
    key = "key"

    def __init__(self, config, counters: Counters) -> None:
        super().__init__(config, counters)
        self.blocks: dict[str, HistoryBlock] = self.records
        self.gpu_lru: OrderedDict[str, None] = OrderedDict()  # GPU-state keys, oldest first
        self.cpu_lru: OrderedDict[str, None] = OrderedDict()  # CPU-state keys, oldest first
        self.probation: OrderedDict[str, None] = OrderedDict()
        self.gpu_used = 0
        self.cpu_used = 0
        self.writers: list[str] = []  # the tickets whose retentions are copying, oldest first
        # key -> how many open sessions keep it (kept by `session.py` only; a key may be kept
        # before it is resident: its retention is then admitted without probation)
        self.kept: dict[str, int] = {}
        # Keys no session keeps any longer that were mid-copy then (in no LRU): they enter their
        # tier's LRU at the old end, the first to leave, as the others did.
        self.released: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.config.gpu_history_bytes > 0 and self.config.block_bytes > 0

    # -- small moves -----------------------------------------------------------------------------

    def _remember(self, key: str) -> None:
        probation = self.probation
        probation[key] = None
        probation.move_to_end(key)
        while len(probation) > self.config.probation_max:
            probation.popitem(last=False)

    def _remove(self, blk: HistoryBlock, trigger: str, reason: Dropped, out: list[Effect]) -> None:
        if reason == Dropped.CAPACITY and blk.key in self.kept:
            self._internal_error(f"history {blk.key}: evicted for room while a session keeps it")
        bb = self.config.block_bytes
        tier = "cpu" if blk.state in (DEMOTING, CPU, PROMOTING) else "gpu"
        if tier == "gpu" or blk.state == PROMOTING:
            self.gpu_used -= bb
        if tier == "cpu" or blk.cpu_held:
            self.cpu_used -= bb
            blk.cpu_held = False
        self.gpu_lru.pop(blk.key, None)
        self.cpu_lru.pop(blk.key, None)
        self.released.discard(blk.key)
        self._move(blk, trigger, EVICTED)
        del self.blocks[blk.key]
        if blk.parent:
            parent = self.blocks.get(blk.parent)
            if parent is not None:
                parent.children -= 1
        self._remember(blk.key)
        self.counters.add("history.removed." + reason)
        out.append(DropHistory(blk.key, tier, reason))

    def _lru_victim(self, lru: OrderedDict, protect: set, leaf_only: bool,
                    kept_too: bool = False) -> HistoryBlock | None:
        blocks, kept = self.blocks, self.kept
        for key in lru:
            blk = blocks[key]
            if blk.pins or key in protect or (leaf_only and blk.children) or (key in kept and not kept_too):
                continue
            return blk
        return None

    def _seen(self, key: str) -> bool:
        """Whether `key` may displace retained content: seen before, or kept by a session."""

        return key in self.probation or key in self.kept

    def _cpu_room(self, key: str, protect: set, out: list[Effect]) -> Dropped | str:
        """Make room for one block in the CPU tier: "" when there is room, else why not."""

        cfg = self.config
        if self.cpu_used + cfg.block_bytes <= cfg.cpu_history_bytes:
            return ""
        if not self._seen(key):
            return Dropped.PROBATION
        victim = self._lru_victim(self.cpu_lru, protect, leaf_only=True)
        if victim is None:
            return Dropped.CAPACITY
        self._remove(victim, "evict", Dropped.CAPACITY, out)
        return ""

    def _gpu_room(self, key: str, protect: set, out: list[Effect]) -> Dropped | str:
        """Make room for one block in the GPU tier: "" when there is room, else why not."""

        cfg = self.config
        bb = cfg.block_bytes
        if self.gpu_used + bb <= cfg.gpu_history_bytes:
            return ""
        # A block no session keeps goes first; a kept one may go down a tier (never out).
        victim = (self._lru_victim(self.gpu_lru, protect, leaf_only=False)
                  or self._lru_victim(self.gpu_lru, protect, leaf_only=False, kept_too=True))
        if victim is not None and cfg.cpu_history_bytes >= bb:
            reason = self._cpu_room(key, protect, out)
            if not reason:
                self._demote(victim, out)
                return ""
        # No room to demote into: displace a GPU leaf, which needs a key seen before.
        if not self._seen(key):
            return Dropped.PROBATION
        leaf = self._lru_victim(self.gpu_lru, protect, leaf_only=True)
        if leaf is None:
            return Dropped.CAPACITY
        self._remove(leaf, "evict", Dropped.CAPACITY, out)
        return ""

    def _enter(self, lru: OrderedDict, key: str) -> None:
        """`key` enters its tier's LRU: as the newest, or, released mid-copy, as the oldest."""

        lru[key] = None
        if key in self.released:
            self.released.discard(key)
            if key not in self.kept:
                lru.move_to_end(key, last=False)

    def _demote(self, victim: HistoryBlock, out: list[Effect]) -> None:
        bb = self.config.block_bytes
        self._move(victim, "demote", DEMOTING)
        del self.gpu_lru[victim.key]
        self.gpu_used -= bb
        self.cpu_used += bb
        self.counters.add("history.demotions")
        out.append(DemoteHistory(victim.key))

    def touch(self, keys) -> None:
        """Mark a chain recently used, tail first, so heads end newest."""

        blocks = self.blocks
        for key in reversed(keys):
            blk = blocks.get(key)
            if blk is None:
                continue
            if blk.state == GPU:
                self.gpu_lru.move_to_end(key)
            elif blk.state == CPU:
                self.cpu_lru.move_to_end(key)

    # -- policy ----------------------------------------------------------------------------------

    def observe(self, keys) -> None:
        """Keys a prompt used that history does not hold go on probation (no state moves)."""

        for key in keys:
            if key not in self.blocks:
                self._remember(key)

    def admit(self, ticket: str, keys, blocks, out: list[Effect]) -> list[tuple[int, str]]:
        """A released ticket's keys: the leading ones that fit → new blocks PROBATION → STAGING (this
        ticket a writer), the rest counted dropped by reason; none while `retention_writers_max`
        retentions copy."""

        if not self.enabled or not keys:
            return []
        if not self._may_write(keys):
            # As many retentions as may are copying. The leading keys already
            # resident were just used again: refresh them, as an admitted retention would, or a
            # prefix that stays hot in the engine's own cache under load ages out of history.
            # Only the keys that would have needed a copy are dropped.
            resident = self._resident_prefix(keys)
            self.touch(keys[:resident])
            if resident < len(keys):
                # As the normal path: a key held under another parent is no chain of this prompt.
                reason = Dropped.REJECTED if keys[resident] in self.blocks else Dropped.BUSY_WRITER
                self.counters.add("history.dropped." + reason, len(keys) - resident)
            return []
        cfg = self.config
        protect = set(keys)
        copies: list[tuple[int, str]] = []
        candidate_bytes = 0
        stop_reason: Dropped | str = ""
        index = 0
        for index, key in enumerate(keys):
            parent = keys[index - 1] if index else ""
            blk = self.blocks.get(key)
            if blk is not None:
                if blk.parent != parent:
                    stop_reason = Dropped.REJECTED  # the same key under another parent: not a chain
                    break
                if blk.state == STAGING and blk.writer != ticket:
                    # Another retention is copying this prefix: a chain of ours below it would be
                    # orphaned if that copy failed. The rest waits for a later visit.
                    stop_reason = Dropped.BUSY_WRITER
                    index += 1  # this key is kept, by the other retention: only the rest drop
                    break
                continue
            if parent and parent not in self.blocks:
                stop_reason = Dropped.REJECTED
                break
            if candidate_bytes + cfg.block_bytes > cfg.candidate_bytes_max:
                stop_reason = Dropped.CANDIDATE_BYTES
                break
            stop_reason = self._gpu_room(key, protect, out)
            if stop_reason:
                self._remember(key)
                break
            self.blocks[key] = HistoryBlock(key, parent, PROBATION, writer=ticket)
            self._move(self.blocks[key], "stage", STAGING)
            self.probation.pop(key, None)
            if parent:
                self.blocks[parent].children += 1
            self.gpu_used += cfg.block_bytes
            candidate_bytes += cfg.block_bytes
            copies.append((blocks[index], key))
        else:
            index = len(keys)
        if stop_reason and index < len(keys):
            self.counters.add("history.dropped." + stop_reason, len(keys) - index)
        self.touch(keys[:index])
        if copies:
            self.writers.append(ticket)
            self.counters.add("history.staged", len(copies))
        return copies

    def _may_write(self, keys) -> bool:
        """Whether a retention of `keys` may copy now: a place among `retention_writers_max`, or,
        when the first key it would copy is kept by a session, among the sessions' extra places."""

        cfg, writing = self.config, len(self.writers)
        if writing < cfg.retention_writers_max:
            return True
        if writing >= cfg.retention_writers_max + cfg.session_writers_max:
            return False
        resident = self._resident_prefix(keys)
        return resident < len(keys) and keys[resident] in self.kept

    def _resident_prefix(self, keys) -> int:
        """How many leading keys are resident as this chain (each under the key before it)."""

        blocks = self.blocks
        for index, key in enumerate(keys):
            blk = blocks.get(key)
            if blk is None or blk.parent != (keys[index - 1] if index else ""):
                return index
        return len(keys)

    def finish_staging(self, ticket: str, keys, ok: bool, reason: Dropped, out: list[Effect]) -> None:
        """The retention's copies ended: its STAGING blocks → GPU when `ok`, else → EVICTED (tail
        first, counted under `reason`); the ticket is no longer a writer."""

        if ticket in self.writers:
            self.writers.remove(ticket)
        if ok:
            for key in reversed(keys):
                blk = self.blocks.get(key)
                if blk is not None and blk.state == STAGING:
                    self._move(blk, "published", GPU)
                    blk.writer = ""
                    self._enter(self.gpu_lru, key)
            self.counters.add("history.published", len(keys))
            return
        for key in reversed(keys):
            blk = self.blocks.get(key)
            if blk is not None and blk.state == STAGING:
                self._remove(blk, "stage_failed", reason, out)
        self.counters.add("history.dropped." + reason, len(keys))

    def demoted(self, key: str, ok: bool, out: list[Effect]) -> Reason | str:
        """From DEMOTING → CPU when `ok`, else → EVICTED with its whole subtree (the data is in no
        tier); returns "" or, when the block is not demoting, Reason.NOT_DEMOTING (nothing changes)."""

        blk = self.blocks.get(key)
        if blk is None or blk.state != DEMOTING:
            return Reason.NOT_DEMOTING
        if ok:
            self._move(blk, "demoted", CPU)
            self._enter(self.cpu_lru, key)
            return ""
        # The data is gone from both tiers: drop it and every descendant, leaves first.
        doomed = self._subtree(key)
        for victim in reversed(doomed):
            trigger = {DEMOTING: "demote_failed", STAGING: "stage_failed"}.get(victim.state, "evict")
            self._remove(victim, trigger, Dropped.DEMOTION_FAILED, out)
        return ""

    def _subtree(self, key: str) -> list[HistoryBlock]:
        children: dict[str, list[str]] = {}
        for blk in self.blocks.values():
            if blk.parent:
                children.setdefault(blk.parent, []).append(blk.key)
        order, stack = [], [key]
        while stack:
            current = stack.pop()
            order.append(self.blocks[current])
            stack.extend(sorted(children.get(current, ())))
        return order

    def restorable_prefix(self, keys) -> list[tuple[str, str]]:
        prefix = []
        for key in keys:
            blk = self.blocks.get(key)
            if blk is None or blk.state not in RESTORABLE:
                break
            prefix.append((key, RESTORABLE[blk.state]))
        return prefix

    def ancestors(self, key: str) -> list[str] | None:
        """Resident blocks above `key` (parent first), or None when one of them is mid-copy.

        A restore whose keys start below the engine's own cached prefix pins those ancestors too:
        an unpinned ancestor could be demoted, and a failed demotion drops its whole subtree.
        """
        chain: list[str] = []
        blk = self.blocks.get(key)
        while blk is not None and blk.parent:
            blk = self.blocks.get(blk.parent)
            if blk is None:
                break
            if blk.state not in RESTORABLE:
                return None
            chain.append(blk.key)
        return chain

    # -- sessions (see session.py) ---------------------------------------------------------------

    def keep(self, keys) -> None:
        kept = self.kept
        for key in keys:
            kept[key] = kept.get(key, 0) + 1

    def unkeep(self, keys) -> None:
        """Keys a session no longer keeps; a resident one no session keeps goes to the old end of
        its tier's LRU (head first, so the chain's tail leaves first)."""

        kept = self.kept
        for key in keys:
            count = kept.get(key, 0)
            if count <= 0:
                self._internal_error(f"history {key}: unkept more than kept")
                continue
            if count > 1:
                kept[key] = count - 1
                continue
            del kept[key]
            blk = self.blocks.get(key)
            if blk is None:
                continue
            if blk.state == GPU:
                self.gpu_lru.move_to_end(key, last=False)
            elif blk.state == CPU:
                self.cpu_lru.move_to_end(key, last=False)
            else:
                self.released.add(key)

    def promote(self, keys, out: list[Effect]) -> Dropped | str:
        """Move the CPU-tier blocks of the chain `keys` back to the GPU tier, head first: each →
        PROMOTING (one `PromoteHistory` for them all). Room is made only by demoting blocks no
        session keeps. Returns "" or why the rest stays in the CPU tier."""

        if not self.enabled:
            return ""
        cfg, bb = self.config, self.config.block_bytes
        protect = set(keys)
        moving: list[str] = []
        why: Dropped | str = ""
        for index, key in enumerate(keys):
            blk = self.blocks.get(key)
            if blk is None or blk.parent != (keys[index - 1] if index else ""):
                break  # the chain ends here in history
            if blk.state != CPU:
                continue
            if self.gpu_used + bb > cfg.gpu_history_bytes:
                victim = self._lru_victim(self.gpu_lru, protect, leaf_only=False)
                if victim is None or self._cpu_room(key, protect, out):
                    why = Dropped.CAPACITY
                    break
                self._demote(victim, out)
            self._move(blk, "promote", PROMOTING)
            del self.cpu_lru[key]
            self.gpu_used += bb
            moving.append(key)
        if moving:
            self.counters.add("history.promotions", len(moving))
            out.append(PromoteHistory(tuple(moving)))
        return why

    def promoted(self, key: str, ok: bool, out: list[Effect]) -> Reason | str:
        """From PROMOTING → GPU (its CPU bytes freed, or held while a lease pins it) when `ok`, else
        → EVICTED with its subtree (→ CPU where a lease pins any of it); returns "" or, when the
        block is not promoting, Reason.NOT_PROMOTING (nothing changes)."""

        blk = self.blocks.get(key)
        if blk is None or blk.state != PROMOTING:
            return Reason.NOT_PROMOTING
        if ok:
            self._move(blk, "promoted", GPU)
            self.counters.add("history.promoted")
            if blk.pins:
                blk.cpu_held = True
            else:
                self.cpu_used -= self.config.block_bytes
            self._enter(self.gpu_lru, key)
            return ""
        self.counters.add("history.promotions_failed")
        doomed = self._subtree(key)
        if any(victim.pins for victim in doomed):
            self._move(blk, "promote_failed", CPU)
            self.gpu_used -= self.config.block_bytes
            self._enter(self.cpu_lru, key)
            return ""
        for victim in reversed(doomed):
            trigger = "promote_failed" if victim is blk else (
                {DEMOTING: "demote_failed", STAGING: "stage_failed"}.get(victim.state, "evict"))
            self._remove(victim, trigger, Dropped.PROMOTION_FAILED, out)
        return ""

    def pin(self, keys) -> None:
        for key in keys:
            self.blocks[key].pins += 1

    def unpin(self, keys) -> None:
        for key in keys:
            blk = self.blocks.get(key)
            if blk is None or blk.pins <= 0:
                self._internal_error(f"history {key}: unpinned more than pinned")
                continue
            blk.pins -= 1
            if not blk.pins and blk.cpu_held:
                blk.cpu_held = False
                self.cpu_used -= self.config.block_bytes

    # -- invariants ------------------------------------------------------------------------------

    def violations(self) -> list[str]:
        found = list(self.internal_errors)
        cfg = self.config
        gpu = cpu = 0
        children: dict[str, int] = {}
        for blk in self.blocks.values():
            where = f"history {blk.key} ({blk.state})"
            if blk.state not in RESIDENT:
                found.append(f"{where}: non-resident state in the store")
            if blk.parent:
                if blk.parent not in self.blocks:
                    found.append(f"{where}: parent {blk.parent} absent (not prefix-closed)")
                children[blk.parent] = children.get(blk.parent, 0) + 1
            if blk.state in (STAGING, GPU, PROMOTING):
                gpu += cfg.block_bytes
            if blk.state in (DEMOTING, CPU, PROMOTING) or blk.cpu_held:
                cpu += cfg.block_bytes
            if blk.cpu_held and (blk.state != GPU or not blk.pins):
                found.append(f"{where}: CPU bytes held but not a pinned GPU block")
            if blk.pins and blk.state not in RESTORABLE:
                found.append(f"{where}: pinned but not restorable")
            if blk.pins < 0:
                found.append(f"{where}: negative pins")
            if (blk.state == GPU) != (blk.key in self.gpu_lru):
                found.append(f"{where}: GPU LRU out of step")
            if (blk.state == CPU) != (blk.key in self.cpu_lru):
                found.append(f"{where}: CPU LRU out of step")
        for blk in self.blocks.values():
            if children.get(blk.key, 0) != blk.children:
                found.append(f"history {blk.key}: child count {blk.children} != {children.get(blk.key, 0)}")
        if gpu != self.gpu_used or cpu != self.cpu_used:
            found.append(f"history: byte accounting off (gpu {self.gpu_used}/{gpu}, cpu {self.cpu_used}/{cpu})")
        if gpu > cfg.gpu_history_bytes:
            found.append(f"history: GPU tier over budget ({gpu} > {cfg.gpu_history_bytes})")
        if cpu > cfg.cpu_history_bytes:
            found.append(f"history: CPU tier over budget ({cpu} > {cfg.cpu_history_bytes})")
        return found
