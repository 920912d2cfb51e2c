"""Real P/D handoffs between vLLM CPU engines over NIXL (DRAM), driven by kvbaton's sidecars.

Three single-process engines start once for the module: P (producer; its engine is *not* stepped
while it holds tickets, so every handoff here proves D never waits for P's engine), D (consumer,
prefix caching on, every read through its landing area) and S (a plain engine giving the reference greedy outputs). Every test ends by
checking, from the engines and sidecars themselves, that no block and no ticket leaked.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")

from kvbaton.control.client import call_sidecar_sync  # noqa: E402
from kvbaton.testing.engines import EngineProcess  # noqa: E402
from kvbaton.testing.tiny_model import build_tiny_model, tiny_prompt  # noqa: E402

from . import engine_hooks  # noqa: E402
from .log_checks import replay_engine_logs  # noqa: E402

pytestmark = pytest.mark.integration

CONNECTOR = {"kv_connector": "KvbatonConnector", "kv_connector_module_path": "kvbaton.adapters.vllm"}
BLOCK = 32
UNCLAIMED_TTL_S = 3
CLAIM_LEASE_S = 4
IDLE_POLL_S = 0.5  # how long each round of assert_nothing_held waits for an engine to go idle


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    model = build_tiny_model(root / "model")
    events = root / "events"
    p = EngineProcess("P", model, cpu_core=0, log_dir=root, mirror_busy_loop=False,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": {
                          "event_log_dir": str(events), "unclaimed_ttl_s": UNCLAIMED_TTL_S,
                          # Every handoff of these tests is checked block by block.
                          "claim_lease_s": CLAIM_LEASE_S, "kv_checksums": True}})
    d = EngineProcess("D", model, cpu_core=1, log_dir=root,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": {
                          "event_log_dir": str(events), "kv_checksums": True,
                          # A granted handoff runs in the step that loads it (opt-in), so every
                          # test here proves that path too; `parked` turns it off for the tests of
                          # a load that waits for its read across steps.
                          "sync_loads": "auto",
                          # Every read that fits goes through D's landing area (packed, then
                          # scattered), so these tests prove that path on real engines too.
                          "test_hooks": {"heartbeat_interval_s": 1.0, "landing_bytes": 32 << 20}}})
    s = EngineProcess("S", model, cpu_core=0, log_dir=root)
    engines = [p, d, s]
    for engine in engines:
        engine.launch()
    try:
        for engine in engines:
            engine.wait_ready(300)
        yield SimpleNamespace(p=p, d=d, s=s, events=events)
    finally:
        for engine in engines:
            engine.stop()


def prefill(pd, prompt) -> dict:
    out = pd.p.generate([prompt], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}])[0]
    params = out["kv_transfer_params"]
    assert params and params.get("do_remote_prefill") and "kvbaton" in params, params
    return params


def decode(pd, prompt, params, max_tokens=8, timeout_s=60.0) -> list[int]:
    return pd.d.generate([prompt], max_tokens=max_tokens, kv_transfer_params_list=[params],
                         timeout_s=timeout_s)[0]["token_ids"]


def reference(pd, prompt, max_tokens=8) -> list[int]:
    return pd.s.generate([prompt], max_tokens=max_tokens)[0]["token_ids"]


def counters(engine) -> dict:
    return engine.call_connector("debug_state")["counters"]


def delta(before: dict, after: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def assert_nothing_held(pd, timeout_s: float = 15.0) -> None:
    """P's and D's sidecars hold no open record, and both block pools are whole again (P's engine
    is stepped so it can report the blocks its tickets gave back)."""

    deadline = time.monotonic() + timeout_s
    while True:
        pd.p.step(3)
        p_state, d_state = pd.p.call_connector("debug_state"), pd.d.call_connector("debug_state")
        # Short waits: P steps only when told (mirror_busy_loop=False), so a ticket closed after
        # the steps above is seen by the next round's steps, not by waiting here.
        p_stats, d_stats = pd.p.wait_idle(IDLE_POLL_S), pd.d.wait_idle(IDLE_POLL_S)
        clean = (not any(p_state["open"].values()) and not any(d_state["open"].values())
                 and p_stats["free_blocks"] == p_stats["usable_blocks"]
                 and d_stats["free_blocks"] == d_stats["usable_blocks"]
                 and p_stats["scheduler_requests"] == 0 and d_stats["scheduler_requests"] == 0)
        if clean:
            assert p_state["violations"] == [] and d_state["violations"] == []
            assert p_state["connector_errors"] == 0 and d_state["connector_errors"] == 0
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after {timeout_s} s: P {p_state['open']} {p_stats['free_blocks']}/"
                                 f"{p_stats['usable_blocks']} reqs {p_stats['scheduler_requests']}; D "
                                 f"{d_state['open']} {d_stats['free_blocks']}/{d_stats['usable_blocks']} "
                                 f"reqs {d_stats['scheduler_requests']}")
        time.sleep(0.2)


@contextlib.contextmanager
def parked(pd):
    """D parks every load (vLLM's asynchronous flow), as when P's grant is not in hand when vLLM
    schedules the request: the tests of a read held past its pin or between reads need the
    request to wait for its load, not a step to."""

    pd.d.call_connector("debug_set", "sync_loads", 0)
    try:
        yield
    finally:
        pd.d.call_connector("debug_set", "sync_loads", 1)


@pytest.mark.parametrize("length", [5, 31, 32, 33, 100, 700])
def test_decode_output_equals_single_engine(pd, length):
    prompt = tiny_prompt(length, seed=1000 + length)
    before = counters(pd.d)
    params = prefill(pd, prompt)
    assert decode(pd, prompt, params) == reference(pd, prompt)
    after = counters(pd.d)
    assert delta(before, after, "loads.done") == 1
    assert delta(before, after, "loads.blocks") == math.ceil(length / BLOCK)
    assert_nothing_held(pd)


def test_decode_reads_only_what_its_own_prefix_cache_lacks(pd):
    shared = tiny_prompt(160, seed=7)
    first = shared + tiny_prompt(40, seed=8)
    second = shared + tiny_prompt(100, seed=9)
    assert decode(pd, first, prefill(pd, first)) == reference(pd, first)
    before = counters(pd.d)
    assert decode(pd, second, prefill(pd, second)) == reference(pd, second)
    loaded = delta(before, counters(pd.d), "loads.blocks")
    # 160 shared tokens = 5 full blocks hit D's own cache; only the other 4 of 9 are read.
    assert loaded == math.ceil(len(second) / BLOCK) - len(shared) // BLOCK
    assert_nothing_held(pd)


def test_decode_really_uses_the_transferred_kv(pd):
    prompt = tiny_prompt(96, seed=11)
    params = prefill(pd, prompt)
    pd.p.run_in_engine(engine_hooks.corrupt_blocks, params["remote_block_ids"])
    pd.d.call_connector("debug_set", "unchecked_reads", 1)  # (checked, the change would be caught)
    try:
        assert decode(pd, prompt, params) != reference(pd, prompt)
    finally:
        pd.d.call_connector("debug_set", "unchecked_reads", 0)
    assert_nothing_held(pd)


def test_p_blocks_changed_after_their_ticket_are_caught_by_the_checksums(pd):
    summed = pd.p.call_connector("debug_state")["checksums"].get("summed", 0)
    prompt = tiny_prompt(96, seed=13)
    params = prefill(pd, prompt)
    wait_for_sums(pd, summed)
    before = pd.d.call_connector("debug_state")["checksums"]
    pd.p.run_in_engine(engine_hooks.corrupt_blocks, params["remote_block_ids"])
    assert decode(pd, prompt, params) == reference(pd, prompt)  # recomputed: never decoded from
    assert delta(before, pd.d.call_connector("debug_state")["checksums"], "mismatch") == 1
    assert_nothing_held(pd)


def test_transferred_kv_is_bit_identical(pd):
    prompt = tiny_prompt(130, seed=12)
    params = prefill(pd, prompt)
    full_blocks = len(prompt) // BLOCK  # the block holding the last token is recomputed on D
    source = pd.p.run_in_engine(engine_hooks.read_blocks, params["remote_block_ids"][:full_blocks])
    request = pd.d.submit(f"bits-{uuid.uuid4().hex[:6]}", prompt, max_tokens=1, kv_transfer_params=params)
    pd.d.results(60)
    d_blocks = pd.d.call_connector("debug_state")["load_blocks"][request][:full_blocks]
    received = pd.d.run_in_engine(engine_hooks.read_blocks, d_blocks)
    assert len(received) == len(source) > 0
    assert received == source
    transfer = pd.d.call_connector("debug_state")["transfer"]
    assert transfer["landed"] >= 1, transfer  # the bytes came through the landing area
    # Good reads say where their time went (a read with nothing to move has no phases): the five
    # phases until a read's end are part of its seconds, all of them when every read said.
    assert 0 < transfer["phased_reads"] <= transfer["reads"] - transfer["failed"], transfer
    phased = sum(transfer[f"{phase}_seconds"] for phase in ("queued", "describe", "initialize", "transfer_call", "settle"))
    assert phased <= transfer["seconds"] * (1 + 1e-6), transfer
    if transfer["phased_reads"] == transfer["reads"] - transfer["failed"]:
        assert phased == pytest.approx(transfer["seconds"], rel=1e-6), transfer
    assert_nothing_held(pd)


def test_claim_after_the_ticket_expired_recomputes(pd):
    prompt = tiny_prompt(200, seed=13)
    params = prefill(pd, prompt)
    time.sleep(UNCLAIMED_TTL_S + 1.5)
    before = counters(pd.d)
    assert decode(pd, prompt, params) == reference(pd, prompt)
    assert delta(before, counters(pd.d), "loads.missed") == 1
    assert counters(pd.p).get("tickets.closed.expired", 0) >= 1
    assert_nothing_held(pd)


def test_router_abandons_after_p_answered(pd):
    prompt = tiny_prompt(150, seed=14)
    params = prefill(pd, prompt)
    section = params["kvbaton"]
    assert call_sidecar_sync(section["control"], "abandon", section["ticket"], section["abandon"], to=section["instance"]) is True
    before = counters(pd.d)
    assert decode(pd, prompt, params) == reference(pd, prompt)
    assert delta(before, counters(pd.d), "loads.missed") == 1
    assert_nothing_held(pd)


@pytest.mark.parametrize("damage", ["garbage", "wrong_layout", "unknown_ticket", "huge_block_id", "bad_control",
                                    "untrusted_control", "absurd_token_count", "megabyte_ticket", "unsigned"])
def test_malformed_or_stale_params_recompute_locally(pd, damage):
    prompt = tiny_prompt(120, seed=15)
    params = prefill(pd, prompt)
    bad = copy.deepcopy(params)
    if damage == "garbage":
        bad["kvbaton"] = "not a handoff"
    elif damage == "wrong_layout":
        bad["kvbaton"]["layout"] = "0123456789abcdef"
    elif damage == "unknown_ticket":
        bad["kvbaton"]["ticket"] = uuid.uuid4().hex
    elif damage == "huge_block_id":
        bad["remote_block_ids"] = [2**40] + bad["remote_block_ids"][1:]
    elif damage == "bad_control":
        bad["kvbaton"]["control"] = "127.0.0.1:1"
    elif damage == "untrusted_control":  # not in D's peer_networks: never contacted
        bad["kvbaton"]["control"] = "198.18.7.7:4444"
    elif damage == "absurd_token_count":
        bad["kvbaton"]["num_tokens"] = 10**12
    elif damage == "megabyte_ticket":
        bad["kvbaton"]["ticket"] = "t" * (1 << 20)
    elif damage == "unsigned":
        del bad["kvbaton"]["sig"]
    before = counters(pd.d)
    assert decode(pd, prompt, bad) == reference(pd, prompt)
    # Refused before any claim, and counted by reason (kvbaton_handoffs_refused{reason}).
    refused_as = {"garbage": "invalid", "wrong_layout": "forged", "unknown_ticket": "forged", "megabyte_ticket": "invalid",
                  "untrusted_control": "forged", "unsigned": "unsigned", "absurd_token_count": "forged",
                  "huge_block_id": "invalid", "bad_control": "forged"}.get(damage)
    if refused_as is not None:
        assert delta(before, counters(pd.d), f"handoffs.refused.{refused_as}") == 1
    section = params["kvbaton"]
    call_sidecar_sync(section["control"], "abandon", section["ticket"], section["abandon"], to=section["instance"])  # the real ticket
    assert_nothing_held(pd)


def test_ticket_expires_between_reads(pd):
    with parked(pd):
        pd.d.call_connector("debug_set", "heartbeat_interval_s", 30)
        pd.d.call_connector("debug_set", "reads_per_load", 2)
        pd.d.call_connector("debug_set", "pause_between_reads_s", CLAIM_LEASE_S + 2)
        time.sleep(1.5)  # let the heartbeat loop pick up the long interval
        try:
            prompt = tiny_prompt(400, seed=16)
            before = counters(pd.d)
            assert decode(pd, prompt, prefill(pd, prompt)) == reference(pd, prompt)
            after = counters(pd.d)
            assert delta(before, after, "loads.failed") == 1
            assert counters(pd.p).get("tickets.closed.expired", 0) >= 1
        finally:
            pd.d.call_connector("debug_set", "reads_per_load", 1)
            pd.d.call_connector("debug_set", "pause_between_reads_s", 0)
            pd.d.call_connector("debug_set", "heartbeat_interval_s", 1)
        assert_nothing_held(pd)


def test_a_read_that_ends_past_its_pin_is_used_once_p_confirms_it(pd):
    """P keeps a read's blocks for CLAIM_LEASE_S of its reader's silence; D counts a read at once
    only within half of that. A read held past it (D heartbeating meanwhile) is confirmed with P,
    which still held it: the request uses what it read."""

    with parked(pd):
        pd.d.call_connector("debug_set", "hold_post_s", CLAIM_LEASE_S / 2 + 0.5)
        try:
            prompt = tiny_prompt(280, seed=48)
            before = counters(pd.d)
            assert decode(pd, prompt, prefill(pd, prompt)) == reference(pd, prompt)
            after = counters(pd.d)
        finally:
            pd.d.call_connector("debug_set", "hold_post_s", 0)
        assert delta(before, after, "loads.reads_confirmed") == 1 and delta(before, after, "loads.done") == 1
        assert delta(before, after, "loads.reads_unpinned") == 0
        assert delta(before, after, "peers.refused.read_unpinned") == 0
        assert_nothing_held(pd)


def test_a_read_p_let_go_of_while_it_landed_is_recomputed(pd):
    """D's sidecar falls silent (no heartbeats) while its worker holds a read past P's bound: P
    ends the read; D's read still succeeds, but P does not confirm it, so D reports its blocks
    invalid and recomputes them, and the output is still one engine's."""

    with parked(pd):
        pd.d.call_connector("debug_set", "heartbeat_interval_s", 30)
        pd.d.call_connector("debug_set", "hold_post_s", CLAIM_LEASE_S + 1.5)
        time.sleep(1.5)  # let the heartbeat loop pick up the long interval
        try:
            prompt = tiny_prompt(290, seed=49)
            before, p_before = counters(pd.d), counters(pd.p)
            assert decode(pd, prompt, prefill(pd, prompt)) == reference(pd, prompt)
            after, p_after = counters(pd.d), counters(pd.p)
        finally:
            pd.d.call_connector("debug_set", "hold_post_s", 0)
            pd.d.call_connector("debug_set", "heartbeat_interval_s", 1)
        assert delta(p_before, p_after, "reads.ended.reader_silent") == 1
        assert delta(before, after, "loads.reads_unpinned") == 1 and delta(before, after, "loads.failed") == 1
        assert delta(before, after, "peers.refused.read_unpinned") == 1
        assert_nothing_held(pd)


def wait_for_sums(pd, before: int, timeout_s: float = 10.0) -> None:
    """Until P's workers have summed one more ticket's blocks than `before`."""

    deadline = time.monotonic() + timeout_s
    while pd.p.call_connector("debug_state")["checksums"].get("summed", 0) <= before:
        assert time.monotonic() < deadline, "P never summed the ticket's blocks"
        time.sleep(0.02)


def test_kv_changed_on_the_way_is_caught_and_recomputed(pd):
    """With `kv_checksums`, P sums a ticket's blocks and D sums what it read: equal bytes verify;
    a word changed on the way fails the read, the request recomputes (same output), and the
    mismatch is counted with P's engine."""

    summed = pd.p.call_connector("debug_state")["checksums"].get("summed", 0)
    prompt = tiny_prompt(300, seed=23)
    params = prefill(pd, prompt)
    wait_for_sums(pd, summed)
    before = pd.d.call_connector("debug_state")
    assert decode(pd, prompt, params) == reference(pd, prompt)
    mid = pd.d.call_connector("debug_state")
    assert delta(before["checksums"], mid["checksums"], "verified") == 1
    assert delta(before["counters"], mid["counters"], "loads.done") == 1

    prompt = tiny_prompt(300, seed=24)
    params = prefill(pd, prompt)
    wait_for_sums(pd, summed + 1)
    pd.d.call_connector("debug_set", "corrupt_next_reads", 1)
    assert decode(pd, prompt, params) == reference(pd, prompt)
    after = pd.d.call_connector("debug_state")
    assert delta(mid["checksums"], after["checksums"], "mismatch") == 1
    assert delta(mid["checksums"], after["checksums"], "verified") == 0
    assert delta(mid["counters"], after["counters"], "loads.failed") == 1
    engine = params["kvbaton"]["engine"]
    assert delta(mid["checksum_mismatches"], after["checksum_mismatches"], engine) == 1
    assert_nothing_held(pd)


def test_transport_error_mid_read_recomputes(pd):
    pd.d.call_connector("debug_set", "fail_next_reads", 1)
    prompt = tiny_prompt(300, seed=17)
    before = counters(pd.d)
    assert decode(pd, prompt, prefill(pd, prompt)) == reference(pd, prompt)
    assert delta(before, counters(pd.d), "loads.failed") == 1
    assert_nothing_held(pd)


def test_each_decode_response_says_where_its_prompt_came_from(pd):
    """D's response carries `kvbaton_prompt`: its prompt's tokens from D's own cache, from P's
    handoff, and recomputed, with why (a refused section, a failed read, or the tail a delivered
    handoff leaves to the engine)."""

    ids = []

    def report(prompt, params) -> dict:
        out = pd.d.generate([prompt], max_tokens=2, kv_transfer_params_list=[params])[0]
        ids.append(out["internal_request_id"])
        got = out["kv_transfer_params"]["kvbaton_prompt"]
        assert got["engine_cache"] + got["handoff"] + got["recomputed"] == got["prompt_tokens"] == len(prompt), got
        return got

    prompt = tiny_prompt(210, seed=40)
    handed = report(prompt, prefill(pd, prompt))
    assert handed["handoff"] >= 192 and handed["engine_cache"] == 0, handed
    assert handed["recomputed"] == 0 or handed["recomputed_because"] == "tail", handed

    prompt = tiny_prompt(150, seed=41)
    params = prefill(pd, prompt)
    unsigned = copy.deepcopy(params)
    del unsigned["kvbaton"]["sig"]
    refused = report(prompt, unsigned)
    assert refused["handoff"] == 0 and refused["recomputed_because"] == "refused: unsigned", refused
    section = params["kvbaton"]
    call_sidecar_sync(section["control"], "abandon", section["ticket"], section["abandon"], to=section["instance"])

    pd.d.call_connector("debug_set", "fail_next_reads", 1)
    prompt = tiny_prompt(260, seed=42)
    failed = report(prompt, prefill(pd, prompt))
    assert failed["handoff"] == 0 and failed["recomputed_because"].startswith("transport error"), failed
    assert_nothing_held(pd)
    # The event logs tell the same request's story, P's side joined by its ticket.
    from kvbaton.core.log import read_log_prefix
    from kvbaton.core.timings import engine_stream, request_story

    # (Each sidecar writes its log out at its next tick: P's last events may be a tick behind.)
    deadline = time.monotonic() + 10.0
    while True:
        logs = []
        for path in sorted(pd.events.glob("*.kvlog")):
            header, records, _stopped = read_log_prefix(str(path))
            logs.append((header.engine, *engine_stream(header, records)))
        story = request_story(logs, ids[-1])
        names = [name for _at, _engine, name, _what, _said in story["events"]]
        if "ReadFinished" in names or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert story["outcome"].startswith("load ended: transport error"), story
    assert names[0] == "TicketIssued" and "LoadRequested" in names and "ReadFinished" in names, names


def test_decode_aborted_before_allocation(pd):
    pd.d.call_connector("debug_set", "delay_claim_s", 1.5)
    try:
        prompt = tiny_prompt(180, seed=18)
        params = prefill(pd, prompt)
        request = f"abort-early-{uuid.uuid4().hex[:6]}"
        pd.d.submit(request, prompt, max_tokens=8, kv_transfer_params=params)
        time.sleep(0.3)
        pd.d.abort(request)
        time.sleep(2.5)  # the claim lands after the abort: D gives the ticket straight back
    finally:
        pd.d.call_connector("debug_set", "delay_claim_s", 0)
    p_counters = counters(pd.p)
    assert p_counters.get("tickets.closed.released", 0) + p_counters.get("tickets.closed.expired", 0) >= 1
    assert_nothing_held(pd)


def test_decode_aborted_while_loading(pd):
    with parked(pd):
        pd.d.call_connector("debug_set", "hold_post_s", 1.5)
        try:
            prompt = tiny_prompt(250, seed=19)
            params = prefill(pd, prompt)
            request = f"abort-loading-{uuid.uuid4().hex[:6]}"
            pd.d.submit(request, prompt, max_tokens=8, kv_transfer_params=params)
            time.sleep(0.5)
            state = pd.d.call_connector("debug_state")
            assert state["open"]["loads"] == 1  # claimed, allocated, read granted: LOADING
            pd.d.abort(request)
            time.sleep(2.5)
        finally:
            pd.d.call_connector("debug_set", "hold_post_s", 0)
        assert counters(pd.d).get("loads.cancelled", 0) >= 1
        assert_nothing_held(pd)


def test_idle_prefill_engine_does_not_delay_the_handoff(pd):
    prompt = tiny_prompt(500, seed=20)
    params = prefill(pd, prompt)  # from here on P's engine is not stepped
    started = time.monotonic()
    assert decode(pd, prompt, params, max_tokens=4) == reference(pd, prompt, max_tokens=4)
    elapsed = time.monotonic() - started
    assert elapsed < 5.0, f"a handoff from an idle P took {elapsed:.1f} s"
    p_state = pd.p.call_connector("debug_state")
    assert p_state["open"]["tickets"] == 0  # closed by P's sidecar, before P's engine stepped
    assert_nothing_held(pd)


def test_a_load_aborted_while_its_read_is_held(pd):
    with parked(pd):
        pd.d.call_connector("debug_set", "hold_post_s", 1.0)
        try:
            prompt = tiny_prompt(260, seed=47)
            params = prefill(pd, prompt)
            request = f"rw-abort-{uuid.uuid4().hex[:6]}"
            pd.d.submit(request, prompt, max_tokens=8, kv_transfer_params=params)
            deadline = time.monotonic() + 10
            while pd.d.call_connector("debug_state")["open"]["loads"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pd.d.call_connector("debug_state")["open"]["loads"] == 1  # its read is held
            pd.d.abort(request)
            time.sleep(1.5)
        finally:
            pd.d.call_connector("debug_set", "hold_post_s", 0)
        assert_nothing_held(pd)


def test_a_real_ticket_presented_with_another_prompt_loads_nothing(pd):
    """P is the authority on what D reads: a client that got a real ticket for its own prompt
    and sends it to D with another prompt (hoping to read the ticket's KV as that prompt's)
    loads nothing; the request recomputes and its output is right."""

    own, other = tiny_prompt(200, seed=31), tiny_prompt(200, seed=32)
    params = prefill(pd, own)
    before = pd.d.call_connector("debug_state")["counters"]
    assert decode(pd, other, params) == reference(pd, other)
    after = pd.d.call_connector("debug_state")["counters"]
    assert delta(before, after, "peers.refused.grant_mismatch") == 1
    assert delta(before, after, "loads.missed") == 1 and delta(before, after, "loads.done") == 0
    assert_nothing_held(pd)


def test_forged_block_ids_are_only_a_hint(pd):
    """remote_block_ids from the client point at another prompt's blocks: D reads what P granted
    (the ticket's own blocks), so the output is this prompt's."""

    victim, own = tiny_prompt(300, seed=33), tiny_prompt(300, seed=34)
    victim_params = prefill(pd, victim)
    params = copy.deepcopy(prefill(pd, own))
    params["remote_block_ids"] = list(victim_params["remote_block_ids"])
    before = counters(pd.d)
    assert decode(pd, own, params) == reference(pd, own)
    assert delta(before, counters(pd.d), "loads.done") == 1
    section = victim_params["kvbaton"]
    call_sidecar_sync(section["control"], "abandon", section["ticket"], section["abandon"], to=section["instance"])
    assert_nothing_held(pd)


def test_a_keyless_pickle_to_p_runs_nothing(pd, tmp_path):
    """What any local user (or host, with a routable control address) can send to P's control
    port: a frame without the deployment key, carrying a pickle that would create a file."""

    import os
    import subprocess
    import sys

    from .test_peer_security import UNAUTHENTICATED_CLIENT

    prompt = tiny_prompt(64, seed=35)
    params = prefill(pd, prompt)
    marker = tmp_path / "pwned-p"
    env = {k: v for k, v in os.environ.items() if k not in ("XOSCAR_AUTH_KEY", "KVBATON_SECRET")}
    out = subprocess.run([sys.executable, "-c", UNAUTHENTICATED_CLIENT, params["kvbaton"]["control"],
                          str(marker)], env=env, capture_output=True, text=True, timeout=60)
    assert "refused" in out.stdout, out.stdout + out.stderr
    assert not marker.exists()
    assert decode(pd, prompt, params) == reference(pd, prompt)  # P serves its real peers still
    assert counters(pd.p).get("peers.refused.unauthenticated", 0) >= 1
    assert_nothing_held(pd)


def test_a_control_address_answering_a_pickle_runs_nothing_and_the_request_completes(pd, tmp_path):
    from .test_peer_security import PickleListener

    prompt = tiny_prompt(150, seed=36)
    params = prefill(pd, prompt)
    marker = tmp_path / "pwned-d"
    listener = PickleListener(str(marker))
    try:
        # Signed as a holder of the deployment secret would: an unsigned or altered section is
        # never dialled at all (test_malformed_or_stale_params_recompute_locally).
        from kvbaton.adapters.vllm.handoff import handoff_key, sign_handoff
        from kvbaton.control.guard import resolve_secret

        bad = copy.deepcopy(params)
        bad["kvbaton"]["control"] = listener.address
        bad["kvbaton"] = sign_handoff({k: v for k, v in bad["kvbaton"].items() if k not in ("sig", "expires")},
                                      handoff_key(resolve_secret()), 120)
        assert decode(pd, prompt, bad) == reference(pd, prompt)
    finally:
        listener.close()
    assert listener.served >= 1 and not marker.exists()
    section = params["kvbaton"]
    call_sidecar_sync(section["control"], "abandon", section["ticket"], section["abandon"], to=section["instance"])
    assert_nothing_held(pd)


def test_a_granted_handoff_runs_in_the_step_that_loads_it(pd):
    """P's grant is in hand when vLLM schedules the request (D claims as it arrives): the
    request is not parked, its step waits for the read, and its output is one engine's."""

    prompt = tiny_prompt(330, seed=60)
    params = prefill(pd, prompt)
    before = counters(pd.d)
    out = pd.d.generate([prompt], max_tokens=8, kv_transfer_params_list=[params])[0]
    assert out["token_ids"] == reference(pd, prompt)
    after = counters(pd.d)
    assert delta(before, after, "loads.sync") == 1 and delta(before, after, "loads.done") == 1
    assert delta(before, after, "loads.mode.in_step") == 1  # counted as D chose it
    report = out["kv_transfer_params"]["kvbaton_prompt"]
    assert report["handoff"] == 329 and report["recomputed"] == 1, report  # vLLM computes the last token
    assert_nothing_held(pd)


def test_a_prompt_extended_by_ps_token_loads_synchronously_and_computes_only_that_token(pd):
    """The router's flow: D's prompt is P's prompt and the token P sampled."""

    prompt = tiny_prompt(300, seed=61)
    params = prefill(pd, prompt)
    first = reference(pd, prompt, max_tokens=1)
    before = counters(pd.d)
    out = pd.d.generate([prompt + first], max_tokens=7, kv_transfer_params_list=[params])[0]
    assert first + out["token_ids"] == reference(pd, prompt)
    assert delta(before, counters(pd.d), "loads.sync") == 1
    report = out["kv_transfer_params"]["kvbaton_prompt"]
    assert report["handoff"] == 300 and report["recomputed"] == 1, report
    assert_nothing_held(pd)


def test_a_synchronous_read_that_fails_recomputes_in_its_step(pd):
    pd.d.call_connector("debug_set", "fail_next_reads", 1)
    prompt = tiny_prompt(310, seed=62)
    before = counters(pd.d)
    assert decode(pd, prompt, prefill(pd, prompt)) == reference(pd, prompt)
    after = counters(pd.d)
    assert delta(before, after, "loads.sync") == 1 and delta(before, after, "loads.failed") == 1
    assert_nothing_held(pd)


def test_a_synchronous_load_whose_read_comes_too_late_recomputes_and_is_never_posted(pd):
    """P's read grant reaches the worker after the step stopped waiting (`sync_load_wait_s`):
    the step ran without it and the request recomputed its prompt; the late grant posts no read
    (its bytes would land in blocks the recompute wrote)."""

    pd.d.call_connector("debug_set", "hold_post_s", 0.6)
    try:
        prompt = tiny_prompt(320, seed=63)
        before = counters(pd.d)
        assert decode(pd, prompt, prefill(pd, prompt)) == reference(pd, prompt)
        time.sleep(1.0)  # the held grant reaches the worker, which refuses to post it
        after = counters(pd.d)
        transfer = pd.d.call_connector("debug_state")["transfer"]
    finally:
        pd.d.call_connector("debug_set", "hold_post_s", 0)
    assert delta(before, after, "loads.sync") == 1 and delta(before, after, "loads.failed") == 1
    assert transfer.get("sync_wait_passed", 0) >= 1
    assert_nothing_held(pd)



def test_engine_logs_replay_without_violations(pd):
    replay_engine_logs(pd.events, engines=2)


def test_decode_killed_after_claiming_lets_p_reclaim(pd):
    """Last: it kills D. P's core finds the reader silent (reader_silence_ns), ends its read and the idle lease
    expires, so P gets its blocks back without D."""

    pd.d.call_connector("debug_set", "hold_post_s", 60)
    prompt = tiny_prompt(220, seed=21)
    params = prefill(pd, prompt)
    pd.d.submit(f"doomed-{uuid.uuid4().hex[:6]}", prompt, max_tokens=8, kv_transfer_params=params)
    time.sleep(1.0)
    assert pd.p.call_connector("debug_state")["counters"].get("tickets.claimed", 0) >= 1
    pd.d.kill()
    deadline = time.monotonic() + 4 * CLAIM_LEASE_S + 5
    while time.monotonic() < deadline:
        if pd.p.call_connector("debug_state")["open"]["tickets"] == 0:
            break
        time.sleep(0.5)
    pd.p.step(3)
    stats = pd.p.wait_idle()
    assert pd.p.call_connector("debug_state")["open"]["tickets"] == 0
    assert stats["free_blocks"] == stats["usable_blocks"]

