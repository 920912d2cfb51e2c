"""n > 1 on D: vLLM fans a request out into child requests that carry the same handoff. D's
scheduler side claims the ticket once (the first child, the reader); the other children wait
until the reader's load is over and then take its blocks from D's prefix cache. Driven here
with request stand-ins and a sidecar that records what it is sent."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvbaton.adapters.vllm import scheduler_side as c  # noqa: E402
from kvbaton.adapters.vllm.handoff import handoff_key, sign_handoff  # noqa: E402
from kvbaton.adapters.vllm.identity import KvIdentity  # noqa: E402
from kvbaton.adapters.vllm.settings import parse_peer_networks  # noqa: E402
from kvbaton.control import messages as m  # noqa: E402
from kvbaton.core import events as ev  # noqa: E402

LAYOUT = "layout0"


class Sidecar:
    def __init__(self) -> None:
        self.sent: list = []
        self.address = "127.0.0.1:1"

    def send(self, msg) -> bool:
        self.sent.append(msg)
        return True

    def drain(self):
        return []

    def alive(self) -> bool:
        return True

    def of(self, kind) -> list:
        """The core events of type `kind` the scheduler side sent, in order."""

        return [event for msg in self.sent if type(msg) is m.Apply for event in msg.events if type(event) is kind]


KEY = handoff_key("3f9c1a7be2d84c06a5f1e93b7d20c4e8")


def scheduler_side() -> c.SchedulerSide:
    conn = SimpleNamespace(is_consumer=True, is_producer=False, layout=LAYOUT, block_size=32, engine_id="D0",
                           identity=KvIdentity(LAYOUT, "W", 1))
    return c.SchedulerSide.attached(conn, Sidecar(), handoff_key=KEY, trusted=parse_peer_networks("127.0.0.0/8"))


def children(n: int, ticket: str | None = None, tokens: int = 80) -> list[SimpleNamespace]:
    """n requests as vLLM's fan-out makes them: ids `i_parent`, one kv_transfer_params dict."""

    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3],
              "kvbaton": sign_handoff({"ticket": ticket or uuid.uuid4().hex, "control": "127.0.0.1:9000",
                                       "num_tokens": tokens, "layout": LAYOUT, "weights": "W", "tp": 1, "keepalive": uuid.uuid4().hex,
                                       "instance": uuid.uuid4().hex}, KEY, 120)}
    return [SimpleNamespace(request_id=f"{i}_parent", kv_transfer_params=params, prompt_token_ids=list(range(tokens)),
                            status=RequestStatus.WAITING, cache_salt=None, lora_request=None, mm_features=None)
            for i in range(n)]


class Blocks:
    def __init__(self, ids) -> None:
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


def test_the_ticket_is_claimed_once_and_siblings_wait_for_its_load():
    side = scheduler_side()
    reader, *siblings = children(3)
    for request in (reader, *siblings):
        side.on_new_request(request)
    assert len(side.sidecar.of(ev.LoadRequested)) == 1 and side.sidecar.of(ev.LoadRequested)[0].request == reader.request_id

    assert side.get_num_new_matched_tokens(reader, 0) == (80, True)
    side.update_state_after_alloc(reader, Blocks([7, 8, 9]), 80)
    reader.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    for sibling in siblings:  # the load is in flight: not known yet
        assert side.get_num_new_matched_tokens(sibling, 0) == (None, False)
    reader.status = RequestStatus.RUNNING  # loaded, cached, scheduled
    for sibling in siblings:  # D's prefix cache has the blocks (num_computed_tokens 64 = 2 full blocks)
        assert side.get_num_new_matched_tokens(sibling, 64) == (0, False)
        side.update_state_after_alloc(sibling, Blocks([7, 8, 10]), 0)
    assert len(side.sidecar.of(ev.LoadAllocated)) == 1  # only the reader's blocks are read into

    for request in (*siblings, reader):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        side.request_finished(request, [[7, 8, 9]])
    assert side.sidecar.of(ev.RequestAborted) == side.sidecar.of(ev.RequestPreempted) == []  # the reader's load was consumed; siblings never claimed
    assert side.slots == {} and side.readers == {}


def test_siblings_go_on_when_the_reader_is_aborted_and_nothing_stays_behind():
    side = scheduler_side()
    reader, sibling = children(2)
    side.on_new_request(reader)
    side.on_new_request(sibling)
    side.get_num_new_matched_tokens(reader, 0)
    side.update_state_after_alloc(reader, Blocks([1, 2, 3]), 80)
    reader.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    assert side.get_num_new_matched_tokens(sibling, 0) == (None, False)
    # The client walked away: vLLM aborts every child.
    for request in (reader, sibling):
        request.status = RequestStatus.FINISHED_ABORTED
        side.request_finished(request, [[1, 2, 3]])
    assert [x.request for x in side.sidecar.of(ev.RequestAborted)] == [reader.request_id]
    assert side.sidecar.of(ev.RequestPreempted) == []
    assert side.slots == {} and side.readers == {}


def test_a_preempted_reader_lets_siblings_compute():
    side = scheduler_side()
    reader, sibling = children(2)
    side.on_new_request(reader)
    side.on_new_request(sibling)
    reader.status = RequestStatus.PREEMPTED
    assert side.get_num_new_matched_tokens(sibling, 0) == (0, False)
    assert len(side.sidecar.of(ev.LoadRequested)) == 1


def test_a_sibling_stops_waiting_at_its_bound(monkeypatch):
    side = scheduler_side()
    reader, sibling = children(2)
    side.on_new_request(reader)
    side.on_new_request(sibling)
    assert side.get_num_new_matched_tokens(sibling, 0) == (None, False)
    monkeypatch.setattr(c, "SIBLING_WAIT_S", 0.0)
    assert side.get_num_new_matched_tokens(sibling, 0) == (0, False)


def test_other_tickets_and_a_new_request_after_the_reader_finished_claim_their_own():
    side = scheduler_side()
    first = children(1)
    other = children(1)
    other[0].request_id = "other"
    side.on_new_request(first[0])
    side.on_new_request(other[0])
    assert len(side.sidecar.of(ev.LoadRequested)) == 2  # two handoffs, two claims
    # The same handoff again after its reader finished is a request of its own (P refuses the
    # second claim and it recomputes): the sibling rule covers requests that live together.
    first[0].status = RequestStatus.FINISHED_STOPPED
    side.request_finished(first[0], [[1, 2, 3]])
    again = children(1, ticket=first[0].kv_transfer_params["kvbaton"]["ticket"])
    again[0].request_id = "again"
    side.on_new_request(again[0])
    assert len(side.sidecar.of(ev.LoadRequested)) == 3
