"""Fault and delay hooks exist only where test hooks are on: a configuration or a message cannot
turn one on in a production sidecar."""

from __future__ import annotations

import pytest

from kvbaton.control import messages as m
from kvbaton.control.hooks import NO_HOOKS, SidecarHooks, active_hooks, changed
from kvbaton.core import events as ev
from kvbaton.testing.fake_io import listed_sidecar


def test_configured_hooks_are_ignored_unless_test_hooks_are_on(monkeypatch):
    configured = SidecarHooks(hold_post_s=5.0, instance="a" * 32)
    monkeypatch.setenv("KVBATON_TEST_HOOKS", "0")
    assert active_hooks(configured) is NO_HOOKS
    monkeypatch.setenv("KVBATON_TEST_HOOKS", "1")
    assert active_hooks(configured) == configured
    assert active_hooks(None) is NO_HOOKS


def test_a_hook_change_is_refused_and_counted_unless_test_hooks_are_on(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATON_TEST_HOOKS", "0")
    sidecar = listed_sidecar(tmp_path, "D0", "consumer")
    sidecar.on_message(m.Debug("hold_post_s", 60))
    sidecar.on_message(m.Debug("fail_next_reads", 1))
    assert sidecar.hooks is NO_HOOKS and sidecar.io.sent == []
    assert sidecar.refused["test_hook"] == 2


def test_hooks_change_where_test_hooks_are_on(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATON_TEST_HOOKS", "1")
    sidecar = listed_sidecar(tmp_path, "D0", "consumer")
    sidecar.on_message(m.Debug("reads_per_load", 2))
    sidecar.on_message(m.Debug("history_hold_stage_s", 0.5))  # the copier's: forwarded
    sidecar.on_message(m.Debug("no_such_hook", 1))  # logged, nothing changes
    assert sidecar.hooks.reads_per_load == 2
    assert sidecar.io.sent == [("history", m.Debug("history_hold_stage_s", 0.5))]
    # A load allocated now is split into the hooked number of reads.
    sidecar.on_message(m.Apply((ev.LoadRequested(0, "r1", "t1", "127.0.0.1:2", 1, 2, 32, "d" * 32),)))
    sidecar.on_message(m.Apply((ev.LoadAllocated(0, "r1", (4, 5)),)))
    assert sidecar.ledger.loads.loads["r1"].reads_left == 2


def test_a_hook_change_names_a_hook():
    assert changed(NO_HOOKS, "hold_post_s", 1).hold_post_s == 1.0
    with pytest.raises(ValueError, match="no sidecar hook named 'instance'"):
        changed(NO_HOOKS, "instance", 1)
    with pytest.raises(ValueError, match="no sidecar hook"):
        changed(NO_HOOKS, "post_reads_inline", 1)


def test_a_workers_hooks_change_only_where_test_hooks_are_on(monkeypatch):
    from kvbaton.control.hooks import WorkerHooks

    hooks = WorkerHooks()
    monkeypatch.setenv("KVBATON_TEST_HOOKS", "0")
    assert not hooks.change("fail_next_reads", 2) and hooks.fail_next_reads == 0
    monkeypatch.setenv("KVBATON_TEST_HOOKS", "1")
    assert hooks.change("fail_next_reads", 2) and hooks.change("history_hold_stage_s", 0.25)
    assert not hooks.change("reads_per_load", 2)  # the sidecar's, not a worker's
    assert [hooks.fail_read(f"r{i}") for i in range(3)] == [True, True, False]
    assert hooks.hold_stage_s == 0.25


def test_every_nth_read_fails_with_the_hook():
    from kvbaton.control.hooks import WorkerHooks

    hooks = WorkerHooks(fail_every_nth_read=3)
    assert [hooks.fail_read(str(i)) for i in range(6)] == [False, False, True, False, False, True]
