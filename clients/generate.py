"""`interleaf export` and `interleaf generate`: a checkpoint as one unsharded file, and
text sampled from it on the CPU, so a user sees what was trained."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch

from interleaf.clients.checkpoint import Checkpoint, CheckpointError, load_parameters, model_config
from interleaf.common.data.text_tokenizer import BytesTokenizer, load_tokenizer
from interleaf.stageserver import safetensors
from interleaf.stageserver.model.attention import LayerCache
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
    params = {name: t.float() for name, t in load_parameters(checkpoint).items()}

    def saved(name: str, spec) -> torch.Tensor:
        if name not in params:
            raise CheckpointError(f"{checkpoint.manifest_path} holds no {name!r}, which its model has")
        return params.pop(name)

    model = full_model(model_config(checkpoint), seed=0, initial=saved)
    if params:
        raise CheckpointError(f"{checkpoint.manifest_path} holds parameters its model has not: {sorted(params)}")
    return model.eval()


def check_sampling(tokens: int, temperature: float, top_k: int) -> None:
    if tokens < 1:
        raise ValueError(f"--tokens={tokens} must be at least 1")
    if temperature < 0:
        raise ValueError(f"--temperature={temperature} must be 0 (greedy) or more")
    if top_k < 0:
        raise ValueError(f"--top-k={top_k} must be 0 (no limit) or more")


def check_tokenizer(tokenizer, vocab_size: int, named: str = "the tokenizer") -> None:
    """Refuses a tokenizer that cannot stand for a model of `vocab_size` ids: the byte
    tokenizer on a larger model, which may emit an id from 256 up that no byte decodes
    to, or a tokenizer.json with ids the model lacks (a job refuses such a
    data.tokenizer at submission). A tokenizer.json smaller than its model passes:
    models are padded beyond their tokenizer (50304 rows for GPT-2's 50257 ids), and
    `tokenizers` decodes an id it lacks as nothing. So does bytes on a smaller model:
    'bytes' is every job's default, also of one trained on its own token file of small
    ids, and the prompt's ids are checked as they are encoded (generate_ids).
    `named`: how the error names the tokenizer (--tokenizer='bytes')."""
    if isinstance(tokenizer, BytesTokenizer):
        if vocab_size > tokenizer.vocab_size:
            raise ValueError(f"{named} has {tokenizer.vocab_size} ids and the model {vocab_size}: the model may "
                             f"emit ids from {tokenizer.vocab_size} up, which no byte decodes to; name the job's "
                             f"tokenizer with --tokenizer PATH (a tokenizer.json or a model folder)")
    elif tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{named} has {tokenizer.vocab_size} ids and the model {vocab_size}: its ids from "
                         f"{vocab_size} up are beyond the model's vocabulary; name the job's tokenizer with "
                         f"--tokenizer PATH (a tokenizer.json or a model folder)")


def generate(model: ModelChunk, prompt: str, tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, tokenizer=None) -> str:
    """The text that follows `prompt` (see generate_ids), encoded and decoded by
    `tokenizer` (common/data/text_tokenizer.py; default: bytes)."""
    tokenizer = tokenizer or load_tokenizer("bytes")
    check_tokenizer(tokenizer, model.config.vocab_size)
    (ids,) = tokenizer.encode_batch([prompt])
    out = generate_ids(model, [int(i) for i in ids], tokens, temperature, top_k, seed, stop=tokenizer.eos_id)
    return tokenizer.decode(out)


@torch.no_grad()
def generate_ids(model: ModelChunk, prompt: list[int], tokens: int, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0, stop: int | None = None) -> list[int]:
    """The token ids that follow `prompt`: greedy at temperature 0, else sampled from the
    softmax of logits/temperature over the top_k most likely tokens (all when 0), with
    a generator seeded by `seed`; at most `tokens`, ending early with the token `stop`
    (the end of a document, as transformers' generate stops at eos_token_id).

    The context is the last seq_len tokens. Each layer's keys and values are cached, so
    a new token costs one position's forward; once the window is full it slides, and
    the cache is rebuilt over the window's tokens (gpt2 has no positions beyond
    seq_len; a llama saw none beyond it in training)."""
    check_sampling(tokens, temperature, top_k)
    if not prompt:
        raise ValueError("--prompt must not be empty: generation continues a text")
    vocab, window = model.config.vocab_size, model.config.seq_len
    if max(prompt) >= vocab:
        raise ValueError(f"--prompt holds token {max(prompt)}, outside the model's vocabulary of {vocab}")
    generator = torch.Generator().manual_seed(seed)
    seen, cache, fresh = list(prompt), None, []
    out: list[int] = []
    for _ in range(tokens):
        if cache is None or cache[0].length + len(fresh) > window:
            cache = [LayerCache() for _ in range(model.config.n_layers)]
            fresh = seen[-window:]
        logits = next_token_logits(model, torch.tensor([fresh]), cache)[0].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < vocab:
                threshold = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        out.append(token)
        if token == stop:
            break
        seen.append(token)
        fresh = [token]
    return out
