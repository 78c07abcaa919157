"""The memory model against a GPU: each case's predicted peak (coordinator/memory_model.py,
what admission adds its runtime reserve to) beside what the stage server measured,
torch.cuda.max_memory_allocated over each step, and the server's own ledger peak.

Cases (bf16, one stage server, pp=1, 4 microbatches of 8 samples of 2048 tokens):
- gpt2-1.1b: bench/gpu/train.py's model (20 layers, d_model 2048), eager and compiled
  (train.compile: the model predicts what inductor's graphs keep, coordinator/
  activation_bytes.py's compiled_block_bytes), and compiled under selective recompute
  (each block compiled with its checkpoint: compiled_selective_block_bytes), in bf16 and
  with float8 products (train.precision=fp8, tensorwise);
- gpt2-2.7b-full: 32 layers, d_model 2560, 32 heads, full recompute, the case admission
  refused on an 80 GB H100 (83.3 GiB predicted against 79.2 GiB). Run where the GPU
  holds the prediction (an H200), it says whether the refusal was right.

A case passes when the measured peak is within 10% of the prediction (the issue's
bound); one that fails or is refused (admission: the 2.7B GPT on an 80 GB GPU) is
recorded with its reason, the other cases still run, and the file is written after every
case; on a GPU the prediction holds the fused loss's forward temporaries, which the
device holds and the ledger does not. `--train-json PATH...` does the same, with no GPU, for every Interleaf side of
bench/gpu/train.py results (one table for all of them): its recorded per-step device peaks against the prediction for
its job's overrides (the eager, compiled and float8 sides of both architectures), and
`--measured-json PATH` for this script's own earlier GPU result. `--device cpu --tiny`: a tiny GPT on the CPU, where no device peak exists, so
the ledger peak is compared instead (equal to the prediction, as tests/test_memory.py
holds it); it runs the same client, planning and prediction code in seconds.
`--peak-breakdown` (a GPU): each case also records its second step's CUDA memory history
(trace.memory_snapshot) and lists what that step held at its peak, by where it was
allocated (memory_peak.py), to find what a row above its prediction holds that the model
does not count.

    PYTHONPATH=. python bench/gpu/memory_check.py [--cases gpt2-1.1b,gpt2-1.1b-compiled,gpt2-2.7b-full]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import pickle
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/ siblings
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # and bench/gpu/ ones

from interleaf.clients.launcher import LocalCluster  # noqa: E402
from interleaf.coordinator.config import load_config  # noqa: E402
from interleaf.coordinator.memory_model import predict, with_temporaries  # noqa: E402
from interleaf.coordinator.plan import plan_programs  # noqa: E402
import memory_peak  # noqa: E402 - bench/gpu/memory_peak.py
from report import peak_lines  # noqa: E402 - bench/gpu/report.py
from interleaf_run import exit_cleanly_on_sigterm, run_job  # noqa: E402
from measure import write_atomically  # noqa: E402

BOUND = 0.10
STEPS = 3


def _model(layers: int, width: int, heads: int, seq: int, vocab: int) -> list[str]:
    return [f"model.n_layers={layers}", f"model.d_model={width}", f"model.n_heads={heads}",
            f"model.seq_len={seq}", f"model.vocab_size={vocab}"]


COMMON = ["parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
          "parallel.microbatches=4", "train.global_batch=32", f"train.steps={STEPS}", "train.warmup_steps=1",
          "train.precision=bf16"]
GPU_CASES = {
    "gpt2-1.1b": _model(20, 2048, 16, 2048, 50304) + COMMON + ["train.compile=off"],
    "gpt2-1.1b-compiled": _model(20, 2048, 16, 2048, 50304) + COMMON + ["train.compile=on"],
    "gpt2-1.1b-compiled-selective": _model(20, 2048, 16, 2048, 50304) + COMMON + ["train.compile=on",
                                                                                  "train.recompute=selective"],
    "gpt2-1.1b-fp8-compiled-selective": _model(20, 2048, 16, 2048, 50304) + COMMON + [
        "train.compile=on", "train.recompute=selective", "train.precision=fp8"],
    "gpt2-2.7b-full": _model(32, 2560, 32, 2048, 50304) + COMMON + ["train.compile=off", "train.recompute=full"],
}
TINY_CASES = {
    "gpt2-tiny": _model(2, 64, 4, 32, 256) + COMMON + ["train.precision=fp32"],
}


def predicted_peak(overrides: list[str], device_type: str) -> int:
    """The memory model's peak for the job these overrides make on servers of
    `device_type` (pipeline rank 0: pp=1): on a GPU with the loss's forward
    temporaries, which the device holds and the ledger does not (memory_model.
    with_temporaries, what admission adds its reserve to); on a CPU the ledger's."""
    config = load_config("", overrides)
    programs, _ = plan_programs(config)
    prediction = predict(config, programs, device_type)[0]
    return with_temporaries(prediction) if device_type == "cuda" else prediction["peak_bytes"]


def compared(name: str, overrides: list[str], run: dict, gpu: bool) -> dict:
    """A finished run's measured peak (the steps after the first, which the model
    predicts) beside the prediction for its overrides."""
    predicted = predicted_peak(overrides, "cuda" if gpu else "cpu")
    after_first = [rank for step in run["memory"][1:] for rank in step]
    measured = max(r["device_peak_bytes" if gpu else "peak_bytes"] for r in after_first)
    return {"case": name, "overrides": overrides, "predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
            "measured": "torch.cuda.max_memory_allocated" if gpu else "ledger peak_bytes",
            "ledger_peak_bytes": max(r["peak_bytes"] for r in after_first), "error": measured / predicted - 1,
            "losses": run["losses"]}


SNAPSHOT_STEP = 1
"""The step whose CUDA memory history --peak-breakdown records: the first the model
predicts (after the first step, which allocates the optimizer's state)."""


def check(client, name: str, overrides: list[str], gpu: bool, peak_breakdown: bool = False) -> dict:
    """A case run and compared; `peak_breakdown` (a GPU): also what its step
    SNAPSHOT_STEP held at its peak (memory_peak.py), from that step's memory snapshot,
    or why there is none (the measurement stands either way)."""
    recording = [f"trace.steps=[{SNAPSHOT_STEP}]", "trace.memory_snapshot=true"] if peak_breakdown and gpu else []
    run = run_job(client, overrides + recording)
    row = compared(name, overrides, run, gpu)
    if recording:
        try:
            traced = client.trace_profile(run["job_id"], SNAPSHOT_STEP, 0)
            if not traced.memory_snapshot:
                raise RuntimeError("the traced step's report carries no memory snapshot (over the size bound?)")
            row["peak_breakdown"] = memory_peak.live_at_peak(pickle.loads(gzip.decompress(traced.memory_snapshot)))
        except Exception as err:  # noqa: BLE001 - a diagnosis that failed leaves the measurement
            row["peak_breakdown_error"] = f"{type(err).__name__}: {err}"
    return row


def from_train_json(path: str) -> list[dict]:
    """Each Interleaf side of a bench/gpu/train.py result against the prediction for it,
    named by its architecture and side ("llama interleaf-fp8")."""
    import train  # bench/gpu/train.py: the jobs its sides submitted

    result = json.loads(pathlib.Path(path).read_text())
    model = train.ARCHS[result["arch"]]
    rows = []
    for side, run in result["runs"].items():
        if not side.startswith("interleaf"):
            continue
        job = train.overrides(result["steps"], model, "cuda", "fp8" if side.endswith("fp8") else "bf16", train.ROWS)
        job.append(f"train.compile={'false' if side == 'interleaf' else 'true'}")
        rows.append(compared(f"{result['arch']} {side}", job, run, gpu=True))
    return rows


def from_measured_json(path: str) -> list[dict]:
    """An earlier GPU result's cases, their measured peaks against today's predictions."""
    rows = []
    for earlier in json.loads(pathlib.Path(path).read_text()):
        if "failed" in earlier:  # refused or failed there: nothing measured
            rows.append(earlier)
            continue
        predicted = predicted_peak(earlier["overrides"], "cuda")
        rows.append({**earlier, "predicted_peak_bytes": predicted,
                     "error": earlier["measured_peak_bytes"] / predicted - 1})
    return rows


def main() -> None:
    exit_cleanly_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT (with --device cpu: in seconds)")
    parser.add_argument("--cases", default="", help="comma-separated names (default: all of the mode's)")
    parser.add_argument("--train-json", nargs="+", metavar="PATH",
                        help="no GPU: the Interleaf sides of these bench/gpu/train.py results")
    parser.add_argument("--measured-json", help="no GPU: this script's earlier GPU result (its --out), its "
                                                "measured peaks against today's predictions")
    parser.add_argument("--peak-breakdown", action="store_true",
                        help=f"a GPU: record step {SNAPSHOT_STEP}'s CUDA memory history and list what it held at its "
                             f"peak, by where it was allocated (memory_peak.py)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_memory.json"))
    args = parser.parse_args()
    if args.train_json:
        report([row for path in args.train_json for row in from_train_json(path)], args.out)
        return
    if args.measured_json:
        report(from_measured_json(args.measured_json), args.out)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/memory_check.py needs a CUDA GPU (or --device cpu --tiny, or a GPU run's "
                         "--train-json or --measured-json)")
    cases = TINY_CASES if args.tiny else GPU_CASES
    names = [n for n in args.cases.split(",") if n] or list(cases)
    unknown = sorted(set(names) - set(cases))
    if unknown:
        raise SystemExit(f"--cases: {', '.join(unknown)} not among {', '.join(cases)}")
    gpu = args.device == "cuda"
    rows = []
    with LocalCluster(1, device=args.device, steps_per_call=STEPS, log_dir=os.environ.get("BENCH_LOG_DIR")) as cluster:
        client = cluster.client()
        try:
            for name in names:
                try:
                    rows.append(check(client, name, cases[name] + ([] if gpu else ["train.compile=off"]), gpu,
                                      args.peak_breakdown))
                except Exception as err:  # noqa: BLE001 - a case refused (admission) or failed is recorded; the rest run
                    rows.append({"case": name, "failed": f"{type(err).__name__}: {err}"})
                print(json.dumps(rows[-1]), flush=True)
                write_rows(rows, args.out)  # after every case: a run cut short keeps what it measured
        finally:
            client.close()
    report(rows, args.out)


def write_rows(rows: list[dict], out: str) -> None:
    write_atomically(out, json.dumps(rows, indent=2) + "\n")


def report(rows: list[dict], out: str) -> None:
    """Writes `rows` and prints them; exits non-zero when a case failed or was refused,
    or its measured peak lies outside BOUND of the prediction."""
    write_rows(rows, out)
    print(f"{'case':<26}{'predicted MiB':>14}{'measured MiB':>14}{'ledger MiB':>12}{'error':>8}")
    measured = [r for r in rows if "failed" not in r]
    for r in measured:
        print(f"{r['case']:<26}{r['predicted_peak_bytes'] / 2**20:>14.1f}{r['measured_peak_bytes'] / 2**20:>14.1f}"
              f"{r['ledger_peak_bytes'] / 2**20:>12.1f}{r['error']:>+8.1%}")
    held = peak_lines(measured)  # report.py's lines, which the session's report.md prints too
    if held:
        print("\n".join(held))
    failed = [r for r in rows if "failed" in r]
    for r in failed:
        print(f"{r['case']:<26}FAILED {r['failed'][:300]}")
    outside = [r["case"] for r in measured if abs(r["error"]) > BOUND]
    if outside or failed:
        raise SystemExit(f"measured peak more than {BOUND:.0%} from the prediction: {', '.join(outside) or '-'}; "
                         f"failed or refused: {', '.join(r['case'] for r in failed) or '-'}")

if __name__ == "__main__":
    main()
