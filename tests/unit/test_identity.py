"""The fingerprints that decide whether KV may move between two engines, and the models refused at
start: KV is bound to the weights that computed it, not to where they were read from."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from kvbaton.adapters.vllm.identity import (
    UnsupportedModel,
    check_supported,
    layout_fingerprint,
    weights_fingerprint,
)


class HfConfig:
    def __init__(self, **values):
        self.values = {"model_type": "qwen2", "num_hidden_layers": 2, "num_key_value_heads": 2,
                       "head_dim": 32, "hidden_size": 128, "vocab_size": 1000, **values}

    def to_dict(self):
        return dict(self.values)

    def __getattr__(self, name):
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


def config(model: str, *, load_format="auto", tp=1, pp=1, quantization=None, kv_dtype="auto",
           hf=None, revision=None):
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=revision, dtype="torch.bfloat16",
                                     quantization=quantization, hf_overrides={},
                                     hf_config=hf or HfConfig(_name_or_path=model)),
        load_config=SimpleNamespace(load_format=load_format),
        cache_config=SimpleNamespace(block_size=32, cache_dtype=kv_dtype, calculate_kv_scales=False,
                                     kv_cache_layout=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))


def checkpoint(folder, seed: int):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    data = bytes((seed * 7 + i) % 256 for i in range(3 << 20))
    (folder / "model.safetensors").write_bytes(data)
    return folder


def test_the_same_checkpoint_at_two_paths_is_one_identity_and_another_checkpoint_is_not(tmp_path):
    a = checkpoint(tmp_path / "a", seed=1)
    a_elsewhere = tmp_path / "mounted" / "a"
    shutil.copytree(a, a_elsewhere)
    b = checkpoint(tmp_path / "b", seed=2)
    assert weights_fingerprint(config(str(a))) == weights_fingerprint(config(str(a_elsewhere)))
    assert weights_fingerprint(config(str(a))) != weights_fingerprint(config(str(b)))


def test_a_change_in_the_last_mib_of_a_weight_file_changes_the_identity(tmp_path):
    a = checkpoint(tmp_path / "a", seed=1)
    before = weights_fingerprint(config(str(a)))
    data = bytearray((a / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # the last MiB is sampled
    (a / "model.safetensors").write_bytes(bytes(data))
    assert weights_fingerprint(config(str(a))) != before


@pytest.mark.parametrize("change", [
    {"quantization": "fp8"}, {"kv_dtype": "fp8_e4m3"}, {"revision": "v2"},
    {"hf": HfConfig(rope_theta=5e5)}, {"load_format": "dummy"},
])
def test_quantization_kv_dtype_revision_configuration_and_load_format_change_the_weights(change):
    assert weights_fingerprint(config("org/model", **change)) != weights_fingerprint(config("org/model"))


def test_dummy_weights_are_one_identity_per_configuration_wherever_the_config_lives():
    # vLLM seeds dummy weights with a constant: two engines of one configuration compute one model.
    assert (weights_fingerprint(config("/x/tiny", load_format="dummy"))
            == weights_fingerprint(config("/y/tiny", load_format="dummy")))


def test_the_layout_is_one_for_every_tensor_parallel_size_of_a_model():
    # D maps heads between sizes (the section's `tp` says P's): the layout names the model's KV heads.
    assert layout_fingerprint(config("m", tp=1), None) == layout_fingerprint(config("m", tp=2), None)
    assert layout_fingerprint(config("m"), None) != layout_fingerprint(config("m", hf=HfConfig(num_key_value_heads=4)), None)


def group(spec, *layers):
    return SimpleNamespace(kv_cache_spec=spec, layer_names=list(layers))


def test_pipeline_parallel_several_groups_and_state_that_is_not_attention_are_refused_at_start():
    attention = SimpleNamespace(num_kv_heads=2, head_size=32, dtype="bf16")
    check_supported(config("m", tp=2), SimpleNamespace(kv_cache_groups=[group(attention, "l0", "l1")]))
    with pytest.raises(UnsupportedModel, match="pipeline_parallel_size=2"):
        check_supported(config("m", pp=2), None)

    class SlidingWindowSpec(SimpleNamespace):
        pass

    with pytest.raises(UnsupportedModel, match="one KV cache group; this engine has 2"):
        check_supported(config("m"), SimpleNamespace(kv_cache_groups=[
            group(attention, "l0"), group(SlidingWindowSpec(num_kv_heads=2, head_size=32), "l1")]))

    class MambaSpec(SimpleNamespace):
        pass

    with pytest.raises(UnsupportedModel, match="attention KV only.*MambaSpec"):
        check_supported(config("m"), SimpleNamespace(kv_cache_groups=[group(MambaSpec(shapes=()), "m0")]))
