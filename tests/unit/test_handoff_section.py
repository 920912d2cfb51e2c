"""P signs the handoff section it hands out and D checks it before it dials anything: a client
cannot point D at another address (even one inside peer_networks), alter what it claims, or use
a section long expired."""

from __future__ import annotations

import ipaddress

import pytest

from kvbaton.adapters.vllm.handoff import HandoffError, handoff_key, parse_handoff, sign_handoff
from kvbaton.adapters.vllm.identity import KvIdentity

KEY = handoff_key("3f9c1a7be2d84c06a5f1e93b7d20c4e8")
TRUSTED = ([ipaddress.ip_network("127.0.0.0/8")], set())
ME = KvIdentity("L", "W", 2, kv_heads=4)


def section(**changes) -> dict:
    fields = {"v": 1, "ticket": "a" * 32, "control": "127.0.0.1:5000", "engine": "P0", "num_tokens": 64,
              "layout": "L", "weights": "W", "tp": 2, "keepalive": "b" * 32, "abandon": "c" * 32, "instance": "d" * 32}
    return {**fields, **changes}


def params(kvbaton: dict) -> dict:
    return {"do_remote_prefill": True, "kvbaton": kvbaton}


def test_a_signed_section_passes_and_the_router_may_drop_its_abandon_capability():
    signed = sign_handoff(section(), KEY, ttl_s=120)
    assert parse_handoff(params(signed), ME, TRUSTED, KEY)["ticket"] == "a" * 32
    forwarded = {k: v for k, v in signed.items() if k != "abandon"}
    assert parse_handoff(params(forwarded), ME, TRUSTED, KEY)["control"] == "127.0.0.1:5000"


@pytest.mark.parametrize("field, value", [("control", "127.0.0.2:5000"), ("ticket", "e" * 32),
                                          ("num_tokens", 63), ("instance", "f" * 32), ("keepalive", "0" * 32),
                                          ("expires", 2**40), ("weights", "X"), ("tp", 1)])
def test_an_altered_section_is_refused_before_anything_is_dialled(field, value):
    signed = sign_handoff(section(), KEY, ttl_s=120)
    with pytest.raises(HandoffError, match="signature does not match"):
        parse_handoff(params({**signed, field: value}), ME, TRUSTED, KEY)


def test_unsigned_foreign_and_expired_sections_are_refused():
    with pytest.raises(HandoffError, match="not signed"):
        parse_handoff(params(section()), ME, TRUSTED, KEY)
    other = sign_handoff(section(), handoff_key("9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b"), ttl_s=120)
    with pytest.raises(HandoffError, match="another deployment secret"):
        parse_handoff(params(other), ME, TRUSTED, KEY)
    signed = sign_handoff(section(), KEY, ttl_s=120)
    assert parse_handoff(params(signed), ME, TRUSTED, KEY, now=signed["expires"] + 29)
    with pytest.raises(HandoffError, match="expired"):
        parse_handoff(params(signed), ME, TRUSTED, KEY, now=signed["expires"] + 31)
    with pytest.raises(HandoffError, match="cannot be signed|signature"):
        parse_handoff(params({**signed, "expires": 2**70}), ME, TRUSTED, KEY)


@pytest.mark.parametrize("identity, reason, words", [
    (KvIdentity("L", "W", 3, kv_heads=6), "tensor_parallel", "sizes 2 and 3 do not divide each other"),
    (KvIdentity("L", "W", 4, kv_heads=2), "tensor_parallel", "2 KV heads do not split over 4 ranks"),
    (KvIdentity("M", "W", 2), "layout", "layout fingerprint"),
    (KvIdentity("L", "V", 2), "weights", "other weights"),
])
def test_a_section_from_other_shapes_or_other_weights_is_refused_with_its_reason(identity, reason, words):
    signed = sign_handoff(section(), KEY, ttl_s=120)
    with pytest.raises(HandoffError, match=words) as refused:
        parse_handoff(params(signed), identity, TRUSTED, KEY)
    assert refused.value.reason == reason


@pytest.mark.parametrize("size", [1, 2, 4])
def test_sizes_that_divide_each_other_and_the_heads_are_read(size):
    signed = sign_handoff(section(), KEY, ttl_s=120)
    assert parse_handoff(params(signed), KvIdentity("L", "W", size, kv_heads=4), TRUSTED, KEY)["tp"] == 2


def test_every_refusal_names_its_reason():
    signed = sign_handoff(section(), KEY, ttl_s=120)
    cases = [(section(), "unsigned"), ({**signed, "num_tokens": 1}, "forged"),
             (sign_handoff(section(control="10.0.0.1:5000"), KEY, ttl_s=120), "untrusted_control"),
             ({k: v for k, v in signed.items() if k != "weights"}, "invalid")]
    for kvbaton, reason in cases:
        with pytest.raises(HandoffError) as refused:
            parse_handoff(params(kvbaton), ME, TRUSTED, KEY)
        assert refused.value.reason == reason, (kvbaton, refused.value)
    with pytest.raises(HandoffError) as refused:
        parse_handoff(params(signed), ME, TRUSTED, KEY, now=signed["expires"] + 60)
    assert refused.value.reason == "expired"
