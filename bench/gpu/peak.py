"""The GPU's measured dense bf16 matrix rate: the ceiling MFU is stated against.

An 8192^3 bf16 product on random data (zeros run faster on Hopper and would flatter
the ceiling), timed with CUDA events after warm-up, median of the repeats.
"""

from __future__ import annotations

import statistics

import torch


def time_cuda(fn, repeats: int = 20, warmup: int = 5) -> float:
    """Median seconds of `fn` over `repeats` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def bf16_matmul_peak(n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matrix product on this GPU."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = time_cuda(lambda: torch.matmul(a, b, out=out))
    return 2 * n**3 / seconds
