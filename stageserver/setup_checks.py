"""A SetupRequest checked whole before a stage server keeps anything of it.

The coordinator sends only requests it planned from a validated config, but a stage
server answers whoever holds the token: a request with a zero grid size, a rank outside
the grid or a model beyond the config's bounds (common/limits.py) is refused with
JobRejected (INVALID_ARGUMENT), naming the field, the value and the rule, instead of
failing deep in the job (a division by zero) or allocating without end at Connect.
"""

from __future__ import annotations

import math

from interleaf.common.buckets import bucket_cap_bytes
from interleaf.common.limits import MAX_PIPELINE_SLOTS, MAX_RANKS, MAX_TEXT_CHARS, MAXIMA, shown
from interleaf.common.lr_schedule import DECAYS
from interleaf.common.model.architectures import ARCHITECTURES
from interleaf.protos import interleaf_pb2 as pb

MAX_JOB_ID_CHARS = 128
"""Job ids name spool folders and log lines; the coordinator's are job-N-NNNNN."""
MAX_COMM_TIMEOUT_S = 86400.0


class SetupError(ValueError):
    """A request no stage server could run; the message names the field, value and rule."""


def _within(name: str, value, low, high) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SetupError(f"{name}={value} must be a finite number")
    if not low <= value <= high:
        raise SetupError(f"{name}={value} must be between {low} and {high}")


def _check_optimizer(t: pb.TrainSpec) -> None:
    """AdamW's and the schedule's settings, as TrainConfig checks them (an unset eps or
    lr_decay is refused: the coordinator always sets them)."""
    for name in ("beta1", "beta2"):
        value = getattr(t, name)
        if not 0 <= value < 1:  # NaN fails too
            raise SetupError(f"train.{name}={value} must be at least 0 and less than 1")
    if not (math.isfinite(t.eps) and 0 < t.eps <= MAXIMA["train.eps"]):
        raise SetupError(f"train.eps={t.eps} must be more than 0 and at most {MAXIMA['train.eps']}")
    if t.lr_decay not in DECAYS:
        raise SetupError(f"train.lr_decay={shown(t.lr_decay)} must be one of {', '.join(DECAYS)}")
    _within("train.min_lr_ratio", t.min_lr_ratio, 0.0, 1.0)
    if not 0 < t.decay_fraction <= 1:
        raise SetupError(f"train.decay_fraction={t.decay_fraction} must be more than 0 and at most 1")


def check_setup(r: pb.SetupRequest) -> None:
    if not r.job_id or len(r.job_id) > MAX_JOB_ID_CHARS or not r.job_id.isprintable():
        raise SetupError(f"job_id={shown(r.job_id)} must be 1 to {MAX_JOB_ID_CHARS} printable characters")
    g, m, t = r.grid, r.model, r.train
    for axis in ("dp", "pp", "tp"):
        _within(f"grid.{axis}", getattr(g, axis), 1, MAXIMA[f"parallel.{axis}"])
    world = g.dp * g.pp * g.tp
    if r.world_size != world or world > MAX_RANKS:
        raise SetupError(f"world_size={r.world_size} must equal grid.dp*grid.pp*grid.tp={world} "
                         f"(at most {MAX_RANKS})")
    _within("rank", r.rank, 0, world - 1)
    for axis in ("dp", "pp", "tp"):
        _within(f"coordinates.{axis}", getattr(r.coordinates, axis), 0, getattr(g, axis) - 1)
    _within("vpp", r.vpp, 1, MAXIMA["parallel.vpp"])
    _within("bucket_bytes", r.bucket_bytes, 0, bucket_cap_bytes(MAXIMA["parallel.bucket_mb"]))
    for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
        _within(f"model.{name}", getattr(m, name), 1, MAXIMA[f"model.{name}"])
    if m.arch not in ("", *ARCHITECTURES):
        raise SetupError(f"model.arch={shown(m.arch)} must be one of {', '.join(ARCHITECTURES)}")
    for name in ("n_kv_heads", "ffn_hidden", "pad_vocab_to"):
        _within(f"model.{name}", getattr(m, name), 0, MAXIMA[f"model.{name}"])
    kv_heads, ffn = m.n_kv_heads or m.n_heads, m.ffn_hidden or 4 * m.d_model
    if m.d_model % m.n_heads or m.n_heads % kv_heads or any(n % g.tp for n in (m.n_heads, kv_heads, ffn)):
        raise SetupError(f"model.d_model={m.d_model}, model.n_heads={m.n_heads}, model.n_kv_heads={kv_heads} and "
                         f"model.ffn_hidden={ffn} must split: d_model by n_heads, n_heads by n_kv_heads, and "
                         f"n_heads, n_kv_heads and ffn_hidden by grid.tp={g.tp}")
    for name in ("norm_eps", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        _within(f"model.{name}", getattr(m, name), 0.0, MAXIMA[f"model.{name}"])
    _within("model.rope_original_positions", m.rope_original_positions, 0, MAXIMA["model.rope_original_positions"])
    low, high = m.rope_low_freq_factor or 1.0, m.rope_high_freq_factor or 4.0
    if m.rope_scaling_factor and not (m.rope_scaling_factor >= 1 and high > low):  # ModelConfig's rules
        raise SetupError(f"model.rope_scaling_factor={m.rope_scaling_factor} must be at least 1, and "
                         f"model.rope_high_freq_factor={high} greater than model.rope_low_freq_factor={low}")
    if r.sequence_parallel and (g.tp < 2 or m.seq_len % g.tp):
        raise SetupError(f"sequence_parallel needs grid.tp>=2 dividing model.seq_len={m.seq_len} "
                         f"(grid.tp={g.tp}): each tensor rank holds an equal slice of the sequence")
    _within("train.microbatches", t.microbatches, 1, MAXIMA["parallel.microbatches"])
    for name in ("steps", "global_batch"):
        _within(f"train.{name}", getattr(t, name), 1, MAXIMA[f"train.{name}"])
    if t.global_batch % (g.dp * t.microbatches):
        raise SetupError(f"train.global_batch={t.global_batch} must be divisible by "
                         f"grid.dp*train.microbatches={g.dp * t.microbatches}")
    # The data position is a resumed checkpoint's: never past the job's end, and never
    # more samples than the longest job consumes (the sampler counts them in int64).
    _within("train.data_start_step", t.data_start_step, 0, t.steps)
    _within("train.data_start_samples", t.data_start_samples, 0,
            MAXIMA["train.steps"] * MAXIMA["train.global_batch"])
    _within("train.warmup_steps", t.warmup_steps, 0, MAXIMA["train.warmup_steps"])
    if not (math.isfinite(t.lr) and t.lr > 0):
        raise SetupError(f"train.lr={t.lr} must be a finite number greater than 0")
    for name in ("weight_decay", "grad_clip"):
        _within(f"train.{name}", getattr(t, name), 0.0, MAXIMA[f"train.{name}"])
    _check_optimizer(t)
    _within("train.recompute_layers", t.recompute_layers, 0, MAXIMA["train.recompute_layers"])
    if t.recompute_layers and t.recompute != "selective":
        raise SetupError(f"train.recompute_layers={t.recompute_layers} needs train.recompute='selective', "
                         f"not {shown(t.recompute)}")
    last = g.pp * r.vpp
    for i, c in enumerate(r.chunks):
        _within(f"chunks[{i}].index", c.index, 0, last - 1)
        if not 0 <= c.first_layer < c.end_layer <= m.n_layers:
            raise SetupError(f"chunks[{i}] holds layers [{c.first_layer}, {c.end_layer}): must be a non-empty "
                             f"range within model.n_layers={m.n_layers}")
    for i, group in enumerate(r.groups):
        if len(group.name) > MAX_TEXT_CHARS or any(member >= world for member in group.members):
            raise SetupError(f"groups[{i}] ({shown(group.name)}) must name members below world_size={world}")
    _check_eval(r)
    for name in ("data_source", "init_from", "store_host", "store_prefix", "eval_source"):
        if len(getattr(r, name)) > MAX_TEXT_CHARS:
            raise SetupError(f"{name}={shown(getattr(r, name))} must be at most {MAX_TEXT_CHARS} characters")
    _within("store_port", r.store_port, 0, 65535)
    if not 0 < r.comm_timeout_s <= MAX_COMM_TIMEOUT_S:  # NaN fails too
        raise SetupError(f"comm_timeout_s={r.comm_timeout_s} must be more than 0 and at most {MAX_COMM_TIMEOUT_S}")


def _check_eval(r: pb.SetupRequest) -> None:
    """[eval], as EvalConfig and JobConfig check it: a job that evaluates has a program,
    and its samples fill whole microbatches of the training microbatch's rows; the
    held-out documents, which training skips whether or not the job evaluates, are the
    evaluated ones when there is no eval_source."""
    if not 0 <= r.held_out_fraction < 1:  # NaN fails too
        raise SetupError(f"held_out_fraction={r.held_out_fraction} must be at least 0 and below 1")
    if not r.eval_program:
        return
    t = r.train
    _within("eval_samples", r.eval_samples, 1, MAXIMA["eval.samples"])
    rows = t.global_batch // t.microbatches
    if r.eval_samples != r.eval_microbatches * rows:
        raise SetupError(f"eval_samples={r.eval_samples} must be eval_microbatches={r.eval_microbatches} "
                         f"microbatches of train.global_batch/train.microbatches={rows} rows")
    if r.grid.pp * r.vpp * r.eval_microbatches > MAX_PIPELINE_SLOTS:
        raise SetupError(f"eval_microbatches={r.eval_microbatches} makes more than {MAX_PIPELINE_SLOTS} forwards")
    if not r.eval_source and not 0 < r.eval_fraction < 1:  # NaN fails too
        raise SetupError(f"eval_fraction={r.eval_fraction} must be between 0 and 1 (exclusive) with no eval_source")
    if not r.eval_source and r.held_out_fraction != r.eval_fraction:
        raise SetupError(f"held_out_fraction={r.held_out_fraction} must equal eval_fraction={r.eval_fraction} with "
                         f"no eval_source: the held-out documents are the evaluated ones")
