"""A rank's training state written by global parameter name, and read back under any
layout (DESIGN.md, "Checkpoints").

What a rank writes: for every parameter element in its optimizer window, the master
weight and both Adam moments, as pieces named `NAME|KIND|OFFSET`: elements
[OFFSET, OFFSET + len) of the parameter's local tensor flattened (its tensor-parallel
slice, or the whole tensor). The file's metadata records each parameter's local shape
and tensor-parallel slice, and the optimizer's step count. One writer per distinct
piece: data-parallel replicas of a ZeRO-0 bucket leave it to rank 0, tensor-replicated
parameters to tp rank 0, and the tied embedding's second copy (with the head) to the
first chunk's, which holds the same values.

A padded vocabulary (model.pad_vocab_to) is written without its padding: of the
embedding's and head's local rows only those of real tokens, so the files hold the true
vocabulary and load under a tp whose padding differs.

What a rank reads: every file's header, and the pieces of the parameters it holds
under the new layout (safetensors reads a tensor without the rest of its file). From
them it rebuilds each of those parameters' full tensors (joining tensor-parallel
slices), cuts its own slice, lays it into its flat buckets and keeps its window.

The working weights follow from the master weights (they are a cast of them after
every step), so they are not written: the master weights are the checkpoint's
parameters, which `interleaf export` reads through the same `Pieces`.
"""

from __future__ import annotations

import json
import math

import torch

from interleaf.common.model.params import true_rows
from interleaf.stageserver import safetensors
from interleaf.stageserver.model.params import shard
from interleaf.stageserver.model_state import ModelState

KINDS = ("master", "exp_avg", "exp_avg_sq")


def collect(model: ModelState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the pieces this rank writes, the file's metadata)."""
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, list] = {}
    steps = 0
    tp = model.tp
    for index in sorted(model.chunks):
        chunk = model.chunks[index]
        specs = chunk.param_specs()
        local = {name: tuple(p.shape) for name, p in chunk.named_parameters()}
        for bucket in model.buckets[index]:
            steps = bucket.optimizer.steps
            if bucket.zero == 0 and model.dp.rank > 0:
                continue  # the replicas hold the same bytes
            lo, hi = bucket.window
            buffers = dict(zip(KINDS, (bucket.master, bucket.optimizer.exp_avg, bucket.optimizer.exp_avg_sq)))
            for name in bucket.layout.names:
                spec = specs[name]
                if (spec.tied and not chunk.has_embedding) or (spec.tp_dim is None and tp.rank > 0):
                    continue  # another rank writes the same values
                start, n = bucket.layout.offsets[name]
                rows = true_rows(spec, tp.rank, tp.size)
                if rows is not None:  # the padding rows come last: leave them out
                    n = rows * math.prod(local[name][1:])
                a, e = max(start, lo), min(start + n, hi)
                if a >= e:
                    continue
                for kind, buffer in buffers.items():
                    tensors[f"{name}|{kind}|{a - start}"] = buffer[a - lo:e - lo].detach().to("cpu", copy=True)
                shapes[name] = [list(local[name]), spec.tp_dim, tp.rank if spec.tp_dim is not None else 0,
                                tp.size if spec.tp_dim is not None else 1,
                                None if rows is None else spec.full_shape[0]]
    return tensors, {"shapes": json.dumps(shapes), "steps": str(steps)}


class Pieces:
    """The pieces of `kinds` of every parameter, or of those `wanted` names (each with
    the kinds it needs), from every file, indexed to rebuild full tensors; only those
    pieces are read."""

    def __init__(self, paths: list[str], wanted: dict[str, set[str]] | None = None,
                 kinds: tuple[str, ...] = KINDS):
        self.pieces: dict[tuple[str, str], list[tuple[int, int, torch.Tensor]]] = {}
        # name -> (local shape, tp dim, tp size, true rows of a padded vocabulary or None)
        self.shapes: dict[str, tuple[list[int], int | None, int, int | None]] = {}
        self.steps = None
        for path in paths:
            with safetensors.open(path) as f:
                meta = f.metadata() or {}
                steps = int(meta["steps"])
                if self.steps is not None and steps != self.steps:
                    raise ValueError(f"{path} holds optimizer step {steps}, other files {self.steps}")
                self.steps = steps
                # name -> [local shape, tp dim, tp rank, tp size(, true vocabulary rows)]
                shapes = json.loads(meta["shapes"])
                for name, (shape, dim, _, size, *vocab) in shapes.items():
                    if wanted is None or name in wanted:
                        self.shapes[name] = (shape, dim, size, vocab[0] if vocab else None)
                        for kind in (kinds if wanted is None else wanted[name]):
                            self.pieces.setdefault((name, kind), [])
                for key in f.keys():
                    name, kind, offset = key.split("|")
                    if (name, kind) in self.pieces:
                        self.pieces[(name, kind)].append((shapes[name][2], int(offset), f.get_tensor(key)))

    @property
    def names(self) -> list[str]:
        return sorted(self.shapes)

    def full(self, name: str, kind: str) -> torch.Tensor:
        if name not in self.shapes:
            raise ValueError(f"the checkpoint holds no state for parameter {name!r}")
        shape, dim, size, vocab = self.shapes[name]
        numel = math.prod(shape)
        # A padded vocabulary's slices hold only their real rows; the padding is zeros.
        expected = [numel if vocab is None else max(0, min(shape[0], vocab - r * shape[0])) * numel // shape[0]
                    for r in range(size)]
        dtype = next((t.dtype for _, _, t in self.pieces[(name, kind)]), torch.float64)
        parts = [torch.zeros(numel, dtype=dtype) for _ in range(size)]
        covered = [0] * size
        for rank, offset, tensor in self.pieces[(name, kind)]:
            parts[rank][offset:offset + tensor.numel()] = tensor
            covered[rank] += tensor.numel()
        if covered != expected:
            raise ValueError(f"the checkpoint's {kind} of {name!r} covers {covered} of {expected} elements "
                             f"per tensor-parallel slice")
        views = [p.view(shape) for p in parts]
        full = views[0] if dim is None else torch.cat(views, dim=dim)
        return full if vocab is None else full[:vocab]


def _needed(bucket, name: str) -> set[str]:
    """What this rank keeps of a parameter: the moments of its window; the master
    weights of its window under ZeRO-3, else of the whole bucket (the working
    parameters, replicated below stage 3, are their cast)."""
    start, n = bucket.layout.offsets[name]
    lo, hi = bucket.window
    mine = start < hi and start + n > lo
    kinds = {"exp_avg", "exp_avg_sq"} if mine else set()
    return kinds | {"master"} if mine or bucket.zero < 3 else kinds


def restore(model: ModelState, paths: list[str]) -> int:
    """Loads the state in `paths` into this rank's buckets, reading only the pieces it
    keeps; returns the optimizer step."""
    wanted: dict[str, set[str]] = {}
    for index in model.chunks:
        for bucket in model.buckets[index]:
            for name in bucket.layout.names:
                wanted.setdefault(name, set()).update(_needed(bucket, name))
    pieces = Pieces(paths, {name: kinds for name, kinds in wanted.items() if kinds})
    for index in sorted(model.chunks):
        specs = model.chunks[index].param_specs()
        for bucket in model.buckets[index]:
            flat = {kind: torch.zeros(bucket.layout.padded, dtype=bucket.md) for kind in KINDS}
            for name in bucket.layout.names:
                start, n = bucket.layout.offsets[name]
                for kind in _needed(bucket, name):
                    mine = shard(pieces.full(name, kind), specs[name], model.tp)
                    flat[kind][start:start + n] = mine.reshape(-1)
            bucket.load_state(flat["master"], flat["exp_avg"], flat["exp_avg_sq"], pieces.steps)
    return pieces.steps
