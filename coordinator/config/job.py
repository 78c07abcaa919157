"""The whole job configuration, and the rules that span its sections."""

from __future__ import annotations

from dataclasses import dataclass, field

from interleaf.coordinator.config.metrics import MetricsConfig
from interleaf.coordinator.config.eval import EvalConfig, eval_microbatches
from interleaf.coordinator.config.model import ModelConfig
from interleaf.coordinator.config.parallel import SPLIT_BACKWARD, ParallelConfig
from interleaf.coordinator.config.rules import ConfigError
from interleaf.coordinator.config.sections import (
    DEFAULT_TRACED,
    CheckpointConfig,
    DataConfig,
    RecoveryConfig,
    TraceConfig,
)
from interleaf.coordinator.config.train import TrainConfig
from interleaf.common import limits
from interleaf.common.model.compile_modes import compiles


@dataclass(frozen=True)
class JobConfig:
    """A job is described by a TOML file of the sections below. Every key is optional
    (its default applies), an unknown section or key is an error, and
    `--set SECTION.KEY=VALUE` on the command line overrides any of them
    (`--set train.betas=0.9,0.99`, `--set trace.steps=[0,-1]`). `interleaf config
    [CONFIG] [--set ...]` prints the complete config a job would run with.

    The coordinator checks a config whole before it touches a server. A value that
    breaks a rule is refused (exit status 2 from the command line, INVALID_ARGUMENT over
    gRPC) with one line naming the field, the value and the rule, e.g.
    `parallel.microbatches=6 must be a multiple of parallel.pp=4 for interleaved-1f1b`.
    Besides each key's own rules (below), the sections must agree: parallel.pp*vpp at
    most model.n_layers; model.n_heads, n_kv_heads and ffn_hidden divisible by
    parallel.tp; model.seq_len divisible by tp under sequence parallelism;
    train.recompute_layers at most model.n_layers; train.compile not true, and train.precision
    not fp8, for a zero-bubble schedule; fp8 only at parallel.tp=1; train.global_batch divisible by
    parallel.dp*microbatches; trace.steps within train.steps; and, with eval.every,
    eval.samples a multiple of the training microbatch's rows (times parallel.pp for
    interleaved 1F1B). Every number must be finite and at most its bound (the "at most"
    column, common/limits.py), and dp*tp*pp at most 65,536 ranks and pp*vpp*microbatches
    at most 16,384 pipeline slots."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self):
        m, p, t = self.model, self.parallel, self.train
        for step in self.trace.steps:
            if not -t.steps <= step < t.steps and self.trace.steps != DEFAULT_TRACED:
                raise ConfigError(f"trace.steps={list(self.trace.steps)}: step {step} is not one of train.steps="
                                  f"{t.steps} (0 to {t.steps - 1}, or -{t.steps} to -1 counting from the end)")
        if p.pp * p.vpp > m.n_layers:
            raise ConfigError(
                f"parallel.pp*parallel.vpp={p.pp * p.vpp} must not exceed model.n_layers="
                f"{m.n_layers}: every chunk needs at least one layer"
            )
        if p.layers:
            self._check_layers()
        if m.n_heads % p.tp:
            raise ConfigError(
                f"model.n_heads={m.n_heads} must be divisible by parallel.tp={p.tp}"
            )
        if m.n_kv_heads % p.tp:
            raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must be divisible by parallel.tp={p.tp}: "
                              f"key/value heads are split across tensor ranks")
        if m.ffn_hidden % p.tp:
            raise ConfigError(f"model.ffn_hidden={m.ffn_hidden} must be divisible by parallel.tp={p.tp}")
        if p.sequence_parallel and m.seq_len % p.tp:
            raise ConfigError(f"model.seq_len={m.seq_len} must be divisible by parallel.tp={p.tp} with "
                              f"parallel.sequence_parallel=true: each tensor rank holds an equal slice of the "
                              f"sequence")
        if t.recompute_layers > m.n_layers:
            raise ConfigError(f"train.recompute_layers={t.recompute_layers} must not exceed model.n_layers="
                              f"{m.n_layers}: every K-th block is rerun whole, and no block would be")
        if t.compile == "on" and p.schedule in SPLIT_BACKWARD:
            raise ConfigError(f"train.compile=true cannot run parallel.schedule={p.schedule!r}: its backwards split "
                              f"into I and W in hand-written autograd Functions that compiled graphs replace "
                              f"(train.compile=\"auto\" runs it eager)")
        if t.precision == "fp8" and p.tp > 1:
            raise ConfigError(f"train.precision='fp8' needs parallel.tp=1, not {p.tp}: the float8 products are "
                              f"torchao's whole linears, and the tensor-parallel ones fuse their collectives")
        if t.precision == "fp8" and p.schedule in SPLIT_BACKWARD:
            raise ConfigError(f"train.precision='fp8' cannot run parallel.schedule={p.schedule!r}: torchao's "
                              f"float8 backward is whole, where {p.schedule} splits each into I and W")
        if t.global_batch % (p.dp * p.microbatches):
            raise ConfigError(
                f"train.global_batch={t.global_batch} must be divisible by "
                f"parallel.dp*parallel.microbatches={p.dp * p.microbatches}"
            )
        if self.eval.enabled:
            self._check_eval()

    def compiles_on(self, device_type: str) -> bool:
        """Whether a server on `device_type` ("cpu", "cuda") compiles this job's blocks:
        train.compile as common/model/compile_modes.py reads it, where the schedule's
        name says whether its backwards split into I and W. The one answer the memory
        model and the driver's compile allowance share."""
        return compiles(str(self.train.compile), device_type, self.parallel.schedule in SPLIT_BACKWARD)

    def _check_layers(self) -> None:
        p, n = self.parallel, self.model.n_layers
        given = ",".join(map(str, p.layers))
        if len(p.layers) != p.pp * p.vpp:
            raise ConfigError(f"parallel.layers=[{given}] must give one count per chunk: parallel.pp*parallel.vpp="
                              f"{p.pp * p.vpp} of them, not {len(p.layers)}")
        if min(p.layers) < 1:
            raise ConfigError(f"parallel.layers=[{given}] must give every chunk at least 1 layer")
        if sum(p.layers) != n:
            raise ConfigError(f"parallel.layers=[{given}] must sum to model.n_layers={n}, not {sum(p.layers)}")

    def _check_eval(self) -> None:
        """An evaluation runs microbatches of the training microbatch's shape through the
        job's own pipeline (coordinator/schedule/forward_only.py)."""
        p, t, e = self.parallel, self.train, self.eval
        rows = t.global_batch // p.microbatches
        if e.samples % rows:
            raise ConfigError(f"eval.samples={e.samples} must be a multiple of train.global_batch/"
                              f"parallel.microbatches={rows}: evaluation runs microbatches of the training "
                              f"microbatch's rows")
        count = eval_microbatches(e.samples, t.global_batch, p.microbatches)
        if p.schedule == "interleaved-1f1b" and p.vpp > 1 and count % p.pp:
            raise ConfigError(f"eval.samples={e.samples} must be a multiple of train.global_batch/"
                              f"parallel.microbatches*parallel.pp={rows * p.pp} for interleaved-1f1b: its "
                              f"{count} evaluation microbatch{'es sweep' if count > 1 else ' sweeps'} the chunks in groups of "
                              f"parallel.pp={p.pp}")
        if p.pp * p.vpp * count > limits.MAX_PIPELINE_SLOTS:
            raise ConfigError(f"eval.samples={e.samples} makes parallel.pp*parallel.vpp*{count} evaluation "
                              f"microbatches={p.pp * p.vpp * count} forwards, more than "
                              f"{limits.MAX_PIPELINE_SLOTS}: the coordinator plans every one")
