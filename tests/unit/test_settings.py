"""The connector's settings: the keys a user sets, what is derived from them, the gated test hooks,
errors that name the bad key, and the generated reference page."""

from __future__ import annotations

import pytest

from kvbaton.adapters.vllm import settings as S
from kvbaton.adapters.vllm.settings import SettingsError, parse_settings


def test_defaults_and_derived_values():
    s = parse_settings({})
    assert (s.unclaimed_ttl_s, s.claim_lease_s, s.peer_timeout_s) == (120.0, 600.0, 10.0)
    assert s.claim_wait_s == s.read_grant_wait_s == 30.0
    assert s.heartbeat_interval_s == 10.0 and s.history_lease_s == 120.0
    assert s.history_scope == "handoff" and s.test_hooks == S.TestHooks()
    config = s.ledger_config(block_bytes=1 << 20, cpu_default_bytes=7 << 20)
    assert config.candidate_bytes_max == s.gpu_history_bytes and config.cpu_history_bytes == 7 << 20
    assert config.retention_deadline_ns == int(S.RETENTION_DEADLINE_S * 1e9)
    # D heartbeats well inside the shorter of the two lifetimes it must keep alive.
    short = parse_settings({"unclaimed_ttl_s": 60, "claim_lease_s": 6, "peer_timeout_s": 2})
    assert short.heartbeat_interval_s == 0.5 and short.claim_wait_s == 6.0 and short.history_lease_s == 60


def test_unknown_keys_are_named():
    with pytest.raises(SettingsError, match=r"unknown kv_connector_extra_config key 'gpu_histroy_bytes' "
                                            r"\(did you mean gpu_history_bytes\?\)"):
        parse_settings({"gpu_histroy_bytes": 1})
    with pytest.raises(SettingsError, match=r"unknown kv_connector_extra_config key 'history_plain_requests' "
                                            r"\(did you mean history_gate, history_scope\?\)"):
        parse_settings({"history_plain_requests": True})
    with pytest.raises(SettingsError, match="unknown kv_connector_extra_config key 'landing_bytes'$"):
        parse_settings({"landing_bytes": 0})  # a test hook, not a setting


@pytest.mark.parametrize("extra, named", [
    ({"unclaimed_ttl_s": 0}, "'unclaimed_ttl_s'"),
    ({"claim_lease_s": float("nan")}, "'claim_lease_s'"),
    ({"peer_timeout_s": float("inf")}, "'peer_timeout_s'"),
    ({"gpu_history_bytes": -1}, "'gpu_history_bytes'"),
    ({"cpu_history_bytes": -2}, "'cpu_history_bytes'"),
    ({"history_scope": "plain"}, "'history_scope'"),
    ({"control_port": 65536}, "'control_port'"),
    ({"event_log_dir": 3}, "'event_log_dir'"),
    ({"peer_networks": "10.0.0.0/8,not a host!"}, "'peer_networks'"),
])
def test_bad_values_are_named(extra, named):
    with pytest.raises(SettingsError, match=named):
        parse_settings(extra)


def test_test_hooks_need_the_environment(monkeypatch):
    monkeypatch.delenv(S.TEST_HOOKS_ENV, raising=False)
    with pytest.raises(SettingsError, match=f"'test_hooks' is for tests and benchmarks only.*{S.TEST_HOOKS_ENV}=1"):
        parse_settings({"test_hooks": {"reads_per_load": 2}})
    monkeypatch.setenv(S.TEST_HOOKS_ENV, "0")
    with pytest.raises(SettingsError, match="'test_hooks'"):
        parse_settings({"test_hooks": {}})
    assert parse_settings({}).test_hooks == S.TestHooks()  # no hooks: nothing to refuse
    monkeypatch.setenv(S.TEST_HOOKS_ENV, "1")
    s = parse_settings({"test_hooks": {"reads_per_load": 2, "heartbeat_interval_s": 1, "claim_wait_s": 5,
                                       "history_lease_s": 2, "transport": "local"}})
    assert s.test_hooks.reads_per_load == 2 and s.test_hooks.transport == "local"
    assert (s.heartbeat_interval_s, s.claim_wait_s, s.history_lease_s) == (1.0, 5.0, 2.0)
    with pytest.raises(SettingsError, match="'test_hooks'.*unknown field `reads`"):
        parse_settings({"test_hooks": {"reads": 2}})
    with pytest.raises(SettingsError, match="'test_hooks.landing_bytes'"):
        parse_settings({"test_hooks": {"landing_bytes": -2}})
    with pytest.raises(SettingsError, match="'test_hooks.pause_between_reads_s'"):
        parse_settings({"test_hooks": {"pause_between_reads_s": float("nan")}})


def test_the_settings_reference_is_current():
    """docs/reference/SETTINGS.md is generated from settings.py: regenerate it with
    `python -m kvbaton.adapters.vllm.settings` after changing a setting."""
    assert S.REFERENCE_PATH.exists(), "run python -m kvbaton.adapters.vllm.settings"
    assert S.REFERENCE_PATH.read_text() == S.settings_reference(), \
        "docs/reference/SETTINGS.md is stale: run python -m kvbaton.adapters.vllm.settings"
    text = S.settings_reference()
    for name in S.Settings.__struct_fields__ + S.TestHooks.__struct_fields__:
        assert f"`{name}`" in text, name
