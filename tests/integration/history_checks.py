"""Checks shared by the history tests on CPU engines (tests/integration/test_history.py) and on
GPU engines (tests/gpu/test_history_gpu.py): both run P (history on), D and S (history off)."""

from __future__ import annotations

import time

from . import engine_hooks


def state(engine) -> dict:
    return engine.call_connector("debug_state")


def delta(before: dict, after: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def assert_nothing_held(engines, timeout_s: float = 15.0) -> None:
    """No open ticket, load or lease anywhere; every block pool whole, no request left; no
    history block pinned or moving, no lease context, the copier's slot books equal the ledger's
    tier usage; no violation, no connector error. `engines`: (P, D, S), P first."""

    deadline = time.monotonic() + timeout_s
    p = engines[0]
    while True:
        p.step(2)
        states = [state(e) for e in engines]
        stats = [e.wait_idle() for e in engines]
        p_hist = states[0]["history"]
        copier = p.run_in_engine(engine_hooks.history_slots)
        moving = sum(p_hist["by_state"].get(st, 0) for st in ("STAGING", "DEMOTING", "PROMOTING"))
        # An agent session open on P holds no engine block: only its keep time ends it.
        clean = (all(not any(n for kind, n in st["open"].items() if kind != "sessions") for st in states)
                 and all(sc["free_blocks"] == sc["usable_blocks"] and sc["scheduler_requests"] == 0
                         for sc in stats)
                 and not moving and p_hist["pinned_blocks"] == 0
                 and copier["gpu_used"] == p_hist["gpu_blocks"] and copier["cpu_used"] == p_hist["cpu_blocks"])
        if clean:
            for st in states:
                assert st["violations"] == [] and st["connector_errors"] == 0
            assert copier["errors"] == 0 and not copier["broken"]
            assert p_hist["gpu_used_bytes"] <= p_hist["gpu_budget_bytes"]
            assert p_hist["cpu_used_bytes"] <= p_hist["cpu_budget_bytes"]
            assert not {"asked", "reserved"} & set(states[0]["slots"])  # no lease left unanswered
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after {timeout_s} s: open {[st['open'] for st in states]}, "
                                 f"pools {[(sc['free_blocks'], sc['usable_blocks'], sc['scheduler_requests']) for sc in stats]}, "
                                 f"history {p_hist}, copier {copier}")
        time.sleep(0.2)


def settle_history(engine, timeout_s: float = 10.0) -> dict:
    """Wait until no history copy is in flight (nothing staging, demoting or promoting, no writers)."""

    deadline = time.monotonic() + timeout_s
    while True:
        hist = state(engine)["history"]
        moving = sum(hist["by_state"].get(st, 0) for st in ("STAGING", "DEMOTING", "PROMOTING"))
        if not moving and not hist["writers"]:
            return hist
        assert time.monotonic() < deadline, hist
        time.sleep(0.05)
