"""A minimal OpenAI `/v1/completions` server over vLLM's AsyncLLM, for benchmarks.

Why it exists: the GPU machines get vLLM as a slim kit that runs `LLM` and `AsyncLLM` but not
`vllm serve` (its OpenAI server imports a dozen packages the kit leaves out). The P/D benchmark
needs real HTTP engines behind the real router, and the *same* engine server for kvbaton and for
vLLM's native NixlConnector, so this one file serves both. It speaks the subset the router and
the benchmark use: token-id prompts, greedy or sampled decoding, streaming, `kv_transfer_params`
in and out (the P/D protocol), `/health` and `/v1/models`.

    python -m kvbaton.bench.lite_server --model DIR --port 8100 --kv-transfer-config '{...}' \
        [--engine-arg key=value ...]
"""


import argparse
import asyncio
import json
import logging
import time
import uuid

logger = logging.getLogger("kvbaton.bench.lite_server")


def parse_engine_args(pairs: list[str]) -> dict:
    """`key=value` pairs; values are JSON when they parse as JSON (numbers, booleans), else text."""

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg wants key=value, got {pair!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


def build_app(engine, model_name: str):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    app = FastAPI()

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}},
                            status_code=status)

    @app.get("/health")
    async def health():
        await engine.check_health()
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model"}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return error(400, "this server takes 'prompt' as a non-empty list of token ids")
        max_tokens = body.get("max_tokens") or 16
        stream = bool(body.get("stream"))
        extra_args = {}
        if body.get("kv_transfer_params"):
            extra_args["kv_transfer_params"] = body["kv_transfer_params"]
        params = SamplingParams(
            max_tokens=int(max_tokens), temperature=float(body.get("temperature", 0.0) or 0.0),
            ignore_eos=bool(body.get("ignore_eos", True)), detokenize=False,
            seed=body.get("seed"), extra_args=extra_args or None,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        request_id = str(body.get("request_id") or f"cmpl-{uuid.uuid4().hex}")
        created = int(time.time())
        generator = engine.generate({"prompt_token_ids": prompt}, params, request_id)

        if not stream:
            final = None
            try:
                async for output in generator:
                    final = output
            except asyncio.CancelledError:
                await engine.abort(request_id)
                raise
            if final is None or not final.outputs:
                return error(500, f"request {request_id} produced no output")
            completion = final.outputs[0]
            return JSONResponse({
                "id": request_id, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "text": "", "token_ids": list(completion.token_ids),
                             "finish_reason": completion.finish_reason}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion.token_ids),
                          "total_tokens": len(prompt) + len(completion.token_ids)},
                "kv_transfer_params": final.kv_transfer_params,
            })

        async def events():
            try:
                async for output in generator:
                    completion = output.outputs[0]
                    chunk = {"id": request_id, "object": "text_completion", "created": created,
                             "model": model_name,
                             "choices": [{"index": 0, "text": "", "token_ids": list(completion.token_ids),
                                          "finish_reason": completion.finish_reason}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                await engine.abort(request_id)
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", default="model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kv-transfer-config", default="", help="JSON, as for vllm serve")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="an AsyncEngineArgs field as key=value (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_kwargs = {"model": args.model, "skip_tokenizer_init": True, "load_format": "dummy",
                     "seed": 0, "enforce_eager": True, **parse_engine_args(args.engine_arg)}
    if args.kv_transfer_config:
        from vllm.config import KVTransferConfig

        engine_kwargs["kv_transfer_config"] = KVTransferConfig(**json.loads(args.kv_transfer_config))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))
    app = build_app(engine, args.served_model_name)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=3)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
