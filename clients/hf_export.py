"""`interleaf export --format hf`: a checkpoint as a Hugging Face model folder that
`transformers`' AutoModelForCausalLM.from_pretrained loads (and AutoTokenizer, when the
job had a tokenizer of its own): config.json, generation_config.json, the weights as
safetensors (sharded with model.safetensors.index.json above a size, as
save_pretrained does) and the tokenizer files.

The weights are the checkpoint's master weights, unpadded, converted by the
architecture's state-dict adapter (stageserver/model/*/hf.py; the config.json by
common/model/*_hf_config.py), in their own precision or cast to --dtype. `transformers` is not needed to write any of it.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from dataclasses import dataclass

import torch

from interleaf.clients.checkpoint import Checkpoint, load_parameters, model_config
from interleaf.clients.generate import EXPORT_DTYPES
from interleaf.common.data.text_tokenizer import FileTokenizer, load_tokenizer
from interleaf.common.model.config import ModelShape
from interleaf.common.model.hf_folder import CONFIG, INDEX, WEIGHTS, config_adapter
from interleaf.stageserver import safetensors
from interleaf.stageserver.model.hf_weights import tensor_adapter

MAX_SHARD_BYTES = 5 * 10**9
"""transformers' own default shard size (save_pretrained's max_shard_size="5GB")."""
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64"}
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""Files a tokenizer's folder may hold beside tokenizer.json, copied with it."""


@dataclass(frozen=True)
class Exported:
    tensors: int
    parameters: int
    weight_files: int
    tokenizer: bool


def export_hf(checkpoint: Checkpoint, out: str | pathlib.Path, dtype: str = "", tokenizer: str = "",
              max_shard_bytes: int = MAX_SHARD_BYTES) -> Exported:
    """Writes the folder `out` (new, or empty). `tokenizer`: the one to write beside the
    model (default: the job's data.tokenizer, as its manifest records it; 'bytes' writes
    none, as the built-in byte tokenizer has no files)."""
    field = "--tokenizer" if tokenizer else "the job's tokenizer"  # where the error says the spec came from
    tokenizer = tokenizer or checkpoint.manifest.get("tokenizer", "bytes")
    _checked(out, dtype, max_shard_bytes, tokenizer, field)  # before the weights are read
    return write_hf_folder(load_parameters(checkpoint), model_config(checkpoint), out, dtype, tokenizer,
                           max_shard_bytes)


def write_hf_folder(params: dict[str, torch.Tensor], shape: ModelShape, out: str | pathlib.Path, dtype: str = "",
                    tokenizer: str = "bytes", max_shard_bytes: int = MAX_SHARD_BYTES) -> Exported:
    """The folder of `shape`'s model with parameters `params` (Interleaf's names, full
    unpadded tensors)."""
    out, tok = _checked(out, dtype, max_shard_bytes, tokenizer)
    convert = tensor_adapter(shape.arch)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        weights.update(convert.to_hf(name, tensor.to(EXPORT_DTYPES[dtype]) if dtype else tensor, shape))
    out.mkdir(parents=True, exist_ok=True)
    files = _write_weights(out, weights, max_shard_bytes)
    special = _special_ids(tok) if tok else {}
    config = {**config_adapter(shape.arch).hf_config(shape, DTYPE_NAMES[next(iter(weights.values())).dtype]), **special}
    _write_json(out / CONFIG, config)
    _write_json(out / "generation_config.json", special)
    if tok:
        _write_tokenizer(out, tok, shape.seq_len)
    return Exported(len(weights), sum(t.numel() for t in weights.values()), files, tok is not None)


def _checked(out: str | pathlib.Path, dtype: str, max_shard_bytes: int, tokenizer: str,
             field: str = "the job's tokenizer") -> tuple[pathlib.Path, FileTokenizer | None]:
    """(the folder, the tokenizer to write), or why the export cannot be made; `field`
    names where the tokenizer's spec came from."""
    if dtype and dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype={dtype!r} must be one of {', '.join(EXPORT_DTYPES)}")
    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-bytes={max_shard_bytes} must be at least 1")
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not an empty folder: export into a new one")
    return out, _tokenizer(tokenizer, field)


def _write_weights(out: pathlib.Path, weights: dict[str, torch.Tensor], max_shard_bytes: int) -> int:
    """One file when all fit in `max_shard_bytes`, else shards filled in name order up
    to it (a tensor larger than it alone in its shard) and an index naming each
    tensor's file; returns the number of files."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(weights):
        nbytes = weights[name].numel() * weights[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = weights[name]
        size += nbytes
    metadata = {"format": "pt"}  # what transformers checks a safetensors file for
    if len(shards) == 1:
        safetensors.write(out / WEIGHTS, shards[0], metadata)
        return 1
    stem, suffix = WEIGHTS.rsplit(".", 1)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}"
        safetensors.write(out / file, shard, metadata)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return len(shards)


def _tokenizer(spec: str, field: str) -> FileTokenizer | None:
    if spec == "bytes":
        return None
    try:
        return load_tokenizer(spec, field=field)
    except ValueError as err:
        raise ValueError(f"{err} (name another with --tokenizer PATH, or --tokenizer bytes to write none)") from None


def _special_ids(tok: FileTokenizer) -> dict:
    """eos_token_id (the end-of-document token) and bos_token_id when the tokenizer
    names them."""
    ids = {} if tok.eos_id is None else {"eos_token_id": tok.eos_id}
    config = tok.path.parent / "tokenizer_config.json"
    bos = json.loads(config.read_text(encoding="utf-8")).get("bos_token") if config.is_file() else None
    if isinstance(bos, dict):  # an AddedToken, as older transformers saved it
        bos = bos.get("content")
    if isinstance(bos, str) and tok.tokenizer.token_to_id(bos) is not None:
        ids["bos_token_id"] = tok.tokenizer.token_to_id(bos)
    return ids


def _write_tokenizer(out: pathlib.Path, tok: FileTokenizer, seq_len: int) -> None:
    """tokenizer.json, with the tokenizer_config.json (and special_tokens_map.json) of
    its folder when it has one; else a minimal tokenizer_config.json by which
    AutoTokenizer loads it as a PreTrainedTokenizerFast."""
    shutil.copyfile(tok.path, out / "tokenizer.json")
    beside = [tok.path.parent / name for name in TOKENIZER_FILES if (tok.path.parent / name).is_file()]
    for path in beside:
        shutil.copyfile(path, out / path.name)
    if not beside:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
        if tok.eos_id is not None:
            config["eos_token"] = tok.tokenizer.id_to_token(tok.eos_id)
        _write_json(out / "tokenizer_config.json", config)


def _write_json(path: pathlib.Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
