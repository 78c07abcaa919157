"""GPT-2 to and from Hugging Face's GPT2LMHeadModel (torchtitan's state-dict adapter):
the config.json fields, and every parameter by name.

Two differences of layout, converted here:
- transformers' GPT-2 uses Conv1D, whose weight is [in, out]: the transpose of a Linear's.
- its c_attn output columns are three blocks [q | k | v], each head-major; Interleaf's
  qkv rows are head-major [q_h, k_h, v_h] per head h, so a tensor rank's heads are one
  contiguous slice (gpt2/model.py). The weight and bias are regrouped both ways.
The position table has n_positions rows there and model.seq_len here: a job may train
shorter than its source and keeps the first seq_len positions. Pure functions over
dicts and tensors; `transformers` is never imported.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from interleaf.common.model.config import ModelShape
from interleaf.stageserver.model.hf_keys import required_count

ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""transformers' names of GELU's tanh approximation, which Interleaf's GPT-2 computes."""

_LAYER = re.compile(r"h\.(\d+)\.(.+)")
_BLOCK = {  # Interleaf's name in a block -> (transformers' name, Conv1D weight)
    "ln_1.weight": ("ln_1.weight", False), "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False), "ln_2.bias": ("ln_2.bias", False),
    "mlp.up.weight": ("mlp.c_fc.weight", True), "mlp.up.bias": ("mlp.c_fc.bias", False),
    "mlp.down.weight": ("mlp.c_proj.weight", True), "mlp.down.bias": ("mlp.c_proj.bias", False),
}
_QKV = ("attn.qkv.weight", "attn.qkv.bias")
_OUTSIDE = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
            "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
            "lm_head.weight": "lm_head.weight"}
_DEFAULTS = {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
             "n_positions": 1024, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
             "add_cross_attention": False}
"""GPT2Config's own defaults for keys a config.json may leave out."""


def _hf(name: str) -> tuple[str, bool]:
    """(the transformers tensor parameter `name` is, whether it is a Conv1D weight)."""
    if name in _OUTSIDE:
        return _OUTSIDE[name], False
    layer = _LAYER.fullmatch(name)
    if layer is None or layer[2] not in _BLOCK:
        raise ValueError(f"parameter {name!r} is not part of a GPT-2 model")
    hf, conv = _BLOCK[layer[2]]
    return f"transformer.h.{layer[1]}.{hf}", conv


def hf_name(name: str) -> str:
    return _hf(name)[0]


def _regroup_qkv(tensor: torch.Tensor, shape: ModelShape, to_heads: bool) -> torch.Tensor:
    """Rows (dim 0) from [q | k | v] blocks to per-head [q_h, k_h, v_h] (or back)."""
    split = (3, shape.n_heads) if to_heads else (shape.n_heads, 3)
    grouped = tensor.reshape(*split, shape.head_dim, *tensor.shape[1:])
    return grouped.transpose(0, 1).reshape(tensor.shape)


def from_hf(name: str, read: Callable[[str], torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """Parameter `name`'s unsharded value, from the one tensor `read` returns for it."""
    hf, conv = _hf(name)
    tensor = read(hf)
    if conv:
        tensor = tensor.t()
    if name.endswith(_QKV):
        tensor = _regroup_qkv(tensor, shape, to_heads=True)
    if name == "wpe.weight":
        tensor = tensor[:shape.seq_len]
    return tensor.contiguous()


def to_hf(name: str, tensor: torch.Tensor, shape: ModelShape) -> dict[str, torch.Tensor]:
    hf, conv = _hf(name)
    if name.endswith(_QKV):
        tensor = _regroup_qkv(tensor, shape, to_heads=False)
    if conv:
        tensor = tensor.t()
    return {hf: tensor.contiguous()}


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

