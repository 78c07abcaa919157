"""GPT-2's config.json to and from Hugging Face's GPT2LMHeadModel: the `[model]` fields
a folder fixes, read by the coordinator (checkpoint.init) as by the stage servers, and
the config an export writes. A config whose model Interleaf cannot compute the same way
is refused, naming the key and its value. Its tensors are stageserver/model/gpt2/hf.py's.
Pure functions over dicts; `transformers` is never imported.
"""

from __future__ import annotations

from interleaf.common.model.config import ModelShape
from interleaf.common.model.hf_keys import required_count

ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""transformers' names of GELU's tanh approximation, which Interleaf's GPT-2 computes."""
_DEFAULTS = {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
             "n_positions": 1024, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
             "add_cross_attention": False}
"""GPT2Config's own defaults for keys a config.json may leave out."""


def model_fields(config: dict) -> dict:
    """The `[model]` fields of a GPT2LMHeadModel's config.json, and `max_positions`."""
    _refuse_unsupported(config)
    d_model = required_count(config, "n_embd")
    return {
        "arch": "gpt2",
        "n_layers": required_count(config, "n_layer"),
        "d_model": d_model,
        "n_heads": required_count(config, "n_head"),
        "n_kv_heads": config["n_head"],
        "ffn_hidden": config.get("n_inner") or 4 * d_model,
        "vocab_size": required_count(config, "vocab_size"),
        "norm_eps": float(config.get("layer_norm_epsilon", _DEFAULTS["layer_norm_epsilon"])),
        "tie_embeddings": bool(config.get("tie_word_embeddings", _DEFAULTS["tie_word_embeddings"])),
        "max_positions": config.get("n_positions", _DEFAULTS["n_positions"]),
    }


def hf_config(shape: ModelShape, dtype: str) -> dict:
    """A config.json that transformers (4.40 and later) loads as this model: its
    position table holds the job's seq_len positions."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "n_embd": shape.d_model,
        "n_layer": shape.n_layers,
        "n_head": shape.n_heads,
        "n_inner": shape.ffn_hidden,
        "n_positions": shape.seq_len,
        "n_ctx": shape.seq_len,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": shape.norm_eps,
        "tie_word_embeddings": shape.tie_embeddings,
        "vocab_size": shape.vocab_size,
        "torch_dtype": dtype,
    }


def _refuse_unsupported(config: dict) -> None:
    activation = config.get("activation_function", _DEFAULTS["activation_function"])
    if activation not in ACTIVATIONS:
        raise ValueError(f"config.json activation_function={activation!r}: Interleaf's GPT-2 computes GELU's "
                         f"tanh approximation ({' or '.join(ACTIVATIONS)}) only")
    for key in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        value = config.get(key, _DEFAULTS[key])
        if value != _DEFAULTS[key]:
            raise ValueError(f"config.json {key}={value!r}: Interleaf's GPT-2 computes {key}={_DEFAULTS[key]!r} "
                             f"only")
