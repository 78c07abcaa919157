"""Reading what a job saved: the model's parameters as full tensors, from a
checkpoint's state files (finding and checking a checkpoint: coordinator/checkpoints.py;
the files' layout: stageserver/state_io.py)."""

from __future__ import annotations

import torch

from interleaf.common.model.config import ModelShape
from interleaf.coordinator.checkpoints import Checkpoint, CheckpointError, find
from interleaf.stageserver.state_io import Pieces

__all__ = ["Checkpoint", "CheckpointError", "find", "load_parameters", "model_config"]


def model_config(checkpoint: Checkpoint) -> ModelShape:
    if "model" not in checkpoint.manifest:
        raise CheckpointError(f"{checkpoint.manifest_path} does not record the model's shape "
                              f"(written by an older Interleaf)")
    return ModelShape(**checkpoint.manifest["model"])


def load_parameters(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every parameter as its full tensor, by global name, tensor-parallel slices and
    ZeRO shards joined: the master weights, in their own precision (fp32 for an fp32
    or bf16 job, fp64 for an fp64 one). Each file is checked against the manifest's size
    and SHA-256 first; a missing, truncated or altered file is refused by name."""
    paths = [str(p) for p in checkpoint.paths()]
    try:
        pieces = Pieces(paths, kinds=("master",))
        return {name: pieces.full(name, "master") for name in pieces.names}
    except ValueError as err:  # pieces that do not add up: a checkpoint not written whole
        raise CheckpointError(f"{checkpoint.manifest_path}: {err}") from None
