"""The weights a new job starts from (checkpoint.init; SetupRequest.init_from): a Hugging
Face model folder, or an Interleaf checkpoint's manifest, as the `initial` values a
ModelChunk is built from (stageserver/model/chunk.py).

Each value is read when the chunk asks for it, so a stage server reads the parameters
its chunks hold and nothing else, one unsharded tensor at a time, and cuts its own
tensor-parallel slice (and ZeRO shard) from it as it would from a seeded initialization:
weights land in any layout without any process holding the whole model. The files must
be readable at the same path on every stage server (a shared filesystem; local runs
share this machine's).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch

from interleaf.common.model.config import JOB_OWN, ModelShape
from interleaf.common.model.hf_folder import HFFolder, is_hf_folder
from interleaf.common.model.params import ParamSpec
from interleaf.stageserver.model.chunk import InitialValues
from interleaf.stageserver.model.hf_weights import folder_values
from interleaf.stageserver.state_io import Pieces


def initial_values(location: str, shape: ModelShape) -> InitialValues:
    """The values of `shape`'s parameters at `location`: a Hugging Face folder or an
    Interleaf manifest, whose model must be `shape`'s (the coordinator took the job's
    model from it; this guards against the files changing since)."""
    if is_hf_folder(location):
        folder = HFFolder(location)
        _check_same(folder.model_fields(), shape, location)
        return folder_values(folder, shape)
    return CheckpointWeights(pathlib.Path(location), shape)


class CheckpointWeights:
    """Parameters from the master weights of an Interleaf checkpoint (its manifest's
    state files), each read from the pieces that hold it (stageserver/state_io.py)."""

    def __init__(self, manifest: pathlib.Path, shape: ModelShape):
        try:
            saved = json.loads(manifest.read_text())
            self.paths = [str(manifest.parent / entry["path"]) for entry in saved["state"]]
            model = saved["model"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"checkpoint.init: {manifest} is not an Interleaf checkpoint manifest: {err!r}") from None
        fields = dataclasses.asdict(ModelShape(**model))
        _check_same({k: v for k, v in fields.items() if k not in JOB_OWN}, shape, str(manifest))

    def __call__(self, name: str, spec: ParamSpec) -> torch.Tensor:
        full = Pieces(self.paths, {name: {"master"}}).full(name, "master")
        # A gpt2 job may train on fewer positions than its source learned: the first ones.
        return full[:spec.full_shape[0]] if name == "wpe.weight" else full


def _check_same(fields: dict, shape: ModelShape, location: str) -> None:
    for key, value in fields.items():
        if getattr(shape, key) != value:
            raise ValueError(f"checkpoint.init={location!r} holds a model with {key}={value!r}, the job's has "
                             f"{key}={getattr(shape, key)!r}")
