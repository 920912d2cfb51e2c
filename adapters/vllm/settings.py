"""Connector settings, read from `kv_connector_extra_config`.

A user sets a handful of keys (`Settings`); everything else is derived from them (`DERIVED`), a
named constant with its reason (`CONSTANTS`), or chosen by the connector from the engine it runs
in (`AUTOMATIC`). An unknown key or a bad value stops the engine at start with a message that
names the key: a typo must not silently fall back to a default.

Tests and benchmarks reach further through one key, `test_hooks`, which is refused unless the
engine's environment has `KVBATON_TEST_HOOKS=1`: a production engine never runs with a hook on.

`docs/reference/SETTINGS.md` is generated from this file (`python -m
kvbaton.adapters.vllm.settings`); a unit test fails when the committed page is stale.
"""

from __future__ import annotations

import ipaddress
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from ...control.hooks import TEST_HOOKS_ENV
from ...core.ledger import SECOND_NS, LedgerConfig

# -- constants ----------------------------------------------------------------------------------

# D's patience with P is a multiple of one peer call's timeout, so a claim or a read grant
# survives a retried call or two before it is given up.
PEER_WAITS_PER_TIMEOUT = 3
# D speaks for a ticket this many times per ticket lifetime (the shorter of the two), so a few
# lost heartbeats never let a ticket that D still wants expire.
HEARTBEATS_PER_LIFETIME = 12
# A new ticket's grace, in heartbeat intervals and at least GRACE_MIN_S (see unclaimed_grace_s).
GRACE_HEARTBEATS = 3
GRACE_MIN_S = 10.0
# A released ticket's engine blocks are held at most this long while history copies them: P's
# engine gets its blocks back on time, and what is not copied by then is dropped and counted.
RETENTION_DEADLINE_S = 0.05
# The deadline of a retention that copies a prefix an agent session keeps: a late copy of what a
# session keeps is finished rather than dropped.
SESSION_RETENTION_DEADLINE_S = 1.0
# Retentions P's history copier may have queued at once: under load, releases arrive while a copy
# runs, and one at a time would drop most of them as busy. Each queued one holds its ticket's
# engine blocks until its copy ends or the retention deadline passes, so a few fit within the
# deadline at the copier's speed.
RETENTION_WRITERS = 4
# An engine step (from start_load_kv to get_finished) still running after this long writes every
# thread's Python stack to the engine's log, and again each time as long again passes: vLLM ends an
# engine whose step outlasts its 300 s execute_model timeout, and a stack taken from C (without
# the GIL) is what names where a stalled worker stopped.
STEP_STALL_DUMP_S = 120.0
# A post-state hash every this many log records: replay names a divergence within this many
# events. Hashing digests the whole state, history blocks included (tens of milliseconds on a P
# with a full CPU tier), and the sidecar answers no claim meanwhile, so it stays rare.
EVENT_LOG_HASH_EVERY = 10000
# D lands a scattered read in its landing area only when that saves at least this many runs: the
# extra scatter on the device must be paid for by descriptors saved.
LANDING_MIN_RUNS_SAVED = 2
# The landing area a reading engine whose KV cache is on CUDA gets.
LANDING_BYTES_CUDA = 256 << 20
# A reading engine whose KV cache is in host memory lands *every* read, so that every read has a
# bound: a NIXL read cannot be stopped once posted (its bytes may still arrive after it is given
# up), and only a read into the landing area can be failed at its bound without its late bytes
# overwriting engine blocks that vLLM has handed to another request. The area holds two
# full-length prompts, within these limits; a read larger than the area goes straight into the
# engine's blocks and is only flagged at its bound.
LANDING_BYTES_CPU_MIN = 64 << 20
LANDING_BYTES_CPU_MAX = 1 << 30
# The engine process's GIL switch interval on a reading engine and on a prefill engine that keeps
# history (Python's default is 5 ms): the worker's io thread posts granted reads and reports their
# end, and P's history copier takes the GIL back after every copy call of a batch; both must get it
# within a fraction of an engine step from the busy engine thread. Only ever lowered.
GIL_SWITCH_INTERVAL_S = 0.0005


def automatic_landing(layout, max_model_len: int) -> tuple[int, int]:
    """The landing area (bytes) and landing threshold (runs saved) a reading engine gets when
    the test hooks leave them to the connector."""
    if layout.device_type == "cuda":
        return LANDING_BYTES_CUDA, LANDING_MIN_RUNS_SAVED
    blocks = -(-max(max_model_len, 1) // max(layout.block_size, 1))
    wanted = 2 * blocks * layout.block_nbytes
    return min(max(wanted, LANDING_BYTES_CPU_MIN), LANDING_BYTES_CPU_MAX), 0


class SettingsError(ValueError):
    pass


def _doc(text: str, **constraints) -> msgspec.Meta:
    return msgspec.Meta(description=" ".join(text.split()), **constraints)


class TestHooks(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Hooks for tests and benchmarks (`test_hooks: {...}`); refused unless `KVBATON_TEST_HOOKS=1`."""

    __test__ = False  # not a pytest test class

    transport: Annotated[Literal["nixl", "local"], _doc(
        '"local" moves bytes with torch copies inside one process (single-process tests).')] = "nixl"
    reads_per_load: Annotated[int, _doc("Split each handoff load into this many sequential reads.", ge=1)] = 1
    pause_between_reads_s: Annotated[float, _doc("Pause before the 2nd and later reads of a load.", ge=0)] = 0.0
    hold_first_read_s: Annotated[float, _doc(
        "Hold each load's first read this long after the claim is granted, before asking P for the "
        "read (P sees a claim and no read).", ge=0)] = 0.0
    hold_post_s: Annotated[float, _doc(
        "Hold each read this long after P granted it, before posting it (P sees a read in flight).",
        ge=0)] = 0.0
    fail_every_nth_read: Annotated[int, _doc("The transport fails every Nth read (0: none).", ge=0)] = 0
    cross_layer_blocks: Annotated[bool, _doc(
        "false: ask vLLM for per-layer KV caches instead of one cross-layer tensor (both sides must "
        "agree). GPU tests use it to cover per-layer caches (the layout of CPU engines and of vLLM "
        "versions without the cross-layer option) and engines of different tensor parallel "
        "sizes.")] = True
    landing_bytes: Annotated[int, _doc(
        "Size of D's landing area; every read that fits lands in it, so tests prove that path. -1 "
        "chooses the size and when to land automatically, 0 turns it off.", ge=-1)] = -1
    # None: the derived value (see DERIVED).
    heartbeat_interval_s: Annotated[float, _doc("Overrides the derived heartbeat interval.", gt=0)] | None = None
    claim_wait_s: Annotated[float, _doc("Overrides the derived claim wait.", gt=0)] | None = None
    history_lease_s: Annotated[float, _doc("Overrides the derived history lease.", gt=0)] | None = None
    history_retention_deadline_s: Annotated[float, _doc(
        "Overrides the retention deadline constant.", gt=0)] = RETENTION_DEADLINE_S
    history_retention_writers: Annotated[int, _doc(
        "Overrides the number of retentions that may copy at once.", ge=1)] = RETENTION_WRITERS


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    gpu_history_bytes: Annotated[int, _doc(
        "P's GPU history tier, in bytes per engine. 0 (or less than one engine block) turns history "
        "off; the direct handoff is unaffected.", ge=0)] = 256 << 20
    cpu_history_bytes: Annotated[int, _doc(
        "P's CPU history tier, in bytes (pinned host memory). -1: the engine's KV cache size; 0: no "
        "CPU tier.", ge=-1)] = -1
    history_gate: Annotated[Literal["auto", "off"], _doc(
        'P: "auto" restores a returning prefix from history only when the engine\'s own measurements '
        '(its steps\' seconds per scheduled token, its restores\' waits) say that is faster than '
        'computing it (`kvbaton_history_gate_total`); "off" restores whatever history holds.')] = "auto"
    session_keep_max_s: Annotated[float, _doc(
        "P: the longest an agent session's prefix is kept per turn or prefetch; a client's keep time "
        "above it is cut to it (`kvbaton_sessions` counts the cuts).", gt=0)] = 600.0
    session_bytes_max: Annotated[int, _doc(
        "P: the most one session keeps in history (its prompt's leading blocks). -1: the GPU history "
        "tier's size.", ge=-1)] = -1
    sessions_bytes_max: Annotated[int, _doc(
        "P: the most all sessions keep together (distinct blocks; a turn keeps the leading blocks "
        "that fit). -1: half of both history tiers together, so plain history always has room.",
        ge=-1)] = -1
    sessions_max: Annotated[int, _doc(
        "P: the most sessions open at once; a new one past it is refused (counted) and its prompt "
        "is history like any other.", ge=1)] = 4096
    kv_checksums: Annotated[bool, _doc(
        "Check the KV of every handoff: P sums each block of a ticket it issues (on the device, a "
        "reduction per chunk of blocks, off the request's path), D sums the blocks it read and "
        "fails the read when they differ (the request recomputes; counted in "
        "`kvbaton_handoff_checksums_total` and, by P's engine, `kvbaton_handoff_checksum_mismatches_total`). "
        "Both engines need it on; a read granted before P's sums were ready is counted unverified. "
        "Equal tensor parallel sizes only.")] = False
    sync_loads: Annotated[Literal["auto", "off"], _doc(
        'D: "auto" (opt-in): when P has granted a handoff by the time vLLM schedules its request (D claims '
        'as the request arrives, and waits up to `sync_claim_wait_s` for the answer), the request '
        'runs in that very step: the workers wait for its read before the forward pass (a '
        'synchronous load) instead of parking it until a later step. A first read from a P engine, '
        'a seeded request, a load whose wait would cost the other requests of a busy step more than '
        'the step it saves (measured), and a read this engine expects to take longer than '
        '`sync_load_max_s` (its measured read rate) are parked instead. "off": every load is parked '
        '(vLLM\'s asynchronous flow), the default: a synchronous load that fails leaves its blocks in '
        'vLLM\'s prefix cache until the request recomputes them, and vLLM\'s async scheduling is refused '
        '(PROTOCOL.md, "How D loads a handoff").')] = "off"
    sync_claim_wait_s: Annotated[float, _doc(
        "D: how long a request may wait for P's answer to its claim before vLLM schedules it, so "
        "that it can load synchronously; past it the load is parked.", ge=0)] = 0.02
    sync_load_wait_s: Annotated[float, _doc(
        "D: how long a step waits for a synchronous load's read to start (P's read grant); past it "
        "the step runs without it and the request recomputes its prompt (`sync wait passed`). A "
        "read that started is waited out: its bytes land in the engine's blocks.", gt=0)] = 0.1
    sync_load_max_s: Annotated[float, _doc(
        "D: a load expected to read for longer than this (its bytes at this engine's measured read "
        "rate) is parked rather than run synchronously, so the other requests in its step do not "
        "wait for it.", gt=0)] = 0.05
    history_scope: Annotated[Literal["handoff", "all"], _doc(
        'Which finished P requests leave their prompt in history: "handoff" (requests handed to a '
        'decode engine) or "all" (plain requests on P too).')] = "handoff"
    unclaimed_ttl_s: Annotated[float, _doc(
        "P: a handoff ticket nobody claimed (and nobody heartbeats) is closed and its engine blocks "
        "returned after this long.", gt=0)] = 120.0
    claim_lease_s: Annotated[float, _doc(
        "P: a claimed ticket whose claimer has been silent this long (no read, retry or heartbeat) is "
        "closed; a read whose reader has been silent this long is ended as failed.", gt=0)] = 600.0
    peer_timeout_s: Annotated[float, _doc(
        "A call to a peer's sidecar (claim, read grant, heartbeat, release) or a transfer that gets "
        "no answer by then has failed: a stopped or wedged peer never holds a claim or a read "
        "forever.", gt=0)] = 10.0
    event_log_dir: Annotated[str, _doc(
        'Directory of the event logs (one file per engine, for `kvbaton replay` and `kvbaton '
        'timings`); "" turns logging off. A relative path is taken from the engine\'s working '
        'directory.')] = "kvbaton-logs"
    control_host: Annotated[str, _doc(
        "Address the engine's sidecar binds and advertises to peers.")] = "127.0.0.1"
    control_port: Annotated[int, _doc("Port of the sidecar; 0 picks a free one.", ge=0, le=65535)] = 0
    metrics_port: Annotated[int, _doc(
        "Port where the engine's sidecar serves kvbaton's Prometheus metrics (`GET /metrics`, "
        "`kvbaton_*`: tickets, loads, handoff bytes and seconds, history hits, drops, restores, "
        "refusals), on control_host; 0: not served. Unauthenticated and counts only: expose it to "
        "the scraper's network only.", ge=0, le=65535)] = 0
    require_router_capability: Annotated[bool, _doc(
        "P: hand off only requests whose kv_transfer_params carry the router's capability "
        "(`kvbaton_router`, made with the router key): a client of P's own HTTP port cannot make it "
        "pin KV for a ticket. `kvbaton serve` turns it on for the engines it starts; a stock "
        "NixlConnector-protocol proxy needs it off.")] = False
    router_port: Annotated[int, _doc(
        "Port of the router's door on the engine's sidecar (on control_host): the router gives "
        "tickets back and reads counts and history residency there under a key derived from the "
        "secret; 0 picks a free one (P's handoffs name it).", ge=0, le=65535)] = 0
    secret_file: Annotated[str, _doc(
        "The deployment secret that authenticates every control frame comes from KVBATON_SECRET, else "
        "this file (owner-only), else (loopback control_host only) a per-user file made on first "
        "use.")] = ""
    peer_networks: Annotated[str, _doc(
        "The P control addresses a decode engine will contact (CIDR networks or exact host names, "
        "comma-separated): a handoff naming any other address recomputes locally, with a "
        "warning.")] = "127.0.0.0/8,::1/128"
    test_hooks: Annotated[TestHooks, _doc(
        f"Hooks for tests and benchmarks; refused unless the engine's environment has "
        f"{TEST_HOOKS_ENV}=1 (see below).")] = msgspec.field(default_factory=TestHooks)

    # -- derived --------------------------------------------------------------------------------

    @property
    def claim_wait_s(self) -> float:
        hooked = self.test_hooks.claim_wait_s
        return hooked if hooked is not None else PEER_WAITS_PER_TIMEOUT * self.peer_timeout_s

    @property
    def read_grant_wait_s(self) -> float:
        return PEER_WAITS_PER_TIMEOUT * self.peer_timeout_s

    @property
    def heartbeat_interval_s(self) -> float:
        hooked = self.test_hooks.heartbeat_interval_s
        if hooked is not None:
            return hooked
        return min(self.unclaimed_ttl_s, self.claim_lease_s) / HEARTBEATS_PER_LIFETIME

    @property
    def unclaimed_grace_s(self) -> float:
        return min(self.unclaimed_ttl_s, max(GRACE_MIN_S, GRACE_HEARTBEATS * self.heartbeat_interval_s))

    @property
    def history_lease_s(self) -> float:
        hooked = self.test_hooks.history_lease_s
        return hooked if hooked is not None else self.unclaimed_ttl_s

    def ledger_config(self, block_bytes: int, cpu_default_bytes: int) -> LedgerConfig:
        cpu = self.cpu_history_bytes if self.cpu_history_bytes >= 0 else cpu_default_bytes
        return LedgerConfig(
            unclaimed_ttl_ns=int(self.unclaimed_ttl_s * SECOND_NS),
            unclaimed_grace_ns=int(self.unclaimed_grace_s * SECOND_NS),
            claim_lease_ns=int(self.claim_lease_s * SECOND_NS),
            # A reader silent for a whole idle lease has gone: its reads end (see LedgerConfig).
            reader_silence_ns=int(self.claim_lease_s * SECOND_NS),
            claim_wait_ns=int(self.claim_wait_s * SECOND_NS),
            read_grant_wait_ns=int(self.read_grant_wait_s * SECOND_NS),
            history_lease_ns=int(self.history_lease_s * SECOND_NS),
            retention_deadline_ns=max(1, int(self.test_hooks.history_retention_deadline_s * SECOND_NS)),
            session_retention_deadline_ns=int(max(SESSION_RETENTION_DEADLINE_S,
                                                  self.test_hooks.history_retention_deadline_s) * SECOND_NS),
            retention_writers_max=self.test_hooks.history_retention_writers,
            gpu_history_bytes=self.gpu_history_bytes,
            cpu_history_bytes=cpu,
            # One retention may copy up to the whole GPU budget: a prompt that fits is kept whole
            # on its first visit (older content moves to the CPU tier).
            candidate_bytes_max=self.gpu_history_bytes,
            block_bytes=block_bytes,
            session_keep_max_ns=int(self.session_keep_max_s * SECOND_NS),
            session_bytes_max=self.session_bytes_max if self.session_bytes_max >= 0 else self.gpu_history_bytes,
            sessions_bytes_max=(self.sessions_bytes_max if self.sessions_bytes_max >= 0
                                else (self.gpu_history_bytes + cpu) // 2),
            sessions_max=self.sessions_max,
        )


# What each derived value is, as the reference shows it: (name, formula, value, what it does).
DERIVED = (
    ("claim_wait_s", f"{PEER_WAITS_PER_TIMEOUT} × peer_timeout_s", lambda s: s.claim_wait_s,
     "D: a load whose claim P has not answered by then recomputes locally."),
    ("read_grant_wait_s", f"{PEER_WAITS_PER_TIMEOUT} × peer_timeout_s", lambda s: s.read_grant_wait_s,
     "D: a load whose read P has not granted by then recomputes locally."),
    ("heartbeat_interval_s", f"min(unclaimed_ttl_s, claim_lease_s) / {HEARTBEATS_PER_LIFETIME}",
     lambda s: s.heartbeat_interval_s,
     "D heartbeats each ticket it holds this often, from the request's arrival on (P and D share "
     "their lifetimes)."),
    ("unclaimed_grace_s", f"min(unclaimed_ttl_s, max({GRACE_MIN_S:g}, {GRACE_HEARTBEATS} × heartbeat_interval_s))",
     lambda s: s.unclaimed_grace_s,
     "P: a new ticket nobody claims or heartbeats by then is closed and its blocks returned (a "
     "handoff that never reached a decode engine); each heartbeat extends it to unclaimed_ttl_s."),
    ("history_lease_s", "unclaimed_ttl_s", lambda s: s.history_lease_s,
     "P: a history restore lease not used by then expires and its tokens are recomputed."),
    ("candidate_bytes_max", "gpu_history_bytes", lambda s: s.gpu_history_bytes,
     "How much of one released prompt a retention may copy into history (its leading blocks)."),
)

CONSTANTS = (
    ("PEER_WAITS_PER_TIMEOUT", PEER_WAITS_PER_TIMEOUT,
     "A claim or read grant survives a retried peer call or two before it is given up."),
    ("HEARTBEATS_PER_LIFETIME", HEARTBEATS_PER_LIFETIME,
     "A few lost heartbeats never let a ticket that D still wants expire."),
    ("GRACE_HEARTBEATS", GRACE_HEARTBEATS,
     "A new ticket lives this many heartbeat intervals unless claimed or heartbeated: two lost "
     "heartbeats never close a ticket D holds."),
    ("GRACE_MIN_S", GRACE_MIN_S,
     "However short the heartbeats, a decode engine that is slow to take a request (a loaded "
     "machine) has this long to claim or heartbeat its ticket."),
    ("RETENTION_DEADLINE_S", RETENTION_DEADLINE_S,
     "P's engine gets a released ticket's blocks back on time; what history has not copied by then "
     "is dropped and counted."),
    ("SESSION_RETENTION_DEADLINE_S", SESSION_RETENTION_DEADLINE_S,
     "A retention of a prefix an agent session keeps holds its ticket's engine blocks at most this "
     "long; what is not copied by then is dropped and counted."),
    ("RETENTION_WRITERS", RETENTION_WRITERS,
     "Releases that arrive while history copies queue instead of being dropped as busy, a few "
     "at a time, each within the retention deadline."),
    ("STEP_STALL_DUMP_S", STEP_STALL_DUMP_S,
     "vLLM ends an engine whose step outlasts 300 s; every thread's stack, taken before that, names "
     "where a stalled worker stopped."),
    ("EVENT_LOG_HASH_EVERY", EVENT_LOG_HASH_EVERY,
     "Replay names a divergence within this many events; each hash digests the whole state (history "
     "included) while the sidecar answers no claim, so it stays rare."),
    ("LANDING_MIN_RUNS_SAVED", LANDING_MIN_RUNS_SAVED,
     "Landing a read must save more descriptors than its extra device scatter costs."),
    ("GIL_SWITCH_INTERVAL_S", GIL_SWITCH_INTERVAL_S,
     "A reading engine's io thread (to post and finish reads) and a prefill engine's history "
     "copier (between the copy calls of a batch) get the GIL within a fraction of an engine step "
     "(only ever lowered)."),
)

AUTOMATIC = (
    ("NIXL descriptor mode",
     "Per read (descriptors built from each read's runs of adjacent blocks) for GPU caches, where "
     "NIXL's cost is per descriptor; per-block lists prepared once for CPU caches."),
    ("landing area",
     f"{LANDING_BYTES_CUDA >> 20} MiB on an engine that reads handoffs into a CUDA KV cache, so a "
     "read into scattered blocks is one descriptor per layer and source run. An engine that reads "
     "into a CPU KV cache lands every read (two full-length prompts, "
     f"{LANDING_BYTES_CPU_MIN >> 20} MiB to {LANDING_BYTES_CPU_MAX >> 30} GiB), so every read can "
     "be failed at its bound without late bytes reaching engine blocks."),
    ("cross-layer KV caches",
     "Always asked for: vLLM gives one tensor whose blocks hold every layer where the version, "
     "device and model allow it (a run of blocks is then one descriptor and one history copy), "
     "per-layer caches elsewhere. P and D compare their layouts at the handshake."),
    ("kv_load_failure_policy",
     'Set to "recompute" on engines that load KV (D, and P with history): a failed handoff or '
     "restore recomputes its tokens instead of failing the request. D then allocates a handoff's "
     "blocks while its claim is still on the way to P (a refused claim marks them invalid)."),
)


def hooks_allowed() -> bool:
    return os.environ.get(TEST_HOOKS_ENV) == "1"


def parse_settings(extra: dict[str, Any] | None) -> Settings:
    if extra is not None and not isinstance(extra, dict):
        raise SettingsError(f"kvbaton: kv_connector_extra_config must be a mapping, not {type(extra).__name__}")
    raw = dict(extra or {})
    known = set(Settings.__struct_fields__)
    for key in raw:
        if key not in known:
            close = [k for k in known if k.split("_")[0] == str(key).split("_")[0]]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            raise SettingsError(f"kvbaton: unknown kv_connector_extra_config key {key!r}{hint}")
    if "test_hooks" in raw and not hooks_allowed():
        raise SettingsError(f"kvbaton: kv_connector_extra_config key 'test_hooks' is for tests and "
                            f"benchmarks only; it is refused unless the engine's environment has "
                            f"{TEST_HOOKS_ENV}=1")
    try:
        settings = msgspec.convert(raw, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"kvbaton: bad kv_connector_extra_config value: {_where(exc)}") from None
    for name, value in _floats(settings):
        if not math.isfinite(value):
            raise SettingsError(f"kvbaton: kv_connector_extra_config {name!r} must be a finite number "
                                f"(got {value!r})")
    ports = [(name, getattr(settings, name)) for name in ("control_port", "metrics_port", "router_port")]
    for i, (name, port) in enumerate(ports):
        for other, other_port in ports[i + 1:]:
            if port and port == other_port:
                raise SettingsError(f"kvbaton: kv_connector_extra_config {other!r} and {name!r} are "
                                    f"both {port}; the sidecar needs one port for each")
    if settings.event_log_dir:
        settings.event_log_dir = os.path.abspath(settings.event_log_dir)
    try:
        parse_peer_networks(settings.peer_networks)
    except ValueError as exc:
        raise SettingsError(f"kvbaton: kv_connector_extra_config 'peer_networks': {exc}") from None
    return settings


def _where(exc: msgspec.ValidationError) -> str:
    """msgspec says `... - at `$.test_hooks.landing_bytes``: name the key the way a user wrote it."""
    text = str(exc)
    if " - at `$." in text:
        what, _, where = text.partition(" - at `$.")
        return f"{where.rstrip('`')!r}: {what}"
    return text


def _floats(settings: Settings):
    for owner, prefix in ((settings, ""), (settings.test_hooks, "test_hooks.")):
        for name in owner.__struct_fields__:
            value = getattr(owner, name)
            if isinstance(value, float):
                yield prefix + name, value


def parse_peer_networks(text: str) -> tuple[list, set[str]]:
    """CIDR networks and exact host names from `peer_networks`."""

    networks, names = [], set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            if not all(c.isalnum() or c in "-." for c in item):
                raise ValueError(f"{item!r} is neither a network (10.0.0.0/8) nor a host name") from None
            names.add(item.lower())
    return networks, names


# -- the reference page -------------------------------------------------------------------------

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "reference" / "SETTINGS.md"


def _fields(struct) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) of each field, from the struct's own declaration."""
    info = msgspec.inspect.type_info(struct)
    rows = []
    for f in info.fields:
        rows.append((f.name, _type_name(f.type), _default_text(f.default, f.default_factory),
                     _describe(f.type)))
    return rows


def _type_name(t) -> str:
    mi = msgspec.inspect
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        return " | ".join(_type_name(x) for x in t.types)
    if isinstance(t, mi.LiteralType):
        return " | ".join(f'"{v}"' for v in t.values)
    return {mi.IntType: "int", mi.FloatType: "float", mi.BoolType: "bool", mi.StrType: "str",
            mi.NoneType: "null"}.get(type(t), "mapping")


def _describe(t) -> str:
    mi = msgspec.inspect
    text, bounds = "", []
    if isinstance(t, mi.UnionType):  # an optional value: its own type carries the text
        t = next((x for x in t.types if not isinstance(x, mi.NoneType)), t)
    if isinstance(t, mi.Metadata):
        text = (t.extra_json_schema or {}).get("description", "")
        t = t.type
    for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
        value = getattr(t, attr, None)
        if value is not None:
            bounds.append(f"{sign} {value}")
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _default_text(default, factory) -> str:
    if factory is not msgspec.NODEFAULT:
        return "{}"
    if isinstance(default, bool):
        return str(default).lower()
    if default is None:
        return "derived"
    return f'"{default}"' if isinstance(default, str) else _num(default)


def _table(rows, header) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines


def settings_reference() -> str:
    """The text of docs/reference/SETTINGS.md."""
    defaults = Settings()
    user = [(f"`{n}`", t, d, text) for n, t, d, text in _fields(Settings)]
    derived = [(f"`{n}`", formula, _num(value(defaults)), text) for n, formula, value, text in DERIVED]
    hooks = [(f"`{n}`", t, d, text) for n, t, d, text in _fields(TestHooks)]
    out = [
        "# Settings",
        "",
        "<!-- Generated by `python -m kvbaton.adapters.vllm.settings` from adapters/vllm/settings.py;"
        " do not edit. -->",
        "",
        "kvbaton reads its settings from vLLM's `kv_connector_extra_config`. An unknown key or a bad"
        " value stops the engine at start with a message that names the key.",
        "",
        "## What a user sets",
        "",
        *_table(user, ("key", "type", "default", "what it does")),
        "",
        "## Derived",
        "",
        "Computed from the keys above; shown with their values under the defaults.",
        "",
        *_table(derived, ("value", "is", "default", "what it does")),
        "",
        "## Constants",
        "",
        *_table([(f"`{n}`", repr(v), why) for n, v, why in CONSTANTS], ("constant", "value", "why")),
        "",
        "## Chosen automatically",
        "",
        *_table(AUTOMATIC, ("what", "how")),
        "",
        "## Test hooks",
        "",
        f"`test_hooks` is a mapping for tests and benchmarks. An engine refuses it unless its"
        f" environment has `{TEST_HOOKS_ENV}=1`; unknown keys inside it are refused too.",
        "",
        *_table(hooks, ("key", "type", "default", "what it does")),
        "",
    ]
    return "\n".join(out)


def _num(value) -> str:
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, compare) docs/reference/SETTINGS.md."""
    args = sys.argv[1:] if argv is None else argv
    text = settings_reference()
    if args == ["--check"]:
        current = REFERENCE_PATH.read_text() if REFERENCE_PATH.exists() else ""
        if current != text:
            print(f"{REFERENCE_PATH} is stale: run python -m kvbaton.adapters.vllm.settings", file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m kvbaton.adapters.vllm.settings [--check]", file=sys.stderr)
        return 2
    REFERENCE_PATH.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE_PATH.write_text(text)
    print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
