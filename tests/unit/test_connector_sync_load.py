"""D's scheduler side chooses how a handoff loads: synchronously when P's grant is in hand as vLLM
schedules the request (the request runs in the step that allocates its blocks, and that step's
workers wait for the read), parked otherwise (vLLM's asynchronous flow). Driven with request
stand-ins and a sidecar that records what it is sent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvbaton.adapters.vllm.slots import SlotState  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402

from .test_connector_siblings import Blocks, children, scheduler_side  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def side_with(sync_loads="auto", rate=0.0, block_bytes=1 << 20):
    side = scheduler_side()
    side.conn.settings = SimpleNamespace(sync_loads=sync_loads, sync_claim_wait_s=0.02, sync_load_max_s=0.05)
    side.clock = Clock()
    side.read_rate, side.block_bytes = rate, block_bytes
    return side


def granted(side, request, num_tokens, warm=True):
    side.sidecar.drain = lambda: [m.Resolved(request.request_id, True, num_tokens=num_tokens, warm=warm)]
    side.drain()
    side.sidecar.drain = lambda: []


def test_a_granted_handoff_loads_synchronously_leaving_the_last_token_to_compute():
    side = side_with()
    (request,) = children(1, tokens=80)  # P's prompt of 80 tokens is the whole of D's: decode's flow
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # the claim is out: wait a little
    granted(side, request, 80)
    assert side.get_num_new_matched_tokens(request, 0) == (79, False)  # vLLM computes the last token
    side.update_state_after_alloc(request, Blocks([10, 11, 12]), 79)
    (allocated,) = side.sidecar.of(ev.LoadAllocated)
    assert allocated.sync and allocated.blocks == (10, 11, 12)  # every granted block is read
    assert side.take_sync_step() == {request.request_id: (10, 11, 12)}
    assert side.take_sync_step() == {}  # for that step's workers only
    assert side.slots[request.request_id].state == SlotState.LOADING


def test_a_prompt_that_extends_ps_by_its_token_loads_every_granted_token():
    side = side_with()
    (request,) = children(1, tokens=80)
    request.prompt_token_ids = list(range(81))  # P's prompt and the token P sampled
    side.on_new_request(request)  # D claims as the request arrives
    granted(side, request, 80)
    assert side.get_num_new_matched_tokens(request, 0) == (80, False)


def test_a_claim_unanswered_past_the_wait_is_parked():
    side = side_with()
    (request,) = children(1, tokens=80)
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    side.clock.now += 0.021
    assert side.get_num_new_matched_tokens(request, 0) == (80, True)  # allocated early, parked
    side.update_state_after_alloc(request, Blocks([10, 11, 12]), 80)
    assert not side.sidecar.of(ev.LoadAllocated)[0].sync and side.take_sync_step() == {}


@pytest.mark.parametrize("sync_loads, rate, synchronous", [
    ("off", 0.0, False),  # off: always parked
    ("auto", 1e9, True),  # 3 MiB at 1 GB/s: 3 ms
    ("auto", 1e7, False),  # 3 MiB at 10 MB/s: 300 ms, longer than sync_load_max_s
])
def test_how_a_granted_load_runs(sync_loads, rate, synchronous):
    side = side_with(sync_loads, rate)
    (request,) = children(1, tokens=80)
    request.prompt_token_ids = list(range(81))
    side.get_num_new_matched_tokens(request, 0)
    granted(side, request, 80)
    assert side.get_num_new_matched_tokens(request, 0) == (80, not synchronous)


def test_a_grant_of_only_the_last_token_past_the_local_hit_is_parked():
    """vLLM must compute one token in the step: with only the prompt's last token left past D's
    own cache there is nothing to load in the step, so the load is parked (vLLM's flow)."""

    side = side_with()
    (request,) = children(1, tokens=33)
    side.on_new_request(request)
    granted(side, request, 33)
    assert side.get_num_new_matched_tokens(request, 32) == (1, True)


def test_each_ask_decides_again_so_an_allocation_after_a_parked_answer_is_parked():
    """vLLM may ask, not allocate (no room), and ask again next step: the allocation follows the
    last answer. A load first answered as synchronous and then as parked must be parked, or its
    request would wait for a received report that never comes."""

    side = side_with(rate=1e9)
    (request,) = children(1, tokens=80)
    request.prompt_token_ids = list(range(81))
    side.on_new_request(request)
    granted(side, request, 80)
    assert side.get_num_new_matched_tokens(request, 0) == (80, False)  # no room: not allocated
    side.read_rate = 1e6  # reads have turned slow meanwhile
    assert side.get_num_new_matched_tokens(request, 0) == (80, True)
    side.update_state_after_alloc(request, Blocks([10, 11, 12]), 80)
    assert not side.sidecar.of(ev.LoadAllocated)[0].sync and side.take_sync_step() == {}


def test_a_first_read_from_a_p_engine_and_a_seeded_request_are_parked():
    """A first read from a P engine also connects to it, which may outlast the step's wait; a
    seeded request whose load failed in its step would lose a draw of its generator (its output
    would no longer be one engine's): both load parked."""

    side = side_with()
    (cold,) = children(1, tokens=80)
    cold.prompt_token_ids = list(range(81))
    side.on_new_request(cold)
    granted(side, cold, 80, warm=False)
    assert side.get_num_new_matched_tokens(cold, 0) == (80, True)
    (seeded,) = children(1, tokens=80)
    seeded.prompt_token_ids = list(range(81))
    seeded.sampling_params = SimpleNamespace(seed=7)
    side.on_new_request(seeded)
    granted(side, seeded, 80)
    assert side.get_num_new_matched_tokens(seeded, 0) == (80, True)


@pytest.mark.parametrize("batch, synchronous", [(0, True), (1, True), (2, False), (32, False)])
def test_a_busy_engine_parks_loads_whose_wait_would_cost_its_other_requests_more_than_a_step(batch, synchronous):
    """A synchronous load holds every request of its step for its wait (3 ms measured here); a
    parked one costs its own request a step (4 ms measured here). The last step ran `batch`."""

    side = side_with()
    side.load_wait_s = 0.003
    for _ in range(3):  # steps 4 ms apart, each running `batch` requests
        side.build_connector_meta(SimpleNamespace(preempted_req_ids=set(),
                                                  num_scheduled_tokens={f"r{i}": 1 for i in range(batch)}))
        side.clock.now += 0.004
    (request,) = children(1, tokens=80)
    request.prompt_token_ids = list(range(81))
    side.on_new_request(request)
    granted(side, request, 80)
    assert side.get_num_new_matched_tokens(request, 0) == (80, not synchronous)
