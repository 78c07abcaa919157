"""A Hugging Face model folder, described: `config.json` as the `[model]` fields it fixes,
and which safetensors file (`model.safetensors`, or the shards that
`model.safetensors.index.json` maps) holds each tensor, from the files' headers alone.
The coordinator checks checkpoint.init with it; stage servers, `interleaf eval` and the
reference trainer read the tensors it locates (stageserver/model/hf_weights.py).

Each architecture's config adapter (`gpt2_hf_config.py`, `llama_hf_config.py`) says how
its config.json converts; this module only finds files and tensor names.
"""

from __future__ import annotations

import json
import pathlib
from types import ModuleType

from safetensors import SafetensorError, safe_open

from interleaf.common.model import gpt2_hf_config, llama_hf_config
from interleaf.common.model.config import ModelShape

ADAPTERS: dict[str, ModuleType] = {"gpt2": gpt2_hf_config, "llama": llama_hf_config}
"""The config adapter of each architecture, by model.arch (= transformers' model_type)."""
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFFolderError(ValueError):
    """A folder that is not a Hugging Face model Interleaf can read, and why."""


def is_hf_folder(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path).expanduser() / CONFIG).is_file()


def config_adapter(arch: str) -> ModuleType:
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
            # The header's names only: no tensor is read, and no framework's type is needed.
            with safe_open(str(self.path / WEIGHTS), framework="numpy") as f:
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
