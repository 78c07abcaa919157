"""Does float8 training track bf16? The same Interleaf job twice, `train.precision=bf16` and
`=fp8` (torchao's tensorwise float8 products, compiled blocks), from the same initial
weights on the same samples in the same order, for long enough that a divergence would
show, and their losses step by step.

The speed run (train.py) trains 8 steps, too few to tell whether float8's rounding
drifts a run away from bf16's. Here each side trains `--steps` (default 200) steps of a
smaller model of the same architecture (12 layers, d_model 1024, 1024-token samples, 4
microbatches of 8: 32,768 tokens a step, an estimated 0.1 s on an H200), with the learning rate
warmed up over the first tenth of them, on the builtin corpus (real text, so that the
loss falls as it does in training). Reported: both loss curves, every step's relative
difference (fp8 - bf16) / bf16, its mean and largest over the whole run and its mean over
the last quarter. The run passes when they are within the bounds train.py holds two bf16
runs to (mean 1%, largest 5%), the last quarter's mean included: where float8 drifted
away late, that mean shows it, where the whole run's could still hide it.

Both jobs run on one local stage server one after the other, as a user would, and each is
also a memory case (memory_check.py's): its predicted peak against the device's
measured one, and on a GPU what its second step held at its peak (memory_peak.py), so
that float8's bytes beyond the memory model show at this size too, whatever time a GPU
session has left for memory_check.py's own cases. These rows are for information: the
run passes or fails on its losses alone (memory_check.py holds its own cases to 10%). The
JSON is written after the bf16 job too ("partial"), so a run cut short keeps that job's
losses and memory.
`--device cpu --tiny`: a 2-layer d_model 64 model for 12 steps, float8 through torchao's
emulation (train.fp8_emulate), so that the code runs in CI; its bounds are held too.
`--device cpu --small`: a 4-layer d_model 128 model with byte-level tokens for 400
steps, float8 emulated: the same casts to float8 and the same scales, the float8 values
then multiplied in float32 (torchao's emulation), where a GPU multiplies them on float8
tensor cores (the forward's product with torchao's fast, lower-precision accumulation,
`use_fast_accum`; the backward's two in float32); for a machine without a float8 GPU.

    PYTHONPATH=. python bench/gpu/fp8_tracking.py [--arch gpt2|llama] [--steps 200] [--out PATH]
    PYTHONPATH=. python bench/gpu/fp8_tracking.py --device cpu --small --out F   # float8 emulated
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/ siblings
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # and bench/gpu/ ones

from interleaf.clients.launcher import LocalCluster  # noqa: E402
from interleaf.common.model.config import ModelShape  # noqa: E402
from interleaf.coordinator.admission import amount_text  # noqa: E402
from interleaf_run import exit_cleanly_on_sigterm  # noqa: E402
from measure import machine, write_atomically  # noqa: E402
from memory_check import check as memory_case  # noqa: E402 - bench/gpu/memory_check.py
from train import LOSS_MAX_TOLERANCE, LOSS_MEAN_TOLERANCE, TINY, overrides  # noqa: E402

MODELS = {
    "gpt2": ModelShape(n_layers=12, d_model=1024, n_heads=16, seq_len=1024, vocab_size=50304),
    "llama": ModelShape(n_layers=12, d_model=1024, n_heads=16, seq_len=1024, vocab_size=32000, arch="llama",
                        n_kv_heads=4, ffn_hidden=2816, tie_embeddings=False),
}
SMALL = {
    "gpt2": ModelShape(n_layers=4, d_model=128, n_heads=4, seq_len=128, vocab_size=256),
    "llama": ModelShape(n_layers=4, d_model=128, n_heads=4, seq_len=128, vocab_size=256, arch="llama", n_kv_heads=2,
                        ffn_hidden=352, tie_embeddings=False),
}
"""CPU-sized: byte-level tokens, every dimension a multiple of 16 as float8's products need."""
ROWS = 8
STEPS, TINY_STEPS, SMALL_STEPS = 200, 12, 400


def job(model: ModelShape, steps: int, device: str, precision: str) -> list[str]:
    """train.py's job for this model (its optimizer, clipping, seed and layout), with the
    learning rate warmed up over the first tenth of the steps (train.py's 100-step
    warm-up is longer than its runs)."""
    extra = ["train.compile=on", f"train.warmup_steps={max(1, steps // 10)}"]
    if precision == "fp8" and device != "cuda":
        extra.append("train.fp8_emulate=true")
    return overrides(steps, model, device, precision, ROWS) + extra


def compared(bf16: list[float], fp8: list[float]) -> dict:
    """Step by step relative differences of fp8's losses from bf16's, with the means and
    largest the bounds hold: every step's, and the last quarter's mean."""
    differences = [abs(f - b) / abs(b) for b, f in zip(bf16, fp8, strict=True)]
    mean, largest = statistics.fmean(differences), max(differences)
    last_quarter = statistics.fmean(differences[-max(1, len(differences) // 4):])
    return {"relative_differences": differences, "mean": mean, "max": largest, "last_quarter_mean": last_quarter,
            "tracks": mean <= LOSS_MEAN_TOLERANCE and last_quarter <= LOSS_MEAN_TOLERANCE
            and largest <= LOSS_MAX_TOLERANCE}


def main() -> None:
    exit_cleanly_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gpt2", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=None, help=f"steps per side (default {STEPS}; tiny "
                                                                  f"{TINY_STEPS}, small {SMALL_STEPS})")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="a 2-layer d_model 64 model (with --device cpu: "
                                                          "float8 emulated, in about a minute)")
    size.add_argument("--small", action="store_true", help=f"a 4-layer d_model 128 model for {SMALL_STEPS} steps "
                                                           "(with --device cpu: float8 emulated)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "fp8_tracking.json"))
    args = parser.parse_args()
    steps = args.steps or (TINY_STEPS if args.tiny else SMALL_STEPS if args.small else STEPS)
    if steps < 4:
        raise SystemExit(f"--steps {steps} must be at least 4: the last quarter must hold a step")
    model = TINY[args.arch] if args.tiny else SMALL[args.arch] if args.small else MODELS[args.arch]
    losses, memory = {}, []
    gpu = args.device == "cuda"
    described = {"machine_before": machine(), "arch": args.arch, "device": args.device, "tiny": args.tiny,
                 "small": args.small, "steps": steps,
                 "model": {f: getattr(model, f) for f in ("n_layers", "d_model", "seq_len", "vocab_size")}}

    def write(result: dict) -> None:
        write_atomically(args.out, json.dumps(result, indent=1) + "\n")

    with LocalCluster(1, device=args.device, steps_per_call=10, log_dir=os.environ.get("BENCH_LOG_DIR")) as cluster:
        client = cluster.client()
        try:
            for precision in ("bf16", "fp8"):
                name = f"{args.arch} {model.n_layers}x{model.d_model} {precision}"
                memory.append(memory_case(client, name, job(model, steps, args.device, precision), gpu,
                                          peak_breakdown=gpu))
                losses[precision] = memory[-1].pop("losses")
                print(f"{args.arch} {precision}: losses {losses[precision][0]:.4f} ... {losses[precision][-1]:.4f}; "
                      f"peak {amount_text(memory[-1]['measured_peak_bytes'])} against "
                      f"{amount_text(memory[-1]['predicted_peak_bytes'])} predicted", flush=True)
                if precision == "bf16":  # a run cut short (a GPU lease's limit) keeps the first job's
                    write({**described, "partial": True, "losses": dict(losses), "memory": memory})
        finally:
            client.close()
    result = {**described, "machine_after": machine(), "losses": losses, **compared(losses["bf16"], losses["fp8"]), "memory": memory,
              "bounds": {"mean": LOSS_MEAN_TOLERANCE, "last_quarter_mean": LOSS_MEAN_TOLERANCE,
                         "max": LOSS_MAX_TOLERANCE}}
    write(result)
    print(f"fp8 against bf16 over {steps} steps: mean {result['mean']:.2%}, last quarter "
          f"{result['last_quarter_mean']:.2%}, largest {result['max']:.2%} (bounds {LOSS_MEAN_TOLERANCE:.0%}, "
          f"{LOSS_MEAN_TOLERANCE:.0%}, {LOSS_MAX_TOLERANCE:.0%})")
    if not result["tracks"]:
        raise SystemExit("float8's losses do not track bf16's within the bounds")


if __name__ == "__main__":
    main()
