"""kvbaton: prefill/decode KV handoff for vLLM.

`kvbaton.core` is the pure, event-sourced lifecycle core; `kvbaton.adapters.vllm` is the KV
connector vLLM loads; `kvbaton.sim` is the seeded swarm simulator behind `kvbaton fuzz`.
"""

__version__ = "0.1.0"
