"""checkpoint.init where a job's config is built: the model section comes from the
source, a Hugging Face folder or an Interleaf checkpoint.

A job started from given weights must have their model, so `[model]` is taken from
the source, and a value the user gave that contradicts it is refused, naming the field
and both values. Two fields stay the job's own: `seq_len` (at most the positions the
source was made for, when it has a limit: GPT-2's position table, Llama's
max_position_embeddings) and `pad_vocab_to` (padding is never saved). The path is
resolved once, here, to what every stage server then reads (stageserver/init_weights.py):
the folder or the manifest of one checkpoint step, absolute.
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass

from interleaf.common.model.config import JOB_OWN, ModelShape
from interleaf.common.model.hf_folder import HFFolder, HFFolderError, is_hf_folder
from interleaf.coordinator.checkpoints import CheckpointError, find
from interleaf.coordinator.config import ConfigError, InitNotFound, ModelConfig


@dataclass(frozen=True)
class InitSource:
    location: str
    """The absolute Hugging Face folder or Interleaf manifest the servers read."""
    model: dict
    """The `[model]` fields the source fixes."""
    max_positions: int | None
    """The longest model.seq_len the source allows (None: no limit, rotary positions)."""


def read_source(path: str) -> InitSource:
    """What checkpoint.init=`path` holds: reads config.json, or a checkpoint manifest."""
    where = f"checkpoint.init={path!r}"
    if not pathlib.Path(path).expanduser().exists():
        raise InitNotFound(f"{where}: there is nothing at that path (a Hugging Face model folder or an Interleaf "
                           f"checkpoint, readable by the coordinator and every stage server)")
    if is_hf_folder(path):
        try:
            folder = HFFolder(path)
        except HFFolderError as err:
            raise ConfigError(f"{where}: {err}") from None
        return InitSource(str(folder.path), folder.model_fields(), folder.max_positions)
    try:
        checkpoint = find(path)
    except CheckpointError as err:
        raise ConfigError(f"{where} is neither a Hugging Face model folder (no config.json) nor an Interleaf "
                          f"checkpoint: {err}") from None
    if "model" not in checkpoint.manifest:
        raise ConfigError(f"{where}: {checkpoint.manifest_path} does not record its model (written by an older "
                          f"Interleaf)")
    saved = dataclasses.asdict(ModelShape(**checkpoint.manifest["model"]))
    positions = saved["seq_len"] if saved["arch"] == "gpt2" else None
    return InitSource(str(checkpoint.manifest_path), {k: v for k, v in saved.items() if k not in JOB_OWN},
                      positions)


def take_model(given: dict, path: str, source: InitSource) -> dict:
    """The `[model]` values of a job starting from `source`: the source's, with the
    user's seq_len and pad_vocab_to. Pure: `given` holds only the values the user set."""
    for key, value in given.items():
        if key in source.model and value != source.model[key]:
            raise ConfigError(f"model.{key}={value!r} contradicts checkpoint.init={path!r}, whose model has "
                              f"{key}={source.model[key]!r} (a job started from given weights takes their model; "
                              f"leave model.{key} out)")
    seq_len = given.get("seq_len", ModelConfig.seq_len)
    if source.max_positions is not None and seq_len > source.max_positions:
        raise ConfigError(f"model.seq_len={seq_len} must be at most {source.max_positions}: checkpoint.init="
                          f"{path!r} holds a model of {source.max_positions} positions")
    return {**given, **source.model}
