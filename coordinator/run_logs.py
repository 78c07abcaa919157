"""A run's scalars for the tools users already read runs with: TensorBoard event files
and Weights & Biases (the optional `wandb` extra).

Every source of a run's figures (a job's JobEvent stream, as `interleaf run`/`watch`,
the Python client and the coordinator's `metrics.tensorboard_dir` follow it; the
reference trainer's records) becomes one call, `RunLogs.log(step, scalars)`, and every
sink writes the same tags, so a parallel run and its reference line up in one board.
Here rather than in clients/ because the coordinator writes them too:

    train/loss  train/lr  train/grad_norm  train/tokens_per_second  train/step_seconds
    train/mfu            (model FLOPs utilization; only where the servers' peak FLOP/s are known)
    pipeline/bubble_seconds  pipeline/idle_seconds      (mean over ranks)
    memory/<kind>_bytes  (RankMemory's kinds, the largest rank's: e.g. memory/activations_peak_bytes)
    eval/loss  eval/perplexity  eval/seconds

`step` is the steps completed (a StepEvent's 0-based `step` + 1), the count an
EvalEvent and a checkpoint carry, so `eval/loss` after step 3 sits at x=3 beside the
third step's `train/loss`. Worked example: the StepEvent {step: 2, loss: 5.1, lr: 1e-3}
is logged as log(3, {"train/loss": 5.1, "train/lr": 0.001, ...}).
"""

from __future__ import annotations

from interleaf.protos import interleaf_pb2 as pb

MEMORY_KINDS = tuple(f.name for f in pb.RankMemory.DESCRIPTOR.fields if f.name.endswith("_bytes"))


def step_scalars(s: pb.StepEvent, mfu: float | None = None) -> dict[str, float]:
    """The scalars of one training step of a job."""
    scalars = {"train/loss": s.loss, "train/lr": s.lr, "train/grad_norm": s.grad_norm,
               "train/tokens_per_second": s.tokens_per_second, "train/step_seconds": s.step_seconds,
               "pipeline/bubble_seconds": s.bubble_seconds, "pipeline/idle_seconds": s.idle_seconds}
    if mfu is not None:
        scalars["train/mfu"] = mfu
    for kind in MEMORY_KINDS:  # the rank that needs the most sets what a device must hold
        most = max((getattr(r, kind) for r in s.ranks), default=0)
        if most or kind != "device_peak_bytes":  # that one is 0 on CPU servers: no device
            scalars[f"memory/{kind}"] = float(most)
    return scalars


def eval_scalars(loss: float, perplexity: float, seconds: float) -> dict[str, float]:
    """The scalars of one held-out evaluation (an EvalEvent, or the reference's)."""
    return {"eval/loss": loss, "eval/perplexity": perplexity, "eval/seconds": seconds}


def reference_scalars(r) -> dict[str, float]:
    """The scalars of a reference step (clients/reference.py's ReferenceStep)."""
    return {"train/loss": r.loss, "train/lr": r.lr, "train/grad_norm": r.grad_norm,
            "train/tokens_per_second": r.tokens / r.step_seconds, "train/step_seconds": r.step_seconds}


class TensorBoardSink:
    """Event files in `log_dir` (created), written by torch's SummaryWriter and read by
    TensorBoard itself (`tensorboard --logdir DIR`)."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        # flush_secs: a board opened on a running job sees its steps within seconds.
        self.writer = SummaryWriter(log_dir=log_dir, flush_secs=5)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        """What was logged, on disk now (the coordinator's job logs, after each step)."""
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WANDB_MISSING = ("--wandb needs the wandb package, which Interleaf does not require: "
                 "pip install 'interleaf[wandb]' (or pip install wandb)")


class WandbSink:
    """A W&B run in `project`. WANDB_MODE=offline (and WANDB_DIR) work as wandb
    documents them: an offline run is written locally for `wandb sync`."""

    def __init__(self, project: str, name: str | None = None, config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise RuntimeError(WANDB_MISSING) from None
        self.run = wandb.init(project=project, name=name, config=config, reinit="create_new")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        # W&B keeps one row per step and drops rows for steps below its newest: steps
        # run again after a recovery are not logged twice.
        self.run.log(scalars, step=step)

    def flush(self) -> None:
        """W&B's own process writes each row as it is logged."""

    def close(self) -> None:
        self.run.finish()


def check_wandb() -> None:
    """Raises RuntimeError(WANDB_MISSING) when wandb is not installed: checked before a
    run starts, so a missing extra costs nothing."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise RuntimeError(WANDB_MISSING) from None


class RunLogs:
    """Every sink a run writes to; with none, each call costs nothing. `model` (a job's
    [model] section) and `peak_flops` (a job status -> its servers' peak FLOP/s, or None)
    give train/mfu, computed as the coordinator's Prometheus gauge is (coordinator/flops.py)."""

    def __init__(self, sinks=(), model=None, peak_flops=None):
        self.sinks = list(sinks)
        self.model, self.peak_flops = model, peak_flops
        self._peaks: list[float] = []

    @classmethod
    def open(cls, tensorboard: str | None = None, wandb: str | None = None, name: str | None = None,
             config: dict | None = None, model=None, peak_flops=None) -> "RunLogs":
        """Sinks for a TensorBoard folder and/or a W&B project (`name` the W&B run's,
        `config` the settings it records)."""
        if wandb:
            check_wandb()
        sinks = [TensorBoardSink(tensorboard)] if tensorboard else []
        try:
            if wandb:
                sinks.append(WandbSink(wandb, name, config))
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
        return cls(sinks, model, peak_flops)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, scalars)

    def event(self, event: pb.JobEvent) -> None:
        """Logs a job's step or evaluation; a status naming the job's ranks gives MFU its
        denominator (the peaks of the servers it runs on, planned anew after a recovery)."""
        if not self.sinks:
            return
        kind = event.WhichOneof("event")
        if kind == "status" and event.status.ranks and self.model is not None and self.peak_flops:
            self._peaks = self.peak_flops(event.status) or []
        elif kind == "step":
            from interleaf.coordinator.flops import utilization  # the model code: imported when needed

            s = event.step
            mfu = utilization(self.model, s.tokens, s.step_seconds, self._peaks) if self.model is not None else None
            self.log(s.step + 1, step_scalars(s, mfu))
        elif kind == "eval":
            e = event.eval
            self.log(e.step, eval_scalars(e.loss, e.perplexity, e.seconds))

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

