"""How many streamed tokens per second `bench/pd_compare.py`'s harness (its load generator and
kvbaton's router) can carry, with engines that cost nothing: a fake P answers at once, a fake D
streams one SSE event per token every `--tpot-ms`. When pd_compare's figures come near this
ceiling, they measure the harness, not the connectors.

    python -m kvbaton.bench.harness_ceiling --concurrency 16,32 --router thread,process

`--router thread` is how pd_compare ran until 2026-12-01 (`--no-router-process`): the router in a
thread of the process that also runs the load generator, one GIL for both. `process` starts it
as its own process (`kvbaton serve` attached to the engines), as pd_compare now does. Prints
achieved tok/s against the engines' rate (concurrency / TPOT).
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations.
import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def fake_engine_app(tpot_s: float):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": "model", "object": "model"}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if not body.get("stream"):  # P: one token and the handoff's parameters
            return JSONResponse({"choices": [{"index": 0, "text": "", "token_ids": [7], "finish_reason": "length"}],
                                 "kv_transfer_params": {"fake": True}})
        max_tokens = int(body.get("max_tokens") or 16)

        async def events():
            for index in range(max_tokens):
                await asyncio.sleep(tpot_s)
                chunk = {"id": "x", "object": "text_completion", "model": "model",
                         "choices": [{"index": 0, "text": "", "token_ids": [index % 100 + 3],
                                      "finish_reason": "length" if index == max_tokens - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve_fake_engine(port: int, tpot_s: float) -> None:
    import uvicorn

    uvicorn.run(fake_engine_app(tpot_s), host="127.0.0.1", port=port, log_level="warning")


def serve_router(port: int, p_url: str, d_url: str) -> None:
    import uvicorn

    from kvbaton.router.app import Router, build_app

    uvicorn.run(build_app(Router([p_url], [d_url])), host="127.0.0.1", port=port, log_level="warning")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def spawn(target: str, *args: str) -> subprocess.Popen:
    code = f"from kvbaton.bench.harness_ceiling import {target}; {target}(*{list(args)!r})"
    return subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ))


def main(argv: list[str] | None = None) -> int:
    from kvbaton.bench.pd_clients import throughput_in_processes
    from kvbaton.bench.pd_stack import free_port, router_command, wait_healthy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[16, 32])
    parser.add_argument("--router", default="thread,process", help="thread, process or both (comma list)")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--client-processes", type=lambda v: [int(x) for x in v.split(",")], default=[1],
                        help="load-generator processes to try (comma list)")
    parser.add_argument("--tpot-ms", type=float, default=3.0, help="the fake D's time per token")
    parser.add_argument("--out", default="", help="also write the rows as JSON here")
    args = parser.parse_args(argv)

    p_port, d_port = free_port(), free_port()
    engines = [spawn("serve_fake_engine", p_port, args.tpot_ms / 1e3),
               spawn("serve_fake_engine", d_port, args.tpot_ms / 1e3)]
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    rows = []
    scratch = tempfile.TemporaryDirectory(prefix="kvb-harness-")  # the router's log folder
    try:
        wait_healthy(p_url, 60, engines[0])
        wait_healthy(d_url, 60, engines[1])
        docs = [[5] * 64 for _ in range(args.requests)]
        for mode in [m for m in args.router.split(",") if m]:
            port = free_port()
            router_proc = None
            if mode == "thread":  # (a daemon thread: it ends with this process)
                threading.Thread(target=serve_router, args=(port, p_url, d_url), daemon=True).start()
            elif mode == "process":
                router_proc = subprocess.Popen(router_command(p_url, d_url, port, Path(scratch.name)))
            else:
                raise SystemExit(f"--router takes thread or process, got {mode!r}")
            url = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(url, 60, router_proc)
                for procs in args.client_processes:
                    for concurrency in args.concurrency:
                        result = throughput_in_processes(url, docs, concurrency, args.max_tokens, procs)
                        ideal = concurrency / (args.tpot_ms / 1e3)
                        rows.append((mode, procs, concurrency, result["output_tok_s"], ideal, result["tpot_p50_ms"]))
                        print(json.dumps({"router": mode, "client_processes": procs, "concurrency": concurrency,
                                          "ideal_tok_s": ideal, **result}), flush=True)
            finally:
                if router_proc is not None:
                    stop(router_proc)
    finally:
        for proc in engines:
            stop(proc)
        scratch.cleanup()
    if args.out:
        with open(args.out, "w") as stream:
            json.dump([dict(zip(("router", "client_processes", "concurrency", "tok_s", "engines_tok_s", "tpot_p50_ms"),
                                row)) for row in rows], stream, indent=1)
    print(f"\n{'router':<9}{'clients':>8}{'C':>4}{'tok/s':>9}{'engines could':>15}{'carried':>9}{'TPOT p50':>10}")
    for mode, procs, concurrency, tok_s, ideal, tpot in rows:
        print(f"{mode:<9}{procs:>8}{concurrency:>4}{tok_s:>9.0f}{ideal:>15.0f}{tok_s / ideal:>9.0%}{tpot:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
