"""Connector settings, read from `kv_connector_extra_config`.

Every key has a documented default; an unknown key or a bad value stops the engine at start with
a message that names the key (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

import msgspec

from ...core.ledger import SECOND_NS, LedgerConfig


class SettingsError(ValueError):
    pass


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Handoff tickets (P).
    unclaimed_ttl_s: float = 120.0
    claim_lease_s: float = 600.0
    # Loads (D).
    claim_wait_s: float = 30.0
    read_grant_wait_s: float = 30.0
    heartbeat_interval_s: float = 10.0
    # A call to a peer's sidecar (claim, read grant, heartbeat, release) that gets no answer by
    # then has failed: a stopped or wedged peer must not hold a claim or a read forever.
    peer_call_timeout_s: float = 10.0
    # D allocates a handoff's blocks as soon as the request arrives, while its claim is still on
    # the way to P (saves an engine step per handoff); a refused claim then costs a recompute of
    # blocks already allocated. False: wait for P's answer before allocating.
    allocate_before_claim: bool = True
    # History (P). `xavier_gpu_cache_bytes` is accepted as an alias of `gpu_history_bytes`.
    # 0 (or less than one engine block) turns history off; the direct handoff is unaffected.
    gpu_history_bytes: int = 256 << 20
    cpu_history_bytes: int = -1  # -1: the engine's KV cache size
    history_lease_s: float = 120.0
    # Soft deadline of one retention's copies: a released ticket's engine blocks are held at most
    # this long while history copies them (what is not copied by then is dropped, counted).
    history_retention_deadline_s: float = 0.05
    # How much of one released prompt a retention may copy into history (its leading blocks).
    # -1: the GPU budget, so a whole prompt that fits is kept on its first visit (older content
    # moves to the CPU tier). A 7B-shaped 4000-token prompt is 229 MB: under the core's former
    # fixed 64 MiB only its first 73 of 250 blocks were kept per visit, so its next visits
    # recomputed most of it while history grew by 73 blocks a visit.
    history_retention_max_bytes: int = -1
    # Which finished P requests leave their prompt in history: by default only handed-off ones
    # (their ticket is released by D). True: plain requests on P (no remote decode) too.
    history_plain_requests: bool = False
    # How P loads a restore. False (async): vLLM parks the request until the copies are reported
    # done, which costs it at least one engine step after the copies end (restore end -> ticket:
    # P50 19 ms at 0.5B, 30 ms at 7B on one H200, docs/BENCHMARKS.md). True (sync): the copies
    # run in the step that computes the request's remaining tokens, queued before its forward on
    # the same stream (7B revisit P50 0.59x native against 0.67x async; 0.5B 0.82x against 0.68x).
    # Known exposure: a sync restore that fails is recomputed, but vLLM (policy "recompute")
    # keeps those blocks in its prefix cache meanwhile; a preemption or abort before the
    # recompute can leave them holding bytes nobody wrote. Failures need a key lost between
    # reservation and copy (rare), but this is why the setting is off by default.
    history_restore_sync: bool = False
    # An asynchronous restore is started before a step's forward and reported to vLLM from a
    # later step's get_finished, which vLLM calls right after launching the forward: a copy of a
    # few ms then costs a whole step before vLLM schedules the request. With this > 0, P's
    # get_finished waits up to this long (on the host, while the GPU runs the launched forward)
    # for restores started before this step's forward and still copying, so one that ends in
    # time is reported a step earlier (an older one still copying is not waited for again). Under 7B
    # throughput load P's steps were long (P90 75 ms, some 200 ms and more) and 21 of 45 restores
    # were reported 280-340 ms after they were posted (docs/BENCHMARKS.md, sixth session). At
    # most 0.1 s. Off until measured on a GPU.
    history_restore_wait_s: float = 0.0
    # D: a handoff's read is granted while the step that allocated its blocks runs, and vLLM
    # learns it ended only from a later step's get_finished, called right after that step's
    # forward is launched. A 7B prompt's read took 0.23 ms on its own on one H200 and 0.6 ms to
    # post inside D, yet was seen done only at D's next poll, a step later (8.9 ms; 13 ms steps
    # at 7B under load, docs/BENCHMARKS.md, seventh session), and the request was scheduled the
    # step after that. With
    # this > 0, D's get_finished waits up to this long (on the host, while the GPU runs the
    # forward just launched) for the loads allocated in this same step, so a read that ends in
    # time lets vLLM schedule the request one step sooner. At most 0.1 s. Off until measured
    # on a GPU (on a CPU engine the wait adds to the step: the forward has already run). An
    # engine in both roles may wait for this and history_restore_wait_s in one get_finished.
    handoff_read_wait_s: float = 0.0
    # Control plane.
    control_host: str = "127.0.0.1"
    control_port: int = 0  # 0: pick a free port
    # The deployment secret that authenticates every control frame: KVBATON_SECRET, else this
    # file (owner-only), else (loopback control_host only) a per-user file made on first use.
    secret_file: str = ""
    # The P control addresses a decode engine will contact (CIDR networks or exact host names,
    # comma-separated): a handoff naming any other address recomputes locally, with a warning.
    peer_networks: str = "127.0.0.0/8,::1/128"
    # Event log: one file per engine; "" turns logging off.
    event_log_dir: str = "kvbaton-logs"
    event_log_hash_every: int = 1000
    # Transport: "nixl" (default) or "local" (one process, tests only).
    transport: str = "nixl"
    # How NIXL reads are described: "per_read" builds each read's descriptors from the runs of
    # adjacent blocks (one per layer for a contiguous prompt), "prepped" indexes per-block lists
    # prepared once (vLLM's way), "auto" picks per_read for GPU caches (NIXL costs ~10 us per
    # descriptor there) and prepped for CPU caches of up to 1M blocks x layers.
    nixl_descriptor_mode: str = "auto"
    # D's landing area (transports/landing.py): a read whose destination blocks are scattered
    # lands packed there and the device scatters it (one descriptor per layer and source run
    # instead of per run on both sides; NIXL costs ~10 us per descriptor on an H200). -1: 256 MiB
    # on a reading engine whose cache is on CUDA, none on CPU; 0: none.
    landing_bytes: int = -1
    # Land a read when that saves at least this many runs; 0 lands every read that fits.
    landing_min_runs_saved: int = 2
    # Ask vLLM for a cross-layer KV cache: one tensor whose blocks hold every layer, so a run of
    # adjacent blocks is one NIXL descriptor (and one history copy) instead of one per layer.
    # vLLM 0.14-0.28 honour it on GPU for models with one uniform attention group; other vLLM
    # versions and CPU engines ignore it. P and D must agree (their layouts are compared at the
    # handshake). On by default: on an H200 it nearly halved a 7B revisit's 224 MB reads (3.8 ->
    # 2.1 ms, 95 -> 3 descriptors) and turned every history copy into one copy per run (docs/BENCHMARKS.md).
    cross_layer_blocks: bool = True
    # The engine process's GIL switch interval (Python's default is 5 ms): the worker's io
    # thread posts granted reads and reports their end, and must not wait a whole interval for
    # the GIL each time while the engine thread runs Python. Only ever lowered; 0 leaves it.
    gil_switch_interval_s: float = 0.0005
    # vLLM's default load-failure policy is "fail"; kvbaton's recompute guarantee needs
    # "recompute", which the connector sets (on D, and on P when history restores are on)
    # unless this is false.
    set_recompute_policy: bool = True
    # Test hooks (never needed in production): split each load into several sequential reads,
    # pause before the 2nd and later reads, hold the first read, fail every Nth read.
    debug_reads_per_load: int = 1
    debug_pause_between_reads_s: float = 0.0
    debug_hold_first_read_s: float = 0.0
    debug_fail_every_nth_read: int = 0

    def ledger_config(self, block_bytes: int, cpu_default_bytes: int) -> LedgerConfig:
        cpu = self.cpu_history_bytes if self.cpu_history_bytes >= 0 else cpu_default_bytes
        return LedgerConfig(
            unclaimed_ttl_ns=int(self.unclaimed_ttl_s * SECOND_NS),
            claim_lease_ns=int(self.claim_lease_s * SECOND_NS),
            claim_wait_ns=int(self.claim_wait_s * SECOND_NS),
            read_grant_wait_ns=int(self.read_grant_wait_s * SECOND_NS),
            history_lease_ns=int(self.history_lease_s * SECOND_NS),
            retention_deadline_ns=max(1, int(self.history_retention_deadline_s * SECOND_NS)),
            gpu_history_bytes=self.gpu_history_bytes,
            cpu_history_bytes=cpu,
            candidate_bytes_max=(self.history_retention_max_bytes if self.history_retention_max_bytes >= 0
                                 else max(self.gpu_history_bytes, 0)),
            block_bytes=block_bytes,
        )


_POSITIVE = ("unclaimed_ttl_s", "claim_lease_s", "claim_wait_s", "read_grant_wait_s",
             "heartbeat_interval_s", "peer_call_timeout_s", "history_lease_s", "history_retention_deadline_s",
             "debug_reads_per_load")
_NON_NEGATIVE = ("gpu_history_bytes", "landing_min_runs_saved", "gil_switch_interval_s", "history_restore_wait_s", "handoff_read_wait_s", "control_port", "event_log_hash_every", "debug_pause_between_reads_s",
                 "debug_hold_first_read_s", "debug_fail_every_nth_read")


def parse_settings(extra: dict[str, Any] | None) -> Settings:
    raw = dict(extra or {})
    if "xavier_gpu_cache_bytes" in raw:
        if "gpu_history_bytes" in raw:
            raise SettingsError("kvbaton: give gpu_history_bytes or its alias xavier_gpu_cache_bytes, not both")
        raw["gpu_history_bytes"] = raw.pop("xavier_gpu_cache_bytes")
    known = set(Settings.__struct_fields__)
    for key in raw:
        if key not in known:
            close = [k for k in known if k.split("_")[0] == key.split("_")[0]]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            raise SettingsError(f"kvbaton: unknown kv_connector_extra_config key {key!r}{hint}")
    try:
        settings = msgspec.convert(raw, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"kvbaton: bad kv_connector_extra_config value: {exc}") from None
    for key in _POSITIVE:
        if getattr(settings, key) <= 0:
            raise SettingsError(f"kvbaton: kv_connector_extra_config {key!r} must be > 0 "
                                f"(got {getattr(settings, key)!r})")
    for key in _NON_NEGATIVE:
        if getattr(settings, key) < 0:
            raise SettingsError(f"kvbaton: kv_connector_extra_config {key!r} must be >= 0 "
                                f"(got {getattr(settings, key)!r})")
    if not 0.0 <= settings.history_restore_wait_s <= 0.1:  # (also refuses NaN)
        raise SettingsError("kvbaton: kv_connector_extra_config 'history_restore_wait_s' must be between 0 "
                            f"and 0.1 (seconds P's engine thread may wait per step; got {settings.history_restore_wait_s!r})")
    if not 0.0 <= settings.handoff_read_wait_s <= 0.1:  # (also refuses NaN)
        raise SettingsError("kvbaton: kv_connector_extra_config 'handoff_read_wait_s' must be between 0 "
                            f"and 0.1 (seconds D's engine thread may wait per step; got {settings.handoff_read_wait_s!r})")
    if settings.cpu_history_bytes < -1:
        raise SettingsError("kvbaton: kv_connector_extra_config 'cpu_history_bytes' must be >= 0 "
                            "(or -1 for the engine's KV cache size)")
    if settings.history_retention_max_bytes < -1:
        raise SettingsError("kvbaton: kv_connector_extra_config 'history_retention_max_bytes' must be >= 0 "
                            "(or -1 for the GPU history budget)")
    if settings.landing_bytes < -1:
        raise SettingsError("kvbaton: kv_connector_extra_config 'landing_bytes' must be >= 0 "
                            "(or -1 for the default: 256 MiB on a reading GPU engine)")
    if settings.transport not in ("nixl", "local"):
        raise SettingsError(f"kvbaton: kv_connector_extra_config 'transport' must be 'nixl' or "
                            f"'local' (got {settings.transport!r})")
    if settings.nixl_descriptor_mode not in ("auto", "prepped", "per_read"):
        raise SettingsError(f"kvbaton: kv_connector_extra_config 'nixl_descriptor_mode' must be 'auto', "
                            f"'prepped' or 'per_read' (got {settings.nixl_descriptor_mode!r})")
    if settings.event_log_dir:
        settings.event_log_dir = os.path.abspath(settings.event_log_dir)
    try:
        parse_peer_networks(settings.peer_networks)
    except ValueError as exc:
        raise SettingsError(f"kvbaton: kv_connector_extra_config 'peer_networks': {exc}") from None
    return settings


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
