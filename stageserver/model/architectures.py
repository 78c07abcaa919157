"""The model architectures' modules, by `model.arch`. Each is a module of its own
exposing `Block(config, tp, sequence_parallel)` and `final_norm(config)`; its parameters
as shapes and whether it learns positions are its description (common/model/
architectures.py). Everything they share (tensor-parallel layers, vocab-parallel
embedding, head and loss, attention and its cache, initialisation) lives beside them in
stageserver/model/."""

from __future__ import annotations

from types import ModuleType

from interleaf.common.model.architectures import architecture
from interleaf.stageserver.model.gpt2 import model as gpt2
from interleaf.stageserver.model.llama import model as llama

MODULES: dict[str, ModuleType] = {"gpt2": gpt2, "llama": llama}


def architecture_modules(name: str) -> ModuleType:
    architecture(name)  # an unknown name is refused in the description's words
    return MODULES[name]
