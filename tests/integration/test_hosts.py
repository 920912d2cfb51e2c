"""P, D and the router on three separate "hosts" (network namespaces made here, see hosts.py):
nothing passes between them but the network. The sidecars listen on routable addresses, so they
run with an explicit deployment secret; NIXL moves the KV over UCX's TCP transport; D trusts only
the hosts' network (`peer_networks`). Checked: outputs equal a single engine's, the prompt came
from the transfer, nothing is left open, and a P restarted at the same address and port gives a
miss at once for its old tickets and hits for new ones."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl._api")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kvbaton.adapters.vllm.tiny_model import build_tiny_model, tiny_prompt, words_for  # noqa: E402
from kvbaton.control.client import call_authority_sync, free_port  # noqa: E402
from kvbaton.control.guard import resolve_secret  # noqa: E402
from kvbaton.router.serve import Deployment, EngineSpec  # noqa: E402

from .hosts import Hosts, can_make_hosts  # noqa: E402

pytestmark = pytest.mark.integration
MODEL = "tiny"

_why_not = can_make_hosts()
if _why_not:
    pytest.skip(f"separate hosts need network namespaces: {_why_not}", allow_module_level=True)


def engine_spec(hosts: Hosts, role: str, name: str, core: int, events: Path) -> EngineSpec:
    host = hosts.address(name)
    extra = {"control_host": host, "peer_networks": "198.18.0.0/15", "event_log_dir": str(events),
             "heartbeat_interval_s": 1}
    env = {"KVBATON_SECRET": resolve_secret(), "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
    return EngineSpec(role, 8100 if role == "prefill" else 8200, free_port("127.0.0.1"), f"cpu:{core}", 64 << 20,
                      extra, host=host, prefix=hosts.prefix(name), env=env)


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("hosts")
    model_dir = build_tiny_model(root / "model")
    hosts = Hosts(["p", "p2", "d", "r"])
    events = root / "events"
    specs = [engine_spec(hosts, "prefill", "p", 0, events), engine_spec(hosts, "prefill", "p2", 1, events),
             engine_spec(hosts, "decode", "d", 1, events)]
    deployment = Deployment(str(model_dir), tokenizer=str(model_dir / "tokenizer"), served_model_name=MODEL,
                            log_dir=root, specs=specs, block_size=32, max_model_len=2048, load_format="dummy",
                            extra_engine_args=[])
    router = None
    router_log = open(root / "router.log", "wb")
    try:
        deployment.start(lambda text: None, timeout_s=400)
        r_host = hosts.address("r")
        router = subprocess.Popen(
            hosts.prefix("r") + [sys.executable, "-m", "kvbaton.cli", "serve", "--log-dir", str(root / "router"),
                                 "--prefill-url", deployment.prefill_urls[0], "--prefill-url",
                                 deployment.prefill_urls[1], "--decode-url", deployment.decode_urls[0],
                                 "--host", r_host, "--port", "8000"],
            stdout=router_log, stderr=subprocess.STDOUT,
            env={**__import__("os").environ, "KVBATON_SECRET": resolve_secret()})
        url = f"http://{r_host}:8000"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert router.poll() is None and time.monotonic() < deadline, (root / "router.log").read_text()
            time.sleep(0.3)
        yield hosts, deployment, url, root
    finally:
        if router is not None:
            router.terminate()
            try:
                router.wait(20)
            except subprocess.TimeoutExpired:
                router.kill()
        router_log.close()
        deployment.stop()
        hosts.close()


def d_state(deployment) -> dict:
    return call_authority_sync(deployment.controls("decode")[deployment.decode_urls[0]], "debug_state")


def p_state(deployment, index: int = 0) -> dict:
    return call_authority_sync(deployment.controls("prefill")[deployment.prefill_urls[index]], "debug_state")


def reference(deployment, prompt: str, max_tokens: int) -> str:
    direct = openai.OpenAI(base_url=f"{deployment.decode_urls[0]}/v1", api_key="x", max_retries=0)
    return direct.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def wait_closed(deployment, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s

    def open_records():
        return [p_state(deployment, i)["open"] for i in range(len(deployment.prefill_urls))] + \
            [d_state(deployment)["open"]]

    while any(any(o.values()) for o in open_records()):
        assert time.monotonic() < deadline, open_records()
        time.sleep(0.3)


@pytest.mark.parametrize("words", [40, 400])
def test_handoff_across_hosts_equals_a_single_engine(net, words):
    hosts, deployment, url, _root = net
    prompt = words_for(tiny_prompt(words, seed=700 + words))
    before = d_state(deployment)["counters"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    after = d_state(deployment)
    assert after["counters"].get("loads.done", 0) == before.get("loads.done", 0) + 1  # from the transfer
    assert after["transfer"]["bytes"] > 0
    assert text == reference(deployment, prompt, 10)
    wait_closed(deployment)
    # The control addresses are the hosts' own, never loopback.
    assert p_state(deployment)["counters"].get("peers.refused.unauthenticated", 0) == 0


def test_two_prefill_hosts_and_one_decode_host_serve_a_stream_with_every_handoff_loaded(net):
    hosts, deployment, url, _root = net
    prompts = [words_for(tiny_prompt(100 + 40 * i, seed=900 + i)) for i in range(6)]
    before_d = d_state(deployment)["counters"]
    before_p = [p_state(deployment, i)["counters"] for i in range(2)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    for prompt in prompts:
        text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        assert text == reference(deployment, prompt, 6)
    after_d = d_state(deployment)
    assert after_d["counters"].get("loads.done", 0) - before_d.get("loads.done", 0) == len(prompts)
    assert after_d["transfer"].get("timed_out", 0) == 0
    issued = [p_state(deployment, i)["counters"].get("tickets.issued", 0) - before_p[i].get("tickets.issued", 0)
              for i in range(2)]
    assert issued == [3, 3], issued  # round robin: both prefill hosts handed off
    wait_closed(deployment)


def test_a_p_restarted_at_the_same_address_misses_old_tickets_at_once(net):
    hosts, deployment, url, _root = net
    prompt = words_for(tiny_prompt(120, seed=801))
    p_url = deployment.prefill_urls[0]
    p_reply = httpx.post(f"{p_url}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=120).json()
    old_params = p_reply["kv_transfer_params"]
    assert old_params["kvbaton"]["control"].startswith(hosts.address("p"))
    engine = next(e for e in deployment.engines if e.spec.role == "prefill" and e.spec.host == hosts.address("p"))
    hosts.kill_all("p")  # P's host dies...
    engine.process.wait(30)
    deployment.engines.remove(engine)
    restarted = Deployment(deployment.model, tokenizer=deployment.tokenizer, served_model_name=MODEL,
                           log_dir=deployment.log_dir / "restart", specs=[engine.spec], block_size=32,
                           max_model_len=2048, load_format="dummy", extra_engine_args=[])
    restarted.start(lambda text: None, timeout_s=400)  # ...and comes back at the same address and port
    deployment.engines[:0] = restarted.engines  # first again: prefill_urls keeps its order
    before = d_state(deployment)["counters"]
    started = time.monotonic()
    d_reply = httpx.post(f"{deployment.decode_urls[0]}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "kv_transfer_params": old_params},
        timeout=120)
    took = time.monotonic() - started
    after = d_state(deployment)["counters"]
    assert d_reply.status_code == 200 and d_reply.json()["choices"][0]["text"] == reference(deployment, prompt, 8)
    assert after.get("peers.refused.stale_instance", 0) == before.get("peers.refused.stale_instance", 0) + 1
    assert took < 6.0, took  # a miss at once, not the unknown-ticket retries (8 s)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    fresh = words_for(tiny_prompt(200, seed=802))
    before = d_state(deployment)["counters"]
    assert client.completions.create(model=MODEL, prompt=fresh, max_tokens=8,
                                     temperature=0).choices[0].text == reference(deployment, fresh, 8)
    assert d_state(deployment)["counters"].get("loads.done", 0) == before.get("loads.done", 0) + 1
    wait_closed(deployment)
