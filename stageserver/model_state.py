"""What one rank holds for a job: its model chunks on flat buffers, their optimizers,
its groups and its data. The executor drives it; the gRPC handler never touches it.

Group roles: `pp` (pipeline neighbours), `dp` (replicas of the same chunks), `tp`
(tensor shards of the same layers), `tie` (first and last pipeline stage, which both
hold the tied embedding), `world` (the global gradient norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protos.actions import Action
from stageserver.data import Sampler
from stageserver.flat import FlatParams
from stageserver.model import GPTChunk, GPTConfig
from stageserver.model.gpt import TIED
from stageserver.optim import AdamW, Schedule, clip_coefficient, squared_norm
from stageserver.transport import Transport


@dataclass(frozen=True)
class ChunkPlan:
    index: int
    layers: range
    has_embedding: bool
    has_head: bool


@dataclass(frozen=True)
class TrainPlan:
    microbatches: int
    rows: int  # samples per microbatch per data-parallel replica
    lr: float
    warmup_steps: int
    steps: int
    weight_decay: float
    grad_clip: float
    seed: int


class ModelState:
    def __init__(
        self,
        config: GPTConfig,
        chunks: list[ChunkPlan],
        groups: dict[str, Transport],
        sampler: Sampler,
        train: TrainPlan,
        last_chunk: int,
    ):
        self.config = config
        self.groups = groups
        self.pp, self.dp, self.tp = groups["pp"], groups["dp"], groups["tp"]
        self.sampler = sampler
        self.train = train
        self.microbatches = train.microbatches
        self.schedule = Schedule(train.lr, train.warmup_steps, train.steps)
        self.last_chunk = last_chunk
        self.chunks: dict[int, GPTChunk] = {}
        self.flats: dict[int, FlatParams] = {}
        self.optimizers: dict[int, AdamW] = {}
        self.norm_segments: dict[int, list[tuple[int, int]]] = {}
        for plan in chunks:
            chunk = GPTChunk(config, plan.layers, plan.has_embedding, plan.has_head, self.tp, train.seed)
            specs = chunk.param_specs()
            flat = FlatParams(chunk, {name: spec.weight_decay for name, spec in specs.items()})
            self.chunks[plan.index] = chunk
            self.flats[plan.index] = flat
            self.optimizers[plan.index] = AdamW(flat.data, flat.decay_mask, train.weight_decay)
            self.norm_segments[plan.index] = self._norm_segments(plan, flat, specs)

    def _norm_segments(self, plan: ChunkPlan, flat: FlatParams, specs) -> list[tuple[int, int]]:
        """The [start, end) ranges of the flat gradient that this rank counts toward the
        global norm.

        Every element of the model must count exactly once over the world: replicas
        (dp rank > 0) count nothing, tensor-replicated parameters count on tp rank 0
        only, and the last chunk's copy of the tied embedding not at all.
        """
        if self.dp.rank > 0:
            return []
        segments: list[tuple[int, int]] = []
        for name, spec in specs.items():
            duplicate = spec.tp_dim is None and self.tp.rank > 0
            tied_copy = spec.tied and plan.has_head and not plan.has_embedding
            if duplicate or tied_copy:
                continue
            start, n = flat.offsets[name]
            if segments and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], start + n)  # merge neighbours
            else:
                segments.append((start, start + n))
        return segments

    # -- what the executor asks for ------------------------------------------------

    def holds(self, chunk: int) -> bool:
        return chunk in self.chunks

    def microbatch(self, step: int, microbatch: int):
        return self.sampler.microbatch(step, microbatch, self.dp.rank, self.dp.size)

    def activation_buffer(self) -> torch.Tensor:
        return torch.empty(self.train.rows, self.config.seq_len, self.config.d_model)

    def tag(self, action: Action) -> int:
        """A gloo tag unique to the tensor within a step: both ends derive the same one."""
        kind, chunk, microbatch = action.message_key()
        return (chunk * self.microbatches + microbatch) * 2 + (kind == "grad")

    def zero_grad(self) -> None:
        for flat in self.flats.values():
            flat.zero_grad()

    def start_dp_reduce(self, chunk: int):
        return self.dp.all_reduce(self.flats[chunk].grad, async_op=True)

    def reduce_tied_grads(self) -> None:
        """Sums the tied embedding's gradient over its copies (first and last chunk)."""
        copies = [self.flats[c].view(TIED, self.flats[c].grad) for c in (0, self.last_chunk) if c in self.flats]
        if len(copies) == 2:
            copies[0].add_(copies[1])
            copies[1].copy_(copies[0])
        else:
            self.groups["tie"].all_reduce(copies[0])

    def optimizer_step(self, step: int) -> tuple[float, float]:
        """Averages data-parallel gradients, clips by the global norm, steps AdamW.
        Returns (global gradient norm before clipping, learning rate)."""
        for flat in self.flats.values():
            flat.check_grads_in_place()
            if self.dp.size > 1:
                flat.grad.div_(self.dp.size)
        sumsq = torch.tensor([sum(squared_norm(flat.grad[start:end])
                                  for index, flat in self.flats.items()
                                  for start, end in self.norm_segments[index])], dtype=torch.float64)
        self.groups["world"].all_reduce(sumsq)
        norm = float(sumsq.sqrt())
        coefficient = clip_coefficient(norm, self.train.grad_clip)
        lr = self.schedule.lr_at(step)
        for index, flat in self.flats.items():
            if coefficient < 1.0:
                flat.grad.mul_(coefficient)
            self.optimizers[index].step(flat.grad, lr)
        return norm, lr

    def named_parameters(self):
        """(global name, tensor, tp_dim) for every parameter this rank holds, each
        name once (a rank holding both tied-embedding copies saves one)."""
        seen = set()
        for index in sorted(self.chunks):
            specs = self.chunks[index].param_specs()
            for name, param in self.chunks[index].named_parameters():
                if name not in seen:
                    seen.add(name)
                    yield name, param.detach(), specs[name].tp_dim

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
