"""The model architectures, by `model.arch`. Each is a module of its own exposing
`Block(config, tp, sequence_parallel)`, `final_norm(config)`, `LEARNED_POSITIONS`, and the parameters of a
block and of a norm as shapes, `block_parameters(config)` and `norm_parameters(config)`;
everything they share (tensor-parallel layers, vocab-parallel embedding, head and loss,
attention and its cache, initialisation) lives beside them in stageserver/model/."""

from __future__ import annotations

from types import ModuleType

from interleaf.stageserver.model.gpt2 import model as gpt2
from interleaf.stageserver.model.llama import model as llama

ARCHITECTURES: dict[str, ModuleType] = {"gpt2": gpt2, "llama": llama}


def architecture(name: str) -> ModuleType:
    if name not in ARCHITECTURES:
        raise ValueError(f"model.arch={name!r} must be one of {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]
