"""The smaller sections: [data], [checkpoint], [recovery], [trace]."""

from __future__ import annotations

from dataclasses import dataclass

from interleaf.coordinator.config.rules import ConfigError, _bounded


@dataclass(frozen=True)
class DataConfig:
    """[data]: what the job trains on (docs/data.md). A step's samples are a function of
    train.seed, the step, train.global_batch and the data alone."""

    source: str = "builtin"
    """'builtin' (the Python standard library's sources, tokenized by bytes and cached)
    or the path of a token file written by `interleaf data prepare`, readable on every
    stage server. Several files blend: `a.bin:0.7,b.bin:0.3` draws each sample from one
    of them in those proportions (weights: positive finite numbers, normalized),
    deterministically and resumably: each block of 65,536 samples takes each file's
    share, interleaved evenly, and each file walks its own epochs
    (common/data/blend.py)."""
    tokenizer: str = "bytes"
    """How text becomes tokens (for `interleaf generate` and the check that the data fits
    the model): 'bytes' (one token per UTF-8 byte, vocabulary 256), or the path of a
    tokenizers `tokenizer.json` or of a Hugging Face model folder holding one. A
    model.vocab_size smaller than its vocabulary is refused at submission."""

    def __post_init__(self):
        if not self.source.strip():
            raise ConfigError("data.source='' must be 'builtin' or a token file path")
        # The stage servers' own grammar of a blend.
        from interleaf.common.data.blend import parse_source

        try:
            parse_source(self.source)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if not self.tokenizer.strip():
            raise ConfigError("data.tokenizer='' must be 'bytes' or the path of a tokenizer.json or model folder")


@dataclass(frozen=True)
class CheckpointConfig:
    """[checkpoint]: saving, resuming and starting from given weights
    (docs/checkpoints.md, docs/huggingface.md)."""

    dir: str = ""
    """When set, checkpoints are written here, under `step-NNNNNN/` (per rank a
    safetensors state file, and a manifest.json written last), at the end and every
    `every` steps, on the coordinator's machine (servers that do
    not share its filesystem send their files over gRPC)."""
    every: int = 0
    """Save every this many steps as well as at the end (0: at the end only)."""
    keep: int = 0
    """Keep the newest this many checkpoints, removing older ones (0: keep all)."""
    resume: str = ""
    """A checkpoint to continue from (also `interleaf run --resume CKPT`; a manifest, a step folder, or a checkpoint.dir,
    whose newest complete step is taken), written under this or any other layout of the
    same model; training continues at its step with its optimizer state."""
    init: str = ""
    """Start this job (at step 0, with a fresh optimizer) from these weights: an
    Interleaf checkpoint (as for resume) or a Hugging Face model folder (config.json and
    safetensors) of LlamaForCausalLM or GPT2LMHeadModel. The job takes its `[model]`
    from them (a model value that contradicts them is refused) except seq_len (at most
    their positions) and pad_vocab_to. Readable at the same path by the coordinator and
    every stage server (coordinator/init_source.py)."""

    def __post_init__(self):
        _bounded("checkpoint", self)
        for key in ("every", "keep"):
            if getattr(self, key) < 0:
                raise ConfigError(f"checkpoint.{key}={getattr(self, key)} must be 0 or more")
        if self.every and not self.dir:
            raise ConfigError(f"checkpoint.every={self.every} needs checkpoint.dir")
        if self.init and self.resume:
            raise ConfigError(f"checkpoint.init={self.init!r} and checkpoint.resume={self.resume!r} exclude each "
                              f"other: init starts a new job at step 0 from given weights, resume continues one")


@dataclass(frozen=True)
class RecoveryConfig:
    """[recovery]: what a job does when it loses a stage server (docs/reliability.md)."""

    max_restarts: int = 3
    """When a stage server dies (its calls fail and it no longer answers), the job is
    set up again on registered servers, continues from its newest checkpoint (or the
    start) and may do so this many times; 0 fails the job at the first loss."""
    progress_timeout_s: float = 60.0
    """A job in which no rank finishes a step for this long (or for ten times the slowest
    step so far, when that is longer) is stuck: a server that then answers no call is
    lost (hung, or cut off) and the job recovers; otherwise it fails."""
    compile_timeout_s: float = 600.0
    """More time for an attempt's first step where a server compiles its blocks in it
    (train.compile): compiling takes from tens of seconds to minutes, once per attempt."""

    def __post_init__(self):
        _bounded("recovery", self)
        if self.max_restarts < 0:
            raise ConfigError(f"recovery.max_restarts={self.max_restarts} must be 0 or more")
        if not self.compile_timeout_s >= 0:
            raise ConfigError(f"recovery.compile_timeout_s={self.compile_timeout_s} must be 0 or more")
        if not self.progress_timeout_s > 0:
            raise ConfigError(f"recovery.progress_timeout_s={self.progress_timeout_s} must be more than 0")


MAX_TRACED_STEPS = 64
"""trace.steps: the coordinator keeps every traced step's timeline with the job."""
DEFAULT_TRACED = (1, -1)


@dataclass(frozen=True)
class TraceConfig:
    """[trace]: which steps every server times action by action, for `interleaf trace`
    and the status page, and what else it records over them (docs/monitoring.md)."""

    steps: tuple[int, ...] = DEFAULT_TRACED
    """Steps (from 0) whose every action each server times, for `interleaf trace`;
    negative ones count from the end (-1: the last step). The default, the second step
    (the first past warm-up; a one-step job has none) and the last, gives a running job
    a trace early on and a finished one its final step. An empty list (`trace.steps =
    []`) traces nothing; on the command line, `--set trace.steps=[0,-1]`. At most 64:
    the coordinator keeps them with the job in its state database, so a restarted
    coordinator still serves them. Untraced steps cost nothing; a traced one two clock
    reads per action, two CUDA events on a GPU (bench/observability_cost.py measures it)."""
    torch_profiler: bool = False
    """Also run torch's profiler (torch.profiler: operators, and CUDA kernels on a GPU)
    over each traced step on every server; `interleaf trace --out T.json` writes each
    rank's Chrome trace beside the action timeline. It slows the traced step itself
    (its action timeline too), never the others."""
    memory_snapshot: bool = False
    """On CUDA servers: record CUDA memory history (torch.cuda.memory._record_memory_history)
    over each traced step and keep each rank's snapshot, which `interleaf trace --out
    T.json` writes beside it as a pickle for pytorch.org/memory_viz. Refused for a job on
    CPU servers, which have no CUDA allocator to record."""

    def __post_init__(self):
        if (self.torch_profiler or self.memory_snapshot) and not self.steps:
            which = "torch_profiler" if self.torch_profiler else "memory_snapshot"
            raise ConfigError(f"trace.{which}=true profiles the traced steps, and trace.steps=[] traces none")
        if len(self.steps) > MAX_TRACED_STEPS:
            raise ConfigError(f"trace.steps holds {len(self.steps)} steps: at most {MAX_TRACED_STEPS} are traced")

    def resolved(self, total: int) -> frozenset[int]:
        """The traced step numbers of a job of `total` steps."""
        return frozenset(s if s >= 0 else total + s for s in self.steps if -total <= s < total)
