"""GPT-2's tensors to and from Hugging Face's GPT2LMHeadModel (torchtitan's state-dict
adapter), every parameter by name; its config.json is common/model/gpt2_hf_config.py.

Two differences of layout, converted here:
- transformers' GPT-2 uses Conv1D, whose weight is [in, out]: the transpose of a Linear's.
- its c_attn output columns are three blocks [q | k | v], each head-major; Interleaf's
  qkv rows are head-major [q_h, k_h, v_h] per head h, so a tensor rank's heads are one
  contiguous slice (gpt2/model.py). The weight and bias are regrouped both ways.
The position table has n_positions rows there and model.seq_len here: a job may train
shorter than its source and keeps the first seq_len positions. Pure functions over
tensors; `transformers` is never imported.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from interleaf.common.model.config import ModelShape

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
