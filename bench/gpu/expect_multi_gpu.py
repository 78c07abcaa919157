"""What larger layouts of bench/gpu/train.py's GPT should give on one 8-GPU node, from
one GPU's measurements: the simulator (coordinator/schedule/simulate.py) run over each
layout's programs with costs taken from a traced single-GPU step. Nothing here ran on
several GPUs (none exist on the machines this was written on): these are expectations,
and docs/gpus.md says what to check first on a real node.

Costs, all from train.py's JSON (its profiled Interleaf side's traced last step):
- a chunk's forward and backward on one microbatch: the whole model's measured mean F
  and B, split over the chunks by layers (the head's share, which only the last chunk
  has, is spread too: a simplification that flatters pipelines by at most its ~10%);
- the optimizer step: the measured one, divided by pp (each stage steps its layers);
- pipeline messages: a microbatch's activations (rows x seq x d_model in bf16) over
  an assumed NVLink p2p bandwidth (BANDWIDTH) with LATENCY per message;
- the data-parallel reduction: a ring all-reduce of each stage's fp32 gradient
  reduction over dp ranks at the assumed ALLREDUCE_BUS_BANDWIDTH, after the backward
  (Interleaf reduces a chunk's gradients after its last backward: no overlap).

    python bench/gpu/expect_multi_gpu.py bench/results/gpu/train_gpt2.json [--side interleaf-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/ siblings
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # and bench/gpu/ ones

import train  # noqa: E402  (bench/gpu/train.py: the workload behind its JSON)
from interleaf.coordinator.schedule import CostModel, build_programs, simulate  # noqa: E402

BANDWIDTH = 150e9
"""Bytes/s between two GPUs of an NVLink 4 node for one p2p message (assumed: about a
third of the link's 450 GB/s each way, as NCCL's p2p reaches for messages of this size)."""
LATENCY = 20e-6
ALLREDUCE_BUS_BANDWIDTH = 350e9
"""NCCL's all-reduce bus bandwidth on an 8-GPU NVSwitch node (assumed, from nccl-tests'
typical H100 figures)."""
LAYOUTS = [  # (dp, pp, vpp, schedule, microbatches) on 8 GPUs, and one GPU for scale; chunks divide 20 layers
    (1, 1, 1, "1f1b", 4), (8, 1, 1, "1f1b", 4), (4, 2, 1, "1f1b", 8), (4, 2, 2, "interleaved-1f1b", 8),
    (2, 4, 1, "1f1b", 16), (2, 4, 5, "interleaved-1f1b", 16),
]


def expectations(result: dict, side: str) -> list[dict]:
    run = result["runs"].get(side)
    if run is None or "spans" not in run:
        raise SystemExit(f"expect_multi_gpu.py needs a traced {side} side: run bench/gpu/train.py with "
                         f"--profile-dir and that side (the result holds {', '.join(result['runs']) or 'none'}, "
                         f"{'not traced' if run else 'not that side'})")
    spans = run["spans"]
    forward = statistics.fmean(s["end"] - s["start"] for s in spans if s["kind"] == "forward")
    backward = statistics.fmean(s["end"] - s["start"] for s in spans if s["kind"] == "backward")
    update = sum(s["end"] - s["start"] for s in spans if s["kind"] == "update")
    model = result["model"]
    n_layers = int(model.split("n_layers=")[1].split(",")[0])
    d_model = int(model.split("d_model=")[1].split(",")[0])
    seq = int(model.split("seq_len=")[1].split(",")[0])
    # The peers count the parameters; a result of Interleaf sides alone has the matrices' count.
    parameters = result["parameters"] or result["matrix_parameters"]
    base_microbatches = train.MICROBATCHES
    rows = run["tokens"][0] // (seq * base_microbatches)  # the workload the JSON's sides ran (tiny: 2)
    tokens_per_replica_microbatch = rows * seq
    out = []
    for dp, pp, vpp, schedule, microbatches in LAYOUTS:
        chunks = pp * vpp
        if n_layers % chunks:
            continue
        programs = build_programs(schedule, pp, vpp, microbatches, dp, 0, 1, tied=True)
        reduce_bytes = 4 * parameters / pp  # fp32 gradient reduction of a stage's parameters
        reduce_s = 0.0 if dp == 1 else 2 * (dp - 1) / dp * reduce_bytes / ALLREDUCE_BUS_BANDWIDTH / vpp
        cost = CostModel(forward_s=forward / chunks, backward_s=backward / chunks, latency_s=LATENCY,
                         bandwidth_bytes_per_s=BANDWIDTH, message_bytes=rows * seq * d_model * 2,
                         reduce_s=reduce_s, optimizer_s=update / pp)
        simulated = simulate(programs, cost)
        tokens = dp * microbatches * tokens_per_replica_microbatch
        out.append({"dp": dp, "pp": pp, "vpp": vpp, "schedule": schedule, "microbatches": microbatches,
                    "gpus": dp * pp, "step_s": simulated.makespan_s, "bubble": simulated.bubble_fraction,
                    "tokens_per_s": tokens / simulated.makespan_s,
                    "tokens_per_s_per_gpu": tokens / simulated.makespan_s / (dp * pp)})
    measured = rows * base_microbatches * seq / statistics.median(run["step_seconds"][result["warmup"]:])
    for row in out:
        row["per_gpu_vs_measured_one"] = row["tokens_per_s_per_gpu"] / measured
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="bench/gpu/train.py's JSON, with a profiled Interleaf side")
    parser.add_argument("--side", default="interleaf-compile")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = expectations(json.loads(pathlib.Path(args.result).read_text()), args.side)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"{'layout':<34}{'GPUs':>5}{'step s':>8}{'bubble':>8}{'tokens/s':>11}{'per GPU vs one GPU':>20}")
    for r in rows:
        name = f"dp{r['dp']} pp{r['pp']} vpp{r['vpp']} {r['schedule']} m{r['microbatches']}"
        print(f"{name:<34}{r['gpus']:>5}{r['step_s']:>8.3f}{r['bubble']:>8.1%}{r['tokens_per_s']:>11.0f}"
              f"{r['per_gpu_vs_measured_one']:>20.2f}")


if __name__ == "__main__":
    main()
