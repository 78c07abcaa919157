"""The in-process peers bench/gpu/train.py holds Interleaf against: what a PyTorch user
would train the same model with, on the same samples, initial weights and schedule.

Each peer is one function of a `Workload`, returning its per-step seconds, losses, peak
memory and parameter count:

- plain: fp32 parameters, `torch.autocast` to the workload's dtype, AdamW(fused=True),
  `clip_grad_norm_`, gradient accumulation over the microbatches;
- compiled: plain with each transformer block `torch.compile`d in place (torchtitan's
  per-block compile: blocks of one shape share one graph, so compile time does not grow
  with depth, and the embedding, head and loss stay eager);
- fsdp2_compiled: torchtitan's recipe on a world-size-1 process group: each block
  compiled, then `fully_shard` on each block and on the root with a
  `MixedPrecisionPolicy` (parameters cast to the workload's dtype for compute, gradients
  reduced in fp32; no autocast, as torchtitan under FSDP), fused AdamW on the fp32
  sharded parameters. As torchtitan, every microbatch's backward reduces its gradients
  (a copy with one rank);
- fsdp2_compiled_fp8: torchtitan's float8 recipe, fsdp2_compiled with the blocks'
  linears multiplying in float8 through torchao (tensorwise), converted first.

Step time is host wall time per step, after the step's final synchronization on CUDA.
With `profile_to`, the last step runs under the stage server's own profiler
(stageserver/profiling.py's StepProfiler: CPU operators, CUDA kernels on a GPU, shapes),
its gzip-compressed Chrome trace written there (empty where over the size a server's
report keeps), and leaves the step times: the peer's kernels beside Interleaf's
(profile_breakdown.py) say where the two steps differ.
Peak memory is `torch.cuda.max_memory_allocated` from the model's construction on; on
the CPU it is not measured (None).
"""

from __future__ import annotations

import contextlib
import gc
import pathlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from interleaf.common.lr_schedule import Schedule
from interleaf.common.model.config import ModelShape
from interleaf.stageserver.data import Sampler, resolve_source
from interleaf.stageserver.model import full_model
from interleaf.stageserver.model.chunk import ModelChunk
from interleaf.stageserver.model.fp8 import convert_blocks_to_fp8
from interleaf.stageserver.optim import BETAS, EPS
from interleaf.stageserver.profiling import StepProfiler
from torch_training import param_groups  # bench/torch_training.py: Interleaf's weight-decay groups
from measure import write_atomically  # bench/measure.py

SEED = 1
LR, WARMUP_STEPS, WEIGHT_DECAY, CLIP = 3e-4, 100, 0.1, 1.0
"""The warmup outlasts any run here, as a real run's first steps' warmup does: at the
full rate by step 2 these 1B models' losses spiked (8.6 to 15-20), and the spike
amplified rounding past bf16's bounds, so that the two bf16 peers' Llama losses ended
8.0e-2 apart (H200, 2026-11-27). No step's time depends on the rate."""


@dataclass(frozen=True)
class Workload:
    """What every side of the bench trains: one model, batch, schedule and precision."""

    model: ModelShape
    steps: int
    rows: int
    """Samples per microbatch."""
    microbatches: int
    device: str
    """cuda or cpu."""
    dtype: torch.dtype
    """The compute dtype: bf16 (autocast, or FSDP2's param_dtype), or fp32 (no casting)."""
    compile_backend: str
    """torch.compile's backend: inductor on a GPU; aot_eager keeps CPU tiny runs to seconds."""


def plain(w: Workload, profile_to: str | None = None) -> dict:
    """The PyTorch user's eager loop."""
    return _train(w, _model(w), autocast=True, profile_to=profile_to)


def compiled(w: Workload, profile_to: str | None = None) -> dict:
    """The eager loop with every transformer block compiled."""
    model = _model(w)
    _compile_blocks(model, w.compile_backend)
    return _train(w, model, autocast=True, profile_to=profile_to)


def fsdp2_compiled(w: Workload, profile_to: str | None = None, float8: bool = False) -> dict:
    """torchtitan's FSDP2 + per-block compile recipe, on one rank. `float8`: its float8
    recipe, the blocks converted first (tensorwise scaling). torchtitan converts nn.Linear
    modules (torchao's convert_to_float8_training); this model's linears take the same
    torchao matmul through Interleaf's own conversion (stageserver/model/fp8.py), so both
    sides' products are torchao's."""
    with _world_of_one(w.device):
        model = _model(w)
        if float8:
            convert_blocks_to_fp8(model, "tensorwise", torch.device(w.device))
        _compile_blocks(model, w.compile_backend)  # torchtitan compiles before it shards
        policy = MixedPrecisionPolicy(param_dtype=w.dtype, reduce_dtype=torch.float32)
        for block in model.h.values():
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return _train(w, model, autocast=False, profile_to=profile_to)


def fsdp2_compiled_fp8(w: Workload, profile_to: str | None = None) -> dict:
    """torchtitan's float8 recipe on one rank (fsdp2_compiled's float8 variant)."""
    return fsdp2_compiled(w, profile_to, float8=True)


def _model(w: Workload) -> ModelChunk:
    # Built on the CPU from the seed, then moved: the initial weights every side starts from.
    if w.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return full_model(w.model, SEED).to(w.device)


def _compile_blocks(model: ModelChunk, backend: str) -> None:
    # In place (Module.compile): parameter names stay `h.N....`, which param_groups and
    # fully_shard read.
    for block in model.h.values():
        block.compile(backend=backend)


@contextlib.contextmanager
def _world_of_one(device: str) -> Iterator[None]:
    """torch.distributed's default group with this process its only rank (nccl on a GPU,
    gloo on the CPU), over a free loopback port; destroyed afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train(w: Workload, model: ModelChunk, autocast: bool, profile_to: str | None = None) -> dict:
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(param_groups([model], WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS, fused=True)
    schedule = Schedule(LR, WARMUP_STEPS, w.steps)
    sampler = Sampler(resolve_source("builtin"), SEED, w.model.seq_len, w.rows * w.microbatches, w.microbatches)
    cast = autocast and w.dtype != torch.float32
    seconds, losses = [], []

    def one_step(step: int) -> None:
        _synchronize(w.device)
        t0 = time.perf_counter()
        total = torch.zeros((), device=w.device)
        for m in range(w.microbatches):
            x, y = (t.to(w.device, non_blocking=True) for t in sampler.microbatch(step, m))
            with torch.autocast(w.device, w.dtype, enabled=cast):
                loss = model(x, y)
            (loss / w.microbatches).backward()
            total += loss.detach().float() / w.microbatches
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total.item())  # .item() synchronizes: the step's time includes its kernels
        seconds.append(time.perf_counter() - t0)

    for step in range(w.steps - 1 if profile_to else w.steps):
        one_step(step)
    if profile_to:
        with StepProfiler(torch_profiler=True, memory_snapshot=False, device=torch.device(w.device)).over(True) as got:
            one_step(w.steps - 1)
        write_atomically(profile_to, got.torch_profile)  # gzip-compressed, as a server's report carries it
        seconds.pop()  # the profiled step, slowed by the profiler, leaves the median as Interleaf's does
    peak = torch.cuda.max_memory_allocated() if w.device == "cuda" else None
    del model, optimizer
    gc.collect()
    if w.device == "cuda":
        torch.cuda.empty_cache()
    return {"step_seconds": seconds, "losses": losses, "max_memory_allocated_bytes": peak, "parameters": parameters}


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
