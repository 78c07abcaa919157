"""The Python API: `interleaf.Client` submits jobs and hands back `Job`s that report in
typed values, not protobuf messages.

    import interleaf

    with interleaf.LocalCluster(servers=2) as cluster:
        client = cluster.connect()
        job = client.submit("job.toml", overrides=["train.steps=20"])
        for step in job.steps():
            print(step.step, step.loss)
        print(job.wait().state)

A job's config is a TOML file's path, TOML text, or a `JobConfig` (interleaf.JobConfig,
built like any dataclass; it is validated where it is built). The protobuf-level client
the command line uses is `Client.rpc`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from interleaf.clients.client import Client as RpcClient
from interleaf.coordinator.config import JobConfig
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.job_states import FINAL_STATES
from interleaf.common.security import Security


@dataclass(frozen=True)
class Step:
    """One completed training step, as the coordinator reported it."""
    step: int         # counting from 1, as JobStatus.step and Checkpoint.step count steps completed
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_seconds: float
    tokens_per_second: float

    @classmethod
    def from_event(cls, event: pb.StepEvent) -> "Step":
        return cls(step=event.step + 1, loss=event.loss, grad_norm=event.grad_norm, lr=event.lr, tokens=event.tokens,
                   step_seconds=event.step_seconds, tokens_per_second=event.tokens_per_second)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint saved, or the one the job resumed from."""
    kind: str          # "saved" or "resumed"
    step: int
    manifest: str
    stall_seconds: float
    write_seconds: float
    load_seconds: float
    bytes: int


@dataclass(frozen=True)
class Evaluation:
    """A held-out evaluation ([eval]): the mean next-token loss over every token of the
    same `samples` held-out samples, after `step` steps completed."""
    step: int
    loss: float
    perplexity: float
    samples: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class Recovery:
    """The job lost stage servers and is running again from `restart_step`."""
    attempt: int
    failure: str
    lost: tuple[str, ...]
    restart_step: int
    recover_seconds: float


@dataclass(frozen=True)
class Grow:
    """parallel.elastic: the job, which had shrunk, grew back to its submitted layout at
    the checkpoint of `step`, taking on the servers `added`."""
    step: int
    dp: int                  # data-parallel replicas from here: the submitted parallel.dp
    microbatches: int
    before_dp: int           # and until here
    before_microbatches: int
    added: tuple[str, ...]
    seconds: float           # from the boundary until running again
    reason: str


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    state: str        # PENDING, SETTING_UP, RUNNING, RECOVERING, SUCCEEDED, FAILED, CANCELLED
    step: int         # steps completed
    steps: int        # steps asked for
    error: str        # why it FAILED
    reason: str       # why it entered this state
    checkpoint: str   # the final parameters' manifest, once written
    layout: str       # the partition and rank grid, in words
    last: Step | None

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @classmethod
    def from_message(cls, status: pb.JobStatus) -> "JobStatus":
        return cls(job_id=status.job_id, state=status.state, step=status.step, steps=status.steps,
                   error=status.error, reason=status.reason, checkpoint=status.checkpoint, layout=status.layout,
                   last=Step.from_event(status.last) if status.HasField("last") else None)


@dataclass(frozen=True)
class Server:
    server_id: str
    address: str
    device: str
    state: str        # IDLE, BUSY, DEAD
    job_id: str
    memory_bytes: int


class JobFailed(RuntimeError):
    """`Job.wait()` on a job that ended FAILED; `.status` says why."""

    def __init__(self, status: JobStatus):
        super().__init__(f"job {status.job_id} failed at step {status.step}: {status.error or status.reason}")
        self.status = status


Event = Step | Evaluation | Checkpoint | Recovery | Grow | JobStatus


class Job:
    """A submitted job: ask its status, follow its steps, wait for it or cancel it."""

    def __init__(self, rpc: RpcClient, job_id: str, model=None):
        """`model`: the job's [model] section where known (the model FLOPs of its MFU)."""
        self._rpc = rpc
        self.id = job_id
        self.model = model

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> JobStatus:
        return JobStatus.from_message(self._rpc.status(self.id))

    def events(self, timeout_s: float | None = None) -> Iterator[Event]:
        """Every event from the job's start, then new ones as they happen, until it ends:
        Steps, Evaluations, Checkpoints, Recoveries, Grows and a JobStatus on each change of state."""
        for event in self._rpc.watch(self.id, timeout_s):
            kind = event.WhichOneof("event")
            if kind == "step":
                yield Step.from_event(event.step)
            elif kind == "status":
                yield JobStatus.from_message(event.status)
            elif kind == "checkpoint":
                c = event.checkpoint
                yield Checkpoint(kind=c.kind, step=c.step, manifest=c.manifest, stall_seconds=c.stall_seconds,
                                 write_seconds=c.write_seconds, load_seconds=c.load_seconds, bytes=c.bytes)
            elif kind == "eval":
                e = event.eval
                yield Evaluation(step=e.step, loss=e.loss, perplexity=e.perplexity, samples=e.samples,
                                 tokens=e.tokens, seconds=e.seconds)
            elif kind == "recovery":
                r = event.recovery
                yield Recovery(attempt=r.attempt, failure=r.failure, lost=tuple(r.lost),
                               restart_step=r.restart_step, recover_seconds=r.recover_seconds)
            elif kind == "grow":
                g = event.grow
                yield Grow(step=g.step, dp=g.grid.dp, microbatches=g.microbatches, before_dp=g.before.dp,
                           before_microbatches=g.before_microbatches, added=tuple(g.added), seconds=g.seconds,
                           reason=g.reason)

    def steps(self, timeout_s: float | None = None) -> Iterator[Step]:
        """The job's steps, from its first, until it ends. After a recovery the steps
        from the checkpoint on come again, as the job trained them again."""
        return (event for event in self.events(timeout_s) if isinstance(event, Step))

    def evaluations(self, timeout_s: float | None = None) -> Iterator[Evaluation]:
        """The job's held-out evaluations ([eval]), from its first, until it ends (after a
        recovery, those from the checkpoint on come again)."""
        return (event for event in self.events(timeout_s) if isinstance(event, Evaluation))

    def wait(self, timeout_s: float | None = None, tensorboard: str | os.PathLike | None = None,
             wandb: str | None = None) -> JobStatus:
        """Blocks until the job ends; its final status, or JobFailed if it failed. Meanwhile
        its scalars from the first step on (loss, lr, grad norm, tokens/s, MFU, bubble,
        memory by kind, eval loss; coordinator/run_logs.py) go to TensorBoard event files
        in the folder `tensorboard` and/or the W&B project `wandb` (the optional extra
        interleaf[wandb]; RuntimeError naming it without), as `interleaf run` writes them."""
        from interleaf.coordinator.run_logs import RunLogs

        logs = RunLogs.open(tensorboard=os.fspath(tensorboard) if tensorboard else None, wandb=wandb,
                            name=self.id, model=self.model, peak_flops=self._rpc.peak_flops)
        try:
            for event in self._rpc.watch(self.id, timeout_s):
                logs.event(event)
        finally:
            logs.close()
        status = self.status()
        if status.state == "FAILED":
            raise JobFailed(status)
        return status

    def cancel(self) -> JobStatus:
        return JobStatus.from_message(self._rpc.cancel(self.id))


def config_text(config: str | os.PathLike | JobConfig) -> str:
    """The TOML text of a job config given as a path, as TOML text or as a JobConfig."""
    if isinstance(config, JobConfig):
        import tomli_w  # imported here: only typed configs need the TOML writer

        return tomli_w.dumps(dataclasses.asdict(config))
    if isinstance(config, os.PathLike):
        return pathlib.Path(config).read_text()
    if isinstance(config, str):
        # One line naming a file is a path; anything else is TOML text.
        if "\n" not in config and (config.endswith(".toml") or pathlib.Path(config).is_file()):
            return pathlib.Path(config).read_text()
        return config
    raise TypeError(f"config={config!r} must be a TOML path, TOML text or an interleaf.JobConfig")


def _model(config, text: str, overrides: Sequence[str]):
    """The [model] section of a submitted config, or None where only the coordinator
    can build it (a checkpoint.init on the cluster's filesystem)."""
    if isinstance(config, JobConfig):
        return config.model
    from interleaf.coordinator.config import ConfigError, load_config

    try:
        return load_config(text, list(overrides)).model
    except ConfigError:
        return None


class Client:
    """A coordinator's client. `address` is HOST:PORT; `security` the token and TLS files to
    call with (default: $INTERLEAF_TOKEN's token, without TLS)."""

    def __init__(self, address: str, security: Security | None = None):
        self.rpc = RpcClient(address, security)
        self.address = address

    def submit(self, config: str | os.PathLike | JobConfig = "", overrides: Sequence[str] = ()) -> Job:
        """Submits a job (the defaults when `config` is empty); `overrides` are
        SECTION.KEY=VALUE settings over it. A config the coordinator refuses raises
        grpc.RpcError with INVALID_ARGUMENT and a message naming the field and rule."""
        text = config_text(config)
        status = self.rpc.submit(text, list(overrides))
        return Job(self.rpc, status.job_id, _model(config, text, overrides))

    def job(self, job_id: str) -> Job:
        """A handle on a job submitted earlier (by anyone)."""
        return Job(self.rpc, job_id)

    def servers(self) -> list[Server]:
        return [Server(server_id=s.server_id, address=s.address, device=s.device, state=s.state,
                       job_id=s.job_id, memory_bytes=s.memory_bytes) for s in self.rpc.servers()]

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
