"""[parallel]: the layout: data, tensor and pipeline degrees, the schedule, ZeRO."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from interleaf.coordinator.config.rules import ConfigError, _bounded
from interleaf.common import limits

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
SPLIT_BACKWARD = ("zb-h1", "zbv")
"""The schedules whose backwards run as I and W (the zero-bubble ones)."""
TRANSPORTS = ("auto", "gloo", "nccl")
MAX_ZERO_PREFETCH = 4


@dataclass(frozen=True)
class ParallelConfig:
    """[parallel]: the layout. A job needs dp*tp*pp stage servers, one per rank. Its
    n_layers are cut into pp*vpp chunks (chunk c on pipeline rank c mod pp, or, under
    zbv, chunks r and 2*pp-1-r on rank r); layers that do not divide evenly are spread,
    the first chunks taking one more. No value here
    changes what is trained on: every layout's losses are the single-process
    reference's (docs/parallelism.md)."""

    dp: int = 1
    """Data-parallel replicas; each takes its slice of every microbatch."""
    tp: int = 1
    """Tensor-parallel ranks per layer (Megatron-LM's column/row split, vocab-parallel
    embedding and loss); a tensor group is placed on one host where a host has room."""
    pp: int = 2
    """Pipeline ranks."""
    vpp: int = 2
    """Model chunks per pipeline rank (interleaved 1F1B's virtual stages); more than 1
    needs schedule interleaved-1f1b, and zbv needs exactly 2."""
    schedule: str = "interleaved-1f1b"
    """One of gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv (docs/parallelism.md, "Which
    schedule"). zb-h1 and zbv are zero-bubble schedules (Qi et al. 2024): each backward
    runs as its input-gradient half, sent upstream at once, and its weight-gradient
    half, moved into what would be bubbles. zb-h1 keeps one chunk per rank and at most
    pp microbatches in flight on each (1F1B's first rank's count); zbv places two
    chunks per rank in a V (rank r holds chunks r and 2*pp-1-r) for a bubble near zero
    with as many layers' activations in flight."""
    microbatches: int = 4
    """Microbatches per step (gradient accumulation through the pipeline); a multiple
    of pp for interleaved-1f1b."""
    zero: int = 0
    """ZeRO stage over the data-parallel group: 0 replicates everything (gradients
    all-reduced); 1 shards the optimizer state (fp32 master weights and Adam moments);
    2 also the gradients (reduce-scattered); 3 also the parameters (gathered before a
    chunk's forwards and backwards, released after). With dp=1 every stage runs and
    shards over the one rank, which holds everything, as stage 0 does."""
    zero_prefetch: int = 1
    """ZeRO-3: how many parameter gathers (0 to 4) are issued ahead of the compute that
    needs them (0: each gather waits in front of its first use; 1: the next chunk's gather
    overlaps the current chunk's compute). Bounds the gathered chunks a rank holds at
    once to zero_prefetch + 1."""
    bucket_mb: float = 25.0
    """MiB of gradient (in the compute dtype) per data-parallel bucket: each chunk's
    parameters, the tied embedding apart, are cut into flat buckets of at most this,
    filled from the last layer back, each reduced and (under ZeRO) sharded on its own
    (torch DDP's bucket_cap_mb, Megatron-LM's --ddp-bucket-size). A parameter larger
    than this is a bucket alone."""
    overlap_grad_reduce: bool = True
    """Start each bucket's data-parallel reduction inside its chunk's last backward, as
    soon as that backward has written all of the bucket's gradients, so the reduction
    runs while the backward computes the rest (DDP's and Megatron-LM's
    --overlap-grad-reduce); false: the chunk's buckets are reduced after its backward.
    Split backwards (zb-h1, zbv) reduce after the chunk's last W either way."""
    transport: str = "auto"
    """How tensors move between ranks: nccl (CUDA servers, through CuPy), gloo (CPU
    servers), or auto: nccl when the job's servers compute on GPUs, gloo otherwise. A job
    whose servers mix devices, or that forces a transport its servers cannot use, fails
    naming the setting."""
    elastic: bool = False
    """When the job loses servers and too few idle ones are registered to set its layout
    up again, go on at once with the largest smaller dp that they hold (tp and pp
    unchanged; microbatches grown so that dp*microbatches stays the same, and with it
    the rows, and so the activations, of a replica's microbatch; a step's samples do not
    depend on the layout) instead of waiting for replacements. Once enough servers are
    free again it grows back to this dp at its next checkpoint boundary (a multiple of
    checkpoint.every), from that checkpoint. Needs dp >= 2 and such a smaller layout
    within every rule (refused at submit otherwise)."""

    sequence_parallel: bool = False
    """Megatron-LM's sequence parallelism (Korthikanti et al. 2022) over the tensor
    group: norms and residual adds run on this rank's 1/tp of the sequence,
    column-parallel inputs are all-gathered along it and row-parallel outputs reduce-scattered
    (no all-reduce left in a block), so activations are divided by tp. Needs tp >= 2 and
    model.seq_len divisible by tp. Pipeline sends then carry each rank's own slice."""
    scatter_gather: bool = True
    """The PTD-P paper's scatter/gather (Narayanan et al. 2021, section 4.1): with tp >= 2
    and pp >= 2, each tensor rank sends only its 1/tp slice of an activation or gradient
    to the next stage, whose ranks all-gather it within their tensor group. Moves the
    same values (false: every rank sends the whole tensor, to compare)."""

    layers: tuple[int, ...] = ()
    """Layers of each chunk, in chunk order (pp*vpp counts summing to model.n_layers,
    each at least 1), to move layers away from a chunk whose embedding or head makes it
    the slowest; `--set parallel.layers=3,3,2`. Empty (default): as even as they divide,
    the first chunks taking the extra. `interleaf plan` weighs a split that evens out
    the head's cost."""
    plan: str = ""
    """"auto": `interleaf run` and `interleaf submit` choose dp, tp, pp, vpp, the schedule,
    microbatches, zero, sequence_parallel and layers here, and train.recompute, for the servers
    the job will run on (`interleaf plan`, docs/planning.md), print the choice and why,
    and submit that layout in place of the one given (which, where it breaks the rules,
    is set aside; `interleaf run` then needs --local N or a coordinator). "" (default):
    the layout is as given. A coordinator refuses
    "auto": it is planned before submitting."""

    def __post_init__(self):
        # each layout setting alone, as a plan that replaces the layout still checks it
        check_layout_values({name: getattr(self, name) for name in LAYOUT_VALUES})
        if self.plan not in ("", "auto"):
            raise ConfigError(f"parallel.plan={self.plan!r} must be \"auto\" or \"\" (the layout as given)")
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError(f"parallel.sequence_parallel=true needs parallel.tp>=2, not parallel.tp={self.tp}: it "
                              f"splits the sequence over the tensor-parallel ranks")
        _bounded("parallel", self)
        if self.world_size > limits.MAX_RANKS:
            raise ConfigError(f"parallel.dp*parallel.tp*parallel.pp={self.world_size} must be at most "
                              f"{limits.MAX_RANKS}: one stage server per rank")
        slots = self.pp * self.vpp * self.microbatches
        if slots > limits.MAX_PIPELINE_SLOTS:
            raise ConfigError(f"parallel.pp*parallel.vpp*parallel.microbatches={slots} must be at most "
                              f"{limits.MAX_PIPELINE_SLOTS}: the coordinator plans every forward and backward "
                              f"of a step")
        if self.schedule == "zbv" and self.vpp != 2:
            raise ConfigError(
                f"parallel.vpp={self.vpp} must be 2 for parallel.schedule='zbv': its V places "
                f"two chunks on each rank"
            )
        if self.vpp > 1 and self.schedule not in ("interleaved-1f1b", "zbv"):
            raise ConfigError(
                f"parallel.vpp={self.vpp} needs parallel.schedule='interleaved-1f1b' or 'zbv' "
                f"({self.schedule} runs one chunk per rank)"
            )
        if self.schedule == "interleaved-1f1b" and self.microbatches % self.pp:
            raise ConfigError(
                f"parallel.microbatches={self.microbatches} must be a multiple of "
                f"parallel.pp={self.pp} for interleaved-1f1b"
            )
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"parallel.transport={self.transport!r} must be one of {', '.join(TRANSPORTS)}")
        if not 0 <= self.zero_prefetch <= MAX_ZERO_PREFETCH:
            raise ConfigError(
                f"parallel.zero_prefetch={self.zero_prefetch} must be between 0 and {MAX_ZERO_PREFETCH}"
            )
        if not self.bucket_mb > 0:
            raise ConfigError(f"parallel.bucket_mb={self.bucket_mb} must be > 0 (MiB of gradient per "
                              f"data-parallel bucket)")
        if self.elastic:
            self._check_elastic()

    def _check_elastic(self) -> None:
        """An elastic job must have a smaller layout to go on with (coordinator/elastic.py):
        some dp' < dp dividing dp*microbatches whose dp*microbatches/dp' microbatches keep
        every rule. dp'=1 need not: at dp=2, microbatches=4096 it would run 8192, beyond
        the bound of common/limits.py."""
        if self.dp < 2:
            raise ConfigError(
                f"parallel.elastic=true needs parallel.dp>=2 (dp={self.dp} has no smaller "
                f"data-parallel degree to go on with)"
            )
        samples = self.dp * self.microbatches
        for dp in range(self.dp - 1, 0, -1):
            if samples % dp:
                continue
            try:
                dataclasses.replace(self, dp=dp, microbatches=samples // dp, elastic=False)
                return
            except ConfigError as err:
                why = err  # dp'=1, tried last, always divides: its rule is the one named
        raise ConfigError(
            f"parallel.elastic=true needs a smaller layout to go on with, and parallel.dp={self.dp} with "
            f"parallel.microbatches={self.microbatches} has none: every dp' < {self.dp} dividing "
            f"dp*microbatches={samples} breaks a rule (dp'=1: {why})"
        )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


LAYOUT_VALUES = ("dp", "tp", "pp", "vpp", "microbatches", "schedule", "zero")
"""The layout settings ParallelConfig checks alone through check_layout_values (a
chunk's layers are checked against the model's: JobConfig)."""


def check_layout_values(given: dict) -> None:
    """The layout settings a config gives (loading.given_settings: each of its
    field's type already), each on its own: what a plan that chooses the layout afresh
    (parallel.plan="auto", `interleaf plan`) still refuses, as ParallelConfig words it.
    A layout may break the rules between its settings and be planned anew (a schedule
    its pipeline cannot run); a setting no layout takes (parallel.schedule='zb-v',
    parallel.zero=7) is a mistake to mend, not a layout to replace."""
    for name in ("dp", "tp", "pp", "vpp", "microbatches"):
        if name in given and given[name] < 1:
            raise ConfigError(f"parallel.{name}={given[name]} must be at least 1")
        bound = limits.MAXIMA.get(f"parallel.{name}")
        if name in given and bound is not None and given[name] > bound:
            raise ConfigError(f"parallel.{name}={given[name]} must be at most {bound}")
    if "schedule" in given and given["schedule"] not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={given['schedule']!r} must be one of {', '.join(SCHEDULES)}")
    if "zero" in given and not 0 <= given["zero"] <= 3:
        raise ConfigError(f"parallel.zero={given['zero']} must be 0, 1, 2 or 3")
    if any(n < 1 for n in given.get("layers", ())):
        shown = ", ".join(map(str, given["layers"]))
        raise ConfigError(f"parallel.layers=[{shown}] must give every chunk at least 1 layer")
