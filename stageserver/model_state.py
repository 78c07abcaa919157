"""What one rank holds for a job: its model chunks, their parameters as ZeRO-sharded
buckets (sharded_bucket.py), its groups, its data and its memory ledger. The executor
drives it; the gRPC handler never touches it.

Group roles: `pp` (pipeline neighbours), `dp` (replicas of the same chunks), `tp`
(tensor shards of the same layers), `tie` (first and last pipeline stage, which both
hold the tied embedding), `world` (the global gradient norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interleaf.common.buckets import BucketLayout, chunk_buckets, clip_segments, starts_in_backward
from interleaf.common.lr_schedule import DECAY_FRACTION, MIN_LR_RATIO, Schedule
from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import TIED
from interleaf.common.pipeline_message_modes import message_mode
from interleaf.protos.actions import Action
from interleaf.stageserver.bucket_readiness import BucketReadiness
from interleaf.stageserver.data import Sampler
from interleaf.stageserver.memory import MemoryLedger, nbytes
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.model.chunk import InitialValues
from interleaf.stageserver.model.compiled import compile_blocks
from interleaf.stageserver.model.fp8 import convert_blocks_to_fp8
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.optim import BETAS, EPS, clip_coefficient, squared_norm
from interleaf.stageserver.pipeline_messages import PipelineMessages
from interleaf.stageserver.sharded_bucket import Pending, ShardedBucket
from interleaf.stageserver.transport import Transport

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64, "fp8": torch.bfloat16}
"""Each train.precision's compute dtype (fp8's is bf16 but for its products: model/fp8.py)."""
MASTER_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float64: torch.float64}


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
    precision: str = "fp32"
    recompute: str = "none"
    betas: tuple[float, float] = BETAS
    eps: float = EPS
    lr_decay: str = "cosine"
    min_lr_ratio: float = MIN_LR_RATIO
    decay_fraction: float = DECAY_FRACTION
    recompute_layers: int = 0
    compile: bool = False  # each block through torch.compile (stageserver/model/compiled.py)
    fp8_recipe: str = "tensorwise"  # precision fp8: the float8 scaling (stageserver/model/fp8.py)


def message_tag(kind: str, chunk: int, microbatch: int, microbatches: int) -> int:
    """The gloo tag of a pipeline message (Action.message_key), `microbatches` being the
    most a program runs: unique to the tensor within a step or an evaluation."""
    return (chunk * microbatches + microbatch) * 2 + (kind == "grad")


class ModelState:
    def __init__(
        self,
        config: ModelShape,
        chunks: list[ChunkPlan],
        groups: dict[str, Transport],
        sampler: Sampler,
        train: TrainPlan,
        last_chunk: int,
        zero: int = 0,
        device: torch.device = torch.device("cpu"),
        initial: InitialValues | None = None,
        sequence_parallel: bool = False,
        scatter_gather: bool = False,
        eval_microbatches: int = 0,
        bucket_bytes: int = 0,
        overlap_grad_reduce: bool = False,
    ):
        """`initial`: the weights to start from (checkpoint.init), else (seed, name)'s.
        `eval_microbatches`: how many microbatches an evaluation runs ([eval]; 0: none),
        which its messages' tags must number as a step's do.
        `sequence_parallel`, `scatter_gather`: parallel.sequence_parallel and
        parallel.scatter_gather (how hidden states sit on the tensor ranks and cross
        between stages: pipeline_messages.py).
        `bucket_bytes`, `overlap_grad_reduce`: parallel.bucket_mb (in bytes; 0: each
        chunk's gradient in one bucket beside the tied embedding's) and
        parallel.overlap_grad_reduce (bucket_readiness.py)."""
        self.config = config
        self.device = device
        self.groups = groups
        self.pp, self.dp, self.tp = groups["pp"], groups["dp"], groups["tp"]
        self.sampler = sampler
        self.train = train
        self.zero = zero
        self.dtype = DTYPES[train.precision]
        self.microbatches = train.microbatches
        # Tags number (chunk, microbatch) pairs: as many microbatches as the longer of a
        # step and an evaluation, so that no two messages of either share a tag.
        self.tag_microbatches = max(train.microbatches, eval_microbatches)
        self.schedule = Schedule.of(train)
        self.last_chunk = last_chunk
        self.ledger = MemoryLedger()
        self.chunks: dict[int, ModelChunk] = {}
        self.buckets: dict[int, list[ShardedBucket]] = {}
        self.bucket_bytes = bucket_bytes
        self.overlap_grad_reduce = overlap_grad_reduce
        self.readiness: dict[int, BucketReadiness] = {}  # chunk -> its buckets' hooks
        self.tied: dict[int, ShardedBucket] = {}  # chunk -> its tied-embedding bucket
        self.norm_segments: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.sequence_parallel = sequence_parallel and self.tp.size > 1
        # (chunk, bucket) -> where the parameters replicated over tp sit: under sequence
        # parallelism each rank's gradient of them is a partial sum (its tokens only).
        self.partial_segments: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.messages = PipelineMessages(message_mode(self.tp.size, sequence_parallel, scatter_gather), self.tp,
                                         train.rows, config.seq_len, config.d_model, self.dtype, device)
        for plan in chunks:
            chunk = ModelChunk(config, plan.layers, plan.has_embedding, plan.has_head, self.tp, train.seed, initial,
                               sequence_parallel=self.sequence_parallel,
                               recompute=BlockRecompute(train.recompute, train.recompute_layers))
            if train.precision == "fp8":
                convert_blocks_to_fp8(chunk, train.fp8_recipe, device)
            if train.compile:
                compile_blocks(chunk)
            self.chunks[plan.index] = chunk
            self.buckets[plan.index] = self._bucketize(plan, chunk)

    def _bucketize(self, plan: ChunkPlan, chunk: ModelChunk) -> list[ShardedBucket]:
        """The tied embedding in a bucket of its own, the rest cut into buckets of at most
        bucket_bytes of gradient, in the order a backward finishes them (common/buckets.py)."""
        specs = chunk.param_specs()
        named = dict(chunk.named_parameters())
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        groups = chunk_buckets([(n, p.numel()) for n, p in named.items()], TIED, plan.has_embedding,
                               self.bucket_bytes, element_bytes)
        buckets = []
        for params in ([(n, named[n]) for n in names] for names in groups):
            layout = BucketLayout.build([(n, p.numel()) for n, p in params], self.dp.size, self.dp.rank)
            decayed = {n for n, _ in params if specs[n].weight_decay}
            self.norm_segments[(plan.index, len(buckets))] = layout.segments(
                n for n, _ in params if self._counts_toward_norm(plan, specs[n]))
            if self.sequence_parallel:
                self.partial_segments[(plan.index, len(buckets))] = layout.segments(
                    n for n, _ in params if specs[n].tp_dim is None)
            buckets.append(ShardedBucket(params, layout, self.zero, self.dtype, MASTER_DTYPES[self.dtype],
                                         self.dp, self.ledger, decayed, self.train.weight_decay, self.device,
                                         self.train.betas, self.train.eps))
            if specs[params[0][0]].tied:
                self.tied[plan.index] = buckets[-1]
        if self.overlap_grad_reduce:  # buckets over the cap are left to the reduction action
            self.readiness[plan.index] = BucketReadiness([
                [named[n] for n in names] if starts_in_backward(bucket.layout.numel, self.bucket_bytes, element_bytes)
                else [] for names, bucket in zip(groups, buckets)])
        return buckets

    def _counts_toward_norm(self, plan: ChunkPlan, spec) -> bool:
        """Every element of the model must count exactly once over the world:
        tensor-replicated parameters count on tp rank 0 only, and the last chunk's copy
        of the tied embedding not at all (data-parallel ranks count disjoint shards)."""
        duplicate = spec.tp_dim is None and self.tp.rank > 0
        tied_copy = spec.tied and plan.has_head and not plan.has_embedding
        return not (duplicate or tied_copy)

    # -- what the executor asks for ------------------------------------------------

    def holds(self, chunk: int) -> bool:
        return chunk in self.chunks

    def microbatch(self, step: int, microbatch: int):
        inputs, targets = self.sampler.microbatch(step, microbatch, self.dp.rank, self.dp.size)
        if self.device.type == "cpu":
            return inputs, targets
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def activation_buffer(self) -> torch.Tensor:
        """An empty pipeline message (an activation or its gradient), to receive into."""
        return self.messages.buffer()

    def tag(self, action: Action) -> int:
        """A gloo tag unique to the tensor within a step or an evaluation: both ends
        derive the same one. Worked example, 4 training and 12 evaluation microbatches:
        chunk 1's activation of evaluation microbatch 5 is (1*12 + 5)*2 = 34, which with
        4 per chunk would have been chunk 4's microbatch 1's, (4*4 + 1)*2 = 34."""
        return message_tag(*action.message_key(), self.tag_microbatches)

    def zero_grad(self) -> None:
        for buckets in self.buckets.values():
            for bucket in buckets:
                bucket.zero_grad()

    def hold_grads(self, chunk: int) -> None:
        for bucket in self.buckets[chunk]:
            bucket.hold_grads()

    def start_bucket_reduction(self, chunk: int, bucket: int, inside_backward: bool) -> Pending:
        """One bucket's data-parallel reduction; `inside_backward`: started by the chunk's
        last backward while it runs (sharded_bucket.py)."""
        return self.buckets[chunk][bucket].reduce(inside_backward)

    def start_gather(self, chunk: int) -> list[Pending]:
        return [bucket.gather() for bucket in self.buckets[chunk]]

    def gathered(self, chunk: int) -> bool:
        return all(bucket.gathered for bucket in self.buckets[chunk])

    def release(self, chunk: int) -> None:
        for bucket in self.buckets[chunk]:
            bucket.release()

    def reduce_tied_grads(self) -> None:
        """Sums the tied embedding's gradient over its copies (first and last chunk):
        whatever the optimizer will read, the full gradient or this rank's shard."""
        copies = [self.tied[c].optimizer_grad() for c in (0, self.last_chunk) if c in self.tied]
        if len(copies) == 2:
            copies[0].add_(copies[1])
            copies[1].copy_(copies[0])
        else:
            self.groups["tie"].all_reduce(copies[0])

    def optimizer_step(self, step: int) -> tuple[float | torch.Tensor, float]:
        """Averages data-parallel gradients, clips by the global norm, steps AdamW.
        Returns (global gradient norm before clipping, learning rate); on a GPU the norm
        stays a device tensor, read once at the step's end."""
        self._sum_partial_grads()
        parts = [part for (index, b), segments in self.norm_segments.items()
                 for part in self.buckets[index][b].count_norm(segments)]
        if self.device.type == "cuda":
            norm, coefficient = self._device_norm(parts)
        else:
            sumsq = torch.tensor([sum(squared_norm(p) for p in parts)], dtype=torch.float64)
            self.groups["world"].all_reduce(sumsq)
            # The sum of squares was taken before averaging over the dp replicas: rescale.
            norm = float(sumsq.sqrt()) / self.dp.size
            coefficient = clip_coefficient(norm, self.train.grad_clip)
        lr = self.schedule.lr_at(step)
        for buckets in self.buckets.values():
            for bucket in buckets:
                bucket.step(lr, coefficient / self.dp.size)
        return norm, lr

    def _sum_partial_grads(self) -> None:
        """Sequence parallel: sums over the tensor group the gradients of the parameters
        replicated over it (norms, row-parallel biases, wpe), each rank's being over its
        own tokens only. Once per step, on what the optimizer reads (the full gradient,
        or this rank's ZeRO shard: the tp ranks of one dp rank hold equal layouts), in
        one all-reduce, as Megatron's finalize_model_grads does, rather than an
        all-reduce per parameter, layer and microbatch inside the backward."""
        pieces = []
        for (index, b), segments in self.partial_segments.items():
            bucket = self.buckets[index][b]
            grad = bucket.optimizer_grad()
            pieces += [grad[s:e] for s, e in clip_segments(segments, bucket.window)]
        if not pieces:
            return
        summed = torch.cat(pieces)
        self.ledger.add("communication", nbytes(summed))
        self.tp.all_reduce(summed)
        for piece, part in zip(pieces, summed.split([p.numel() for p in pieces])):
            piece.copy_(part)
        self.ledger.free("communication", nbytes(summed))

    def _device_norm(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norm and clipping factor as device tensors: no host round trip. Each
        part's norm is accumulated by torch in its own dtype (fp32 gradients: relative
        error near 1e-7), their squares summed in float64."""
        if parts:
            sumsq = torch.stack(torch._foreach_norm(parts)).double().square().sum().reshape(1)
        else:
            sumsq = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.groups["world"].all_reduce(sumsq)
        norm = sumsq.sqrt()[0] / self.dp.size
        if self.train.grad_clip <= 0:
            return norm, torch.ones((), dtype=torch.float64, device=self.device)
        return norm, (self.train.grad_clip / (norm + 1e-6)).clamp(max=1.0)

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
