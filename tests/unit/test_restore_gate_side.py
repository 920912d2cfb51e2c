"""P's scheduler side with the restore gate on: it measures its engine's steps and its restores,
asks the gate before asking history and again once history answered, and reports a gated
prompt's tokens as recomputed because of the gate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvbaton.adapters.vllm import scheduler_side as c  # noqa: E402
from kvbaton.adapters.vllm.handoff import handoff_key  # noqa: E402
from kvbaton.adapters.vllm.identity import KvIdentity  # noqa: E402
from kvbaton.adapters.vllm.settings import parse_peer_networks  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402
from kvbaton.core import gate  # noqa: E402

BLOCK = 16
LAYOUT = "layout0"


class Link:
    """The sidecar as the scheduler side sees it: what it was told, and what the test answers."""

    def __init__(self) -> None:
        self.sent: list = []
        self.inbox: list = []
        self.address, self.instance, self.router_address = "127.0.0.1:1", "b" * 32, ""

    def send(self, msg) -> bool:
        self.sent.append(m.DECODER.decode(m.ENCODER.encode(msg)))
        return True

    def drain(self) -> list:
        out, self.inbox = self.inbox, []
        return out

    def alive(self) -> bool:
        return True

    def events(self, kind) -> list:
        return [e for msg in self.sent if type(msg) is m.Apply for e in msg.events if type(e) is kind]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def p_side(clock: Clock, link: Link) -> c.SchedulerSide:
    settings = SimpleNamespace(history_scope="handoff", require_router_capability=False, history_gate="auto")
    conn = SimpleNamespace(is_consumer=False, is_producer=True, layout=LAYOUT, block_size=BLOCK, engine_id="P0",
                           identity=KvIdentity(LAYOUT, "W", 1), settings=settings)
    side = c.SchedulerSide.attached(conn, link, handoff_key=handoff_key("5d0c9e27a41f86b3c2e7d19a04b6f835"),
                                    trusted=parse_peer_networks("127.0.0.0/8"),
                                    plan=SimpleNamespace(enabled=True, gpu_slots=64, cpu_slots=64),
                                    kv_cache_config=SimpleNamespace(hash_block_size=BLOCK), clock=clock)
    return side


def request(rid: str, blocks: int = 10) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(blocks * BLOCK + 1)),
                           block_hashes=[bytes([i]) * 16 for i in range(blocks)], kv_transfer_params=None,
                           num_computed_tokens=0, status=RequestStatus.WAITING)


def run_steps(side: c.SchedulerSide, clock: Clock, fixed_s: float, per_token_s: float) -> None:
    """The engine steps, as the scheduler side sees them: one schedule after another."""

    for _ in range(4):
        for tokens in (16, 128, 512, 2048):
            side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=tokens, num_scheduled_tokens={},
                                                      preempted_req_ids=()))
            clock.now += fixed_s + per_token_s * tokens
    side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={},
                                              preempted_req_ids=()))


def offered(side: c.SchedulerSide, req) -> None:
    for key in side._keys(req):
        side.offered[key] = None


def test_steps_are_measured_from_one_schedule_to_the_next():
    clock, link = Clock(), Link()
    side = p_side(clock, link)
    run_steps(side, clock, 0.010, 2e-5)
    a, b = side.steps.line()
    assert side.steps.steps == 16 and a == pytest.approx(0.010) and b == pytest.approx(2e-5)


def test_an_engine_that_recomputes_faster_than_it_restores_does_not_ask_history():
    clock, link = Clock(), Link()
    side = p_side(clock, link)
    run_steps(side, clock, 0.010, 1e-6)  # an eager small model: its step is fixed cost
    for _ in range(gate.MIN_RESTORES):
        side.restores.add(0.020, 0.001, 10, 0)
    req = request("r1")
    offered(side, req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert link.events(ev.RestoreRequested) == []  # history was not even asked
    assert side.gate_decisions == {"recompute.slower": 1}
    stats = [msg for msg in link.sent if type(msg) is m.GateStats][-1]
    assert stats.decisions == {"recompute.slower": 1} and stats.restores == gate.MIN_RESTORES
    req.status = RequestStatus.FINISHED_STOPPED
    _, report = side.request_finished(req, ([1] * 11,))
    prompt = report["kvbaton_prompt"]
    assert prompt["recomputed"] == 161 and prompt["recomputed_because"].startswith("gate: slower: restore ~20.0 ms")


def test_an_engine_that_restores_faster_asks_measures_and_restores():
    clock, link = Clock(), Link()
    side = p_side(clock, link)
    run_steps(side, clock, 0.010, 1e-4)  # 100 µs a token: 160 tokens cost 16 ms, a restore 5 ms
    for _ in range(gate.MIN_RESTORES):
        side.restores.add(0.005, 0.001, 10, 0)
    req = request("r2")
    offered(side, req)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # history asked
    (asked,) = link.events(ev.RestoreRequested)
    link.inbox.append(m.RestoreReply(asked.lease, "r2", 10, 0))
    assert side.get_num_new_matched_tokens(req, 0) == (160, True)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(range(11)),)), 160)
    assert side.gate_decisions == {"restore.faster": 1}  # the request's final choice, once
    # The copy ends, vLLM hears it, and the request is scheduled again 12 ms after the ask.
    link.inbox.append(m.LeaseEnded(asked.lease, "r2", True, "", 0.002, 10, 0))
    clock.now += 0.012
    side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1, num_scheduled_tokens={"r2": 1},
                                              preempted_req_ids=()))
    assert side.restores.restores == gate.MIN_RESTORES + 1 and side.measuring == {}
    assert side.restores.fixed_s > 0.004  # the 10 ms this restore waited beyond its copy pulls it up


def test_with_the_gate_off_history_is_always_asked():
    clock, link = Clock(), Link()
    side = p_side(clock, link)
    side.conn.settings.history_gate = "off"
    run_steps(side, clock, 0.010, 1e-6)
    for _ in range(gate.MIN_RESTORES):
        side.restores.add(0.020, 0.001, 10, 0)
    req = request("r3")
    offered(side, req)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(link.events(ev.RestoreRequested)) == 1 and side.gate_decisions == {}


def declining_side(clock: Clock, link: Link) -> c.SchedulerSide:
    """A P whose restores wait 20 ms for prefixes it recomputes in well under 1 ms."""

    side = p_side(clock, link)
    run_steps(side, clock, 0.010, 1e-6)
    for _ in range(gate.MIN_RESTORES):
        side.restores.add(0.020, 0.001, 10, 0)
    return side


def test_after_enough_declines_a_restore_is_made_whole_to_measure_again():
    clock, link = Clock(), Link()
    side = declining_side(clock, link)
    for i in range(gate.EXPLORE_EVERY):
        req = request(f"d{i}")
        offered(side, req)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    req = request("explorer")
    offered(side, req)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # asked: exploring
    (asked,) = link.events(ev.RestoreRequested)
    link.inbox.append(m.RestoreReply(asked.lease, "explorer", 10, 0))
    clock.now += 0.050  # history's answer came late: an explore restores anyway
    assert side.get_num_new_matched_tokens(req, 0) == (160, True)
    assert link.events(ev.LeaseReleased) == []
    assert side.gate_decisions == {"recompute.slower": gate.EXPLORE_EVERY, "restore.explore": 1}
    assert side.declined == 0


def test_a_decline_with_historys_answer_gives_the_lease_back_once():
    """The pre-ask check saw only GPU blocks; history holds them in the CPU tier, which costs more."""

    clock, link = Clock(), Link()
    side = p_side(clock, link)
    run_steps(side, clock, 0.010, 1e-4)  # 160 tokens cost 16 ms
    side.restores.add(0.005, 0.001, 10, 0)
    side.restores.add(0.005, 0.001, 10, 0)
    side.restores.add(0.022, 0.020, 0, 10)  # the CPU tier: 2 ms a block
    req = request("r4")
    offered(side, req)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    (asked,) = link.events(ev.RestoreRequested)
    link.inbox.append(m.RestoreReply(asked.lease, "r4", 10, 10))  # every block in the CPU tier
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert [e.lease for e in link.events(ev.LeaseReleased)] == [asked.lease]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: nothing more
    assert len(link.events(ev.LeaseReleased)) == 1 and len(link.events(ev.RestoreRequested)) == 1
    assert side.gate_decisions == {"recompute.slower": 1}
    assert side.slots["r4"].reason.startswith("gate: slower")


def test_a_step_ended_by_a_finished_request_is_measured_up_to_the_finish():
    clock, link = Clock(), Link()
    side = p_side(clock, link)
    req = request("r5")
    side.get_num_new_matched_tokens(req, 0)  # its slot
    side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=161, num_scheduled_tokens={"r5": 161},
                                              preempted_req_ids=()))
    clock.now += 0.012
    req.status = RequestStatus.FINISHED_STOPPED
    side.request_finished(req, ([1] * 11,))
    clock.now += 5.0  # the engine idles: no step
    side.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=16, num_scheduled_tokens={},
                                              preempted_req_ids=()))
    assert side.steps.steps == 1 and side.steps.sum_y == pytest.approx(0.012)


def test_a_scheduling_retry_asks_again_but_the_measured_wait_counts_from_the_first_ask():
    clock, link = Clock(), Link()
    side = p_side(clock, link)
    run_steps(side, clock, 0.010, 1e-4)
    for _ in range(gate.MIN_RESTORES):
        side.restores.add(0.005, 0.001, 10, 0)
    req = request("r9")
    offered(side, req)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    first_ask = clock.now
    clock.now += 0.030
    # The retry finds one block in the engine's own cache now: the old answer no longer fits.
    assert side.get_num_new_matched_tokens(req, BLOCK) == (None, False)
    asked = link.events(ev.RestoreRequested)
    assert len(asked) == 2 and len(asked[1].keys) == 9
    link.inbox.append(m.RestoreReply(asked[1].lease, "r9", 9, 0))
    assert side.get_num_new_matched_tokens(req, BLOCK) == (144, True)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(range(11)),)), 144)
    assert side.measuring["r9"].asked_at == first_ask
