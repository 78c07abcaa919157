"""What Interleaf's observability reports for a real GPU job, checked against figures
computed here from the same run.

One coordinator and one stage server on this GPU train bench/gpu/train.py's 1.11B GPT
(bf16, pp=1, 4 microbatches) with two traced steps. Then:

- the stage server's Prometheus endpoint, found through the coordinator's /sd, is
  scraped, and its figures are compared with the job's step events: model FLOPs
  utilization = FLOPs per token x tokens / (step seconds x the device's peak), the peak
  being the one the server registered (its datasheet default for this GPU), and its idle
  (bubble) ratio and memory;
- the traced step's executed timeline (CUDA events on the compute stream) is written as a
  Chrome trace and a picture, and its idle share reported: with one rank there is no
  pipeline bubble, so what idle time there is, is the GPU waiting on the host.

    PYTHONPATH=. python bench/gpu/observe.py [--steps 10] [--out DIR]
    PYTHONPATH=. python bench/gpu/observe.py --device cpu --tiny   # a tiny model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench/gpu siblings

from train import ARCHS, ROWS, TINY, overrides  # noqa: E402  (bench/gpu/train.py: the same job)

from interleaf.clients.launcher import LocalCluster  # noqa: E402
from interleaf.coordinator import executed_step  # noqa: E402
from interleaf.coordinator.config import load_config  # noqa: E402
from interleaf.coordinator.flops import flops_per_token  # noqa: E402



def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def pick(samples: dict, name: str, **labels) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == w for k, w in labels.items())]
    if len(found) != 1:
        raise SystemExit(f"expected one {name} {labels}, found {len(found)}")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="default 10 (tiny: 5); step 3 and the last are traced")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer d_model 64 model: checks the script")
    args = parser.parse_args()
    steps, device = args.steps or (5 if args.tiny else 10), args.device
    # --tiny: train.py's tiny gpt2 in fp32, 2 samples a microbatch.
    if args.tiny:
        job_overrides = overrides(steps, TINY["gpt2"], device, "fp32", 2)
    else:
        job_overrides = overrides(steps, ARCHS["gpt2"], device, "bf16", ROWS)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/observe.py needs a CUDA GPU (or --device cpu --tiny)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traced = [3, steps - 1]
    with LocalCluster(1, device=device, steps_per_call=4, log_dir=os.environ.get("BENCH_LOG_DIR")) as cluster:
        client = cluster.connect()
        job = client.submit("", job_overrides + [f"trace.steps={','.join(map(str, traced))}"])
        steps = list(job.steps(timeout_s=900))
        status = job.wait(timeout_s=60)
        with urllib.request.urlopen(f"http://{cluster.http_address}/sd", timeout=10) as reply:
            targets = json.load(reply)
        server = scrape(f"http://{targets[0]['targets'][0]}/metrics")
        coordinator = scrape(f"http://{cluster.http_address}/metrics")
        trace = client.rpc.trace(job.id, traced[0])
        registered = client.rpc.servers()[0]
        client.close()

    last = steps[-1]
    tokens = last.tokens  # the global batch's tokens, as the coordinator counts them
    m = load_config("", job_overrides).model
    per_token = flops_per_token(m)
    mfu_here = tokens * per_token / (last.step_seconds * registered.peak_flops)
    mfu_metric = pick(coordinator, "interleaf_model_flops_utilization_ratio", job=job.id)
    bubble_metric = pick(server, "interleaf_pipeline_bubble_ratio", job=job.id)
    executed_step.write_chrome_trace(str(out / "gpu_trace.json"), trace)
    executed_step.write_picture(str(out / "gpu_trace.png"), trace)
    report = trace.reports[0]
    kinds = {}
    for span in report.spans:
        kinds[span.kind] = kinds.get(span.kind, 0.0) + span.end_seconds - span.start_seconds
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "job": job.id, "state": status.state,
        "registered_peak_flops": registered.peak_flops,
        "losses": [s.loss for s in steps], "step_seconds": [s.step_seconds for s in steps],
        "median_step_seconds": statistics.median(s.step_seconds for s in steps[2:]),
        "mfu_metric_last_step": mfu_metric, "mfu_recomputed_last_step": mfu_here,
        "bubble_metric_last_step": bubble_metric,
        "traced_step": trace.step, "traced_step_seconds": report.step_seconds,
        "traced_idle_seconds": report.idle_seconds, "traced_compute_seconds": report.compute_seconds,
        "traced_seconds_by_kind": kinds, "traced_actions": len(report.spans),
        "device_allocated_peak_bytes_metric": pick(server, "interleaf_device_allocated_peak_bytes", job=job.id),
    }
    (out / "gpu_observe.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['device']}: job {job.id} {status.state}, median step {result['median_step_seconds']:.3f} s")
    print(f"MFU: metric {mfu_metric:.4f}, recomputed here {mfu_here:.4f} (peak {registered.peak_flops / 1e12:.0f} "
          f"TFLOP/s registered)")
    print(f"bubble (idle share) metric, last step: {bubble_metric:.4f}; traced step {trace.step}: idle "
          f"{report.idle_seconds * 1e3:.1f} ms of {report.step_seconds * 1e3:.1f} ms, {len(report.spans)} spans")
    print("traced seconds by kind:", {k: round(v, 4) for k, v in kinds.items()})
    if abs(mfu_metric - mfu_here) > 1e-6 * max(mfu_here, 1e-12):
        raise SystemExit("the MFU metric disagrees with the MFU computed from the same step")


if __name__ == "__main__":
    main()
