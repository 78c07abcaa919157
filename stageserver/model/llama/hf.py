"""Llama to and from Hugging Face's LlamaForCausalLM (torchtitan's state-dict adapter):
the config.json fields, and every parameter by name.

The tensors map one to one, unchanged: Interleaf's rotary embedding uses transformers'
half-split layout (llama/rope.py), so q and k need no permutation, and a Linear weight is
[out, in] on both sides. A config whose model Interleaf cannot compute the same way
(rope scaling, biases, another activation) is refused, naming the key and its value.
Pure functions over dicts and tensors; `transformers` is never imported.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from interleaf.stageserver.model.config import ModelShape
from interleaf.stageserver.model.hf_keys import required_count

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"

_LAYER = re.compile(r"h\.(\d+)\.(.+)")
_BLOCK = {
    "ln_1.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_OUTSIDE = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}
_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
             "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False}
"""LlamaConfig's own defaults for keys a config.json may leave out."""


def hf_name(name: str) -> str:
    """The Hugging Face tensor an Interleaf parameter is."""
    if name in _OUTSIDE:
        return _OUTSIDE[name]
    layer = _LAYER.fullmatch(name)
    if layer is None or layer[2] not in _BLOCK:
        raise ValueError(f"parameter {name!r} is not part of a Llama model")
    return f"model.layers.{layer[1]}.{_BLOCK[layer[2]]}"


def from_hf(name: str, read: Callable[[str], torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """Parameter `name`'s unsharded value, from the one tensor `read` returns for it."""
    return read(hf_name(name))


def to_hf(name: str, tensor: torch.Tensor, shape: ModelShape) -> dict[str, torch.Tensor]:
    return {hf_name(name): tensor}


def model_fields(config: dict) -> dict:
    """The `[model]` fields of a LlamaForCausalLM's config.json, and `max_positions`."""
    _refuse_unsupported(config)
    heads = required_count(config, "num_attention_heads")
    d_model = required_count(config, "hidden_size")
    if config.get("head_dim") not in (None, d_model // heads):
        raise ValueError(f"config.json head_dim={config['head_dim']}: Interleaf's heads are "
                         f"hidden_size/num_attention_heads={d_model // heads} wide")
    return {
        "arch": "llama",
        "n_layers": required_count(config, "num_hidden_layers"),
        "d_model": d_model,
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "ffn_hidden": required_count(config, "intermediate_size"),
        "vocab_size": required_count(config, "vocab_size"),
        "norm_eps": float(config.get("rms_norm_eps", _DEFAULTS["rms_norm_eps"])),
        "rope_theta": float(_rope(config).get("rope_theta", 10000.0)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", _DEFAULTS["tie_word_embeddings"])),
        "max_positions": config.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"]),
    }


def hf_config(shape: ModelShape, dtype: str) -> dict:
    """A config.json that transformers (4.40 and later) loads as this model.
    max_position_embeddings is the training length: rotary positions have no table, but
    serving stacks take it as the context they may use."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.ffn_hidden,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.seq_len,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tie_embeddings,
        "vocab_size": shape.vocab_size,
        "torch_dtype": dtype,
    }


def _rope(config: dict) -> dict:
    """The rotary settings: transformers 5's `rope_parameters`, or 4's `rope_theta`."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict):
        return parameters
    return {"rope_theta": config.get("rope_theta", 10000.0)}


def _refuse_unsupported(config: dict) -> None:
    for key, wanted in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        value = config.get(key, _DEFAULTS[key])
        if value != wanted:
            raise ValueError(f"config.json {key}={value!r}: Interleaf's Llama computes {key}={wanted!r} only")
    scaling = config.get("rope_scaling")
    if scaling:
        raise ValueError(f"config.json rope_scaling={scaling!r}: Interleaf's Llama has plain rotary "
                         f"embeddings (no scaling)")
    rope_type = _rope(config).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"config.json rope_parameters rope_type={rope_type!r}: Interleaf's Llama has plain "
                         f"rotary embeddings (rope_type 'default')")

