"""Engine servers for the tests of what sits in front of the engines (the router, its routing,
/metrics, parallel sampling): each runs its model worker inside vLLM's engine-core
process instead of a worker process of its own, one process (a full import of vLLM) fewer to
start per engine. The connector's scheduler and worker halves then share a process, as in every
`EngineProcess` test. The product's own form, a worker process per engine, is what the hosts,
read-bound, tensor-parallel, demo and bench tests start."""

from __future__ import annotations

# vLLM for CPU turns the `uni` executor back into `mp` unless V1 multiprocessing is off; the API
# server runs its engine core in a process of its own either way.
WORKER_IN_ENGINE_CORE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
WORKER_IN_ENGINE_CORE_ARGS = ["--distributed-executor-backend", "uni"]
