"""Interleaf's checkpoints against torch.distributed.checkpoint (DCP), on the same state.

The state: a 12-layer GPT of d_model 768 (85.4M parameters, 326 MiB in fp32) trained at
dp=2 with its optimizer state sharded over the two ranks: per parameter an fp32 weight
and two fp32 Adam moments, 12 bytes, so 977 MiB per checkpoint, half on each rank.

  Interleaf: one job on a local cluster of 2 stage servers (dp=2, pp=1, ZeRO-3 by
    default, the layout of the peer's FSDP2) with `checkpoint.every`, saving `--saves`
    times; its CheckpointEvents ("saved") give each save's stall (the copies out of the
    training buffers, all that training waits for) and its background write (until the
    manifest is written), the manifests each file's bytes. Then `--saves` jobs resume
    from the checkpoint before last (`checkpoint.resume`), each for one step: the
    "resumed" event gives the load time, and the step's loss must equal the saving
    job's at that step (the round trip).
  DCP: a world of 2 gloo processes holding the same model from the same seed, sharded
    with FSDP2 (`fully_shard`), with torch.optim.AdamW after `--every` steps
    (torch_dcp.py): `dcp.async_save` with training carried on between saves as in the
    Interleaf job, then `dcp.save` and `dcp.load` (+ `set_state_dict`) with training
    stopped, the loaded tensors compared with the saved ones. Run twice: fsync on
    (FileSystemWriter's default) and off (as Interleaf writes).

Both sides run one torch thread per process on the same 2 cores and the same disk, one
after the other, never at once; every phase starts after `os.sync()`, so no side pays
for the other's dirty pages. The script exits non-zero, after writing its JSON, when the
two sides' state bytes differ, a DCP load does not give back the saved tensors, or a
resumed Interleaf step's loss differs from the saving job's beyond measure.LOSS_TOLERANCE.

    python bench/checkpoint_vs_dcp.py [--saves 3] [--every 2] [--zero 3] [--dir DIR] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile

from interleaf.clients.client import Client
from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config

# Siblings in bench/ (the script's own directory is first on sys.path).
import torch_dcp
from interleaf_run import JOB_TIMEOUT_S
from measure import LOSS_TOLERANCE, machine, table, write_json
from peer_world import PeerWorld

MODEL = ["model.n_layers=12", "model.d_model=768", "model.n_heads=12", "model.seq_len=128", "model.vocab_size=256"]
RANKS = 2
MIB = 1 << 20


def overrides(zero: int, steps: int) -> list[str]:
    # One 128-token sample per rank per step: the steps are there to give the state
    # its values and to run beside the background writes, not to be timed.
    return MODEL + [
        f"parallel.dp={RANKS}", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
        "parallel.microbatches=1", f"parallel.zero={zero}", "train.global_batch=2", f"train.steps={steps}",
    ]


def follow(client: Client, sets: list[str]) -> dict:
    """Runs one job to its end through its events: losses by step and checkpoint events."""
    job = client.submit("", sets)
    losses, checkpoints = {}, []
    for event in client.watch(job.job_id, timeout_s=JOB_TIMEOUT_S):
        if event.HasField("step"):
            losses[event.step.step] = event.step.loss
        elif event.HasField("checkpoint"):
            c = event.checkpoint
            checkpoints.append({"kind": c.kind, "step": c.step, "manifest": c.manifest, "bytes": c.bytes,
                                "stall_seconds": c.stall_seconds, "write_seconds": c.write_seconds,
                                "load_seconds": c.load_seconds})
    status = client.status(job.job_id)
    if status.state != "SUCCEEDED":
        raise RuntimeError(f"interleaf job {job.job_id} {status.state}: {status.error}")
    return {"job_id": job.job_id, "losses": losses, "checkpoints": checkpoints}


def interleaf_saves(client: Client, folder: str, args) -> dict:
    run = follow(client, overrides(args.zero, args.saves * args.every) +
                 [f"checkpoint.dir={folder}", f"checkpoint.every={args.every}"])
    saved = [c for c in run["checkpoints"] if c["kind"] == "saved"]
    if [c["step"] for c in saved] != [args.every * (k + 1) for k in range(args.saves)]:
        raise RuntimeError(f"interleaf saved at steps {[c['step'] for c in saved]}, not every {args.every}")
    for c in saved:
        with open(c["manifest"]) as f:
            c["files"] = [{"rank": e["rank"], "bytes": e["bytes"]} for e in json.load(f)["state"]]
    return {**run, "saved": saved}


def interleaf_loads(client: Client, saved: list[dict], losses: dict, args) -> dict:
    """Resumes from the checkpoint before last (a step the saving job trained on from
    it) `--saves` times, one step each."""
    source = saved[-2]
    runs = [follow(client, overrides(args.zero, source["step"] + 1) +
                   [f"checkpoint.resume={os.path.dirname(source['manifest'])}"]) for _ in range(args.saves)]
    resumed = [next(c for c in r["checkpoints"] if c["kind"] == "resumed") for r in runs]
    expected = losses[source["step"]]
    differences = [abs(r["losses"][source["step"]] - expected) / abs(expected) for r in runs]
    return {"step": source["step"], "resumed": resumed, "load_seconds": [c["load_seconds"] for c in resumed],
            "losses": [r["losses"][source["step"]] for r in runs], "saving_job_loss": expected,
            "max_relative_loss_difference": max(differences)}


def dcp_side(peers: PeerWorld, folder: str, args, sync_files: bool) -> dict:
    """DCP's figures on the slowest rank: a save or load is done when its last rank is."""
    config = load_config("", overrides(args.zero, args.saves * args.every))
    ranks = peers.run(torch_dcp.checkpoints, config, folder, args.saves, args.every, sync_files)
    per_save = [{key: max(r["async_saves"][k][key] for r in ranks) for key in ranks[0]["async_saves"][k]}
                for k in range(args.saves)]
    return {"sync_files": sync_files, "async_saves": per_save,
            "sync_save_seconds": [max(s) for s in zip(*(r["sync_save_seconds"] for r in ranks))],
            "load_seconds": [max(s) for s in zip(*(r["load_seconds"] for r in ranks))],
            "state_bytes": sum(r["state_bytes"] for r in ranks), "other_bytes": sum(r["other_bytes"] for r in ranks),
            "disk_bytes": ranks[0]["disk_bytes"], "tensors": ranks[0]["tensors"],
            "mismatched": sorted({key for r in ranks for key in r["mismatched"]}), "ranks": ranks}


def figures(ours: dict, loads: dict, peers: list[dict]) -> str:
    """Medians over the saves and loads; ratio = Interleaf / DCP, below 1 when Interleaf
    takes less time."""
    def median(values):
        return statistics.median(values)

    rows = [
        ("stall per save", median([c["stall_seconds"] for c in ours["saved"]]),
         [median([s["stall_seconds"] for s in p["async_saves"]]) for p in peers]),
        ("save seconds (background write)", median([c["write_seconds"] for c in ours["saved"]]),
         [median([s["write_seconds"] for s in p["async_saves"]]) for p in peers]),
        ("save seconds (stall + write)", median([c["stall_seconds"] + c["write_seconds"] for c in ours["saved"]]),
         [median([s["total_seconds"] for s in p["async_saves"]]) for p in peers]),
        ("save seconds (training stopped)", None, [median(p["sync_save_seconds"]) for p in peers]),
        ("load seconds", median(loads["load_seconds"]), [median(p["load_seconds"]) for p in peers]),
    ]
    headers = ["seconds, median", "interleaf"]
    for p in peers:
        headers += [f"DCP {_fsync(p['sync_files'])}", "ratio"]
    body = []
    for label, mine, theirs in rows:
        row = [label, "-" if mine is None else f"{mine:.3f}"]
        for value in theirs:
            row += [f"{value:.3f}", "-" if mine is None else f"{mine / value:.2f}"]
        body.append(row)
    return table(headers, body)


def per_save(ours: dict, peers: list[dict]) -> str:
    headers = ["stall / write, s", "interleaf"] + [f"DCP {_fsync(p['sync_files'])}" for p in peers]
    rows = []
    for k, c in enumerate(ours["saved"]):
        rows.append([f"save {k + 1} (step {c['step']}{', training stopped' if k == len(ours['saved']) - 1 else ''})",
                     f"{c['stall_seconds']:.3f} / {c['write_seconds']:.3f}"] +
                    [f"{p['async_saves'][k]['stall_seconds']:.3f} / {p['async_saves'][k]['write_seconds']:.3f}"
                     for p in peers])
    return table(headers, rows)


def problems(ours: dict, loads: dict, peers: list[dict]) -> list[str]:
    found = []
    mine = {sum(f["bytes"] for f in c["files"]) for c in ours["saved"]} | {c["bytes"] for c in ours["saved"]}
    for p in peers:
        name = f"DCP {_fsync(p['sync_files'])}"
        if mine != {p["state_bytes"]}:
            found.append(f"state bytes differ: interleaf {sorted(mine)}, {name} {p['state_bytes']}")
        if p["mismatched"]:
            found.append(f"{name}: {len(p['mismatched'])} tensors loaded unequal to the saved ones, "
                         f"e.g. {p['mismatched'][:3]}")
    if loads["max_relative_loss_difference"] > LOSS_TOLERANCE:
        found.append(f"interleaf: the step resumed at {loads['step']} has loss {loads['losses']}, the saving job "
                     f"{loads['saving_job_loss']} (relative difference {loads['max_relative_loss_difference']:.1e})")
    return found


def _phase(phases: dict, name: str) -> None:
    """Starts a phase: no dirty pages left by the one before, and the load average
    noted (anything well above the previous phase's ~2 means other processes ran)."""
    os.sync()
    phases[name] = round(os.getloadavg()[0], 2)


def _fsync(sync_files: bool) -> str:
    return "fsync" if sync_files else "no fsync"


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3, help="saves per side (and loads, and sync saves); at least 2")
    parser.add_argument("--every", type=int, default=2, help="training steps between saves")
    parser.add_argument("--zero", type=int, choices=(1, 2, 3), default=3, help="Interleaf's ZeRO stage")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temporary folder in it, removed)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "checkpoint_vs_dcp.json"))
    args = parser.parse_args()
    if args.saves < 2 or args.every < 1:
        parser.error("--saves must be at least 2 (loads resume from the checkpoint before last), --every at least 1")
    return args


def main() -> None:
    args = _arguments()
    before = machine()
    root = tempfile.mkdtemp(prefix="interleaf-checkpoint-bench-", dir=args.dir)
    phases = {}
    try:
        with LocalCluster(RANKS, threads_per_server=1) as cluster, PeerWorld(RANKS) as world:
            client = cluster.client()
            try:
                _phase(phases, "interleaf saves")
                ours = interleaf_saves(client, os.path.join(root, "interleaf"), args)
                peers = []
                for sync_files in (True, False):
                    _phase(phases, f"DCP {_fsync(sync_files)}")
                    peers.append(dcp_side(world, os.path.join(root, f"dcp-fsync-{sync_files}"), args, sync_files))
                _phase(phases, "interleaf loads")
                loads = interleaf_loads(client, ours["saved"], ours["losses"], args)
            finally:
                client.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    after = machine()

    print(figures(ours, loads, peers))
    print()
    print(per_save(ours, peers))
    state = sum(f["bytes"] for f in ours["saved"][0]["files"])
    print(f"state bytes per checkpoint: interleaf {state:,} ({state / MIB:.1f} MiB, ranks "
          f"{'/'.join(str(f['bytes']) for f in ours['saved'][0]['files'])}); DCP {peers[0]['state_bytes']:,} "
          f"(+ {peers[0]['other_bytes']} bytes of AdamW step counts; {peers[0]['disk_bytes']:,} bytes on disk)")
    print(f"round trip: DCP {peers[0]['tensors']} tensors per rank, "
          f"{len(peers[0]['mismatched']) + len(peers[1]['mismatched'])} unequal after load; interleaf resumed at step "
          f"{loads['step']} {args.saves} times, loss relative difference {loads['max_relative_loss_difference']:.1e}")
    print(f"processes: interleaf 2 stage servers + coordinator (which checks every file's SHA-256 on resume, inside "
          f"load seconds), DCP 2; one torch thread each, on the same {before['cpus']} CPUs and disk, one side "
          f"at a time")
    print(f"{before['cpus']} CPUs, load average {before['load_average_1m']} before, {after['load_average_1m']} after; "
          f"{args.saves} saves every {args.every} steps, Interleaf zero={args.zero} dp={RANKS}, "
          f"DCP over FSDP2 dp={RANKS}")
    print("load average at each phase's start: " + ", ".join(f"{name} {load}" for name, load in phases.items()))
    found = problems(ours, loads, peers)
    write_json(args.out, {
        "benchmark": "checkpoint_vs_dcp", "machine_before": before, "machine_after": after,
        "saves": args.saves, "every": args.every, "zero": args.zero,
        "overrides": overrides(args.zero, args.saves * args.every),
        "load_average_at_phase_start": phases, "interleaf": {"saves": ours, "loads": loads}, "dcp": peers,
        "problems": found,
    })
    print(f"results written to {args.out}")
    if found:
        raise SystemExit("checkpoint_vs_dcp:\n  " + "\n  ".join(found))


if __name__ == "__main__":
    main()
