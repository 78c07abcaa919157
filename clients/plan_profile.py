"""Measures a device profile (coordinator/planner/costs.py) on real stage servers, caches
it per (model, device kind, software), and refines it from the traces of real jobs.

The profile runs short traced jobs of the model on the servers: a pipeline of one chunk
per server (two where two are idle) at a small and a four-times-larger microbatch, with
whole backwards (1f1b) and with split ones (zb-h1), with chunks of one layer
(interleaved 1F1B, vpp up to 4) and of two (zbv) at the small one, and once under
selective recompute; five steps each, tracing the last three.
Every traced forward, backward, input- and weight-gradient half is one observation
(its chunk's forward FLOPs, its seconds), every update one of its parameters (less its
wait for the slowest rank: _norm_calls_s); a least-squares line through each kind's
lower quartile at each size (what it costs undisturbed by the other processes on the
cores) gives its law. A model whose layer
would take more than a second to run on a CPU is measured through a proxy: the same
architecture narrowed until one layer's forward is PROXY_LAYER_FLOPS, with at most
PROXY_LAYERS layers, the law's rate carried over (said in the profile's `measured_on`).
On a GPU the bounds are a thousand times higher: a narrow layer's products are too
small to fill a GPU, so their rate does not carry over to the model's (an H200 ran a
d_model-128 proxy at 2.9 TFLOP/s, the d_model-1024 model it stood for at about 430).
Every profile job must fit a server by the memory model (admission would refuse it,
and the profile with it; weighed at pp=1, where one server holds the most): a model
whose jobs do not is profiled as its first PROXY_LAYERS layers, and where those do not
fit either, narrowed further. So the profile, and its cache key, depend on the servers'
memory too.

Links are measured per group kind inside jobs on the same servers, where two are idle:
a tensor-parallel pair at both microbatch sizes (its all-reduces, and under sequence
parallelism its reduce-scatters and all-gathers), and data-parallel
pairs under ZeRO 0 and 3 with one chunk and with up to four (their all-reduces,
reduce-scatters and all-gathers of one chunk's gradients or parameters). Every
server's traced step says, per (op, group), the seconds it was held in its calls, their
bytes and their count (StepReport.comm): one observation of the group kind's affine law
(the mean call, scaled to two members, costs.normalized). What the rank is held is what
the simulator charges: a reduction that overlaps a backward is charged what it did not
hide. A group kind that could not be run takes its law from two processes of this
machine over gloo (clients/link_probe.py), and so do pipeline messages where the calls
are not timed (a GPU's) or no pipeline ran (one idle server), their posting then free.

Where they are (CPU servers), pipelines are priced as the servers' steps show them: every
send, receive and exchange a rank posted is one observation of its posting law (the
bytes of its messages, its span's seconds: the executor's work, which occupies the
rank), and every traced step of a pipeline of single servers one of the message's
latency: the latency at which the simulator, replaying the step's own computes,
postings and updates, takes what the step took (message_latency). Without them the
layouts of the most messages were predicted 3-28% fast in the benchmark's runs
(bench/results/planner-*.json; docs/planning.md says by how much a message and a
posting cost there).

Every chunk those jobs run without recompute, and every one a traced job runs so, is also
timed as its shape (costs.chunk_shape, its tensor group's calls inside); `measure_shapes` runs the shapes a plan needs that no job
has (shape_jobs), and `interleaf plan` asks it for the shapes of the plans the laws
rank first (plan_command.search_timed).

Worked example: `interleaf plan --servers 4` on this CPU machine starts two local
servers, runs thirteen profile jobs (about 30 s) and the link probe (about 3 s), and
writes ~/.cache/interleaf/plan-profiles/<key>.json; the next plan of the same model,
device, software and profiled model (the servers' memory can cut it) reads it back at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import time

from interleaf.clients import link_probe
from interleaf.common.overlapped_reductions import overlapped_reductions
from interleaf.common.model.compile_modes import device_type_of
from interleaf.coordinator.admission import RUNTIME_RESERVE_BYTES, amount_text
from interleaf.coordinator.config import ConfigError, JobConfig, load_config
from interleaf.coordinator.executed_step import POSTING_KINDS, replay_by_latency
from interleaf.coordinator.memory_model import message_bytes, predict, with_temporaries
from interleaf.coordinator.partition import partition
from interleaf.coordinator.plan import FLOAT8_MULTIPLE
from interleaf.coordinator.planner.costs import (DeviceProfile, chunk_forward_flops, chunk_parameters, chunk_shape,
                                                  compiled_on, normalized)
from interleaf.coordinator.planner.fitting import (LINK_OBSERVED, MESSAGE_OBSERVED, POSTING_OBSERVED, SHAPE_OBSERVED,
                                                   fit)
from interleaf.coordinator.planner.search import programs_for
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.actions import Action, Kind, parse

PROXY_ABOVE_FLOPS = {"cpu": 1e9, "cuda": 1e12}
"""Per device type: a model whose layer's forward at the small microbatch takes more
FLOPs is profiled through a proxy... (on a GPU, models to about 2B parameters are not: a
1.1B GPT's layer is 4.8e11)"""
PROXY_LAYER_FLOPS = {"cpu": 2.5e8, "cuda": 1e12}
"""...narrowed until its layer's forward takes at most this many (a 7B Llama's proxy on a
GPU: d_model 2048, 2048-token samples)."""
PROXY_LAYERS = 8
"""A proxy's layers: enough for chunks from one layer to four on two servers."""
SMALL_ROWS = 2
LARGE_ROWS = 8
STEPS = 5
TRACED = (2, 3, 4)
"""The steps of a profile job whose actions are timed: past the first two's warm-up."""
SPAN_LAWS = {"forward": "forward", "backward": "backward", "input-grad": "input_grad", "weight-grad": "weight_grad"}
FORMAT = 6
"""Of the cached profile: 2 holds the link laws measured per group kind; 3, selective
recompute's costs with compiled float8 blocks that rerun no matrix product; 4, the
update's own law (an overhead and a rate), fitted to updates less their wait in the
gradient norm's all-reduce; 5, the posting law and the message's latency from the
pipeline jobs' steps; 6, selective recompute's forward against a plain one."""


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "interleaf" / "plan-profiles"


def software() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        own = version("interleaf")
    except PackageNotFoundError:
        own = "source"
    return f"interleaf {own}, torch {torch.__version__}"


def profile_model(config: JobConfig, device: str, memory_bytes: int | None) -> dict:
    """The [model] values the profile runs on `device` (a device kind: "cpu", "cuda
    (NVIDIA H200)") servers of `memory_bytes` each (None: unbounded): the job's, where
    its layer's forward at the small microbatch is at most the device type's
    PROXY_ABOVE_FLOPS and the profile jobs fit (profile_jobs_fit); else the job's with at
    most PROXY_LAYERS layers where that fits; else a narrower proxy of it: d_model, the
    heads (to no fewer than two), the MLP and the sequence halved together until that
    forward is at most PROXY_LAYER_FLOPS and the jobs fit, with at most PROXY_LAYERS
    layers.

    Worked example, on an H100 of 79.2 GiB: the 1.11B GPT (20 layers, d_model 2048) is
    profiled as itself; the 2.7B one (32 layers, d_model 2560, vocabulary 50304), whose
    largest profile job (zb-h1, 8 rows) would need 90.8 GiB with the reserve, as its
    first 8 layers; a 7B Llama at 4,096 tokens (layer 7.2e12 FLOPs) as 8 layers of
    d_model 2048 and 2,048 tokens. Where not even the narrowest proxy fits,
    ProfileJobFailed says so."""
    model = dataclasses.asdict(config.model)
    kind = device_type_of([device])

    def fits(candidate: dict) -> bool:
        return memory_bytes is None or profile_jobs_fit(config, candidate, device, memory_bytes)

    if _layer_flops(config, SMALL_ROWS) <= PROXY_ABOVE_FLOPS[kind]:
        if fits(model):
            return model
        shorter = dict(model, n_layers=min(model["n_layers"], PROXY_LAYERS))
        if fits(shorter):
            return shorter
    # Float8 tensor cores multiply multiples of 16 only (plan.check_fp8): the proxy's
    # widths and tokens stay such multiples; otherwise heads of an even width (rotary).
    multiple = FLOAT8_MULTIPLE if config.train.precision == "fp8" else 2
    proxy, scale = dict(model, n_layers=min(model["n_layers"], PROXY_LAYERS)), 1
    while ((_layer_flops(_with_model(config, proxy), SMALL_ROWS) > PROXY_LAYER_FLOPS[kind] or not fits(proxy))
           and proxy["d_model"] > 64):
        scale *= 2
        # down to two heads, as a tensor pair's link job needs, where the model has two
        heads = max(min(2, model["n_heads"]), model["n_heads"] // scale)
        kv = min(heads, max(min(2, model["n_kv_heads"]), model["n_kv_heads"] // scale))
        while heads % kv:
            kv -= 1
        # d_model a whole number of heads (GPT-2 XL's 1600/25 halved is 800, which 12 heads do not divide)
        head_dim = max(multiple, model["d_model"] // scale // heads // multiple * multiple)
        proxy = dict(model, d_model=heads * head_dim, n_heads=heads, n_kv_heads=kv,
                     ffn_hidden=_round_up(model["ffn_hidden"] // scale, multiple),
                     seq_len=_round_up(max(32, model["seq_len"] // scale), multiple),
                     n_layers=min(model["n_layers"], PROXY_LAYERS))
    if memory_bytes is not None and not fits(proxy):
        raise ProfileJobFailed(
            f"no profile job of this model fits a server's {amount_text(memory_bytes)}, not even through a proxy "
            f"of {proxy['n_layers']} layers of d_model {proxy['d_model']} and {proxy['seq_len']}-token samples "
            f"(admission keeps a reserve of {amount_text(RUNTIME_RESERVE_BYTES)}); plan with --profile FILE, a "
            "profile measured on larger servers")
    return proxy


def own_widths(config: JobConfig, profiled: dict) -> bool:
    """Whether the `profiled` model (profile_model's) has `config`'s widths, its layers
    perhaps cut: its chunk shapes are then the model's (costs.chunk_shape), and can be
    timed as shapes of the model's plans."""
    return ({k: v for k, v in profiled.items() if k != "n_layers"}
            == {k: v for k, v in dataclasses.asdict(config.model).items() if k != "n_layers"})


def profile_jobs_fit(config: JobConfig, model: dict, device: str, memory_bytes: int) -> bool:
    """Whether every profile job of `model` fits a server of `memory_bytes` by the memory
    model, with admission's reserve: a job that does not would be refused, and with it
    the whole profile. The compute jobs are weighed on one server (pp=1: on two, each
    holds less), and where the servers' calls are timed (calls_timed) the link jobs too."""
    setup = {"model": model, "train": profile_train(config)}
    jobs = profile_jobs(model["n_layers"], 1) + (link_jobs(model["n_layers"]) if calls_timed(device) else [])
    for job in jobs:
        try:
            job_config = load_config("", _job_overrides(setup, 1, job))
        except ConfigError:  # the settings refuse it (a split backward with compiled blocks): not run
            continue
        if job_need_bytes(job_config, device) > memory_bytes:
            return False
    return True


def job_need_bytes(job_config: JobConfig, device: str) -> int:
    """What a server of a profile or shape job of `job_config` on `device` needs by the
    memory model, admission's reserve included: its busiest rank's peak."""
    peaks = predict(job_config, programs_for(job_config), device_type_of([device]))
    return max(with_temporaries(p) for p in peaks) + RUNTIME_RESERVE_BYTES


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def profile_train(config: JobConfig) -> dict:
    """The [train] values the profile jobs share with the job: what its computes run in."""
    t = config.train
    return {"precision": t.precision, "compile": t.compile, "fp8_recipe": t.fp8_recipe, "fp8_emulate": t.fp8_emulate}


def profile_setup(config: JobConfig, device: str, memory_bytes: int | None) -> dict:
    """What a profile is measured with on `device` servers of `memory_bytes`, and cached
    under beside the device kind."""
    return {"model": profile_model(config, device, memory_bytes), "train": profile_train(config)}


def _with_model(config: JobConfig, model: dict) -> JobConfig:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **model))


def _layer_flops(config: JobConfig, rows: int) -> float:
    one = partition(config.model.n_layers, config.model.n_layers, 1, "1f1b")[1 if config.model.n_layers > 1 else 0]
    # one server, one microbatch, no evaluation (whose rows rules tie to the microbatch's),
    # and none of the settings that need more than one (an uneven split, sequence
    # parallelism, elastic data parallelism)
    single = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, pp=1, vpp=1, dp=1, tp=1,
                                                                       schedule="1f1b", microbatches=1, plan="",
                                                                       layers=(), sequence_parallel=False,
                                                                       elastic=False),
                                 eval=dataclasses.replace(config.eval, every=0))
    return chunk_forward_flops(single, dataclasses.replace(one, has_head=False), rows)


def cache_key(setup: dict, device: str) -> str:
    text = json.dumps({**setup, "device": device, "software": software(), "format": FORMAT}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_cached(setup: dict, device: str) -> DeviceProfile | None:
    path = cache_dir() / f"{cache_key(setup, device)}.json"
    try:
        return DeviceProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(profile: DeviceProfile, setup: dict) -> pathlib.Path:
    path = cache_dir() / f"{cache_key(setup, profile.device)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1))
    tmp.replace(path)
    return path


@dataclasses.dataclass(frozen=True)
class ProfileJob:
    schedule: str
    vpp: int
    rows: int
    recompute: str = "none"
    tp: int = 1
    dp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    layers: tuple[int, ...] = ()
    """Layers per chunk, the model's layers their sum; empty: the profiled model's, split
    evenly."""

    def describe(self, pp: int) -> str:
        return (f"{self.schedule} pp{pp}" + (f"·vpp{self.vpp}" if self.vpp > 1 else "")
                + (f" layers={','.join(map(str, self.layers))}" if self.layers else "")
                + (f"·tp{self.tp}" if self.tp > 1 else "") + (" sp" if self.sequence_parallel else "")
                + (f"·dp{self.dp}" if self.dp > 1 else "")
                + (f" zero{self.zero}" if self.zero else "") + f" {self.rows} rows"
                + (f" {self.recompute} recompute" if self.recompute != "none" else ""))


def profile_jobs(n_layers: int, pp: int, split: bool = True) -> list[ProfileJob]:
    """Chunks from one layer at the small microbatch to a pipeline rank's share at the
    large one, whole backwards and (`split`: where the job's settings allow them) split,
    and selective recompute's rerun."""
    small_vpp = max(1, min(4, n_layers // pp))
    jobs = [ProfileJob("interleaved-1f1b" if small_vpp > 1 else "1f1b", small_vpp, SMALL_ROWS),
            ProfileJob("1f1b", 1, LARGE_ROWS)]
    if split:
        jobs += [ProfileJob("zbv" if n_layers >= 2 * pp else "zb-h1", 2 if n_layers >= 2 * pp else 1, SMALL_ROWS),
                 ProfileJob("zb-h1", 1, LARGE_ROWS)]
    return jobs + [ProfileJob("1f1b", 1, LARGE_ROWS, "selective")]


def link_jobs(n_layers: int) -> list[ProfileJob]:
    """Jobs of two servers (pp=1) whose groups' calls give the link laws: a tensor pair
    at both microbatch sizes, with and without sequence parallelism (all-reduces, or
    reduce-scatters and all-gathers), and data-parallel pairs under ZeRO 0 (all-reduce)
    and 3 (reduce-scatter, all-gather) with the model as one chunk at the large
    microbatch (a data-parallel layout's chunk, measured for the compute laws too) and
    as up to four at the small one: two mean call sizes for each law's line."""
    chunks = max(1, min(4, n_layers))
    jobs = [ProfileJob("1f1b", 1, rows, tp=2, sequence_parallel=sp) for sp in (False, True)
            for rows in (SMALL_ROWS, LARGE_ROWS)]
    for zero in (0, 3):
        jobs.append(ProfileJob("1f1b", 1, LARGE_ROWS, dp=2, zero=zero))
        if chunks > 1:
            jobs.append(ProfileJob("interleaved-1f1b", chunks, SMALL_ROWS, dp=2, zero=zero))
    return jobs


def _job_overrides(setup: dict, pp: int, job: ProfileJob) -> list[str]:
    model = dict(setup["model"], n_layers=sum(job.layers)) if job.layers else setup["model"]
    values = [f"{section}.{k}={_toml(v)}" for section, given in (("model", model), ("train", setup["train"]))
              for k, v in given.items() if v is not None]
    microbatches = 2 * pp
    values += [f"parallel.dp={job.dp}", f"parallel.tp={job.tp}", f"parallel.pp={pp}", f"parallel.vpp={job.vpp}",
               f"parallel.schedule={job.schedule}", f"parallel.microbatches={microbatches}",
               f"parallel.zero={job.zero}", f"parallel.sequence_parallel={_toml(job.sequence_parallel)}",
               "parallel.plan=", f"parallel.layers={','.join(map(str, job.layers)) if len(job.layers) > 1 else '[]'}",
               f"train.global_batch={job.rows * microbatches * job.dp}",
               f"train.steps={STEPS}", f"trace.steps={list(TRACED)}", "checkpoint.every=0", "eval.every=0",
               f"train.recompute={job.recompute}", "train.recompute_layers=0"]
    return values


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def observations(trace: pb.StepTrace, config: JobConfig, device: str) -> list[dict]:
    """Every observation a traced step of `config` on `device` gives: its computes' and
    updates' (observe), and where the servers' calls are timed on the host (CPU
    servers: gloo holds the caller until a call is done) its groups' calls
    (observe_links), tensor shards' compute, postings and message latency
    (observe_messages). A CUDA server's collective or message is only queued on a
    stream when its call returns: it is timed by nobody here."""
    timed = calls_timed(device)
    return (observe(trace, config, calls_timed=timed, compiled=compiled_on(config, device))
            + (observe_links(trace, config) + observe_messages(trace, config) if timed else []))


def observe_messages(trace: pb.StepTrace, config: JobConfig) -> list[dict]:
    """Every send, receive and exchange a rank posted (the bytes of its messages, its
    span's seconds), and where the step is a pipeline of single servers, its message's
    latency (message_latency)."""
    size = message_bytes(config)
    found = [{"kind": POSTING_OBSERVED, "amount": len(parse(span.action).p2p_ops()) * size,
              "seconds": span.end_seconds - span.start_seconds}
             for report in trace.reports for span in report.spans if span.kind in POSTING_KINDS]
    latency = message_latency(trace, config)
    if latency is not None:
        found.append({"kind": MESSAGE_OBSERVED, "amount": size, "seconds": latency})
    return found


def message_latency(trace: pb.StepTrace, config: JobConfig) -> float | None:
    """The latency of a pipeline message at which the simulator, replaying the step
    (executed_step.replay_by_latency: every rank's computes, postings and update as they took,
    each update less its wait for the slowest rank), takes what its slowest rank took;
    found by bisection, the replay's step growing with the latency. What a message
    costs beyond its posting as the servers' steps see it: gloo's transfer and the
    receiver's wait for it, and what the replay leaves out (the executor's work between
    actions, the tied embedding's small all-reduce). Only a pipeline of single servers
    (dp = tp = 1), whose step holds no other group's calls for the latency to absorb
    (None otherwise); 0 where the replay takes as long without any. Sought below the
    step's own length, which the replay exceeds there (the last stage computes after
    some message reached it).

    Why the updates go less their wait: an earlier-finishing rank's update holds the
    gradient norm's all-reduce until the slowest rank is there, which would end that
    rank's replay where the step really ended at a latency too low for the slowest
    rank's own path."""
    p = config.parallel
    if p.pp < 2 or p.dp > 1 or p.tp > 1:
        return None
    took = max(report.step_seconds for report in trace.reports)
    replay = replay_by_latency(_updates_less_their_wait(trace))
    if replay(0.0).makespan_s >= took:
        return 0.0
    low, high = 0.0, took
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if replay(middle).makespan_s < took else (low, middle)
    return (low + high) / 2


def _updates_less_their_wait(trace: pb.StepTrace) -> pb.StepTrace:
    """A copy of `trace` whose update spans end earlier by the seconds their server was
    held in the world group's call (_norm_calls_s), never before they start."""
    own = pb.StepTrace()
    own.CopyFrom(trace)
    for report in own.reports:
        wait = _norm_calls_s(report)
        for span in report.spans:
            if span.kind == "update":
                span.end_seconds = max(span.start_seconds, span.end_seconds - wait)
    return own


BISECTIONS = 30
"""Halvings of the latency's interval: a step's length over 2**30, well under a
microsecond."""


def calls_timed(device: str) -> bool:
    """Whether a server of `device` kind is held in its collectives until they are done
    (gloo on CPUs), so that StepReport.comm's seconds are what the calls cost."""
    return device == "cpu"


def observe(trace: pb.StepTrace, config: JobConfig, calls_timed: bool = True, compiled: bool = False) -> list[dict]:
    """(kind, FLOPs, seconds) of every traced compute of a step of `config`, and
    (update, parameters, seconds) of every update; without recompute, each compute also
    as one timing of its chunk's shape ("shape:<kind>", costs.chunk_shape, `compiled`
    where its blocks ran so), its group's calls inside. A tensor-parallel step's computes hold
    their group's collectives, which the laws leave to the links: they count only
    together, per server, less its tensor group's calls (_tp_compute), where those are
    `calls_timed`, made only inside computes (no sequence parallelism, whose partial
    gradients are summed in the update; no pipeline messages gathered over the group)
    and nothing is rerun."""
    p = config.parallel
    rows = config.train.global_batch // (p.dp * p.microbatches)
    chunks = partition(config.model.n_layers, p.pp, p.vpp, p.schedule, p.layers)
    flops = [chunk_forward_flops(config, c, rows) for c in chunks]
    shapes = [chunk_shape(config, c, rows, compiled) for c in chunks]
    stages = {info.rank: info.coordinates.pp for info in trace.ranks}
    armed = _armed_backwards(trace) if p.overlap_grad_reduce else {}
    found = []
    for report in trace.reports:
        stage = stages[report.rank]
        if (p.tp > 1 and calls_timed and config.train.recompute == "none" and not p.sequence_parallel
                and not (p.pp > 1 and p.scatter_gather)):
            found += _tp_compute(report, flops, armed.get(stage, set()))
        for span in report.spans:
            seconds = span.end_seconds - span.start_seconds
            if span.action in armed.get(stage, ()):
                continue  # it started its buckets' reductions, each waiting for the one before
            if span.kind in SPAN_LAWS:
                kind, chunk = SPAN_LAWS[span.kind], parse(span.action).chunk
                if config.train.recompute == "none":
                    found.append({"kind": SHAPE_OBSERVED + kind, "shape": shapes[chunk], "amount": flops[chunk],
                                  "seconds": seconds})
                if p.tp > 1:  # its group's calls inside: the laws see shards through _tp_compute
                    continue
                if config.train.recompute != "none":  # not the law's: under the checkpoint's policy
                    if config.train.recompute != "selective" or kind not in ("forward", "backward"):
                        continue
                    kind += "_selective"  # the forward deciding what to keep, the backward with its rerun
                found.append({"kind": kind, "amount": flops[chunk], "seconds": seconds})
            elif span.kind == "update" and p.zero in (0, 3) and not (p.sequence_parallel and p.tp > 1):
                # ZeRO-1/2's update holds a gather, sequence parallelism's a tensor group's sum
                seconds -= _norm_calls_s(report) if calls_timed else 0.0
                if seconds <= 0:
                    continue
                held = sum(chunk_parameters(config, c) for c in chunks if c.pipeline_rank == stage)
                stepped = held / p.dp if p.zero else held
                found.append({"kind": "update", "amount": stepped, "seconds": seconds})
    return found


def _norm_calls_s(report: pb.StepReport) -> float:
    """The seconds a server was held in the gradient norm's all-reduce over every rank
    (the world group's only call, in the update): waiting for the slowest rank to
    finish its backward, which is the pipeline's skew and no cost of the update: the
    2.4M-parameter updates of a zbv job's second rank took 56-88 ms with it in the
    benchmark's profile of tree 021675c, about 9 ms without it in f67902a's
    (bench/results/planner-*.json)."""
    return sum(stat.seconds for stat in report.comm if stat.group == "world")


LINK_CALLS = {(op, group): group if op == "all_reduce" else f"{group}_{op}"
              for op in ("all_reduce", "reduce_scatter", "all_gather") for group in ("tp", "dp")}
"""The (op, group) pairs of StepReport.comm that a link law is fitted to."""


def observe_links(trace: pb.StepTrace, config: JobConfig) -> list[dict]:
    """One observation per server, per (op, group) of LINK_CALLS its step called: the
    mean call's bytes and held seconds, scaled to a group of two (costs.normalized).
    The tensor group's all-reduces count without sequence parallelism, its reduce-
    scatters and all-gathers with it: those are the blocks' (and the embedding's and
    head's, with the loss's few small ones averaged in); the other ops' calls there are
    only the loss's and the update's small ones."""
    p = config.parallel
    members = {"tp": p.tp, "dp": p.dp}
    found = []
    for report in trace.reports:
        for stat in report.comm:
            kind = LINK_CALLS.get((stat.op, stat.group))
            if kind is None or not stat.calls or members[stat.group] < 2:
                continue
            if stat.group == "tp" and (kind == "tp") == p.sequence_parallel:
                continue
            amount, seconds = normalized(members[stat.group], stat.bytes / stat.calls, stat.seconds / stat.calls)
            found.append({"kind": LINK_OBSERVED + kind, "amount": amount, "seconds": seconds})
    return found


def _armed_backwards(trace: pb.StepTrace) -> dict[int, set[str]]:
    """Per pipeline rank, the backwards that started their chunk's bucket reductions
    (parallel.overlap_grad_reduce): each bucket waits inside them for the one before,
    so their spans hold data-parallel waits and are no compute's measure."""
    programs = {p.pipeline_rank: [parse(a.text) for a in p.actions] for p in trace.programs}
    return {stage: {str(Action(Kind.BACKWARD, chunk, microbatch))
                    for chunk, microbatch in overlapped_reductions(program)[0].items()}
            for stage, program in programs.items()}


def _tp_compute(report: pb.StepReport, flops: list[float],
                armed: frozenset[str] | set[str] = frozenset()) -> list[dict]:
    """A tensor-parallel server's step as one observation of its shard's compute: its
    computes' (law, FLOPs), and their spans' seconds less those it was held in its
    tensor group's calls (which happen inside them). None from a step with `armed`
    backwards (which started their buckets' reductions and wait in them): its calls are
    summed over the step, so those inside an armed backward cannot be left out with it,
    and were taken from the others' spans (a tiny model's tensor-parallel compute came
    out negative so, and with it every tensor-parallel layout's price)."""
    if not report.comm:  # an unmetered server: its calls cannot be taken out
        return []
    spans = [span for span in report.spans if span.kind in SPAN_LAWS]
    if not spans or any(span.action in armed for span in spans):
        return []
    computes = [[SPAN_LAWS[span.kind], flops[parse(span.action).chunk]] for span in spans]
    seconds = sum(span.end_seconds - span.start_seconds for span in spans)
    held = sum(stat.seconds for stat in report.comm if stat.group == "tp")
    return [{"kind": "tp_compute", "amount": 0.0, "seconds": seconds - held, "computes": computes}]


def refine(profile: DeviceProfile, trace: pb.StepTrace, config: JobConfig, slowdown: float = 1.0) -> DeviceProfile:
    """The profile refitted with a real job's traced step added (planned jobs' traces
    feed their profile back: `interleaf run --plan auto`); `slowdown`: how much the job's
    servers slowed each other (shared cores), taken out of its compute times."""
    seen = unslowed(observations(trace, config, profile.device), slowdown)
    return fit(profile.observations + seen, profile.device, profile.links, _refined(profile.measured_on))


def unslowed(found: list[dict], slowdown: float) -> list[dict]:
    """Observations of a job whose servers computed `slowdown` times slower for sharing
    cores, as the laws take them: the rank's own work (computes, updates, postings)
    divided by it, the links' calls and the messages' latency as they were (a wait for
    another process, not work of this one)."""
    return [o if o["kind"].startswith(LINK_OBSERVED) or o["kind"] == MESSAGE_OBSERVED
            else dict(o, seconds=o["seconds"] / slowdown) for o in found]


def _refined(measured_on: str) -> str:
    """The profile's provenance with one more traced job counted."""
    return counted(measured_on, "refined from", "traced job", 1)


def counted(measured_on: str, prefix: str, unit: str, added: int) -> str:
    """A profile's provenance with `added` more counted in its clause "PREFIX N UNITs",
    which is added once and then grows in place, never a clause per job.

    Worked example: counted("2 servers", "refined from", "traced job", 1) is "2 servers;
    refined from 1 traced job"; counted of that with 2 more is "2 servers; refined from 3
    traced jobs"."""
    parts = measured_on.split("; ")
    clause = re.compile(rf"{re.escape(prefix)} (\d+) {re.escape(unit)}s?")
    for i, part in enumerate(parts):
        found = clause.fullmatch(part)
        if found:
            added += int(found.group(1))
            parts[i] = f"{prefix} {added} {unit}{'s' if added != 1 else ''}"
            return "; ".join(parts)
    return "; ".join(parts + [f"{prefix} {added} {unit}{'s' if added != 1 else ''}"])


def measure(client, config: JobConfig, device: str, idle_servers: int, memory_bytes: int | None,
            log=print) -> DeviceProfile:
    """Runs the profile jobs on the coordinator `client` talks to, whose idle servers
    offer `memory_bytes` each, and fits the laws."""
    setup = profile_setup(config, device, memory_bytes)
    model = setup["model"]
    pp = 2 if idle_servers >= 2 and model["n_layers"] >= 2 else 1
    # compiled blocks and float8 products run no split backward (config/job.py)
    split = config.train.compile != "on" and config.train.precision != "fp8"
    seen: list[dict] = []
    shapes = []
    jobs = [(pp, job) for job in profile_jobs(model["n_layers"], pp, split)]
    if idle_servers >= 2 and calls_timed(device):
        jobs += [(1, job) for job in link_jobs(model["n_layers"])]
    for job_pp, job in jobs:
        found = _run_profile_job(client, setup, job_pp, job, device, log)
        if found is not None:
            seen += found
            shapes.append(job.describe(job_pp))
    proxy = ("" if model == dataclasses.asdict(config.model)
             else f" (its first {model['n_layers']} layers)" if own_widths(config, model)
             else f" (a proxy: d_model {model['d_model']}, seq_len {model['seq_len']})")
    measured = {o["kind"][len(LINK_OBSERVED):] for o in seen if o["kind"].startswith(LINK_OBSERVED)}
    replayed_messages = any(o["kind"] == MESSAGE_OBSERVED for o in seen)
    probed = (("p2p's bandwidth" if replayed_messages else "p2p")
              + ("" if measured >= set(LINK_CALLS.values()) else " and what the jobs did not run"))
    return fit(seen, device, link_probe.measure_links(), f"{len(shapes)} jobs{proxy}: " + ", ".join(shapes)
               + f"; links: {', '.join(sorted(measured)) or 'none'} in those jobs"
               + (", p2p's latency from their pipeline steps replayed" if replayed_messages else "")
               + f", {probed} from two local gloo processes")


def _run_profile_job(client, setup: dict, pp: int, job: ProfileJob, device: str, log) -> list[dict] | None:
    """The observations of one profile job's traced steps; None for a job the model's
    shape rules out (a tensor pair where the heads do not divide by two)."""
    overrides = _job_overrides(setup, pp, job)
    try:
        job_config = load_config("", overrides)
    except ConfigError as err:
        log(f"not profiled: {job.describe(pp)} ({err})")
        return None
    return _run_traced(client, overrides, job_config, job.describe(pp), device, log)


class ProfileJobFailed(RuntimeError):
    """A profile or shape job that did not succeed; the message says which and why."""


def _run_traced(client, overrides: list[str], job_config: JobConfig, label: str, device: str, log) -> list[dict]:
    """Submits the job of `overrides` (read as `job_config`) and returns its traced steps'
    observations; ProfileJobFailed if it does not succeed. Interrupted while it runs
    (Ctrl-C), the job is cancelled: it would otherwise hold the servers for nobody."""
    started = time.monotonic()
    status = client.submit("", overrides)
    try:
        final, _ = client.wait(status.job_id, timeout_s=600)
    except BaseException:
        with contextlib.suppress(Exception):
            client.cancel(status.job_id)
        raise
    if final.state != "SUCCEEDED":
        raise ProfileJobFailed(f"profile job {status.job_id} ({label}) ended {final.state}: "
                               f"{final.error or final.reason}")
    found = []
    for step in TRACED:
        trace = client.trace(status.job_id, step)
        found += observations(trace, job_config, device)
    log(f"profiled {label} in {time.monotonic() - started:.1f} s")
    return found


@dataclasses.dataclass(frozen=True)
class ChunkNeed:
    """A chunk shape a plan holds that the profile has not timed (costs.chunk_shape)."""
    layers: int
    embedding: bool
    head: bool
    rows: int
    split: bool
    """Its backward is split into input and weight halves (zb-h1, zbv)."""
    tp: int = 1
    sequence_parallel: bool = False


SPLIT_SCHEDULES = ("zb-h1", "zbv")


def untimed_shapes(configs: list[JobConfig], profile: DeviceProfile) -> list[ChunkNeed]:
    """The chunk shapes of `configs` some compute of which (forward, and the whole
    backward or both its halves) the profile has not timed, each once, in order."""
    needs: dict[ChunkNeed, None] = {}
    for config in configs:
        p = config.parallel
        rows = config.train.global_batch // (p.dp * p.microbatches)
        split = p.schedule in SPLIT_SCHEDULES
        kinds = ("forward", "input_grad", "weight_grad") if split else ("forward", "backward")
        for chunk in partition(config.model.n_layers, p.pp, p.vpp, p.schedule, p.layers):
            if not set(kinds) <= set(profile.shapes.get(chunk_shape(config, chunk, rows,
                                                                    compiled_on(config, profile.device)), {})):
                needs[ChunkNeed(len(chunk.layers), chunk.has_embedding, chunk.has_head, rows, split, p.tp,
                                p.sequence_parallel)] = None
    return list(needs)


def shape_jobs(needs: list[ChunkNeed], servers: int) -> list[tuple[int, ProfileJob]]:
    """(pp, job) that run every needed shape `servers` can, without recompute, each on a
    tensor group of its size and replicated (data parallel) over the servers left, so
    that every server computes as in the plans: one holding both the embedding and the
    head alone (pp=1); the others on two pipeline ranks, the embedding's shape first, the head's last and
    up to two without either between them (interleaved 1F1B, or zbv where the backward
    is split, at vpp 2), a one-layer chunk in each place no shape needs. The jobs'
    models are the profiled model's layers, as many as their chunks hold.

    Worked example: on two servers at 1 row, tp=1, shapes [3 layers + embedding], [2
    layers], [3 layers + head] and [8 layers + embedding + head] take two jobs: 1f1b
    dp2 of 8 layers, and interleaved-1f1b pp2·vpp2 layers=3,2,1,3."""
    jobs: list[tuple[int, ProfileJob]] = []
    groups: dict[tuple, list[ChunkNeed]] = {}
    for need in needs:
        groups.setdefault((need.rows, need.split, need.tp, need.sequence_parallel), []).append(need)
    for (rows, split, tp, sp), group in groups.items():
        def job(schedule: str, vpp: int, layers: tuple[int, ...]) -> ProfileJob:
            # replicas on the servers a stage leaves idle: every server computes, as in the plans
            stages = 2 if len(layers) > 1 else 1
            return ProfileJob(schedule, vpp, rows, tp=tp, sequence_parallel=sp, layers=layers,
                              dp=servers // (stages * tp))

        if servers >= tp:
            jobs += [(1, job("zb-h1" if split else "1f1b", 1, (n.layers,))) for n in group if n.embedding and n.head]
        if servers < 2 * tp:
            continue
        firsts = [n.layers for n in group if n.embedding and not n.head]
        lasts = [n.layers for n in group if n.head and not n.embedding]
        middles = [n.layers for n in group if not n.embedding and not n.head]
        while firsts or lasts or middles:
            first, last = (firsts.pop(0) if firsts else 1), (lasts.pop(0) if lasts else 1)
            if middles:
                between = (middles.pop(0), middles.pop(0) if middles else 1)
                jobs.append((2, job("zbv" if split else "interleaved-1f1b", 2, (first, *between, last))))
            else:
                jobs.append((2, job("zb-h1" if split else "1f1b", 1, (first, last))))
    return jobs


def measure_shapes(client, config: JobConfig, profile: DeviceProfile, needs: list[ChunkNeed], servers: int,
                   memory_bytes: int, slowdown: float = 1.0, log=print) -> DeviceProfile:
    """The profile refitted with `needs`' shapes run on the coordinator `client` talks
    to (shape_jobs on `servers` idle servers of `memory_bytes` each, computing
    `slowdown` times slower when all do): they are then priced at what they took. A job
    the memory model says would not fit is not run, and one that fails leaves its shapes
    to the laws: the plan goes on either way."""
    setup = profile_setup(config, profile.device, memory_bytes)
    seen: list[dict] = []
    ran = []
    for pp, job in shape_jobs(needs, servers):
        overrides = _job_overrides(setup, pp, job)
        job_config = load_config("", overrides)  # shape_jobs makes only valid ones
        need = job_need_bytes(job_config, profile.device)
        if need > memory_bytes:
            log(f"not timed: {job.describe(pp)} (needs {amount_text(need)} of {amount_text(memory_bytes)})")
            continue
        try:
            found = _run_traced(client, overrides, job_config, job.describe(pp), profile.device, log)
        except ProfileJobFailed as err:
            log(f"not timed: {err}")
            continue
        seen += unslowed(found, slowdown)
        ran.append(job.describe(pp))
    if not ran:
        return profile
    return fit(profile.observations + seen, profile.device, profile.links,
               counted(profile.measured_on, "chunk shapes of the top plans in", "job", len(ran)))
