"""The checkpoint peer: torch.distributed.checkpoint (DCP) saving and loading the training
state of an FSDP2 job, the way torchtitan checkpoints one.

The state: the model built from the job's seed, sharded over the world with
`fully_shard` (one unit: dim-0 shards of every parameter), and torch.optim.AdamW with
Interleaf's groups after `every` training steps, so every parameter has its Adam
moments. `get_state_dict` gives it as the parameters' and moments' local shards
(DTensors) and each parameter's step count: 12 bytes per parameter over the world in
fp32, as Interleaf's ZeRO state files (fp32 master weights, which are the parameters,
and both moments) hold.

What one call measures, on every rank, with training carried on between saves as in
an Interleaf job with `checkpoint.every`:

  async saves: `saves` times, get_state_dict + `dcp.async_save` (the stall: until it
    returns, training is blocked: the state is copied out of the training tensors), then
    `every` training steps while the write runs (none after the last save), then waiting
    for the write; the write's end is stamped where it happens (a callback on the
    upload future). The saves' collectives go through a gloo group of their own, as
    torch advises, so that they never interleave with training's.
  sync saves: `saves` times `dcp.save` with training stopped.
  loads: `saves` times, with training stopped: the live parameters and moments are
    first overwritten with NaN, then `dcp.load` into a fresh state dict of the same
    structure and `set_state_dict` into the model and optimizer (what resuming takes);
    then every tensor is compared with its copy taken after the sync saves.

`sync_files` is FileSystemWriter's: True (torch's default) fsyncs each file before the
save completes; False leaves the files to the page cache, as Interleaf's writer does.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import JobConfig
from interleaf.stageserver.model import full_model

import data_parallel  # siblings in bench/
import torch_training


class _Stamp:
    """A future's done-callback noting when the future completed, where it completes
    (its callbacks may run after `result()` has already returned elsewhere)."""

    def __init__(self):
        self._done = threading.Event()
        self.at = 0.0

    def __call__(self, _future) -> None:
        self.at = time.perf_counter()
        self._done.set()

    def wait(self) -> float:
        self._done.wait()
        return self.at


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict by its dotted key, as this rank holds it."""
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            found[f"{prefix}{key}"] = _local(value)
    return found


def _state(model, optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optimizer_state}


def _state_bytes(state: dict) -> dict:
    """This rank's shards of the parameters and moments (what Interleaf's state files
    hold), and of everything else DCP writes (AdamW's per-parameter step counts)."""
    shards = other = 0
    for key, tensor in _tensors(state).items():
        size = tensor.numel() * tensor.element_size()
        if key.startswith("model.") or key.endswith((".exp_avg", ".exp_avg_sq")):
            shards += size
        else:
            other += size
    return {"state": shards, "other": other}


def checkpoints(rank: int, config: JobConfig, folder: str, saves: int, every: int, sync_files: bool) -> dict:
    m, p, t = config.model, config.parallel, config.train
    replicas = data_parallel.check_layout(config, "DCP")
    model = full_model(shape_of(m), t.seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (replicas,)))
    params = list(model.parameters())
    optimizer, lr_schedule, sampler = torch_training.training_setup(config, [model])

    def train(first: int, count: int) -> None:
        for step in range(first, first + count):
            optimizer.zero_grad()
            for mb in range(p.microbatches):
                inputs, targets = sampler.microbatch(step, mb, rank, replicas)
                model.set_requires_gradient_sync(mb == p.microbatches - 1)
                (model(inputs, targets) / p.microbatches).backward()
            grads = [q.grad.to_local() for q in params]
            torch_training.clip_global_norm(grads, grads, t.grad_clip, across_ranks=True)
            torch_training.step(optimizer, lr_schedule, step)

    def writer(path: str) -> dcp.FileSystemWriter:
        return dcp.FileSystemWriter(path, sync_files=sync_files)

    train(0, every)
    async_saves = _async_saves(model, optimizer, train, [os.path.join(folder, f"async-{k}") for k in range(saves)],
                               every, writer)
    sizes = _state_bytes(_state(model, optimizer))

    sync_saves, paths = [], [os.path.join(folder, f"sync-{k}") for k in range(saves)]
    for path in paths:
        dist.barrier()
        started = time.perf_counter()
        dcp.save(_state(model, optimizer), storage_writer=writer(path))
        sync_saves.append(time.perf_counter() - started)
    disk_bytes = sum(entry.stat().st_size for entry in os.scandir(paths[-1])) if rank == 0 else 0
    expected = {key: tensor.clone() for key, tensor in _tensors(_state(model, optimizer)).items()}
    loads, mismatched = _loads(model, optimizer, paths[-1], saves, expected)
    _remove(rank, paths)
    return {"async_saves": async_saves, "sync_save_seconds": sync_saves, "load_seconds": loads,
            "state_bytes": sizes["state"], "other_bytes": sizes["other"], "disk_bytes": disk_bytes,
            "tensors": len(expected), "mismatched": sorted(mismatched)}


def _async_saves(model, optimizer, train, paths: list[str], every: int, writer) -> list[dict]:
    """One async save into each of `paths`, `every` training steps after each but the
    last; the saves' collectives go through a gloo group of their own."""
    writes = dist.new_group(backend="gloo")
    saves = []
    for k, path in enumerate(paths):
        dist.barrier()
        started = time.perf_counter()
        state = _state(model, optimizer)
        stated = time.perf_counter()
        # The stager is the one async_save makes by default (a blocking copy into fresh
        # CPU tensors), named here because a storage_writer of our own would otherwise
        # stage in its place.
        future = dcp.async_save(state, storage_writer=writer(path), process_group=writes,
                                async_stager=DefaultStager(StagingOptions(False, False, False, False)))
        returned = time.perf_counter()
        written = _Stamp()
        future.add_done_callback(written)
        if k < len(paths) - 1:
            train(every * (k + 1), every)
        waiting = time.perf_counter()
        future.result()
        waited = time.perf_counter() - waiting
        end = written.wait()
        saves.append({"state_dict_seconds": stated - started, "stall_seconds": returned - started,
                      "write_seconds": end - returned, "total_seconds": end - started, "waited_seconds": waited})
    dist.destroy_process_group(writes)
    _remove(dist.get_rank(), paths)
    return saves


def _loads(model, optimizer, path: str, count: int, expected: dict) -> tuple[list[float], set[str]]:
    """`count` loads of the checkpoint at `path`, each after overwriting the live
    parameters and moments with NaN; returns their times and the keys of the tensors
    that did not come back equal to `expected`."""
    times, mismatched = [], set()
    for _ in range(count):
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().fill_(float("nan"))
            for moments in optimizer.state.values():
                moments["exp_avg"].to_local().fill_(float("nan"))
                moments["exp_avg_sq"].to_local().fill_(float("nan"))
        dist.barrier()
        started = time.perf_counter()
        state = _state(model, optimizer)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        times.append(time.perf_counter() - started)
        loaded = _tensors(_state(model, optimizer))
        mismatched |= {key for key, tensor in expected.items()
                       if key not in loaded or not torch.equal(loaded[key], tensor)}
    return times, mismatched


def _remove(rank: int, paths: list[str]) -> None:
    """Measured checkpoints need not take the disk any longer (one rank removes them,
    once every rank is done with them)."""
    dist.barrier()
    if rank == 0:
        for path in paths:
            shutil.rmtree(path)
