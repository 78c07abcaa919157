"""One job on one stage server, from its SetupRequest to teardown.

`prepare` checks the request and opens the data without touching the network;
`connect` joins the groups (in one global order, so no two ranks wait on each other's
groups crosswise) and builds the model. Steps then run with no control traffic.
"""

from __future__ import annotations

import datetime
import logging
import pathlib
import threading

import numpy as np
import torch
import torch.distributed as dist

from interleaf.common.data.vocab_check import data_too_big
from interleaf.common.model.compile_modes import COMPILE, compiles
from interleaf.common.model.config import ModelShape
from interleaf.common.model.recompute_modes import MODES as RECOMPUTE
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.actions import parse, splits_backward
from interleaf.stageserver import safetensors, state_io
from interleaf.stageserver.background_writes import BackgroundWrites
from interleaf.stageserver.data import Sampler, resolve_source
from interleaf.stageserver.data.holdout import open_eval_set, training_data
from interleaf.stageserver.data.tokenfile import TokenFile
from interleaf.stageserver.evaluation import EvalStats, Evaluator
from interleaf.stageserver.executor import Executor, StepStats
from interleaf.stageserver.init_weights import initial_values
from interleaf.stageserver.model import fp8
from interleaf.stageserver.model_state import DTYPES, ChunkPlan, ModelState, TrainPlan
from interleaf.stageserver.profiling import ProfilingRejected, StepProfiler
from interleaf.stageserver.setup_checks import SetupError, check_setup
from interleaf.stageserver.spool import Spool, default_root
from interleaf.stageserver.transport.groups import TRANSPORTS, connect_group, make_group_id
from interleaf.stageserver.transport.metered import CommMeter, metered

log = logging.getLogger("interleaf.stageserver")


class JobRejected(ValueError):
    """The request cannot run on this server; nothing was kept."""


class StageJob:
    def __init__(self, request: pb.SetupRequest, hostname: str, device: torch.device = torch.device("cpu"),
                 spool_root: pathlib.Path | None = None, metered: bool = True):
        try:
            check_setup(request)
        except SetupError as err:
            raise JobRejected(str(err)) from None
        self.request = request
        self.device = device
        self.job_id = request.job_id
        self.rank = request.rank
        self.hostname = hostname
        self.cancelled = threading.Event()
        m, t = request.model, request.train
        self.config = model_shape(m)
        try:
            self.program = [parse(a.text) for a in request.program]
        except ValueError as err:
            raise JobRejected(f"program: {err}") from None
        self.chunks = [
            ChunkPlan(c.index, range(c.first_layer, c.end_layer), c.has_embedding, c.has_head)
            for c in request.chunks
        ]
        if not self.chunks:
            raise JobRejected(f"rank {self.rank} was given no model chunks")
        dp = request.grid.dp
        if request.zero > 3:
            raise JobRejected(f"zero={request.zero} must be 0, 1, 2 or 3")
        if (t.precision or "fp32") not in DTYPES:
            raise JobRejected(f"train.precision={t.precision!r} must be one of {', '.join(DTYPES)}")
        if (t.recompute or "none") not in RECOMPUTE:
            raise JobRejected(f"train.recompute={t.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        if t.precision == "fp8":
            try:
                fp8.check_ready(device)
            except ValueError as err:
                raise JobRejected(str(err)) from None
        if (t.compile or "auto") not in COMPILE:
            raise JobRejected(f"train.compile={t.compile!r} must be one of {', '.join(COMPILE)}")
        self.transport = request.transport or "gloo"
        _check_transport(self.transport, device)
        try:
            self.profiler = StepProfiler(request.torch_profiler, request.memory_snapshot, device)
        except ProfilingRejected as err:
            raise JobRejected(str(err)) from None
        self.train = TrainPlan(
            microbatches=t.microbatches,
            rows=t.global_batch // (dp * t.microbatches),
            lr=t.lr,
            warmup_steps=t.warmup_steps,
            steps=t.steps,
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            seed=t.seed,
            precision=t.precision or "fp32",
            recompute=t.recompute or "none",
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            lr_decay=t.lr_decay,
            min_lr_ratio=t.min_lr_ratio,
            decay_fraction=t.decay_fraction,
            recompute_layers=t.recompute_layers,
            fp8_recipe=t.fp8_recipe or "tensorwise",
            compile=compiles(t.compile or "auto", device.type,
                             splits_backward=splits_backward(self.program)),
        )
        if self.train.compile:
            log.info("job %s: rank %d compiles its blocks (train.compile=%s)", request.job_id, self.rank,
                     t.compile or "auto")
        try:
            self.data = resolve_source(request.data_source)
        except (OSError, ValueError) as err:
            raise JobRejected(str(err)) from None
        if self.data.vocab_size is not None and self.data.vocab_size > m.vocab_size:
            raise JobRejected(data_too_big(m.vocab_size, request.data_source, self.data.vocab_size))
        # Files whose sidecar records their vocabulary were checked above; only older ones
        # are read whole for their largest id (a token file is never empty).
        unrecorded = [f for f in self.data.files if f.vocab_size is None]
        largest = max((int(np.max(f.tokens)) for f in unrecorded), default=-1)
        if largest >= m.vocab_size:
            raise JobRejected(
                f"model.vocab_size={m.vocab_size} must exceed every token id in "
                f"data.source={request.data_source!r}, which holds id {largest}"
            )
        # [eval]: what training reads of the data (the split is kept whether or not this
        # job evaluates), and the held-out set, on the ranks that read tokens: those with
        # the embedding (inputs) or the loss (targets); the others never read a sample.
        self.eval_program, self.eval_set = [], None
        try:
            train_data = training_data(self.data, request.held_out_fraction)
            if request.eval_program:
                self.eval_program = [parse(a.text) for a in request.eval_program]
                if any(c.has_embedding or c.has_head for c in self.chunks):
                    self.eval_set = open_eval_set(self.data, request.eval_source, request.held_out_fraction,
                                                  m.seq_len, request.eval_samples)
        except (OSError, ValueError) as err:
            raise JobRejected(f"eval: {err}") from None
        if self.eval_set is not None and request.eval_source:  # data.source's own ids were checked above
            recorded = TokenFile(request.eval_source, field="eval.source").vocab_size
            largest = self.eval_set.largest() if recorded is None else recorded - 1
            if largest >= m.vocab_size:
                raise JobRejected(f"model.vocab_size={m.vocab_size} must exceed every token id the evaluation "
                                  f"scores; eval.source={request.eval_source!r} holds "
                                  f"{'id' if recorded is None else 'ids up to'} {largest}")
        try:
            self.sampler = Sampler(train_data, t.seed, m.seq_len, t.global_batch, t.microbatches,
                                   start_step=t.data_start_step, start_samples=t.data_start_samples)
        except ValueError as err:  # a file shorter than one sample
            raise JobRejected(str(err)) from None
        try:  # the weights to start from, opened (not read) now: a bad path fails the setup
            self.initial = initial_values(request.init_from, self.config) if request.init_from else None
        except (OSError, ValueError) as err:
            raise JobRejected(f"init_from={request.init_from!r}: {err}") from None
        self.model: ModelState | None = None
        self.executor: Executor | None = None
        self.evaluator: Evaluator | None = None
        # Every group's traffic, taken per step; None on a server with its metrics off
        # (--metrics-port -1): its groups are then used as they are, and StepReport.comm stays empty.
        self.comm = CommMeter() if metered else None
        self.writes = BackgroundWrites()
        self.spool = Spool(spool_root or default_root(), self.job_id, self.rank)
        # The ids of the groups this rank is member 0 of (see transport/groups.py).
        try:
            self.group_ids = {g.name: make_group_id(self.transport) for g in request.groups
                              if len(g.members) > 1 and g.members[0] == self.rank}
        except RuntimeError as err:  # no CuPy: only groups of one could run here
            raise JobRejected(str(err)) from None

    def connect(self, group_ids: dict[str, bytes]) -> None:
        r = self.request
        store = dist.TCPStore(
            r.store_host, r.store_port, is_master=False,
            timeout=datetime.timedelta(seconds=r.comm_timeout_s),
        )
        store = dist.PrefixStore(r.store_prefix, store)
        groups = {}
        try:
            for group in sorted(r.groups, key=lambda g: g.name):
                role = group.name.split("/")[0]
                joined = connect_group(
                    self.transport, group.name, group_ids.get(group.name, b""), list(group.members), self.rank,
                    store=store, timeout_s=r.comm_timeout_s, hostname=self.hostname, device=self.device,
                )
                groups[role] = joined if self.comm is None else metered(joined, role, self.comm)
            last_chunk = r.grid.pp * r.vpp - 1
            self.model = ModelState(self.config, self.chunks, groups, self.sampler, self.train, last_chunk,
                                    zero=r.zero, device=self.device, initial=self.initial,
                                    sequence_parallel=r.sequence_parallel, scatter_gather=r.scatter_gather,
                                    eval_microbatches=r.eval_microbatches if r.eval_program else 0,
                                    bucket_bytes=r.bucket_bytes, overlap_grad_reduce=r.overlap_grad_reduce)
        except BaseException:
            for joined in groups.values():  # never left to the garbage collector
                joined.close()
            raise
        self.executor = Executor(self.model, self.program, self.rank, self.cancelled)
        if self.eval_program:
            self.evaluator = Evaluator(self.model, self.eval_program, self.rank, self.eval_set,
                                       r.eval_microbatches, self.cancelled)

    @property
    def reports_loss(self) -> bool:
        """One rank per data-parallel replica reports the loss: tp rank 0 of the last stage."""
        last = self.request.grid.pp * self.request.vpp - 1
        return any(c.index == last for c in self.chunks) and self.request.coordinates.tp == 0

    def run_step(self, step: int, trace: bool = False) -> StepStats:
        executor = self.executor  # read once: close() may clear it from another thread
        if executor is None:
            raise RuntimeError(f"job {self.job_id} is not connected")
        if self.comm is not None:
            self.comm.take()  # what moved between steps (a checkpoint's load) is no step's
        if self.reports_loss and self.request.coordinates.dp == 0:  # one server says it
            for name, epoch, samples in self.sampler.epochs_begun(step):
                log.info("job %s: step %d begins epoch %d of %s (%d samples an epoch)",
                         self.job_id, step, epoch, name, samples)
        with self.profiler.over(trace) as profiles:
            stats = executor.run_step(step, trace)
        stats.torch_profile, stats.memory_snapshot = profiles.torch_profile, profiles.memory_snapshot
        if self.comm is not None:
            stats.comm = self.comm.take()
        return stats

    def evaluate(self) -> EvalStats:
        """Scores the held-out set with the current weights (stageserver/evaluation.py)."""
        evaluator = self.evaluator  # read once, as run_step's executor
        if evaluator is None:
            raise RuntimeError(f"job {self.job_id} has no evaluation program ([eval] is off)")
        return evaluator.evaluate()

    def _local(self, path: str) -> str:
        """A checkpoint path as this server reads it: in place, or (relative) in the spool."""
        if pathlib.PurePath(path).is_absolute():
            return path
        self.spool.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return str(self.spool.path(path))

    def save_state(self, path: str, background: bool = False) -> tuple[str, int]:
        """Writes this rank's training state (stageserver/state_io.py); in the background:
        ("", bytes) once copied, the checksum from finish_saves."""
        tensors, meta = state_io.collect(self.model)
        path = self._local(path)
        if background:
            return "", self.writes.start(path, tensors, meta)
        return safetensors.write(path, tensors, meta), sum(t.numel() * t.element_size() for t in tensors.values())

    def finish_saves(self):
        return self.writes.finish()

    def load_state(self, paths: list[str]) -> int:
        return state_io.restore(self.model, [self._local(p) for p in paths])

    def close(self) -> None:
        self.cancelled.set()
        self.spool.remove()
        if self.model is not None:
            self.model.close()
            self.model = None
            self.executor = None
            self.evaluator = None


def model_shape(m: pb.ModelSpec) -> ModelShape:
    """The model a ModelSpec describes; its unset fields (0, "") are the defaults."""
    return ModelShape(m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size, arch=m.arch or "gpt2",
                      n_kv_heads=m.n_kv_heads, ffn_hidden=m.ffn_hidden, pad_vocab_to=m.pad_vocab_to or 1,
                      norm_eps=m.norm_eps or 1e-5, rope_theta=m.rope_theta or 10000.0,
                      rope_scaling_factor=m.rope_scaling_factor, rope_low_freq_factor=m.rope_low_freq_factor or 1.0,
                      rope_high_freq_factor=m.rope_high_freq_factor or 4.0,
                      rope_original_positions=m.rope_original_positions or 8192,
                      tie_embeddings=m.tie_embeddings if m.arch else None)


def _check_transport(transport: str, device: torch.device) -> None:
    if transport not in TRANSPORTS:
        raise JobRejected(f"parallel.transport={transport!r} must be one of {', '.join(TRANSPORTS)}")
    if transport == "nccl" and device.type != "cuda":
        raise JobRejected(f"parallel.transport='nccl' moves CUDA tensors; this server computes on {device}")
    if transport == "gloo" and device.type != "cpu":
        raise JobRejected(f"parallel.transport='gloo' moves CPU tensors; this server computes on {device} "
                          f"(use nccl, or start the server with --device cpu)")
