"""The replay window: a sidecar answers a peer call once, only within the freshness window, only
when it is addressed to its own instance, and never forgets a nonce while it could still pass."""

from __future__ import annotations

import msgspec

from kvbaton.control import peer as pc

ME, OTHER = "a" * 32, "b" * 32
SECOND = 10**9


def envelope(call=None, to=ME, sent_ns=100 * SECOND, nonce=None) -> pc.Envelope:
    raw = pc.seal(call or pc.Release("t1", "D", 1), to, "D", now_ns=sent_ns)
    decoded = pc.decode_call(raw)
    return decoded if nonce is None else msgspec.structs.replace(decoded, nonce=nonce)


def test_a_call_is_answered_once_and_only_when_fresh_and_addressed_here():
    window = pc.ReplayWindow(window_ns=30 * SECOND)
    call = envelope()
    assert window.refusal(call, ME, 100 * SECOND) is None
    assert window.refusal(call, ME, 101 * SECOND) == "replayed"
    assert window.refusal(envelope(sent_ns=60 * SECOND), ME, 100 * SECOND) == "stale"
    assert window.refusal(envelope(sent_ns=140 * SECOND), ME, 100 * SECOND) == "stale"
    assert window.refusal(envelope(to=OTHER), ME, 100 * SECOND) == "misaddressed"
    assert window.refusal(envelope(to=""), ME, 100 * SECOND) == "misaddressed"
    assert window.refusal(envelope(pc.State(), to=""), ME, 100 * SECOND) is None
    assert window.refusal(envelope(pc.Residency(), to=""), ME, 100 * SECOND) is None


def test_nonces_are_forgotten_once_stale_and_a_full_window_raises_its_floor():
    window = pc.ReplayWindow(window_ns=30 * SECOND, capacity=3)
    sent = [envelope(sent_ns=(100 + i) * SECOND) for i in range(5)]
    for i, call in enumerate(sent):
        assert window.refusal(call, ME, (100 + i) * SECOND) is None
    # Over capacity, the two oldest were forgotten while still fresh: nothing sent at or before
    # the newer of them passes any more, so neither can be replayed.
    assert len(window.seen) == 3 and window.floor_ns == 101 * SECOND
    assert window.refusal(sent[0], ME, 105 * SECOND) == "stale"
    assert window.refusal(sent[1], ME, 105 * SECOND) == "stale"
    assert window.refusal(sent[4], ME, 105 * SECOND) == "replayed"
    # Past the window every nonce goes; the floor stays where it was.
    assert window.refusal(envelope(sent_ns=200 * SECOND), ME, 200 * SECOND) is None
    assert list(window.seen.values()) == [200 * SECOND]


def test_the_envelope_is_checked_before_the_call_is_used():
    raw = msgspec.msgpack.encode(["D", ME, 1, "0" * 32, {"op": "claim", "ticket": "t", "claimer": "D", "epoch": 1}])
    assert pc.decode_call(raw).call == pc.Claim("t", "D", 1)
    for bad in (["D", ME, -1, "0" * 32, {"op": "state"}], ["D", "xyz", 1, "0" * 32, {"op": "state"}],
                ["D", ME, 1, "short", {"op": "state"}], {"op": "state"}):
        try:
            pc.decode_call(msgspec.msgpack.encode(bad))
        except pc.PeerRefusal as refusal:
            assert refusal.reason == "invalid"
        else:
            raise AssertionError(f"decoded {bad!r}")
