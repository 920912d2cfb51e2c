"""Where the KV of a prompt lives: the router's index from block hash to (engine, tier).

Engines publish what they hold as KV events in vLLM's shape (`vllm/distributed/kv_events.py`:
a batch `[ts, events, dp_rank]` of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`):

* vLLM itself, for its prefix cache (`--kv-events-config`, a ZeroMQ publisher);
* each P's sidecar, for kvbaton's history (admissions, demotions, evictions), with the tier as the
  event's `medium` ("GPU", "CPU") and `ownership` "kvbaton.history".

The router hashes a prompt's full blocks the way the engines do (`PrefixHasher`: the same
algorithm and seed), looks up how long a prefix each engine holds (`KvIndex.prefix`), and
`choose` weighs that against each engine's requests in flight.

Nothing here trusts its input. A batch is size-bounded before it is decoded, decoded against a
typed schema with every list and number bounded, and checked for sense (block size, token count,
hash chain where it can be recomputed); a batch or event that fails is dropped and counted by
reason (`KvIndex.refused`), never raised into the router. Each engine's index is bounded in
entries; past the bound the oldest entries go (counted), which costs routing quality only.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import Annotated, Union

import msgspec

logger = logging.getLogger("kvbaton.router.kv_index")

# A batch larger than this is refused before it is decoded. A BlockStored for a 128k-token prompt
# (its token ids as msgpack) is under 1 MiB.
MAX_BATCH_BYTES = 8 << 20
MAX_EVENTS_PER_BATCH = 65536
MAX_BLOCKS_PER_EVENT = 65536
# A BlockStored names at most this many tokens: a model's whole context (vLLM publishes one event
# per stored run of blocks), where 2^20 let one batch cost seconds of hashing.
MAX_TOKENS_PER_EVENT = 1 << 17
# Entries kept per engine (about 100 bytes each): past this the oldest are forgotten.
DEFAULT_MAX_BLOCKS_PER_ENGINE = 1 << 20

# Block hashes as vLLM publishes them: the low 64 bits of the hash as an int (the default,
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), or the hash's bytes. The index keys on the int form.
# (msgpack integers stop below 2**64, so `ge=0` is the whole bound.)
U64 = Annotated[int, msgspec.Meta(ge=0)]
HashBytes = Annotated[bytes, msgspec.Meta(min_length=8, max_length=64)]
WireHash = Union[U64, HashBytes]
Name = Annotated[str, msgspec.Meta(max_length=128)]

# Where a block is held, as bits of one index entry.
CACHE = 1  # the engine's own prefix cache (vLLM's events)
HISTORY_GPU = 2  # kvbaton history, GPU tier (P only)
HISTORY_CPU = 4  # kvbaton history, CPU tier (P only)
TIER_NAMES = {CACHE: "cache", HISTORY_GPU: "history_gpu", HISTORY_CPU: "history_cpu"}
HISTORY_OWNER = "kvbaton.history"


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: Annotated[list[WireHash], msgspec.Meta(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)]
    parent_block_hash: WireHash | None = None
    token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]],
                         msgspec.Meta(max_length=MAX_TOKENS_PER_EVENT)] = []
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] = 0
    lora_id: int | None = None
    medium: Name | None = None
    lora_name: Name | None = None
    # Extra hash inputs (LoRA, multimodal, cache salt), one entry per block, null where none:
    # kept undecoded (a Raw cannot sit in a union, so nil is its default); a block hashed with
    # any is one the router never computes, so the event is skipped.
    extra_keys: msgspec.Raw = msgspec.Raw(b"\xc0")
    group_idx: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    ownership: Name | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: Annotated[list[WireHash], msgspec.Meta(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)]
    medium: Name | None = None
    group_idx: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    ownership: Name | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KvEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[KvEvent], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None


BATCH_DECODER = msgspec.msgpack.Decoder(KvEventBatch)
_NO_EXTRA_KEYS = msgspec.msgpack.Decoder(list[None] | None)
ENCODER = msgspec.msgpack.Encoder()


class Refusal(StrEnum):
    """Why a batch or event was dropped: the words counted in `kvbaton_router_kv_events_refused`."""

    MALFORMED = "malformed"  # not msgpack, or not bytes
    OVERSIZED = "oversized"  # over MAX_BATCH_BYTES, never decoded
    INVALID = "invalid"  # not the schema, or numbers that make no sense
    WRONG_SOURCE = "wrong_source"  # history on a prefix-cache stream or the reverse
    OTHER_GROUP = "other_group"  # a KV cache group other than the first
    UNROUTABLE = "unroutable"  # hashed with LoRA, multimodal or salt keys
    BLOCK_SIZE = "block_size"  # another block size than the router's
    HASH_MISMATCH = "hash_mismatch"  # the engine hashes blocks differently
    FRAMING = "framing"  # a ZeroMQ message that is not (topic, 8-byte number, payload)
    OVER_BUDGET = "over_budget"  # the feed spent its CPU share: dropped, the engine's entries forgotten


class EventRefused(Exception):
    """A batch or event the index will not use; `reason` names the counter."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def decode_batch(payload: object) -> KvEventBatch:
    """The typed batch in `payload`, or EventRefused: bounded before decoding, schema-checked."""

    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise EventRefused(Refusal.MALFORMED, f"payload is a {type(payload).__name__}")
    if len(payload) > MAX_BATCH_BYTES:
        raise EventRefused(Refusal.OVERSIZED, f"{len(payload)} bytes (bound {MAX_BATCH_BYTES})")
    try:
        return BATCH_DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        raise EventRefused(Refusal.INVALID, str(exc)[:200]) from None
    except msgspec.DecodeError as exc:
        raise EventRefused(Refusal.MALFORMED, str(exc)[:200]) from None


def external_hash(value) -> int:
    """A block hash as the index keys it: vLLM's int form (the hash's low 64 bits)."""

    if isinstance(value, int):
        return value
    return int.from_bytes(bytes(value), "big") & ((1 << 64) - 1)


# --- hashing prompts as the engines do --------------------------------------------------------------


def _sha256(value) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value) -> bytes:
    import cbor2  # a vLLM dependency; only needed when the engines hash with sha256_cbor

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


HASH_ALGOS: dict[str, Callable[[object], bytes]] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}
# vLLM's seed for the first block's parent when PYTHONHASHSEED is unset (kv_cache_utils.py).
VLLM_DEFAULT_SEED = "vllm-none-hash"


class HashConfigError(ValueError):
    pass


class PrefixHasher:
    """vLLM's chained block hashes (`hash_block_tokens`) of a prompt's full blocks.

    Matches engines that run with `--prefix-caching-hash-algo ALGO` and the same PYTHONHASHSEED
    (or none on both). xxhash algorithms are refused: without a shared PYTHONHASHSEED their seed is
    random per engine, so no two engines (nor the router) agree on a hash.
    """

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in HASH_ALGOS:
            raise HashConfigError(f"unsupported prefix-caching hash algorithm {algo!r} for routing "
                                  f"(one of {', '.join(HASH_ALGOS)}; engines must use the same)")
        if block_size <= 0:
            raise HashConfigError(f"block size must be positive, not {block_size}")
        self.block_size = block_size
        self.algo = algo
        self.fn = HASH_ALGOS[algo]
        self.seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)
        self.none_hash = self.fn(self.seed)

    def chain(self, tokens: list[int], parent: bytes | None = None) -> list[bytes]:
        """Full hashes of the full blocks of `tokens`, chained after `parent` (None: the root)."""

        bs = self.block_size
        out, prev = [], parent or self.none_hash
        for start in range(0, len(tokens) - bs + 1, bs):
            prev = self.fn((prev, tuple(tokens[start:start + bs]), None))
            out.append(prev)
        return out

    def block_hashes(self, tokens: list[int]) -> list[int]:
        return [external_hash(h) for h in self.chain(tokens)]


# --- the index -------------------------------------------------------------------------------------


class KvIndex:
    """Per engine: block hash -> tier bits. Fed by decoded batches, asked for prefix lengths."""

    def __init__(self, block_size: int, hasher: PrefixHasher | None = None,
                 max_blocks_per_engine: int = DEFAULT_MAX_BLOCKS_PER_ENGINE) -> None:
        self.block_size = block_size
        self.hasher = hasher
        self.max_blocks = max_blocks_per_engine
        self.blocks: dict[str, dict[int, int]] = {}
        self.accepted: collections.Counter = collections.Counter()  # (source, kind) -> events
        self.refused: collections.Counter = collections.Counter()  # (source, reason) -> count
        self.evicted = 0  # entries forgotten for the bound
        self.hash_agreement: dict[str, bool] = {}  # engine -> root chains recomputed and equal
        self.last_refusal: dict[tuple[str, str], str] = {}  # (source, reason) -> what was wrong

    def engine(self, name: str) -> dict[int, int]:
        return self.blocks.setdefault(name, {})

    # -- input ----------------------------------------------------------------------------------

    def ingest(self, engine: str, payload: object, source: str = "vllm") -> int:
        """Decode and apply one batch from `engine`; returns the events applied. Never raises:
        a refused batch or event is counted under (source, reason)."""

        checked, refusals = self.check(engine, payload, source)
        return self.apply_checked(engine, checked, refusals, source)

    def check(self, engine: str, payload: object, source: str = "vllm") -> tuple[list, list[EventRefused]]:
        """The costly half of `ingest`, which touches no entry of the index (the router runs it
        off its event loop): decode the batch and check every event (its bounds, tier, block
        size, and a root chain's hashes recomputed). Returns (events to apply, refusals)."""

        try:
            batch = decode_batch(payload)
        except EventRefused as refused:
            return [], [refused]
        checked, refusals = [], []
        for event in batch.events:
            try:
                checked.append((event, self._check_one(engine, event, source)))
            except EventRefused as refused:
                refusals.append(refused)
        return checked, refusals

    def apply_checked(self, engine: str, checked: list, refusals: list[EventRefused], source: str = "vllm") -> int:
        """The cheap half of `ingest`: apply what `check` passed, count what it refused."""

        for refused in refusals:
            self._refused(engine, source, refused)
        for event, tier in checked:
            self._apply_one(engine, event, source, tier)
        return len(checked)

    def apply(self, engine: str, events: Iterable, source: str = "vllm") -> int:
        checked, refusals = [], []
        for event in events:
            try:
                checked.append((event, self._check_one(engine, event, source)))
            except EventRefused as refused:
                refusals.append(refused)
        return self.apply_checked(engine, checked, refusals, source)

    def _refused(self, engine: str, source: str, refused: EventRefused) -> None:
        key = (source, refused.reason)
        self.refused[key] += 1
        self.last_refusal[key] = refused.detail
        if self.refused[key] in (1, 1000, 1000000):  # the first of a kind, then rarely
            hint = (" (set the same --prefix-caching-hash-algo and PYTHONHASHSEED on every engine and "
                    "the router)" if refused.reason is Refusal.HASH_MISMATCH else "")
            logger.warning("refused %s KV events from %s (%s, %d so far): %s%s", source, engine, refused.reason,
                           self.refused[key], refused.detail, hint)

    def _tier(self, event, source: str) -> int:
        if event.ownership == HISTORY_OWNER:
            if source != "history":  # only a sidecar speaks for history
                raise EventRefused(Refusal.WRONG_SOURCE, "history event on a prefix-cache stream")
            if event.medium == "GPU":
                return HISTORY_GPU
            if event.medium == "CPU":
                return HISTORY_CPU
            raise EventRefused(Refusal.INVALID, f"history tier {event.medium!r}")
        if source == "history":
            raise EventRefused(Refusal.WRONG_SOURCE, "prefix-cache event on a history stream")
        return CACHE

    def _check_one(self, engine: str, event, source: str) -> int:
        """The tier an event speaks of, or EventRefused; reads no entry of the index."""

        kind = type(event)
        if kind is AllBlocksCleared:
            return (HISTORY_GPU | HISTORY_CPU) if source == "history" else CACHE
        if event.group_idx not in (None, 0):
            raise EventRefused(Refusal.OTHER_GROUP, f"KV cache group {event.group_idx}")
        tier = self._tier(event, source)
        if kind is BlockRemoved:
            return tier
        # BlockStored
        if event.lora_id is not None or event.lora_name or _has_extra_keys(event.extra_keys):
            raise EventRefused(Refusal.UNROUTABLE, "hashed with LoRA, multimodal or salt keys")
        n = len(event.block_hashes)
        if source != "history":
            if event.block_size != self.block_size:
                raise EventRefused(Refusal.BLOCK_SIZE, f"{event.block_size} (router: {self.block_size})")
            if len(event.token_ids) != n * self.block_size:
                raise EventRefused(Refusal.INVALID, f"{len(event.token_ids)} tokens for {n} blocks")
            if event.parent_block_hash is None and self.hasher is not None:
                # A chain from the root can be recomputed: it proves the engine hashes as we do.
                ours = self.hasher.block_hashes(event.token_ids)
                agrees = ours == [external_hash(h) for h in event.block_hashes]
                self.hash_agreement[engine] = agrees
                if not agrees:
                    raise EventRefused(Refusal.HASH_MISMATCH, "the engine hashes blocks differently")
        return tier

    def _apply_one(self, engine: str, event, source: str, tier: int) -> None:
        kind = type(event)
        held = self.engine(engine)
        if kind is AllBlocksCleared:
            for key in [k for k, v in held.items() if v & tier]:
                self._clear(held, key, tier)
            self.accepted[(source, "cleared")] += 1
            return
        if kind is BlockRemoved:
            for value in event.block_hashes:
                self._clear(held, external_hash(value), tier)
            self.accepted[(source, "removed")] += 1
            return
        for value in event.block_hashes:
            key = external_hash(value)
            bits = held.pop(key, 0)  # re-inserted: the most recent entries are kept longest
            held[key] = bits | tier
        while len(held) > self.max_blocks:
            held.pop(next(iter(held)))
            self.evicted += 1
        self.accepted[(source, "stored")] += 1

    @staticmethod
    def _clear(held: dict[int, int], key: int, bit: int) -> None:
        bits = held.get(key)
        if bits is None:
            return
        bits &= ~bit
        if bits:
            held[key] = bits
        else:
            del held[key]

    def forget(self, engine: str, bits: int | None = None) -> None:
        """Drop what an engine was said to hold (all of it, or the given tiers): its stream
        restarted or went away."""

        if bits is None:
            self.blocks.pop(engine, None)
            return
        held = self.blocks.get(engine)
        if held:
            for key in [k for k, v in held.items() if v & bits]:
                self._clear(held, key, bits)

    # -- questions ------------------------------------------------------------------------------

    def prefix(self, engine: str, hashes: list[int]) -> tuple[int, int]:
        """(blocks, tier bits seen) of the longest prefix of `hashes` the engine holds."""

        held = self.blocks.get(engine)
        if not held:
            return 0, 0
        tiers = 0
        for index, key in enumerate(hashes):
            bits = held.get(key)
            if not bits:
                return index, tiers
            tiers |= bits
        return len(hashes), tiers

    def size(self, engine: str) -> int:
        return len(self.blocks.get(engine, ()))


def _has_extra_keys(raw: msgspec.Raw) -> bool:
    if bytes(raw) == b"\xc0":
        return False
    try:
        return any(k is not None for k in (_NO_EXTRA_KEYS.decode(raw) or ()))
    except msgspec.MsgspecError:
        return True


# --- choosing an engine ------------------------------------------------------------------------------


class Choice(msgspec.Struct, frozen=True):
    url: str
    how: str  # "cache" | "load" | "fallback"
    blocks: int  # prefix blocks the chosen engine holds
    tiers: int  # tier bits of that prefix


def choose(urls: list[str], prefixes: dict[str, tuple[int, int]], in_flight: dict[str, int],
           prompt_blocks: int, start: int, load_weight: float) -> Choice:
    """The engine with the best score, `held fraction - load_weight * extra requests in flight`
    (in flight counted above the least loaded engine's). A prefix is worth as much as the share of
    the prompt it saves; each request queued ahead costs `load_weight` of a prompt. Ties go to the
    first engine in round-robin order from `start`, so with nothing held the choice is round robin.

    `how`: "cache" when the chosen engine holds the longest prefix (and some), "load" when a
    shorter one won on load, "fallback" when no engine holds any of the prompt."""

    order = urls[start % len(urls):] + urls[:start % len(urls)]
    least = min(in_flight.get(u, 0) for u in urls)
    longest = max(prefixes.get(u, (0, 0))[0] for u in urls)
    best, best_score = order[0], None
    for url in order:
        held = prefixes.get(url, (0, 0))[0]
        score = held / max(1, prompt_blocks) - load_weight * (in_flight.get(url, 0) - least)
        if best_score is None or score > best_score + 1e-12:
            best, best_score = url, score
    blocks, tiers = prefixes.get(best, (0, 0))
    if longest == 0:
        how = "fallback"
    elif blocks == longest:
        how = "cache"
    else:
        how = "load"
    return Choice(best, how, blocks, tiers)
