"""Llama's tensors to and from Hugging Face's LlamaForCausalLM (torchtitan's state-dict
adapter), every parameter by name; its config.json is common/model/llama_hf_config.py.

The tensors map one to one, unchanged: Interleaf's rotary embedding uses transformers'
half-split layout (llama/rope.py), so q and k need no permutation, and a Linear weight is
[out, in] on both sides. Pure functions over tensors; `transformers` is never imported.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from interleaf.common.model.config import ModelShape

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
