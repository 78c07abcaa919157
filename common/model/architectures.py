"""The model architectures, by `model.arch`, as descriptions: each is a module of its own
exposing `LEARNED_POSITIONS` and the parameters of a block and of a norm as shapes,
`block_parameters(config)` and `norm_parameters(config)`. What the coordinator sizes and
the stage servers build agree through these; the modules that compute
(`Block`, `final_norm`) are stageserver/model/architectures.py's."""

from __future__ import annotations

from types import ModuleType

from interleaf.common.model import gpt2, llama

ARCHITECTURES: dict[str, ModuleType] = {"gpt2": gpt2, "llama": llama}


def architecture(name: str) -> ModuleType:
    if name not in ARCHITECTURES:
        raise ValueError(f"model.arch={name!r} must be one of {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]
