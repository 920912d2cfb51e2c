"""`kvbaton serve`'s routing settings: what started engines are told (KV events on a private
socket, the hash algorithm pinned, the seed), and attach mode's events endpoints."""

from __future__ import annotations

import argparse
import json
import os
import stat

import pytest

from kvbaton.router.routing import RoutingConfig
from kvbaton.deploy.serve import Deployment, EngineSpec, add_serve_arguments, deployment_from_args


def deployment(tmp_path, **kwargs) -> Deployment:
    specs = [EngineSpec("prefill", 8100, 7100, "cpu:0", 1 << 20), EngineSpec("decode", 8101, 7101, "cpu:0", 1 << 20)]
    return Deployment("m", tokenizer="tok", served_model_name="m", log_dir=tmp_path, specs=specs, block_size=32,
                      max_model_len=512, load_format="dummy", extra_engine_args=[], **kwargs)


def test_started_engines_publish_kv_events_on_private_sockets_and_pin_the_hash(tmp_path, monkeypatch):
    dep = deployment(tmp_path, routing=RoutingConfig(hash_seed="7"))
    monkeypatch.setattr(dep, "wait_healthy", lambda progress, timeout_s: None)
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: None)
    dep.start(lambda text: None)
    try:
        cmd, env = dep._command(dep.specs[0])
        events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
        assert events["enable_kv_cache_events"] and events["endpoint"].startswith("ipc://")
        folder = events["endpoint"][len("ipc://"):].rsplit("/", 1)[0]
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert cmd[cmd.index("--prefix-caching-hash-algo") + 1] == "sha256"
        assert env["PYTHONHASHSEED"] == "7"
        config = dep.routing_config()
        assert config.block_size == 32 and config.tokenizer == "tok"
        assert set(config.kv_events) == {"http://127.0.0.1:8100", "http://127.0.0.1:8101"}
    finally:
        dep.engines = []
        dep.stop()
    assert not os.path.exists(folder)


def test_round_robin_starts_engines_without_events(tmp_path, monkeypatch):
    dep = deployment(tmp_path, routing=RoutingConfig(mode="round-robin"))
    monkeypatch.setattr(dep, "wait_healthy", lambda progress, timeout_s: None)
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: None)
    dep.start(lambda text: None)
    assert "--kv-events-config" not in dep._command(dep.specs[0])[0]


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_attach_mode_takes_one_events_endpoint_per_engine(tmp_path):
    args = parse("--model", "m", "--log-dir", str(tmp_path), "--prefill-url", "http://a:1", "--prefill-url",
                 "http://b:1", "--prefill-events", "tcp://a:5557", "--decode-url", "http://c:1",
                 "--disaggregate-below", "0.7")
    dep = deployment_from_args(args)
    assert dep.attach_prefill_events == ["tcp://a:5557", ""]
    assert dep.attach_decode_events == [""]
    assert dep.routing.disaggregate_below == 0.7 and dep.routing.mode == "cache-aware"
    with pytest.raises(ValueError, match="--decode-events was given 2 times for 1 engine URL"):
        deployment_from_args(parse("--model", "m", "--log-dir", str(tmp_path), "--prefill-url", "http://a:1",
                                   "--decode-url", "http://c:1", "--decode-events", "tcp://c:1",
                                   "--decode-events", "tcp://c:2"))
    with pytest.raises(ValueError, match="not a ZeroMQ endpoint"):
        deployment_from_args(parse("--model", "m", "--log-dir", str(tmp_path), "--prefill-url", "http://a:1",
                                   "--prefill-events", "http://a:5557", "--decode-url", "http://c:1"))


def test_a_batch_prompt_limit_below_one_is_refused_before_anything_starts(tmp_path, capsys):
    from kvbaton.deploy.serve import run_serve

    assert parse("--log-dir", str(tmp_path)).max_batch_prompts is None  # the router's default (16)
    assert run_serve(parse("--log-dir", str(tmp_path), "--max-batch-prompts", "0")) == 2
    assert "--max-batch-prompts must be at least 1, not 0" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # no engine, no model was set up


def test_the_api_key_file_must_be_private_and_not_empty(tmp_path):
    from kvbaton.deploy.serve import read_api_key_file

    assert read_api_key_file(None) is None
    path = tmp_path / "key"
    path.write_text("sk-kvbaton-test\n")
    path.chmod(0o600)
    assert read_api_key_file(str(path)) == "sk-kvbaton-test"
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        read_api_key_file(str(path))
    path.write_text("  \n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="is empty"):
        read_api_key_file(str(path))
    with pytest.raises(ValueError, match="No such file"):
        read_api_key_file(str(tmp_path / "missing"))


def test_the_router_runs_on_uvloop_where_installed_and_says_when_it_was_asked_for_and_is_missing(monkeypatch):
    import sys

    from kvbaton.deploy.serve import ServeError, event_loop_factory

    assert event_loop_factory("asyncio") is None
    uvloop = pytest.importorskip("uvloop")
    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed
    assert event_loop_factory("auto") is None
    with pytest.raises(ServeError, match="uvloop is not installed"):
        event_loop_factory("uvloop")
