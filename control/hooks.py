"""Fault and delay hooks: one object, honoured only under `KVBATON_TEST_HOOKS=1`.

Tests and benchmarks hold a read, delay a claim or fail a copy to reach a lifecycle race on
purpose. Every such knob of the sidecar is a field of `SidecarHooks`; the sidecar uses the hooks
its configuration carries only when its own environment turns test hooks on, and `NO_HOOKS`
otherwise, so a production engine cannot be talked into a fault by a configuration file or a
message. The worker's own hooks (failing the next reads, holding restores and stages) are named in
`WORKER_HOOKS`: the sidecar forwards a change of one to the worker ranks, and only when hooks are on.
"""

from __future__ import annotations

import os

import msgspec

TEST_HOOKS_ENV = "KVBATON_TEST_HOOKS"


def hooks_enabled() -> bool:
    return os.environ.get(TEST_HOOKS_ENV) == "1"


class SidecarHooks(msgspec.Struct, kw_only=True, frozen=True):
    """The sidecar's hooks; every default is "no hook"."""

    # Split each handoff load into this many sequential reads.
    reads_per_load: int = 1
    # Pause before the 2nd and later reads of a load.
    pause_between_reads_s: float = 0.0
    # Hold each load's first read after the claim is granted, before asking P for it.
    hold_first_read_s: float = 0.0
    # Hold each claim before sending it.
    delay_claim_s: float = 0.0
    # Hold each read after P granted it, before posting it.
    hold_post_s: float = 0.0
    # Heartbeat interval in place of the configured one (0: the configured one).
    heartbeat_interval_s: float = 0.0
    # D with `kv_checksums`: post reads unchecked while set (a test that changes P's blocks on
    # purpose, to prove the decode uses what it read).
    unchecked_reads: int = 0
    # The instance epoch to speak as (a test that names a sidecar's instance before it starts);
    # "": 128 random bits, new at every start.
    instance: str = ""


NO_HOOKS = SidecarHooks()

# Hooks of the worker ranks, by the connector socket they go to: the sidecar forwards a change.
WORKER_HOOKS = {
    "fail_next_reads": "worker",
    "corrupt_next_reads": "worker",
    "history_fail_next_restores": "worker",
    "history_hold_restore_s": "worker",
    "history_fail_next_stages": "history",
    "history_hold_stage_s": "history",
}


def active_hooks(configured: SidecarHooks | None) -> SidecarHooks:
    """The hooks a sidecar runs with: the configured ones only when test hooks are on."""

    return configured if configured is not None and hooks_enabled() else NO_HOOKS


def changed(hooks: SidecarHooks, key: str, value: float) -> SidecarHooks:
    """`hooks` with `key` set to `value` (ValueError for a key that names no sidecar hook)."""

    if key not in SidecarHooks.__struct_fields__ or key == "instance":
        raise ValueError(f"no sidecar hook named {key!r}")
    current = getattr(hooks, key)
    return msgspec.structs.replace(hooks, **{key: type(current)(value)})


class WorkerHooks:
    """A worker rank's fault and delay hooks, one object its io thread, history copier and
    restore runner share. A change (`change`, from a test's `m.Debug`) is taken only where test
    hooks are on; with every count at 0 nothing is injected."""

    def __init__(self, fail_every_nth_read: int = 0) -> None:
        self.fail_every_nth_read = fail_every_nth_read
        self.reads_seen = 0
        self.fail_next_reads = 0
        self.corrupt_next_reads = 0  # change a word of the next reads' blocks before they are checked
        self.fail_next_stages = 0
        self.hold_stage_s = 0.0
        self.fail_next_restores = 0
        self.hold_restore_s = 0.0

    def change(self, key: str, value: float) -> bool:
        """Set the hook `key` names (a WORKER_HOOKS key): False, and nothing changes, when test
        hooks are off or no such hook exists."""

        name = key.removeprefix("history_")
        if not hooks_enabled() or key not in WORKER_HOOKS or not hasattr(self, name):
            return False
        setattr(self, name, type(getattr(self, name))(value))
        return True

    def take(self, name: str) -> bool:
        """Whether to inject the fault `name` counts (fail_next_*) now; counts it down."""

        left = getattr(self, name)
        if left > 0:
            setattr(self, name, left - 1)
            return True
        return False

    def fail_read(self, read_id: str) -> bool:
        """The transport's fault hook: fail this read (the next N, or every Nth)."""

        self.reads_seen += 1
        if self.take("fail_next_reads"):
            return True
        nth = self.fail_every_nth_read
        return bool(nth) and self.reads_seen % nth == 0
