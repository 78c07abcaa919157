"""A GPU stage server against the CPU single-process reference.

One stage server on the GPU (`--device cuda`) trains a small model for a few steps with
two chunks on the rank (pp=1, vpp=2, interleaved 1F1B), so the device placement, the
fused AdamW kernel and the on-device norm and clipping all run; the reference trains
the same job on the CPU. Two cases:

- fp32 with ZeRO-3 over dp=1 (gathers and releases through the one-member group):
  losses and gradient norms must agree to the equivalence contract's 1e-5 (fp32 matrix
  products on the GPU run in full fp32: torch leaves TF32 off for them by default);
- bf16 with ZeRO-1 and recompute: the losses must agree to the bf16 bounds the test
  suite holds bf16 layouts to (mean 1e-2, largest 5e-2 relative), since GPU and CPU
  bf16 kernels round differently.

    PYTHONPATH=. python bench/gpu/check_equivalence.py [--out PATH]
    PYTHONPATH=. python bench/gpu/check_equivalence.py --device cpu --tiny   # without a GPU, in seconds

--device cpu runs the same check with the stage server on the CPU; --tiny the first case
only, on a 2-layer d_model 64 model for 3 steps (each case starts a cluster and a
reference in processes of their own: two cases would double the tests' time for the
same code).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import torch

MODEL = ["model.n_layers=4", "model.d_model=128", "model.n_heads=4", "model.seq_len=64",
         "model.vocab_size=256", "parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=2",
         "parallel.microbatches=4", "train.steps=8", "train.global_batch=8", "train.warmup_steps=2",
         "train.lr=3e-3"]
TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "train.steps=3",
        "train.warmup_steps=1"]
"""Later settings win: the tiny shape over MODEL's."""
CASES = [  # (name, settings, keys compared, (mean bound, largest bound))
    ("fp32 zero=3", ["parallel.zero=3"], ("loss", "grad_norm"), (1e-5, 1e-5)),
    ("bf16 zero=1 recompute", ["parallel.zero=1", "train.precision=bf16", "train.recompute=full"],
     ("loss",), (1e-2, 5e-2)),
]


def run(args: list[str], settings: list[str], out: str) -> list[dict]:
    sets = [a for s in settings for a in ("--set", s)]
    subprocess.run([sys.executable, "-m", "interleaf.clients.cli", *args, *sets, "--metrics-out", out], check=True,
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer d_model 64 model, 3 steps")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_equivalence.json"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/check_equivalence.py needs a CUDA GPU (or --device cpu --tiny)")
    device, failed, results = args.device, [], []
    for name, case, keys, (mean_bound, max_bound) in CASES[:1] if args.tiny else CASES:
        settings = MODEL + (TINY if args.tiny else []) + case
        with tempfile.TemporaryDirectory() as tmp:
            ours = run(["run", "--local", "1", "--device", device], settings, os.path.join(tmp, "ours.jsonl"))
            ref = run(["reference"], settings, os.path.join(tmp, "ref.jsonl"))
        for key in keys:
            diffs = [abs(o[key] - r[key]) / abs(r[key]) for o, r in zip(ours, ref, strict=True)]
            ok = statistics.fmean(diffs) <= mean_bound and max(diffs) <= max_bound
            print(f"{'ok  ' if ok else 'FAIL'} {name} on {device} vs CPU reference, {len(diffs)} steps: {key} "
                  f"relative difference mean {statistics.fmean(diffs):.2e}, largest {max(diffs):.2e}")
            results.append({"case": name, "key": key, "ok": ok, "relative_difference_mean": statistics.fmean(diffs),
                            "relative_difference_max": max(diffs), "ours": [o[key] for o in ours],
                            "reference": [r[key] for r in ref]})
            if not ok:
                failed.append(f"{name} {key}")
        print(f"     losses {device:<4} {[round(o['loss'], 6) for o in ours]}")
        print(f"     losses ref  {[round(r['loss'], 6) for r in ref]}")
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps({"device": device, "cases": results, "failed": failed}, indent=2) + "\n")
    if failed:
        raise SystemExit(f"differs from the reference beyond its bound: {failed}")
    print("every case matches the reference")


if __name__ == "__main__":
    main()
