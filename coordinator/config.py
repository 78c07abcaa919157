"""A job's configuration: typed sections loaded from TOML, overridable with
`--set SECTION.KEY=VALUE`, and validated where it is built.

Every rule a user can break raises `ConfigError` with one line naming the field, the
value and the rule, e.g.
`parallel.microbatches=6 must be a multiple of parallel.pp=4 for interleaved-1f1b`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field

from interleaf.protos import limits
from interleaf.protos.limits import shown
from interleaf.stageserver.model.config import padded_vocab, resolve_defaults

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
TRANSPORTS = ("auto", "gloo", "nccl")
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}
"""Bytes per element of the compute dtype of each train.precision."""
MASTER_BYTES = {"fp32": 4, "bf16": 4, "fp64": 8}
"""Bytes per element of the master weights, Adam moments and gradient reductions."""
PRECISIONS = tuple(PRECISION_BYTES)
RECOMPUTE = ("none", "full")
MAX_ZERO_PREFETCH = 4


class ConfigError(ValueError):
    """An invalid job configuration; the message names the field, value and rule."""


class InitNotFound(ConfigError):
    """checkpoint.init names nothing this process sees: a client may not see the
    cluster's files, which the coordinator reads (coordinator/init_source.py)."""


def _positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 1:
            raise ConfigError(f"{section}.{name}={value} must be at least 1")


def _bounded(section: str, obj) -> None:
    """Every number finite and within its upper bound (protos/limits.py)."""
    why = limits.violation(section, obj)
    if why:
        raise ConfigError(why)


ARCHS = ("gpt2", "llama")
ROPE_SCALING = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_positions")
"""The fields of Llama 3's rotary scaling, which only llama with a scaling factor uses."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt2"
    """gpt2 (LayerNorm, GELU MLP, learned positions, biases) or llama (RMSNorm, SwiGLU
    MLP, rotary positions, grouped-query attention, no biases)."""
    n_layers: int = 4
    """Transformer blocks."""
    d_model: int = 128
    """Hidden size; must be divisible by n_heads."""
    n_heads: int = 4
    """Attention heads; divisible by parallel.tp (heads are split across tensor ranks)."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention, llama; 0: n_heads). Divides n_heads, and
    is divisible by parallel.tp: key/value heads are split across tensor ranks too."""
    ffn_hidden: int = 0
    """MLP hidden size; 0: the architecture's rule (gpt2 4·d_model; llama 8/3·d_model
    rounded up to a multiple of 256). Divisible by parallel.tp."""
    seq_len: int = 128
    """Tokens per training sample (gpt2: also the number of learned positions)."""
    vocab_size: int = 256
    """Token ids are in [0, vocab_size); the byte tokenizer needs 256."""
    pad_vocab_to: int = 128
    """The embedding and head are padded to a multiple of this times parallel.tp
    (Megatron's make-vocab-size-divisible-by), so any vocabulary splits over any tp;
    padded logits never enter the softmax, and checkpoints and exports hold the true
    vocabulary only."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm (gpt2) or RMSNorm (llama)."""
    rope_theta: float = 10000.0
    """Base of llama's rotary position embedding (gpt2 has learned positions)."""
    rope_scaling_factor: float = 0.0
    """Llama 3's rotary frequency scaling (Llama 3.1 and later; transformers' rope_type
    llama3), which stretches a model trained on rope_original_positions to a longer
    context: rotary wavelengths longer than rope_original_positions/rope_low_freq_factor
    are multiplied by this factor, those shorter than
    rope_original_positions/rope_high_freq_factor kept, those between blended. 0 (the
    default): no scaling; otherwise at least 1. Llama only; checkpoint.init reads it."""
    rope_low_freq_factor: float = 1.0
    """Llama 3 scaling: wavelengths above rope_original_positions/this are fully scaled.
    Greater than 0."""
    rope_high_freq_factor: float = 4.0
    """Llama 3 scaling: wavelengths below rope_original_positions/this are kept. Greater
    than rope_low_freq_factor."""
    rope_original_positions: int = 8192
    """Llama 3 scaling: the context the model was pretrained for before scaling
    (transformers' original_max_position_embeddings)."""
    tie_embeddings: bool | None = None
    """The output head reuses the input embedding's weights; default true for gpt2,
    false for llama."""

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ConfigError(f"model.arch={shown(self.arch)} must be one of {', '.join(ARCHS)}")
        _positive("model", self, "n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "pad_vocab_to",
                  "rope_original_positions")
        for name in ("n_kv_heads", "ffn_hidden"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be 0 (the default) or more")
        # Resolved here so everything downstream (the wire, checkpoints, the memory
        # model) sees one complete shape.
        resolve_defaults(self)
        _bounded("model", self)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}: "
                              f"each key/value head serves a group of query heads")
        if self.arch == "gpt2" and self.n_kv_heads != self.n_heads:
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} must equal model.n_heads={self.n_heads} "
                              f"for model.arch='gpt2' (grouped-query attention is llama's)")
        if self.arch == "llama" and self.head_dim % 2:
            raise ConfigError(f"model.d_model/model.n_heads={self.head_dim} must be even for model.arch='llama': "
                              f"rotary embeddings turn pairs of features")
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise ConfigError(f"model.norm_eps={self.norm_eps} and model.rope_theta={self.rope_theta} "
                              f"must be greater than 0")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        tuned = [f"model.{name}={getattr(self, name)}" for name in ROPE_SCALING
                 if getattr(self, name) != defaults[name]]
        if tuned and self.arch == "gpt2":
            raise ConfigError(f"{', '.join(tuned)} must be left out for model.arch='gpt2': they scale llama's "
                              f"rotary embedding, and gpt2 learns its positions")
        if tuned and not self.rope_scaling_factor:
            raise ConfigError(f"{', '.join(tuned)} must be left out while model.rope_scaling_factor=0 (no scaling): "
                              f"they tune the scaling")
        if self.rope_scaling_factor and self.rope_scaling_factor < 1:
            raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be 0 (no scaling) or at "
                              f"least 1 (Llama 3 slows long wavelengths down, never speeds them up)")
        if not self.rope_low_freq_factor > 0:
            raise ConfigError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} must be greater than 0")
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must be greater than "
                              f"model.rope_low_freq_factor={self.rope_low_freq_factor}: wavelengths between "
                              f"their bounds are blended")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab(self, tp)


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    """Data-parallel replicas; each takes its slice of every microbatch."""
    tp: int = 1
    """Tensor-parallel ranks per layer (Megatron-LM column/row split)."""
    pp: int = 2
    """Pipeline ranks."""
    vpp: int = 2
    """Model chunks per pipeline rank (interleaved 1F1B's virtual stages)."""
    schedule: str = "interleaved-1f1b"
    """One of gpipe, 1f1b, interleaved-1f1b."""
    microbatches: int = 4
    """Microbatches per step (gradient accumulation through the pipeline)."""
    zero: int = 0
    """ZeRO stage over the data-parallel group: 0 replicates everything (gradients
    all-reduced); 1 shards the optimizer state (fp32 master weights and Adam moments);
    2 also the gradients (reduce-scattered); 3 also the parameters (gathered before a
    chunk's forwards and backwards, released after). With dp=1 every stage runs and
    shards over the one rank, which holds everything, as stage 0 does."""
    zero_prefetch: int = 1
    """ZeRO-3: how many parameter gathers are issued ahead of the compute that needs
    them (0: each gather waits in front of its first use; 1: the next chunk's gather
    overlaps the current chunk's compute). Bounds the gathered chunks a rank holds at
    once to zero_prefetch + 1."""
    transport: str = "auto"
    """How tensors move between ranks: nccl (CUDA servers, through CuPy), gloo (CPU
    servers), or auto: nccl when the job's servers compute on GPUs, gloo otherwise."""
    elastic: bool = False
    """When the job loses servers and too few idle ones are registered to set its layout
    up again, go on at once with the largest smaller dp that they hold (tp and pp
    unchanged; microbatches grown so that dp*microbatches stays the same, and with it
    the rows, and so the activations, of a replica's microbatch; a step's samples do not
    depend on the layout) instead of waiting for replacements. Needs dp >= 2 and such a
    smaller layout within every rule (refused at submit otherwise)."""

    def __post_init__(self):
        _positive("parallel", self, "dp", "tp", "pp", "vpp", "microbatches")
        _bounded("parallel", self)
        if self.world_size > limits.MAX_RANKS:
            raise ConfigError(f"parallel.dp*parallel.tp*parallel.pp={self.world_size} must be at most "
                              f"{limits.MAX_RANKS}: one stage server per rank")
        slots = self.pp * self.vpp * self.microbatches
        if slots > limits.MAX_PIPELINE_SLOTS:
            raise ConfigError(f"parallel.pp*parallel.vpp*parallel.microbatches={slots} must be at most "
                              f"{limits.MAX_PIPELINE_SLOTS}: the coordinator plans every forward and backward "
                              f"of a step")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"parallel.schedule={self.schedule!r} must be one of {', '.join(SCHEDULES)}"
            )
        if self.vpp > 1 and self.schedule != "interleaved-1f1b":
            raise ConfigError(
                f"parallel.vpp={self.vpp} needs parallel.schedule='interleaved-1f1b' "
                f"({self.schedule} runs one chunk per rank)"
            )
        if self.schedule == "interleaved-1f1b" and self.microbatches % self.pp:
            raise ConfigError(
                f"parallel.microbatches={self.microbatches} must be a multiple of "
                f"parallel.pp={self.pp} for interleaved-1f1b"
            )
        if not 0 <= self.zero <= 3:
            raise ConfigError(f"parallel.zero={self.zero} must be 0, 1, 2 or 3")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"parallel.transport={self.transport!r} must be one of {', '.join(TRANSPORTS)}")
        if not 0 <= self.zero_prefetch <= MAX_ZERO_PREFETCH:
            raise ConfigError(
                f"parallel.zero_prefetch={self.zero_prefetch} must be between 0 and {MAX_ZERO_PREFETCH}"
            )
        if self.elastic:
            self._check_elastic()

    def _check_elastic(self) -> None:
        """An elastic job must have a smaller layout to go on with (coordinator/elastic.py):
        some dp' < dp dividing dp*microbatches whose dp*microbatches/dp' microbatches keep
        every rule. dp'=1 need not: at dp=2, microbatches=4096 it would run 8192, beyond
        the bound of protos/limits.py."""
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


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Samples per step over all replicas; divisible by parallel.dp * parallel.microbatches."""
    lr: float = 3e-3
    """Peak learning rate (AdamW, betas 0.9/0.95)."""
    warmup_steps: int = 20
    """Linear warmup steps; then cosine decay to lr/10 at the last step."""
    weight_decay: float = 0.1
    """Decoupled weight decay on weights and embeddings (not biases or norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all ranks) to this; 0 turns clipping off."""
    seed: int = 1234
    """Seeds the initial weights and the sample order."""
    precision: str = "fp32"
    """fp32; bf16 (bf16 parameters, activations and gradients for compute, fp32 master
    weights, Adam moments and gradient reductions, softmax and loss in fp32); or fp64
    (everything float64: the verification mode, with no rounding noise to hide a bug)."""
    recompute: str = "none"
    """none, or full: a chunk keeps only its input after a forward and recomputes its
    activations in the backward (less activation memory for a second forward)."""

    def __post_init__(self):
        _positive("train", self, "steps", "global_batch")
        _bounded("train", self)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"train.recompute={self.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr} must be greater than 0")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must not be negative")


@dataclass(frozen=True)
class DataConfig:
    source: str = "builtin"
    """'builtin' (the Python standard library's sources, tokenized by bytes and cached)
    or the path of a token file written by `interleaf data prepare`, readable on every
    stage server. Several files blend: `a.bin:0.7,b.bin:0.3` draws each sample from one
    of them in those proportions (weights: positive finite numbers, normalized),
    deterministically and resumably (stageserver/data/blend.py)."""
    tokenizer: str = "bytes"
    """How text becomes tokens (for `interleaf generate` and the check that the data fits
    the model): 'bytes' (one token per UTF-8 byte, vocabulary 256), or the path of a
    tokenizers `tokenizer.json` or of a Hugging Face model folder holding one."""

    def __post_init__(self):
        if not self.source.strip():
            raise ConfigError("data.source='' must be 'builtin' or a token file path")
        # The stage servers' own grammar of a blend.
        from interleaf.stageserver.data.blend import parse_source

        try:
            parse_source(self.source)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if not self.tokenizer.strip():
            raise ConfigError("data.tokenizer='' must be 'bytes' or the path of a tokenizer.json or model folder")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""
    """When set, checkpoints are written here (per rank a state file, and a manifest),
    at the end and every `every` steps, on the coordinator's machine (servers that do
    not share its filesystem send their files over gRPC)."""
    every: int = 0
    """Save every this many steps as well as at the end (0: at the end only)."""
    keep: int = 0
    """Keep the newest this many checkpoints, removing older ones (0: keep all)."""
    resume: str = ""
    """A checkpoint to continue from (a manifest, a step folder, or a checkpoint.dir,
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
    max_restarts: int = 3
    """When a stage server dies (its calls fail and it no longer answers), the job is
    set up again on registered servers, continues from its newest checkpoint (or the
    start) and may do so this many times; 0 fails the job at the first loss."""
    progress_timeout_s: float = 60.0
    """A job in which no rank finishes a step for this long (or for ten times the slowest
    step so far, when that is longer) is stuck: a server that then answers no call is
    lost (hung, or cut off) and the job recovers; otherwise it fails."""

    def __post_init__(self):
        _bounded("recovery", self)
        if self.max_restarts < 0:
            raise ConfigError(f"recovery.max_restarts={self.max_restarts} must be 0 or more")
        if not self.progress_timeout_s > 0:
            raise ConfigError(f"recovery.progress_timeout_s={self.progress_timeout_s} must be more than 0")


MAX_TRACED_STEPS = 64
"""trace.steps: the coordinator keeps every traced step's timeline with the job."""
DEFAULT_TRACED = (1, -1)


@dataclass(frozen=True)
class TraceConfig:
    steps: tuple[int, ...] = DEFAULT_TRACED
    """Steps (from 0) whose every action each server times, for `interleaf trace`;
    negative ones count from the end (-1: the last step). The default, the second step
    (the first past warm-up; a one-step job has none) and the last, gives a running job
    a trace early on and a finished one its final step. An empty list (`trace.steps =
    []`) traces nothing. Untraced steps cost nothing; a traced one two clock reads per
    action (bench/observability_cost.py measures it)."""

    def __post_init__(self):
        if len(self.steps) > MAX_TRACED_STEPS:
            raise ConfigError(f"trace.steps holds {len(self.steps)} steps: at most {MAX_TRACED_STEPS} are traced")

    def resolved(self, total: int) -> frozenset[int]:
        """The traced step numbers of a job of `total` steps."""
        return frozenset(s if s >= 0 else total + s for s in self.steps if -total <= s < total)


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)

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
        if m.n_heads % p.tp:
            raise ConfigError(
                f"model.n_heads={m.n_heads} must be divisible by parallel.tp={p.tp}"
            )
        if m.n_kv_heads % p.tp:
            raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must be divisible by parallel.tp={p.tp}: "
                              f"key/value heads are split across tensor ranks")
        if m.ffn_hidden % p.tp:
            raise ConfigError(f"model.ffn_hidden={m.ffn_hidden} must be divisible by parallel.tp={p.tp}")
        if t.global_batch % (p.dp * p.microbatches):
            raise ConfigError(
                f"train.global_batch={t.global_batch} must be divisible by "
                f"parallel.dp*parallel.microbatches={p.dp * p.microbatches}"
            )


_SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "recovery": RecoveryConfig,
    "trace": TraceConfig,
}


def _convert(section: str, key: str, kind: type, value):
    """Coerces a TOML or command-line value to the field's type, or says why not."""
    where = f"{section}.{key}={shown(value)}"
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        return value
    if kind is tuple:  # of ints: a TOML array, or on the command line [1, -1] or 1,-1
        items = value if isinstance(value, list) else None
        if items is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise ConfigError(f"{where} must be a list of whole numbers, e.g. [1, -1]")
        return tuple(items)
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be {kind.__name__}, not a boolean")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        if kind is str:
            if not isinstance(value, str):
                raise ValueError
            if len(value) > limits.MAX_TEXT_CHARS:
                raise ConfigError(f"{where} must be at most {limits.MAX_TEXT_CHARS} characters")
            if "\0" in value:
                raise ConfigError(f"{where} must not contain a NUL character")
            return value
    except (ValueError, TypeError, OverflowError) as err:  # a table, an array, a date; inf
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where} must be {kind.__name__}") from None
    raise ConfigError(f"{where}: unsupported field type {kind}")


def _field_types(cls) -> dict[str, type]:
    hints = {"int": int, "float": float, "str": str, "bool": bool, "bool | None": bool, "tuple[int, ...]": tuple}
    return {f.name: hints[f.type] for f in dataclasses.fields(cls)}


def build_config(raw: dict, overrides: list[str] = ()) -> JobConfig:
    """Builds and validates a JobConfig from parsed TOML and SECTION.KEY=VALUE overrides.
    With checkpoint.init, `[model]` is taken from those weights (coordinator/init_source.py)."""
    values: dict[str, dict] = {name: {} for name in _SECTION_TYPES}
    for section, table in raw.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(f"unknown section [{_name(section)}] (known: {', '.join(_SECTION_TYPES)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{section}={shown(table)} must be a table [{section}]")
        for key, value in table.items():
            values[section][key] = (value, False)
    for item in overrides:
        path, sep, text = item.partition("=")
        section, dot, key = path.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set {shown(item)} must look like SECTION.KEY=VALUE")
        if section not in _SECTION_TYPES:
            raise ConfigError(f"--set {shown(item)}: unknown section [{_name(section)}] "
                              f"(known: {', '.join(_SECTION_TYPES)})")
        values[section][key.strip()] = (text.strip(), True)

    given = {section: _typed(section, cls, values[section]) for section, cls in _SECTION_TYPES.items()}
    checkpoint = CheckpointConfig(**given["checkpoint"])
    if checkpoint.init:
        # Imported here: it reads the weights' config through stage-server code, which loads torch.
        from interleaf.coordinator.init_source import read_source, take_model

        source = read_source(checkpoint.init)
        given["model"] = take_model(given["model"], checkpoint.init, source)
        given["checkpoint"]["init"] = source.location
    return JobConfig(**{section: cls(**given[section]) for section, cls in _SECTION_TYPES.items()})


def _typed(section: str, cls, values: dict[str, tuple]) -> dict:
    """A section's given values, (value, from the command line) each, as its fields' types."""
    types = _field_types(cls)
    kwargs = {}
    for key, (value, from_text) in values.items():
        if key not in types:
            raise ConfigError(
                f"unknown key {section}.{_name(key)} (known: {', '.join(types)})"
            )
        if from_text and types[key] is bool:
            value = {"true": True, "false": False}.get(value.lower(), value)
        elif from_text and types[key] is tuple:
            value = _list_from_text(value)
        elif from_text and types[key] is not str:
            value = _number_from_text(section, key, value)
        kwargs[key] = _convert(section, key, types[key], value)
    return kwargs


def _number_from_text(section: str, key: str, text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text  # _convert names the expected type


def _list_from_text(text: str):
    """`[1, -1]` (TOML's form) or `1,-1` as a list, or the text unchanged when it is
    neither (_convert names the expected type)."""
    try:
        return tomllib.loads(f"v = {text if text.startswith('[') else f'[{text}]'}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def _name(text: str) -> str:
    """A section or key name as an error shows it: as written when short and printable."""
    return text if len(text) <= 64 and text.isprintable() else shown(text)


def load_config(toml_text: str = "", overrides: list[str] = ()) -> JobConfig:
    try:
        raw = tomllib.loads(toml_text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config is not valid TOML: {err}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError("config nests arrays or inline tables too deeply to be a job config") from None
    return build_config(raw, overrides)
