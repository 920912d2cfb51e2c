"""What makes one engine's KV interchangeable with another's, and the models kvbaton refuses.

Two fingerprints travel in every handoff section (and prefix every history key):

* the **layout**: block size, dtypes, the model's KV heads and head size, the KV spec of each
  layer group. Equal layouts mean P's blocks hold what D's blocks hold, heads for heads; the
  tensor parallel size (which ranks hold which heads) travels beside it (`tp`), and D maps
  heads between sizes that divide each other and the model's KV heads (control/ranks.py).
* the **weights**: which weights computed the KV. Equal layouts are not enough: two checkpoints of
  one architecture (a fine-tune, another revision, another quantization) fill the same shapes
  with different values, and D would decode from KV its own weights never produced. The identity
  covers the model's configuration (all of it but the local path it was read from), the weights'
  content where they are local files (each file's name, size and a digest of its first and last
  MiB: reading a 140 GB checkpoint whole at every start is not an option, and two checkpoints
  that agree in every file's size and in those two MiB are not found in practice), the repo and
  revision where they are not, the load format, quantization, KV cache dtype and KV scale
  settings. A LoRA adapter belongs to a request, not to the engine: its name and path are in the
  prompt digest (handoff.py), which D compares with P's grant before reading anything.

`check_supported` refuses, when the connector starts, what kvbaton cannot hand off, with a message
naming the setting: pipeline parallelism, and KV caches of several groups or of non-attention
state (Mamba). vLLM itself turns its hybrid KV cache manager off for connectors without
`SupportsHMA` (kvbaton is one), so a model with sliding-window layers runs with one group, every
layer's blocks kept whole, and hands off like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

# Bytes read from each end of a weight file for its content digest.
WEIGHT_SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
# Configuration entries that name where a model was read from, not what it is.
LOCAL_CONFIG_KEYS = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "torch_dtype"})


class UnsupportedModel(ValueError):
    """A model or parallel layout kvbaton cannot hand off: raised when the connector starts."""


@dataclass(frozen=True)
class KvIdentity:
    """This engine's side of the comparison every handoff makes (see parse_handoff)."""

    layout: str
    weights: str
    tensor_parallel: int = 1
    kv_heads: int = 0  # the model's KV heads, all ranks together (0: not known)

    def reads_from(self, tensor_parallel: int) -> str:
        """Why KV from an engine of that tensor parallel size cannot be mapped onto this
        engine's ranks ("" when it can)."""

        ours = self.tensor_parallel
        if tensor_parallel == ours:
            return ""
        if max(ours, tensor_parallel) % min(ours, tensor_parallel):
            return f"tensor parallel sizes {tensor_parallel} and {ours} do not divide each other"
        if not self.kv_heads or self.kv_heads % max(ours, tensor_parallel):
            return (f"the model's {self.kv_heads or 'unknown number of'} KV heads do not split over "
                    f"{max(ours, tensor_parallel)} ranks (replicated heads are not mapped)")
        return ""


def tensor_parallel_size(vllm_config) -> int:
    return int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)


def total_kv_heads(vllm_config) -> int:
    hf = vllm_config.model_config.hf_config
    return int(getattr(hf, "num_key_value_heads", 0) or getattr(hf, "num_attention_heads", 0) or 0)


def check_supported(vllm_config, kv_cache_config) -> None:
    """UnsupportedModel, naming what to change, for a configuration kvbaton cannot hand off."""

    parallel = vllm_config.parallel_config
    pipeline = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pipeline > 1:
        raise UnsupportedModel(
            f"kvbaton does not hand off KV across pipeline-parallel stages (pipeline_parallel_size="
            f"{pipeline}): run each engine with pipeline_parallel_size=1 (tensor parallelism is "
            "supported)")
    if kv_cache_config is None:
        return
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    for group in groups:
        spec = group.kv_cache_spec
        if not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size"):
            raise UnsupportedModel(
                f"kvbaton hands off attention KV only; this model keeps {type(spec).__name__} state "
                f"(layers {', '.join(group.layer_names[:3])}...): serve it without the kvbaton connector")
    if len(groups) > 1:
        kinds = sorted({type(group.kv_cache_spec).__name__ for group in groups})
        raise UnsupportedModel(
            f"kvbaton hands off one KV cache group; this engine has {len(groups)} ({', '.join(kinds)}), "
            "which happens only with vLLM's hybrid KV cache manager forced on: leave "
            "disable_hybrid_kv_cache_manager unset (vLLM turns it off for kvbaton and keeps every "
            "layer's blocks whole)")


def layout_fingerprint(vllm_config, kv_cache_config) -> str:
    """What must match between P and D for blocks to be interchangeable, head for head (no
    addresses, no tensor parallel size, nothing about the weights' values)."""

    parts = [str(vllm_config.cache_config.block_size),
             str(getattr(vllm_config.cache_config, "cache_dtype", "")),
             str(vllm_config.model_config.dtype),
             str(getattr(vllm_config.cache_config, "kv_cache_layout", ""))]
    hf = vllm_config.model_config.hf_config
    for attr in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size"):
        parts.append(f"{attr}={getattr(hf, attr, None)}")
    if kv_cache_config is not None:
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            # Not the spec's KV heads: those are one rank's share (num_key_value_heads above is all).
            parts.append(f"{type(spec).__name__}:{getattr(spec, 'head_size', '')}:{getattr(spec, 'dtype', '')}:"
                         f"{len(group.layer_names)}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def weights_fingerprint(vllm_config) -> str:
    """Which weights computed this engine's KV (see the module's docstring)."""

    model = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    cache = vllm_config.cache_config
    load_format = str(getattr(load, "load_format", "auto"))
    digest = hashlib.blake2b(digest_size=8, person=b"kvbaton-weights")

    def part(name: str, value) -> None:
        digest.update(f"\0{name}=".encode() + str(value).encode())

    part("config", _config_text(model.hf_config))
    part("hf_overrides", _json(getattr(model, "hf_overrides", None)))
    part("dtype", model.dtype)
    part("quantization", getattr(model, "quantization", None))
    part("load_format", load_format)
    part("kv_cache_dtype", getattr(cache, "cache_dtype", ""))
    part("calculate_kv_scales", getattr(cache, "calculate_kv_scales", False))
    if load_format == "dummy":
        # vLLM fills dummy weights from a fixed seed: one configuration, one set of weights.
        return digest.hexdigest()
    path = str(model.model)
    if os.path.isdir(path):
        part("files", weight_files_digest(path))
    else:
        part("repo", path)
        part("revision", getattr(model, "revision", None))
    return digest.hexdigest()


def weight_files_digest(folder: str) -> str:
    """Each weight file of a local model folder: its name, size and the digest of its first and
    last WEIGHT_SAMPLE_BYTES."""

    digest = hashlib.blake2b(digest_size=16)
    for root, _dirs, files in sorted(os.walk(folder)):
        for name in sorted(files):
            if not name.endswith(WEIGHT_SUFFIXES):
                continue
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            digest.update(os.path.relpath(path, folder).encode() + b"\0" + str(size).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read(WEIGHT_SAMPLE_BYTES))
                if size > 2 * WEIGHT_SAMPLE_BYTES:
                    f.seek(size - WEIGHT_SAMPLE_BYTES)
                    digest.update(f.read(WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()


def _config_text(hf_config) -> str:
    try:
        data = hf_config.to_dict()
    except Exception:  # a config class without to_dict: its repr names what it holds
        return repr(hf_config)
    return _json({key: value for key, value in data.items() if key not in LOCAL_CONFIG_KEYS})


def _json(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)
