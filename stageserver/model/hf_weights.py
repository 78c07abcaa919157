"""A Hugging Face model folder's weights, of which only the tensors asked for are read:
stage servers read the parameters their chunks hold, `interleaf eval` and the reference
trainer the whole model, through the same `initial` values (stageserver/model/chunk.py).
Where each tensor lies is the folder's description (common/model/hf_folder.py); how a
tensor converts is its architecture's state-dict adapter (`gpt2/hf.py`, `llama/hf.py`).
"""

from __future__ import annotations

from types import ModuleType

import torch
from safetensors import SafetensorError

from interleaf.common.model.config import ModelShape
from interleaf.common.model.hf_folder import CONFIG, HFFolder, HFFolderError
from interleaf.common.model.params import ParamSpec
from interleaf.stageserver import safetensors
from interleaf.stageserver.model.chunk import InitialValues
from interleaf.stageserver.model.gpt2 import hf as gpt2_hf
from interleaf.stageserver.model.llama import hf as llama_hf

ADAPTERS: dict[str, ModuleType] = {"gpt2": gpt2_hf, "llama": llama_hf}
"""The state-dict adapter of each architecture, by model.arch (= transformers' model_type)."""


def tensor_adapter(arch: str) -> ModuleType:
    if arch not in ADAPTERS:
        raise HFFolderError(f"model.arch={arch!r} has no Hugging Face adapter (known: {', '.join(ADAPTERS)})")
    return ADAPTERS[arch]


def read_tensor(folder: HFFolder, name: str) -> torch.Tensor:
    """One tensor by its transformers name. Checkpoints saved by older transformers
    leave out the base model's prefix (GPT-2's `h.0...` for `transformer.h.0...`)."""
    key = name if name in folder.files else name.partition(".")[2]
    if key not in folder.files:
        raise HFFolderError(f"{folder.path} holds no tensor {name!r}")
    try:
        with safetensors.open(folder.files[key]) as f:
            return f.get_tensor(key)
    except (OSError, SafetensorError) as err:
        raise HFFolderError(f"{folder.files[key]}: tensor {key!r} cannot be read: {err}") from None


def folder_values(folder: HFFolder, shape: ModelShape) -> InitialValues:
    """Each parameter of `shape`'s model from `folder`, read when asked for."""
    adapter = tensor_adapter(folder.fields["arch"])

    def value(name: str, spec: ParamSpec) -> torch.Tensor:
        tensor = adapter.from_hf(name, lambda hf: read_tensor(folder, hf), shape)
        if tuple(tensor.shape) != spec.full_shape:
            raise HFFolderError(f"{folder.path}: parameter {name!r} ({adapter.hf_name(name)}) has shape "
                                f"{list(tensor.shape)}, the model of {CONFIG} needs {list(spec.full_shape)}")
        return tensor

    return value
