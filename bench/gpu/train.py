"""Interleaf against plain PyTorch training of the same ~1.1B GPT on one GPU, in one run.

Both sides train GPT-2 style 20 layers x d_model 2048 (16 heads, 2048-token samples,
vocab 50304, tied embeddings: 1.11B parameters) in bf16 on the same samples from the
same initial weights, with AdamW (Interleaf's betas, eps, weight decay groups and
learning-rate schedule), clipping at 1.0, 4 microbatches of 8 samples per step.

- plain PyTorch: what a PyTorch user writes: fp32 parameters, `torch.autocast` bf16,
  `torch.optim.AdamW(fused=True)`, `clip_grad_norm_`, gradient accumulation, in this
  process;
- Interleaf: a coordinator and one stage server on this GPU (`--device cuda`,
  transport NCCL), `train.precision=bf16` (bf16 working weights and gradients, fp32
  master weights and Adam moments), pp=1 1f1b, submitted through the client.

Reported: the GPU's measured bf16 matrix rate (8192^3, random data), each side's
tokens/s and model FLOPs utilization (coordinator/flops.py's accounting, against that
measured rate and against the datasheet's 989 TFLOP/s for an H100 SXM), their ratio,
their peak GPU memory (torch.cuda.max_memory_allocated: over the run in this process,
over each step in the stage server), and the losses of both. Step times are host wall time per step including the step's final
synchronization, over the steps after warm-up; Interleaf's are measured inside the
stage server, and its coordinator's control time per RunSteps block is reported
beside them. Plain PyTorch runs before and after Interleaf, so drift shows. The run
fails if the two sides' losses disagree beyond bf16's tolerance (they compute the same
function with different rounding: autocast keeps fp32 weights, Interleaf bf16 ones).

    PYTHONPATH=. python bench/gpu/train.py [--steps 12] [--warmup 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/ siblings

from peak import bf16_matmul_peak  # noqa: E402  (bench/gpu/peak.py: this script's directory)
from interleaf.clients.launcher import LocalCluster  # noqa: E402
from interleaf.coordinator.flops import flops_per_token, matrix_parameters  # noqa: E402
from interleaf_run import run_job  # noqa: E402
from interleaf.common.lr_schedule import Schedule  # noqa: E402
from interleaf.common.model.config import ModelShape  # noqa: E402
from interleaf.stageserver.data import Sampler, resolve_source  # noqa: E402
from interleaf.stageserver.model import full_model  # noqa: E402
from interleaf.stageserver.optim import BETAS, EPS  # noqa: E402
from torch_training import param_groups  # noqa: E402

MODEL = ModelShape(n_layers=20, d_model=2048, n_heads=16, seq_len=2048, vocab_size=50304)
ROWS, MICROBATCHES, SEED = 8, 4, 1
LR, WARMUP_STEPS, WEIGHT_DECAY, CLIP = 3e-4, 2, 0.1, 1.0
H100_SXM_DENSE_BF16 = 989e12
LOSS_MEAN_TOLERANCE, LOSS_MAX_TOLERANCE = 1e-2, 5e-2
"""bf16 against bf16-autocast: the bounds tests/test_zero_equivalence.py holds bf16 runs
to (mean and largest relative loss difference over the steps)."""


def overrides(steps: int) -> list[str]:
    m = MODEL
    return [f"model.n_layers={m.n_layers}", f"model.d_model={m.d_model}", f"model.n_heads={m.n_heads}",
            f"model.seq_len={m.seq_len}", f"model.vocab_size={m.vocab_size}",
            "parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
            f"parallel.microbatches={MICROBATCHES}", "parallel.transport=nccl",
            f"train.steps={steps}", f"train.global_batch={ROWS * MICROBATCHES}", f"train.lr={LR}",
            f"train.warmup_steps={WARMUP_STEPS}", f"train.weight_decay={WEIGHT_DECAY}",
            f"train.grad_clip={CLIP}", f"train.seed={SEED}", "train.precision=bf16"]


def plain_pytorch(steps: int) -> dict:
    """The PyTorch user's loop on the same model, samples and schedule."""
    torch.manual_seed(SEED)
    model = full_model(MODEL, SEED).cuda()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(param_groups([model], WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS, fused=True)
    schedule = Schedule(LR, WARMUP_STEPS, steps)
    sampler = Sampler(resolve_source("builtin"), SEED, MODEL.seq_len, ROWS * MICROBATCHES, MICROBATCHES)
    seconds, losses = [], []
    for step in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device="cuda")
        for m in range(MICROBATCHES):
            x, y = (t.cuda(non_blocking=True) for t in sampler.microbatch(step, m))
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(x, y)
            (loss / MICROBATCHES).backward()
            total += loss.detach() / MICROBATCHES
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total.item())
        seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {"step_seconds": seconds, "losses": losses, "max_memory_allocated_bytes": peak,
            "parameters": parameters}


def interleaf(steps: int) -> dict:
    with LocalCluster(1, device="cuda", steps_per_call=4, log_dir=os.environ.get("BENCH_LOG_DIR")) as cluster:
        client = cluster.client()  # carries the cluster's token: a bare Client is refused UNAUTHENTICATED
        try:
            return run_job(client, overrides(steps))
        finally:
            client.close()


def figures(label: str, run: dict, warmup: int, peak: float, memory: int) -> dict:
    tokens = ROWS * MICROBATCHES * MODEL.seq_len
    step = statistics.median(run["step_seconds"][warmup:])
    per_token = flops_per_token(MODEL)
    return {"side": label, "median_step_seconds": step, "tokens_per_second": tokens / step,
            "mfu_measured_peak": tokens * per_token / step / peak,
            "mfu_datasheet_peak": tokens * per_token / step / H100_SXM_DENSE_BF16,
            "max_memory_allocated_bytes": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_train.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu/train.py needs a CUDA GPU")
    peak = bf16_matmul_peak()
    first = plain_pytorch(args.steps)
    ours = interleaf(args.steps)
    second = plain_pytorch(args.steps)
    ours_memory = max(r["device_peak_bytes"] for step in ours["memory"] for r in step)
    rows = [figures("plain PyTorch (before)", first, args.warmup, peak, first["max_memory_allocated_bytes"]),
            figures("Interleaf", ours, args.warmup, peak, ours_memory),
            figures("plain PyTorch (after)", second, args.warmup, peak, second["max_memory_allocated_bytes"])]
    differences = [abs(a - b) / abs(b) for a, b in zip(ours["losses"], first["losses"])]
    control = [b["control_seconds"] / b["inside_seconds"] for b in ours["blocks"] if b["first_step"] >= args.warmup]
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "model": str(MODEL), "parameters": first["parameters"],
        "matrix_parameters": matrix_parameters(MODEL),
        "measured_bf16_peak_flops": peak, "steps": args.steps, "warmup": args.warmup,
        "sides": rows, "plain_before": first, "interleaf": ours, "plain_after": second,
        "loss_relative_difference_mean": statistics.fmean(differences),
        "loss_relative_difference_max": max(differences),
        "control_share_of_block": control,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{torch.cuda.get_device_name()}: measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
    print(f"{'side':<26}{'step s':>8}{'tokens/s':>11}{'MFU (measured peak)':>21}{'MFU (989 TFLOP/s)':>19}"
          f"{'peak GiB':>10}")
    for r in rows:
        print(f"{r['side']:<26}{r['median_step_seconds']:>8.3f}{r['tokens_per_second']:>11.0f}"
              f"{r['mfu_measured_peak']:>21.3f}{r['mfu_datasheet_peak']:>19.3f}"
              f"{r['max_memory_allocated_bytes'] / 2**30:>10.1f}")
    plain = statistics.fmean([rows[0]["tokens_per_second"], rows[2]["tokens_per_second"]])
    print(f"Interleaf / plain PyTorch tokens/s: {rows[1]['tokens_per_second'] / plain:.3f}")
    print(f"losses Interleaf {[round(x, 4) for x in ours['losses']]}")
    print(f"losses PyTorch   {[round(x, 4) for x in first['losses']]}")
    print(f"loss relative difference mean {result['loss_relative_difference_mean']:.2e} "
          f"max {result['loss_relative_difference_max']:.2e}; control share per block {control}")
    if result["loss_relative_difference_mean"] > LOSS_MEAN_TOLERANCE or \
            result["loss_relative_difference_max"] > LOSS_MAX_TOLERANCE:
        raise SystemExit("the two sides did not train the same run: losses disagree beyond bf16 tolerance")


if __name__ == "__main__":
    main()
