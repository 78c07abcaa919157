"""A Hugging Face model folder, read lazily: `config.json`, and the safetensors weights
(`model.safetensors`, or the shards that `model.safetensors.index.json` maps), of which
only the tensors asked for are read. Stage servers read the parameters their chunks
hold, `interleaf eval` and the reference trainer the whole model, through the same
`initial` values (stageserver/model/chunk.py).

Each architecture's state-dict adapter (`gpt2/hf.py`, `llama/hf.py`) says how its
config and tensors convert; this module only finds files and tensors.
"""

from __future__ import annotations

import json
import pathlib
from types import ModuleType

import torch
from safetensors import SafetensorError

from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import ParamSpec
from interleaf.stageserver import safetensors
from interleaf.stageserver.model.chunk import InitialValues
from interleaf.stageserver.model.gpt2 import hf as gpt2_hf
from interleaf.stageserver.model.llama import hf as llama_hf

ADAPTERS: dict[str, ModuleType] = {"gpt2": gpt2_hf, "llama": llama_hf}
"""The state-dict adapter of each architecture, by model.arch (= transformers' model_type)."""
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFFolderError(ValueError):
    """A folder that is not a Hugging Face model Interleaf can read, and why."""


def is_hf_folder(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path).expanduser() / CONFIG).is_file()


def adapter(arch: str) -> ModuleType:
    if arch not in ADAPTERS:
        raise HFFolderError(f"model.arch={arch!r} has no Hugging Face adapter (known: {', '.join(ADAPTERS)})")
    return ADAPTERS[arch]


class HFFolder:
    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path).expanduser().absolute()
        try:
            self.config = json.loads((self.path / CONFIG).read_text())
        except FileNotFoundError:
            raise HFFolderError(f"{self.path} holds no {CONFIG}: not a Hugging Face model folder") from None
        except (OSError, json.JSONDecodeError) as err:
            raise HFFolderError(f"{self.path / CONFIG} cannot be read: {err}") from None
        model_type = self.config.get("model_type")
        if model_type not in ADAPTERS:
            raise HFFolderError(f"{self.path / CONFIG} model_type={model_type!r}: Interleaf reads "
                                f"{' and '.join(a.ARCHITECTURE for a in ADAPTERS.values())} "
                                f"(model_type {' or '.join(map(repr, ADAPTERS))})")
        self.adapter = ADAPTERS[model_type]
        try:
            self.fields = self.adapter.model_fields(self.config)
        except ValueError as err:
            raise HFFolderError(f"{self.path}: {err}") from None
        self.files = self._weight_map()

    def _weight_map(self) -> dict[str, pathlib.Path]:
        """Tensor name -> the file holding it: from the index when the weights are
        sharded, else from the single file's header (no tensor is read)."""
        if (self.path / INDEX).is_file():
            try:
                weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise HFFolderError(f"{self.path / INDEX} is not a safetensors index: {err!r}") from None
            return {name: self.path / file for name, file in weight_map.items()}
        if not (self.path / WEIGHTS).is_file():
            raise HFFolderError(f"{self.path} holds neither {WEIGHTS} nor {INDEX} (only safetensors weights are "
                                f"read, never pickled .bin files)")
        try:
            with safetensors.open(self.path / WEIGHTS) as f:
                return {name: self.path / WEIGHTS for name in f.keys()}
        except (OSError, SafetensorError) as err:
            raise HFFolderError(f"{self.path / WEIGHTS} is not a readable safetensors file: {err}") from None

    @property
    def max_positions(self) -> int:
        return self.fields["max_positions"]

    def model_fields(self) -> dict:
        """The `[model]` fields the folder fixes (all but seq_len and pad_vocab_to)."""
        return {k: v for k, v in self.fields.items() if k != "max_positions"}

    def shape(self, seq_len: int | None = None) -> ModelShape:
        """The model, trained (or scored) seq_len tokens at a time: by default as many as
        the folder's positions."""
        return ModelShape(seq_len=seq_len or self.max_positions, **self.model_fields())

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor by its transformers name. Checkpoints saved by older transformers
        leave out the base model's prefix (GPT-2's `h.0...` for `transformer.h.0...`)."""
        key = name if name in self.files else name.partition(".")[2]
        if key not in self.files:
            raise HFFolderError(f"{self.path} holds no tensor {name!r}")
        try:
            with safetensors.open(self.files[key]) as f:
                return f.get_tensor(key)
        except (OSError, SafetensorError) as err:
            raise HFFolderError(f"{self.files[key]}: tensor {key!r} cannot be read: {err}") from None

    def initial(self, shape: ModelShape) -> InitialValues:
        """Each parameter of `shape`'s model from this folder, read when asked for."""

        def value(name: str, spec: ParamSpec) -> torch.Tensor:
            tensor = self.adapter.from_hf(name, self.tensor, shape)
            if tuple(tensor.shape) != spec.full_shape:
                raise HFFolderError(f"{self.path}: parameter {name!r} ({self.adapter.hf_name(name)}) has shape "
                                    f"{list(tensor.shape)}, the model of {CONFIG} needs {list(spec.full_shape)}")
            return tensor

        return value
