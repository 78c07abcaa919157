"""Llama's config.json to and from Hugging Face's LlamaForCausalLM: the `[model]` fields
a folder fixes, read by the coordinator (checkpoint.init) as by the stage servers, and
the config an export writes. Its tensors are stageserver/model/llama/hf.py's.

Llama 3.1's rotary scaling (rope_type llama3) maps to the model.rope_* fields. A config
whose model Interleaf cannot compute the same way (another rope scaling, biases, another
activation) is refused, naming the key and its value. Pure functions over dicts;
`transformers` is never imported.
"""

from __future__ import annotations

import dataclasses

from interleaf.common.model.config import ModelShape
from interleaf.common.model.hf_keys import required_count

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
             "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False}
"""LlamaConfig's own defaults for keys a config.json may leave out."""
_SCALING = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
            "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_positions"}
"""transformers' parameters of rope_type llama3, and the `[model]` fields that hold them."""
_NO_SCALING = {f.name: f.default for f in dataclasses.fields(ModelShape) if f.name in _SCALING.values()}
"""Those fields' defaults (no scaling), which a rope_type 'default' model has."""


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
        **_rope_fields(config),
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
        "rope_scaling": _rope_scaling(shape),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tie_embeddings,
        "vocab_size": shape.vocab_size,
        "torch_dtype": dtype,
    }


def _rope(config: dict) -> tuple[str, dict]:
    """(the key holding the rotary settings, the settings with rope_theta), taken as
    transformers 5 takes them: 4's `rope_scaling` beside a top-level `rope_theta` first,
    else 5's `rope_parameters`."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    parameters = config.get(key) or {}
    if not isinstance(parameters, dict):
        raise ValueError(f"config.json {key}={parameters!r} must be an object")
    return key, {"rope_theta": config.get("rope_theta", 10000.0), **parameters}


def _rope_fields(config: dict) -> dict:
    """rope_theta and the Llama 3 scaling fields (their defaults: none) of a config.json
    whose rope_type (4.x: `type`) is default or llama3."""
    key, parameters = _rope(config)
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    fields = {"rope_theta": float(parameters["rope_theta"])}
    if rope_type == "default":
        return {**fields, **_NO_SCALING}
    if rope_type != "llama3":
        raise ValueError(f"config.json {key}={config[key]!r}: Interleaf's Llama computes rope_type 'default' "
                         f"and 'llama3' only, not {rope_type!r}")
    # As transformers: without its own, the context before scaling is the model's positions.
    positions = config.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"])
    parameters = {"original_max_position_embeddings": positions, **parameters}
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        value = parameters.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"config.json {key} {name}={value!r} must be a number (rope_type 'llama3')")
    required_count(parameters, "original_max_position_embeddings")
    if not parameters["factor"] >= 1 or not parameters["high_freq_factor"] > parameters["low_freq_factor"] > 0:
        raise ValueError(f"config.json {key}={config[key]!r}: Llama 3's scaling needs factor >= 1 and "
                         f"high_freq_factor > low_freq_factor > 0")
    # Each as its field's type: the factors float, the positions (checked above) int.
    return {**fields, **{field: type(_NO_SCALING[field])(parameters[name]) for name, field in _SCALING.items()}}


def _rope_scaling(shape: ModelShape) -> dict | None:
    """transformers' rope_scaling (4.43 and later read llama3) of the model, None when unscaled."""
    if not shape.rope_scaling_factor:
        return None
    return {"rope_type": "llama3", **{name: getattr(shape, field) for name, field in _SCALING.items()}}


def _refuse_unsupported(config: dict) -> None:
    for key, wanted in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        value = config.get(key, _DEFAULTS[key])
        if value != wanted:
            raise ValueError(f"config.json {key}={value!r}: Interleaf's Llama computes {key}={wanted!r} only")
