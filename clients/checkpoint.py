"""Reading what a job saved: full tensors from a checkpoint's parameter files (finding
and checking a checkpoint: coordinator/checkpoints.py)."""

from __future__ import annotations

import json

import torch

from coordinator.checkpoints import Checkpoint, CheckpointError, find
from stageserver import safetensors
from stageserver.model import GPTConfig

__all__ = ["Checkpoint", "CheckpointError", "find", "load_parameters", "model_config"]


def model_config(checkpoint: Checkpoint) -> GPTConfig:
    if "model" not in checkpoint.manifest:
        raise CheckpointError(f"{checkpoint.manifest_path} does not record the model's shape "
                              f"(written by an older Interleaf)")
    return GPTConfig(**checkpoint.manifest["model"])


def load_parameters(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every parameter as its full tensor, by global name: tensor-parallel slices joined.
    Each file is checked against the manifest's size and SHA-256 first; a missing,
    truncated or altered file is refused by name."""
    slices: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    full: dict[str, torch.Tensor] = {}
    for path in checkpoint.paths("files"):
        tensors, meta = safetensors.read(path)
        layout = json.loads(meta.get("tp_slices", "{}"))
        for name, tensor in tensors.items():
            if name in layout:
                dim, rank, _ = (int(x) for x in layout[name].split(":"))
                slices.setdefault(name, {})[rank] = tensor
                dims[name] = dim
            else:
                full[name] = tensor
    for name, parts in slices.items():
        full[name] = torch.cat([parts[r] for r in sorted(parts)], dim=dims[name])
    return full
