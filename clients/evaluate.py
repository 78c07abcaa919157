"""`interleaf eval`: the mean next-token cross-entropy of a model on given token ids,
computed by Interleaf's own model and loss (stageserver/model/) in float32, so that it
can be set beside `transformers`' loss on the same ids (DESIGN.md, "Interop").

The model is an Interleaf checkpoint or a Hugging Face folder, read through the same
code a job starting from it uses (checkpoint.init). Row i of the ids scores its ids
1..T-1, each predicted from those before it: B·(T-1) predictions, as `transformers`
computes `model(ids, labels=ids).loss`.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import torch

from interleaf.clients.checkpoint import CheckpointError, find, load_parameters, model_config
from interleaf.common.model.architectures import architecture
from interleaf.common.model.hf_folder import HFFolder, is_hf_folder
from interleaf.stageserver.model.chunk import ModelChunk, full_model
from interleaf.stageserver.model.hf_weights import folder_values

LOGITS_BYTES = 1 << 28
"""Rows are scored a group at a time, so that the group's float32 logits stay within
this many bytes whatever the number of rows."""


def load_for_eval(path: str) -> ModelChunk:
    """The whole model in float32 on the CPU: a Hugging Face folder (trained for as many
    positions as its config allows), or an Interleaf checkpoint (a manifest, a step
    folder or a checkpoint.dir)."""
    if is_hf_folder(path):
        folder = HFFolder(path)
        shape = folder.shape()
        return full_model(shape, seed=0, initial=folder_values(folder, shape)).eval()
    try:
        checkpoint = find(path)
    except CheckpointError as err:
        raise CheckpointError(f"{path} is neither a Hugging Face model folder (no config.json) nor an Interleaf "
                              f"checkpoint: {err}") from None
    params = load_parameters(checkpoint)  # each file checked against the manifest first
    return full_model(model_config(checkpoint), seed=0, initial=lambda name, spec: params[name]).eval()


def read_ids(path: str, vocab_size: int | None = None) -> np.ndarray:
    """The ids of an .npy file: integers, shape [B, T] with T >= 2, and in [0, vocab_size)
    when that is given (else check_ids_fit does it, once the model is read)."""
    try:
        ids = np.load(pathlib.Path(path), allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"--tokens {path}: not a readable .npy array ({err})") from None
    if not isinstance(ids, np.ndarray):  # np.load opens an .npz archive as a lazy NpzFile of arrays
        names = ids.files
        ids.close()
        raise ValueError(f"--tokens {path} is an .npz archive (of {', '.join(names) or 'no arrays'}): it must be "
                         f"one .npy array, as numpy.save writes")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"--tokens {path} holds {ids.dtype} values: token ids must be integers")
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ValueError(f"--tokens {path} has shape {list(ids.shape)}: it must be [B, T] with B >= 1 rows of "
                         f"T >= 2 ids (each row's ids 1..T-1 are predicted)")
    if vocab_size is not None:
        check_ids_fit(path, ids, vocab_size)
    return ids


def check_ids_fit(path: str, ids: np.ndarray, vocab_size: int) -> None:
    """The ids read from `path` are in the model's vocabulary [0, vocab_size)."""
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"--tokens {path} holds id {bad}, outside the model's vocabulary [0, {vocab_size})")


@torch.no_grad()
def evaluate(model: ModelChunk, ids: np.ndarray, device: torch.device = torch.device("cpu")) -> tuple[float, int]:
    """(mean cross-entropy, number of predictions) of `model` on `ids` [B, T]."""
    config = model.config
    rows, length = ids.shape
    if architecture(config.arch).LEARNED_POSITIONS and length - 1 > config.seq_len:
        raise ValueError(f"--tokens rows of {length} ids need {length - 1} positions; this {config.arch} model "
                         f"has {config.seq_len}: at most {config.seq_len + 1} ids a row")
    model = model.to(device)
    tokens = torch.from_numpy(ids.astype(np.int64))
    group = max(1, LOGITS_BYTES // (4 * (length - 1) * config.padded_vocab(1)))
    total = 0.0
    for start in range(0, rows, group):
        batch = tokens[start:start + group].to(device)
        loss = model(batch[:, :-1], batch[:, 1:])  # the mean over the group's predictions
        total += float(loss) * batch.size(0) * (length - 1)
    predictions = rows * (length - 1)
    mean = total / predictions
    if not math.isfinite(mean):
        raise ValueError(f"the loss is {mean}: the model's weights are not finite")
    return mean, predictions
