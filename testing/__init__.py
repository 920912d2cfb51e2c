"""What tests, benchmarks and the demo share to run kvbaton, one copy each:

- `engines`: one vLLM engine in a child process, driven over a pipe (`EngineProcess`);
- `tiny_model`: a tiny Qwen2-shaped model folder with a word-level tokenizer, written on demand
  (the model `kvbaton demo` and `kvbaton serve` run when none is given);
- `hosts`: separate hosts on one machine, a network namespace each (needs root);
- `ports`: `free_port`, a port free now that this process has not handed out already;
- `fake_io`: a sidecar driven by a test through `ListIo`, with no engine and no peer calls.

The connector, the sidecar, the core and the transports never import this package.
"""
