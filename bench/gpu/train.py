"""Interleaf against the strongest single-GPU PyTorch peers on the same ~1.1B model, in one run.

Every side trains the same model on the same samples from the same initial weights,
with AdamW (Interleaf's betas, eps, weight decay groups and learning-rate schedule),
clipping at 1.0, 4 microbatches of 8 samples per step, the same steps and warm-up:

- plain: the PyTorch user's eager loop: fp32 parameters, `torch.autocast` bf16,
  `torch.optim.AdamW(fused=True)`, `clip_grad_norm_`, gradient accumulation
  (peers.py); it runs first and again last, so drift shows;
- compile: plain with each transformer block `torch.compile`d (torchtitan's per-block
  compile);
- fsdp2-compile: torchtitan's recipe on a world-size-1 group: `fully_shard` on each
  block and the root with a bf16 `MixedPrecisionPolicy` (fp32 reduction), each block
  compiled, fused AdamW;
- interleaf, interleaf-compile: a coordinator and one stage server on this GPU
  (transport NCCL), `train.precision=bf16` (bf16 working weights and gradients, fp32
  master weights and Adam moments), pp=1 1f1b, submitted through the client, with
  `train.compile=false` and `=true`;
- fsdp2-compile-fp8: torchtitan's float8 recipe (peers.py): fsdp2-compile with the
  blocks' linears multiplying in float8 through torchao, tensorwise scaling;
- interleaf-fp8: `train.precision=fp8` (tensorwise) with compiled blocks.

`--arch gpt2`: 20 layers x d_model 2048, 16 heads, 2048-token samples, vocab 50304,
tied embeddings (1.11B parameters). `--arch llama`: TinyLlama's shape, 22 layers x
d_model 2048, 32 heads, 4 key/value heads, SwiGLU 5632, vocab 32000, untied (1.10B).

Reported per side: median step seconds (host wall time per step, after the step's final
synchronization, over the steps after warm-up; Interleaf's are measured inside the stage
server), tokens/s, model FLOPs utilization (coordinator/flops.py's accounting) against
the datasheet's 989 TFLOP/s (H100 SXM) and against the GPU's measured bf16 matrix rate
(peak.py), peak memory (torch.cuda.max_memory_allocated per in-process side, reset
between sides; the stage server's per-step device peak for Interleaf), the losses and
their largest relative difference from the first side's of the same precision (plain's
for bf16 by default, fsdp2-compile-fp8's for float8). Then, per precision, Interleaf's
best tokens/s over the best peer's, naming that peer. The run fails if a side's losses
disagree with that side's
beyond bf16's tolerance (the same function, rounded differently).

`--profile-dir`: every side's last step (a peer's first run) also runs under torch's
profiler, its trace written there and its time left out of the median; the peers' traces
beside Interleaf's show, kernel by kernel, where the steps differ (profile_breakdown.py).

`--device cpu --tiny`: a 2-layer d_model 64 model, 3 steps, bf16 as on a GPU (autocast,
a bf16 MixedPrecisionPolicy, train.precision=bf16), transport gloo, torch.compile's
aot_eager backend: the same code in seconds, so a broken client, flag or
import fails the tests (tests/test_gpu_benches_tiny.py) instead of the next GPU run.

    PYTHONPATH=. python bench/gpu/train.py [--arch gpt2|llama] [--sides plain,compile,...] [--steps 12]
        [--warmup 3] [--out PATH]
    PYTHONPATH=. python bench/gpu/train.py --device cpu --tiny --sides plain,compile,fsdp2-compile,interleaf
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

# The peers run in this process, one after another, and a profiled one's last step could
# otherwise leave NVIDIA's profiling library (CUPTI) attached to the process, slowing
# the sides after it by 10-20% (pytorch/pytorch#144455): Kineto detaches it at a
# profile's end where this is 1 (newer Kineto by default on CUDA 12.6+; torch turns it off
# only for CUDA graphs, which no side uses). Set before torch loads Kineto.
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/ siblings

import peers  # noqa: E402  (bench/gpu/peers.py: this script's directory)
from peak import bf16_matmul_peak  # noqa: E402
from interleaf.clients.launcher import LocalCluster  # noqa: E402
from interleaf.common.model.config import ModelShape  # noqa: E402
from interleaf.coordinator.flops import flops_per_token, matrix_parameters  # noqa: E402
from interleaf_run import exit_cleanly_on_sigterm, run_job  # noqa: E402
from measure import write_atomically  # noqa: E402

ARCHS = {
    "gpt2": ModelShape(n_layers=20, d_model=2048, n_heads=16, seq_len=2048, vocab_size=50304),
    "llama": ModelShape(n_layers=22, d_model=2048, n_heads=32, seq_len=2048, vocab_size=32000, arch="llama",
                        n_kv_heads=4, ffn_hidden=5632, tie_embeddings=False),
}
TINY = {"gpt2": ModelShape(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=256),
        "llama": ModelShape(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=256, arch="llama",
                            n_kv_heads=2, tie_embeddings=False)}
ROWS, MICROBATCHES = 8, 4
SIDES = ("plain", "compile", "fsdp2-compile", "interleaf", "interleaf-compile", "fsdp2-compile-fp8", "interleaf-fp8")
PEERS = {"plain": peers.plain, "compile": peers.compiled, "fsdp2-compile": peers.fsdp2_compiled,
         "fsdp2-compile-fp8": peers.fsdp2_compiled_fp8}
H100_SXM_DENSE_BF16 = 989e12
LOSS_MEAN_TOLERANCE, LOSS_MAX_TOLERANCE = 1e-2, 5e-2
"""bf16 against bf16-autocast: the bounds tests/test_zero_equivalence.py holds bf16 runs
to (mean and largest relative loss difference over the steps)."""
MODEL_FIELDS = ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "arch", "n_kv_heads", "ffn_hidden",
                "tie_embeddings")


def overrides(steps: int, model: ModelShape = ARCHS["gpt2"], device: str = "cuda", precision: str = "bf16",
              rows: int = ROWS) -> list[str]:
    """The Interleaf job every side's loop is the peer of."""
    shape = [f"model.{f}={str(getattr(model, f)).lower()}" for f in MODEL_FIELDS]
    return [*shape, "parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
            f"parallel.microbatches={MICROBATCHES}", f"parallel.transport={'nccl' if device == 'cuda' else 'gloo'}",
            f"train.steps={steps}", f"train.global_batch={rows * MICROBATCHES}", f"train.lr={peers.LR}",
            f"train.warmup_steps={peers.WARMUP_STEPS}", f"train.weight_decay={peers.WEIGHT_DECAY}",
            f"train.grad_clip={peers.CLIP}", f"train.seed={peers.SEED}", f"train.precision={precision}"]


def interleaf(w: peers.Workload, compile_override: str | None, profile_to: str | None = None,
              precision: str | None = None) -> dict:
    """The job on a local coordinator and one stage server; its peak memory is the
    server's largest per-step device peak (None on the CPU). `profile_to`: a file for the torch
    profiler's trace of the last step, which then leaves step_seconds."""
    precision = precision or ("bf16" if w.dtype == torch.bfloat16 else "fp32")
    job = overrides(w.steps, w.model, w.device, precision, w.rows)
    if compile_override:
        job.append(f"train.compile={compile_override}")
    if precision == "fp8" and w.device != "cuda":
        job.append("train.fp8_emulate=true")
    if profile_to:  # torch's profiler over the last step (left out of the median by the caller)
        job += [f"trace.steps=[{w.steps - 1}]", "trace.torch_profiler=true"]
    with LocalCluster(1, device=w.device, steps_per_call=4, log_dir=os.environ.get("BENCH_LOG_DIR")) as cluster:
        client = cluster.client()  # carries the cluster's token: a bare Client is refused UNAUTHENTICATED
        try:
            run = run_job(client, job)
            if profile_to:
                report = client.trace_profile(run["job_id"], w.steps - 1, 0)
                write_atomically(profile_to, report.torch_profile)  # gzip-compressed Chrome trace
                # Every action's span in that step: per-chunk forward and backward times for
                # docs/gpus.md's expectations of larger layouts (the simulator's costs).
                run["spans"] = [{"action": a.action, "kind": a.kind, "start": a.start_seconds, "end": a.end_seconds}
                                for a in client.trace(run["job_id"], w.steps - 1).reports[0].spans]
                run["step_seconds"] = run["step_seconds"][:-1]
                run["profile"] = profile_to
        finally:
            client.close()
    peak = max(r["device_peak_bytes"] for step in run["memory"] for r in step)
    return {**run, "max_memory_allocated_bytes": peak if w.device == "cuda" else None}


def run_side(side: str, w: peers.Workload, profile_dir: str | None = None) -> dict:
    profile = profile_dir and os.path.join(profile_dir, f"profile_{side}.json.gz")
    if side in PEERS:
        return {**PEERS[side](w, profile), **({"profile": profile} if profile else {})}
    if side == "interleaf-compile":
        return interleaf(w, "on", profile)
    if side == "interleaf-fp8":  # float8 products (tensorwise), compiled blocks: torchao's fast path
        return interleaf(w, "on", profile, precision="fp8")  # (on the CPU, tiny: emulated, asked for below)
    return interleaf(w, "off", profile)


def figures(label: str, run: dict, w: peers.Workload, warmup: int, peak: float, plain: dict | None) -> dict:
    tokens = w.rows * w.microbatches * w.model.seq_len
    step = statistics.median(run["step_seconds"][warmup:])
    flops = tokens * flops_per_token(w.model) / step
    differences = [abs(a - b) / abs(b) for a, b in zip(run["losses"], plain["losses"], strict=True)] if plain else []
    return {"side": label, "median_step_seconds": step, "tokens_per_second": tokens / step,
            "mfu_measured_peak": flops / peak, "mfu_datasheet_peak": flops / H100_SXM_DENSE_BF16,
            "max_memory_allocated_bytes": run["max_memory_allocated_bytes"], "losses": run["losses"],
            "loss_relative_difference_mean": statistics.fmean(differences) if differences else None,
            "loss_relative_difference_max": max(differences) if differences else None}


def precision(side: str) -> str:
    """bf16, or fp8 for the float8 sides: a side is held to, and ranked against, its own."""
    return "fp8" if side.split(" ")[0].endswith("-fp8") else "bf16"


def best_ratios(rows: list[dict]) -> dict[str, dict]:
    """Per precision: Interleaf's best tokens/s over the best peer's, and which peer."""
    ratios = {}
    for kind in sorted({precision(r["side"]) for r in rows}):
        same = [r for r in rows if precision(r["side"]) == kind]
        ours = [r for r in same if r["side"].startswith("interleaf")]
        theirs = [r for r in same if not r["side"].startswith("interleaf")]
        if ours and theirs:
            best, peer = (max(group, key=lambda r: r["tokens_per_second"]) for group in (ours, theirs))
            ratios[kind] = {"interleaf_side": best["side"], "peer_side": peer["side"],
                            "ratio": best["tokens_per_second"] / peer["tokens_per_second"]}
    return ratios


def main() -> None:
    exit_cleanly_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=tuple(ARCHS), default="gpt2")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer d_model 64 model, 3 steps")
    parser.add_argument("--steps", type=int, help="default 12 (tiny: 3)")
    parser.add_argument("--warmup", type=int, help="steps left out of the median; default 3 (tiny: 1)")
    parser.add_argument("--compile-backend", help="torch.compile's backend; default inductor (tiny: aot_eager)")
    parser.add_argument("--profile-dir", help="torch profiler trace of each side's last step (a peer's "
                        "under the settings a stage server profiles with), written here as profile_SIDE.json.gz "
                        "(gzip Chrome trace); that step leaves the median")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_train.json"))
    args = parser.parse_args()
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            parser.error(f"{flag} {value} must be at least {least}")
    sides = args.sides.split(",")
    if unknown := sorted(set(sides) - set(SIDES)):
        parser.error(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/train.py needs a CUDA GPU (or --device cpu --tiny)")
    w = peers.Workload(model=(TINY if args.tiny else ARCHS)[args.arch],
                       steps=args.steps if args.steps is not None else (3 if args.tiny else 12),
                       rows=2 if args.tiny else ROWS, microbatches=MICROBATCHES, device=args.device,
                       dtype=torch.bfloat16,
                       compile_backend=args.compile_backend or ("aot_eager" if args.tiny else "inductor"))
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    timed = w.steps - (1 if args.profile_dir else 0)  # the profiled last step leaves the median
    if warmup >= timed:
        parser.error(f"--warmup {warmup} must be less than --steps {w.steps}"
                     f"{' less the profiled step' if args.profile_dir else ''}: the median is of the steps after it")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = bf16_matmul_peak(256 if args.tiny else 8192, args.device)
    print(f"{device_name}: measured bf16 matmul peak {peak / 1e12:.3f} TFLOP/s")
    print(f"{args.arch}: {w.model}")
    order = sides + (["plain"] if "plain" in sides and len(sides) > 1 else [])  # plain again last: drift
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)  # the stage server writes its traces there
    runs: dict[str, dict] = {}
    rows: list[dict] = []
    failed: dict[str, str] = {}

    def write_result() -> dict:
        """The result so far, written after every side: a run cut short (a GPU lease's
        time limit) keeps the sides it finished."""
        parameters = next((r["parameters"] for r in runs.values() if "parameters" in r), None)
        result = {"device": device_name, "torch": torch.__version__, "arch": args.arch, "model": str(w.model),
                  "parameters": parameters, "matrix_parameters": matrix_parameters(w.model),
                  "dtype": str(w.dtype), "compile_backend": w.compile_backend,
                  "measured_bf16_peak_flops": peak, "steps": w.steps, "warmup": warmup, "sides": rows,
                  "runs": runs, "failed": failed, "interleaf_over_best_peer": best_ratios(rows)}
        write_atomically(args.out, json.dumps(result, indent=2, default=str) + "\n")
        return result

    for i, side in enumerate(order):
        label = f"{side} (after)" if side in runs or side in failed else side
        try:
            # plain's second run (its drift) is not profiled again
            runs[label] = run_side(side, w, args.profile_dir if label == side else None)
        except Exception as err:  # noqa: BLE001 - one side's failure is reported; the others still run
            failed[label] = f"{type(err).__name__}: {err}"
            print(f"  {label}: FAILED {failed[label][:2000]}", flush=True)
            write_result()
            continue
        # Losses are held to the first side's of the same precision (plain's, when it runs).
        first = next((runs[o] for o in runs if precision(o) == precision(side) and o != label), None)
        rows.append(figures(label, runs[label], w, warmup, peak, first))
        print(f"  {label}: {rows[-1]['median_step_seconds']:.3f} s/step, losses "
              f"{[round(x, 4) for x in runs[label]['losses']]}", flush=True)
        write_result()
    result = write_result()
    ratios = result["interleaf_over_best_peer"]
    if result["parameters"]:
        print(f"{args.arch}: {result['parameters'] / 1e9:.3f}B parameters")
    print(f"{'side':<20}{'step s':>8}{'tokens/s':>11}{'MFU (measured)':>16}{'MFU (989 TFLOP/s)':>19}"
          f"{'peak GiB':>10}{'loss diff max':>15}")
    for r in rows:
        memory = r["max_memory_allocated_bytes"]
        diff = r["loss_relative_difference_max"]
        print(f"{r['side']:<20}{r['median_step_seconds']:>8.3f}{r['tokens_per_second']:>11.0f}"
              f"{r['mfu_measured_peak']:>16.3f}{r['mfu_datasheet_peak']:>19.3f}"
              f"{'-' if memory is None else f'{memory / 2**30:.1f}':>10}{'-' if diff is None else f'{diff:.2e}':>15}")
    for kind, ratio in ratios.items():
        print(f"{kind}: Interleaf ({ratio['interleaf_side']}) / best peer ({ratio['peer_side']}) tokens/s: "
              f"{ratio['ratio']:.3f}")
    apart = [r["side"] for r in rows if r["loss_relative_difference_max"] is not None and
             (r["loss_relative_difference_mean"] > LOSS_MEAN_TOLERANCE or
              r["loss_relative_difference_max"] > LOSS_MAX_TOLERANCE)]
    if apart:
        raise SystemExit(f"{apart} did not train the run of the first side of their precision: losses "
                         f"disagree beyond bf16 tolerance")
    if failed:
        raise SystemExit(f"sides that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
