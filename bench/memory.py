"""Peak memory per rank, measured on the peers the way Interleaf's stage servers measure
their own: the process's resident-set high-water mark over one step.

Writing "5" to /proc/self/clear_refs resets the kernel's high-water mark (VmHWM) to the
current resident set; reading VmHWM from /proc/self/status at the step's end gives the
most the process held at once during the step. Both sides of a comparison are processes
with torch loaded that have already run earlier jobs, so their figures compare; neither
is the model's bytes alone (torch's libraries, the allocator's cached pages and, on
Interleaf's side, gRPC are resident too). Linux only.
"""

from __future__ import annotations

import re

import torch

_VMHWM = re.compile(r"^VmHWM:\s+(\d+) kB$", re.MULTILINE)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(_VMHWM.search(f.read()).group(1)) * 1024


def _local_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes this process holds of `tensor`: its shard when it is a DTensor (FSDP2)."""
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(params: list[torch.Tensor], optimizer_state: dict) -> dict:
    """The training state this rank holds, by kind: parameters and gradients (local
    shards where sharded) and the optimizer's tensors (`optimizer_state` is a torch
    optimizer's `state`, of this rank's parameters only under ZeroRedundancyOptimizer).
    The sum of tensor sizes, not what the allocator holds: framework buffers (DDP's
    gradient buckets, FSDP2's gathered parameters and reduce-scatter staging) are in the
    rss figure only."""
    return {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params),
        "optimizer": sum(_local_bytes(v) for state in optimizer_state.values()
                         for v in state.values() if isinstance(v, torch.Tensor)),
    }
