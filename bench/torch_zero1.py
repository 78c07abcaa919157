"""The ZeRO-1 peer: DistributedDataParallel with torch's ZeroRedundancyOptimizer wrapping
AdamW, in Interleaf's two weight-decay groups. Gradients are all-reduced as with plain
DDP (once per step, on the last microbatch); each rank keeps the Adam moments of its
partition of the parameters only, updates that partition, and broadcasts it to the
other ranks (ZeRO stage 1, as `parallel.zero=1`).

torch partitions whole parameters (greedily by size, per group), where Interleaf cuts
one flat buffer into equal shards; the arithmetic per element is the same AdamW.

Runs on every rank of a peer_world; returns what data_parallel.train_steps does and the
training state this rank holds (its optimizer state is its partition's).
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from interleaf.coordinator.config import JobConfig
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.optim import BETAS, EPS

import torch_ddp  # siblings in bench/
import torch_training


def zero_redundancy_adamw(chunks: list[ModelChunk], weight_decay: float) -> ZeroRedundancyOptimizer:
    # parameters_as_bucket_view: each rank's partition lives in one flat bucket, so the
    # post-step broadcast is one collective per rank, not one per parameter (torch's
    # default): the faster of torch's two ways, so the stronger baseline.
    return ZeroRedundancyOptimizer(torch_training.param_groups(chunks, weight_decay),
                                   optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
                                   lr=0.0, betas=BETAS, eps=EPS)


def train(rank: int, config: JobConfig) -> dict:
    # Gradients are whole on every rank after DDP's all-reduce: the norm is local, and
    # every rank scales all of them (only its partition's are used).
    return torch_ddp.train_with(rank, config, "ZeRO-1", zero_redundancy_adamw,
                                lambda optimizer: optimizer.optim.state)
