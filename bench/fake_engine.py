"""An OpenAI-style engine that costs nothing, for testing the bench's own tools (the router as its
own process, the load generator spread over processes) without vLLM: a P request (not streamed)
is answered at once with one token and handoff parameters, a D request streams one SSE event per
token every `tpot_s`."""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations.
import asyncio
import json
import os
import signal
import subprocess
import sys


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
            choice = {"index": 0, "text": "", "token_ids": [7], "finish_reason": "length"}
            prompt = body.get("prompt")
            if body.get("return_token_ids") and isinstance(prompt, list) and prompt and type(prompt[0]) is int:
                choice["prompt_token_ids"] = prompt  # as vLLM: the router's first-token path reads it
            return JSONResponse({"choices": [choice], "kv_transfer_params": {"fake": True}})
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

    uvicorn.run(fake_engine_app(float(tpot_s)), host="127.0.0.1", port=int(port), log_level="warning")


def spawn_fake_engine(port: int, tpot_s: float) -> subprocess.Popen:
    """A fake engine in its own process (its own GIL, as a real engine has)."""
    code = f"from kvbaton.bench.fake_engine import serve_fake_engine; serve_fake_engine({int(port)}, {float(tpot_s)!r})"
    return subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ))


def stop(process: subprocess.Popen) -> None:
    """Terminate a process and its whole session (a server started with `start_new_session=True`
    leads one, and its engine core is a child in it); kill them if the process has not ended
    within 10 s."""

    try:  # a leader's group outlives it while any member is alive
        leads = os.getpgid(process.pid) == process.pid
    except ProcessLookupError:
        leads = False

    def signal_all(sig) -> None:
        try:
            if leads:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    signal_all(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        signal_all(signal.SIGKILL)
        process.wait(10)
    signal_all(signal.SIGKILL)  # a child that ignored SIGTERM while its parent exited
