"""`interleaf export` and `interleaf generate`: a checkpoint as one unsharded file, and
text sampled from it on the CPU, so a user sees what was trained."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch

from interleaf.clients.checkpoint import Checkpoint, load_parameters, model_config
from interleaf.stageserver import safetensors
from interleaf.stageserver.data.tokenizer import decode, encode
from interleaf.stageserver.model.chunk import ModelChunk, full_model, next_token_logits


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def export(checkpoint: Checkpoint, out: str | pathlib.Path, dtype: str = "") -> tuple[int, int]:
    """Writes every parameter, unsharded, under its global name, with the model's shape
    and step in the file's metadata: the master weights, in their own precision or cast
    to `dtype`. Returns (tensors, parameters)."""
    if dtype and dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype={dtype!r} must be one of {', '.join(EXPORT_DTYPES)}")
    params = load_parameters(checkpoint)
    if dtype:
        params = {name: t.to(EXPORT_DTYPES[dtype]) for name, t in params.items()}
    meta = {"model": json.dumps(dataclasses.asdict(model_config(checkpoint))), "step": str(checkpoint.step),
            "trained_precision": checkpoint.manifest.get("precision", "fp32")}
    safetensors.write(out, params, meta)
    return len(params), sum(t.numel() for t in params.values())


def load_model(checkpoint: Checkpoint) -> ModelChunk:
    """The whole model in float32 on the CPU, with the checkpoint's weights."""
    model = full_model(model_config(checkpoint), seed=0)
    params = {name: t.float() for name, t in load_parameters(checkpoint).items()}
    model.load_state_dict(params, strict=True)
    return model.eval()


def check_sampling(tokens: int, temperature: float, top_k: int) -> None:
    if tokens < 1:
        raise ValueError(f"--tokens={tokens} must be at least 1")
    if temperature < 0:
        raise ValueError(f"--temperature={temperature} must be 0 (greedy) or more")
    if top_k < 0:
        raise ValueError(f"--top-k={top_k} must be 0 (no limit) or more")


def generate(model: ModelChunk, prompt: str, tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0) -> str:
    """The text that follows `prompt` (see generate_ids)."""
    return decode(generate_ids(model, prompt, tokens, temperature, top_k, seed))


@torch.no_grad()
def generate_ids(model: ModelChunk, prompt: str, tokens: int, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0) -> list[int]:
    """The token ids that follow `prompt`: greedy at temperature 0, else sampled from the
    softmax of logits/temperature over the top_k most likely tokens (all when 0), with
    a generator seeded by `seed`. The context is the last seq_len tokens."""
    check_sampling(tokens, temperature, top_k)
    ids = [int(t) for t in encode(prompt)]
    if not ids:
        raise ValueError("--prompt must not be empty: generation continues a text")
    vocab = model.config.vocab_size
    if max(ids) >= vocab:
        raise ValueError(f"--prompt holds byte {max(ids)}, outside the model's vocabulary of {vocab}")
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(tokens):
        context = torch.tensor([(ids + out)[-model.config.seq_len:]])
        logits = next_token_logits(model, context)[0].float()
        if temperature == 0:
            out.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if 0 < top_k < vocab:
            threshold = torch.topk(logits, top_k).values[-1]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        out.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)))
    return out
