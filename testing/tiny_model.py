"""A tiny Qwen2-shaped model folder for running real vLLM engines offline (CPU, CI).

``build_tiny_model(dest)`` writes:

* ``dest/config.json``: a Qwen2ForCausalLM config (bf16, no weights). Start engines with
  ``load_format="dummy"`` and a fixed ``seed``: dummy weights are deterministic, so two engines
  built from the same folder produce the same greedy outputs.
* ``dest/tokenizer/``: a WordLevel tokenizer made with the ``tokenizers`` package
  (``tokenizer.json`` + ``tokenizer_config.json``) and a stub ``config.json`` of another model
  type. With transformers 5 an engine whose model config says ``model_type: qwen2`` forces the
  Qwen2 tokenizer class and silently turns every prompt into 0 tokens with a custom tokenizer;
  pointing ``tokenizer=<dest>/tokenizer`` at a folder whose config is ``gpt_bigcode`` resolves
  to the generic fast-tokenizer backend instead. The vocabulary has exactly ``vocab`` entries:
  3 specials (``<unk>``=0, ``<s>``=1, ``</s>``=2) and the words ``w3`` ... ``w{vocab-1}``;
  whitespace splitting, one word = one token, no BOS/EOS added. So a text prompt of N words
  is exactly N tokens.

Token ids can be used directly too (``skip_tokenizer_init=True`` + ``TokensPrompt``):
``tiny_prompt(n, seed)`` gives deterministic ids that avoid the specials, and
``words_for(ids)`` gives the matching text.

Pure standard library at import time; ``tokenizers`` is imported only by ``build_tiny_model``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = [
    "NUM_SPECIAL_TOKENS",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "build_tiny_model",
    "write_tiny_weights",
    "tiny_prompt",
    "words_for",
    "word_for",
    "id_for",
]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKENS)
DEFAULT_VOCAB = 1000

# Head sizes supported by vLLM's CPU attention backend (CPU_ATTN).
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def word_for(token_id: int) -> str:
    """The vocabulary word for a token id (specials map to their literal text)."""
    token_id = int(token_id)
    if token_id < 0:
        raise ValueError(f"negative token id {token_id}")
    if token_id < NUM_SPECIAL_TOKENS:
        return SPECIAL_TOKENS[token_id]
    return f"w{token_id}"


def id_for(word: str) -> int:
    """Inverse of :func:`word_for` (does not check the vocabulary size)."""
    if word in SPECIAL_TOKENS:
        return SPECIAL_TOKENS.index(word)
    if len(word) > 1 and word[0] == "w" and word[1:].isdigit():
        value = int(word[1:])
        if value >= NUM_SPECIAL_TOKENS and str(value) == word[1:]:
            return value
    raise ValueError(f"not a tiny-model word: {word!r}")


def words_for(ids) -> str:
    """Text whose tokenization with the tiny tokenizer is exactly ``ids``."""
    return " ".join(word_for(i) for i in ids)


def tiny_prompt(n_tokens: int, seed: int = 0, *, vocab: int = DEFAULT_VOCAB) -> list[int]:
    """``n_tokens`` deterministic token ids in ``[3, vocab)`` (never a special id)."""
    if n_tokens < 0:
        raise ValueError("n_tokens must be >= 0")
    if vocab <= NUM_SPECIAL_TOKENS:
        raise ValueError(f"vocab must be > {NUM_SPECIAL_TOKENS}")
    rng = random.Random(f"kvbaton-tiny-prompt/{seed}")
    return [rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(n_tokens)]


def _model_config(*, layers, hidden, heads, kv_heads, head_dim, vocab, max_pos) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def write_tiny_weights(model_dir, seed: int, *, std: float = 0.05) -> Path:
    """Random weights for the tiny model in ``model_dir`` (``model.safetensors``), drawn from
    ``seed``: engines loading folders written with different seeds run one architecture with
    different weights (a checkpoint and its fine-tune), which dummy weights cannot give (vLLM
    fills them from a constant seed). Needs torch and safetensors."""

    import torch
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim, heads, kv_heads = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                           ("v_proj", kv_heads * head_dim)):
            tensors[f"{prefix}self_attn.{name}.weight"] = normal(rows, hidden)
            tensors[f"{prefix}self_attn.{name}.bias"] = normal(rows)
        tensors[f"{prefix}self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[f"{prefix}mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[f"{prefix}mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[f"{prefix}mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[f"{prefix}input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, str(model_dir / "model.safetensors"))
    return model_dir


def _tokenizer_json(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = {word_for(i): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Decoding joins words with single spaces (the WordPiece decoder with an unused prefix
    # does exactly that and drops nothing else).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size(with_added_tokens=True) != vocab:
        raise AssertionError("tokenizer vocabulary size mismatch")
    # Normalise for idempotence: a stable, sorted JSON text.
    return json.dumps(json.loads(tok.to_str()), indent=1, sort_keys=True) + "\n"


def _tokenizer_config(max_pos: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[UNK_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_pos,
        # Chat requests work too: messages are joined by spaces (every word is one token).
        "chat_template": "{% for message in messages %}{{ message['content'] }} {% endfor %}",
    }


def _tokenizer_stub_config(vocab: int, max_pos: int) -> dict:
    # Any model type whose tokenizer mapping resolves to the generic fast backend; what
    # matters is that it is NOT qwen2 (see module docstring).
    return {
        "model_type": "gpt_bigcode",
        "architectures": ["GPTBigCodeForCausalLM"],
        "vocab_size": vocab,
        "n_positions": max_pos,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def _write_if_changed(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def build_tiny_model(
    dest_dir,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = DEFAULT_VOCAB,
    max_pos: int = 4096,
) -> Path:
    """Write the tiny model folder (config + ``tokenizer/``) and return its path.

    Idempotent: re-running with the same arguments leaves byte-identical files (files whose
    content is unchanged are not rewritten).
    """
    if heads % kv_heads:
        raise ValueError("heads must be a multiple of kv_heads")
    if head_dim not in _CPU_HEAD_SIZES:
        raise ValueError(
            f"head_dim {head_dim} unsupported by vLLM CPU attention: {_CPU_HEAD_SIZES}")
    if vocab <= NUM_SPECIAL_TOKENS:
        raise ValueError(f"vocab must be > {NUM_SPECIAL_TOKENS}")
    dest = Path(dest_dir)
    tok_dir = dest / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    cfg = _model_config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, vocab=vocab, max_pos=max_pos)
    _write_if_changed(dest / "config.json", _dump(cfg))
    _write_if_changed(tok_dir / "tokenizer.json", _tokenizer_json(vocab))
    _write_if_changed(tok_dir / "tokenizer_config.json", _dump(_tokenizer_config(max_pos)))
    _write_if_changed(tok_dir / "config.json", _dump(_tokenizer_stub_config(vocab, max_pos)))
    return dest
