"""A minimal OpenAI `/v1/completions` server over vLLM's AsyncLLM, for benchmarks.

Why it exists: the GPU machines get vLLM as a slim kit that runs `LLM` and `AsyncLLM` but not
`vllm serve` (its OpenAI server imports a dozen packages the kit leaves out). The P/D benchmark
needs real HTTP engines behind the real router, and the *same* engine server for kvbaton and for
vLLM's native NixlConnector, so this one file serves both. It speaks the subset the router and
the benchmark use: token-id prompts, greedy or sampled decoding, streaming, `kv_transfer_params`
in and out (the P/D protocol), `/health` and `/v1/models`.

Text prompts too, when the engine has a tokenizer: `--tokenizer DIR`, or found beside the model
(a `tokenizer.json` or `tokenizer_config.json` in the model folder or in its `tokenizer/`
subfolder, where `kvbaton.testing.tiny_model.build_tiny_model` writes one). Without one the
engine starts with `skip_tokenizer_init=True` as before and takes token ids only. A token-id
prompt is never detokenized (`text` stays ""); a text prompt's output is (`text` filled), as
`vllm bench serve` and other OpenAI clients expect. Streams honour
`stream_options: {"include_usage": true}` (a last chunk with `choices: []` and `usage`, as vLLM's
server sends) and `continuous_usage_stats` (usage on every chunk).

    python -m kvbaton.bench.lite_server --model DIR --port 8100 --kv-transfer-config '{...}' \
        [--tokenizer DIR|none] [--engine-arg key=value ...]
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def find_tokenizer(model: str) -> str | None:
    """The folder of the tokenizer that goes with a model folder: the folder itself when it holds
    `tokenizer.json` or `tokenizer_config.json`, else its `tokenizer/` subfolder when that does
    (build_tiny_model's layout), else None (a model given by name, or weights without one)."""

    from pathlib import Path

    root = Path(model)
    for folder in (root, root / "tokenizer"):
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            return str(folder)
    return None


def tokenizer_args(model: str, tokenizer: str = "") -> dict:
    """The engine arguments for the tokenizer: an explicit folder, 'none' (token ids only), or
    what find_tokenizer finds (nothing found: token ids only, as this server always did)."""

    if tokenizer.lower() == "none":
        return {"skip_tokenizer_init": True}
    found = tokenizer or find_tokenizer(model)
    if not found:
        return {"skip_tokenizer_init": True}
    return {"skip_tokenizer_init": False, "tokenizer": found}


# Requests whose moments this server keeps for `GET /bench/stamps` (the most recent).
STAMPS_KEPT = 4096


def build_app(engine, model_name: str, takes_text: bool | None = None):
    from collections import deque

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    app = FastAPI()
    # Each request's moments on this host's monotonic clock (the one kvbaton's event logs use):
    # received (the handler ran), started (the engine was handed the request) and answered (the
    # whole answer, or a stream's first chunk). The benchmark joins them with the event logs'
    # slowest loads by request id: vLLM's id for a request is this server's id plus a suffix.
    stamps: deque = deque(maxlen=STAMPS_KEPT)
    if takes_text is None:
        # Text prompts need the engine's tokenizer (one built with skip_tokenizer_init has none).
        takes_text = not getattr(getattr(engine, "model_config", None), "skip_tokenizer_init", True)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}},
                            status_code=status)

    @app.get("/health")
    async def health():
        await engine.check_health()
        return JSONResponse({})

    @app.get("/bench/stamps")
    async def bench_stamps():
        return JSONResponse({"stamps": list(stamps)})

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model"}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        received_ns = time.monotonic_ns()
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        text_prompt = isinstance(prompt, str)
        if text_prompt:
            if not takes_text:
                return error(400, "this server was started without a tokenizer: it takes 'prompt' as a "
                                  "non-empty list of token ids")
            if not prompt:
                return error(400, "'prompt' is empty")
        elif not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return error(400, "this server takes 'prompt' as a non-empty list of token ids"
                         + (" or a string" if takes_text else ""))
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            return error(400, "'stream_options' must be an object")
        max_tokens = body.get("max_tokens") or 16
        stream = bool(body.get("stream"))
        extra_args = {}
        if body.get("kv_transfer_params"):
            extra_args["kv_transfer_params"] = body["kv_transfer_params"]
        params = SamplingParams(
            max_tokens=int(max_tokens), temperature=float(body.get("temperature", 0.0) or 0.0),
            ignore_eos=bool(body.get("ignore_eos", True)), detokenize=text_prompt,
            seed=body.get("seed"), extra_args=extra_args or None,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        request_id = str(body.get("request_id") or f"cmpl-{uuid.uuid4().hex}")
        stamp = {"id": request_id, "received_ns": received_ns}
        stamps.append(stamp)
        created = int(time.time())
        if text_prompt:
            add_special = bool(body.get("add_special_tokens", True))
            generator = engine.generate({"prompt": prompt}, params, request_id,
                                        tokenization_kwargs={"add_special_tokens": add_special})
        else:
            generator = engine.generate({"prompt_token_ids": prompt}, params, request_id)

        def usage(prompt_tokens: int, completion_tokens: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        def prompt_len(output) -> int:
            ids = getattr(output, "prompt_token_ids", None)
            return len(ids) if ids is not None else (0 if text_prompt else len(prompt))

        if not stream:
            final = None
            stamp["started_ns"] = time.monotonic_ns()
            try:
                async for output in generator:
                    final = output
            except asyncio.CancelledError:
                await engine.abort(request_id)
                raise
            if final is None or not final.outputs:
                return error(500, f"request {request_id} produced no output")
            completion = final.outputs[0]
            choice = {"index": 0, "text": (completion.text or "") if text_prompt else "",
                      "token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason}
            if body.get("return_token_ids"):  # as vLLM's server (the router's first-token path reads it)
                choice["prompt_token_ids"] = list(final.prompt_token_ids or (() if text_prompt else prompt))
            stamp["answered_ns"] = time.monotonic_ns()
            return JSONResponse({
                "id": request_id, "object": "text_completion", "created": created, "model": model_name,
                "choices": [choice],
                "usage": usage(prompt_len(final), len(completion.token_ids)),
                "kv_transfer_params": final.kv_transfer_params,
            })

        include_usage = bool(stream_options.get("include_usage"))
        continuous_usage = include_usage and bool(stream_options.get("continuous_usage_stats"))

        async def events():
            prompt_tokens = 0 if text_prompt else len(prompt)
            completion_tokens = 0
            first = True
            stamp["started_ns"] = time.monotonic_ns()
            try:
                async for output in generator:
                    completion = output.outputs[0]
                    prompt_tokens = prompt_len(output)
                    completion_tokens += len(completion.token_ids)
                    choice = {"index": 0, "text": (completion.text or "") if text_prompt else "",
                              "token_ids": list(completion.token_ids), "finish_reason": completion.finish_reason}
                    if first and body.get("return_token_ids"):  # as vLLM's server: in the first chunk
                        choice["prompt_token_ids"] = list(output.prompt_token_ids or (() if text_prompt else prompt))
                    if first:
                        stamp["answered_ns"] = time.monotonic_ns()
                    first = False
                    chunk = {"id": request_id, "object": "text_completion", "created": created,
                             "model": model_name, "choices": [choice]}
                    if continuous_usage:
                        chunk["usage"] = usage(prompt_tokens, completion_tokens)
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                if include_usage:
                    # As vLLM's server: a last chunk with no choices and the request's usage.
                    chunk = {"id": request_id, "object": "text_completion", "created": created,
                             "model": model_name, "choices": [],
                             "usage": usage(prompt_tokens, completion_tokens)}
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
    parser.add_argument("--tokenizer", default="",
                        help="the tokenizer folder (text prompts); default: found beside the model "
                             "(see find_tokenizer); 'none': token-id prompts only (skip_tokenizer_init)")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="an AsyncEngineArgs field as key=value (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    extra = parse_engine_args(args.engine_arg)
    # An explicit tokenizer (--tokenizer, or --engine-arg tokenizer=...) wins over the one found;
    # --engine-arg skip_tokenizer_init=true wins over both.
    engine_kwargs = {"model": args.model, "load_format": "dummy", "seed": 0, "enforce_eager": True,
                     **tokenizer_args(args.model, args.tokenizer or str(extra.pop("tokenizer", "") or "")),
                     **extra}
    if engine_kwargs.get("skip_tokenizer_init"):
        engine_kwargs.pop("tokenizer", None)
    logger.info("tokenizer: %s", "none (token-id prompts only)" if engine_kwargs.get("skip_tokenizer_init")
                else engine_kwargs.get("tokenizer", args.model))
    if args.kv_transfer_config:
        from vllm.config import KVTransferConfig

        engine_kwargs["kv_transfer_config"] = KVTransferConfig(**json.loads(args.kv_transfer_config))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))
    app = build_app(engine, args.served_model_name, takes_text=not engine_kwargs.get("skip_tokenizer_init"))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=3)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
