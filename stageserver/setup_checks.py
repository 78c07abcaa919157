"""A SetupRequest checked whole before a stage server keeps anything of it.

The coordinator sends only requests it planned from a validated config, but a stage
server answers whoever holds the token: a request with a zero grid size, a rank outside
the grid or a model beyond the config's bounds (protos/limits.py) is refused with
JobRejected (INVALID_ARGUMENT), naming the field, the value and the rule, instead of
failing deep in the job (a division by zero) or allocating without end at Connect.
"""

from __future__ import annotations

import math

from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.limits import MAX_RANKS, MAX_TEXT_CHARS, MAXIMA, shown
from interleaf.stageserver.model.architectures import ARCHITECTURES

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
    for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
        _within(f"model.{name}", getattr(m, name), 1, MAXIMA[f"model.{name}"])
    if m.arch not in ("", *ARCHITECTURES):
        raise SetupError(f"model.arch={shown(m.arch)} must be one of {', '.join(ARCHITECTURES)}")
    for name in ("n_kv_heads", "ffn_hidden", "pad_vocab_to"):
        _within(f"model.{name}", getattr(m, name), 0, MAXIMA[f"model.{name}"])
    kv_heads, ffn = m.n_kv_heads or m.n_heads, m.ffn_hidden or 4 * m.d_model
    if m.d_model % m.n_heads or m.n_heads % kv_heads or (m.n_heads | kv_heads | ffn) % g.tp:
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
    last = g.pp * r.vpp
    for i, c in enumerate(r.chunks):
        _within(f"chunks[{i}].index", c.index, 0, last - 1)
        if not 0 <= c.first_layer < c.end_layer <= m.n_layers:
            raise SetupError(f"chunks[{i}] holds layers [{c.first_layer}, {c.end_layer}): must be a non-empty "
                             f"range within model.n_layers={m.n_layers}")
    for i, group in enumerate(r.groups):
        if len(group.name) > MAX_TEXT_CHARS or any(member >= world for member in group.members):
            raise SetupError(f"groups[{i}] ({shown(group.name)}) must name members below world_size={world}")
    for name in ("data_source", "init_from", "store_host", "store_prefix"):
        if len(getattr(r, name)) > MAX_TEXT_CHARS:
            raise SetupError(f"{name}={shown(getattr(r, name))} must be at most {MAX_TEXT_CHARS} characters")
    _within("store_port", r.store_port, 0, 65535)
    if not 0 < r.comm_timeout_s <= MAX_COMM_TIMEOUT_S:  # NaN fails too
        raise SetupError(f"comm_timeout_s={r.comm_timeout_s} must be more than 0 and at most {MAX_COMM_TIMEOUT_S}")
