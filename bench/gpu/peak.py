"""The GPU's measured dense bf16 matrix rate: the ceiling MFU is stated against.

An 8192^3 bf16 product on random data (zeros run faster on Hopper and would flatter
the ceiling), timed with CUDA events after warm-up, median of the repeats.

    PYTHONPATH=. python bench/gpu/peak.py [--out PATH]
    PYTHONPATH=. python bench/gpu/peak.py --device cpu --tiny   # a 256^3 product on the CPU: checks the script

On the CPU the product is timed with the host clock (there are no CUDA events).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable

import torch


def time_device(fn: Callable[[], object], device: str = "cuda", repeats: int = 20, warmup: int = 5) -> float:
    """Median seconds of `fn` over `repeats` runs: CUDA events on a GPU, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def bf16_matmul_peak(n: int = 8192, device: str = "cuda") -> float:
    """FLOP/s of an n x n x n bf16 matrix product on `device`."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    seconds = time_device(lambda: torch.matmul(a, b, out=out), device)
    return 2 * n**3 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 256^3 product: checks the script in a second")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_peak.json"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/peak.py needs a CUDA GPU (or --device cpu --tiny)")
    n = 256 if args.tiny else 8192
    peak = bf16_matmul_peak(n, args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "n": n, "measured_bf16_peak_flops": peak}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{name}: measured bf16 matmul peak ({n}^3) {peak / 1e12:.3f} TFLOP/s")


if __name__ == "__main__":
    main()
