"""Upper bounds on every value a job's config may hold: the coordinator refuses a config
beyond them (coordinator/config.py) and a stage server a SetupRequest (stageserver/setup_checks.py).

Each bound is far above anything a real run on today's machines uses (the largest
published runs: ~120 layers, d_model 25,600, 128k-token contexts, vocabularies of
~256k, thousands of GPUs, ~1M steps), and low enough that a typo (`steps=1e12`,
`d_model=10**9`) is refused when the job is submitted, naming the field, the value and
the bound, rather than overflowing a wire field, planning for minutes or allocating
until the machine gives out. Floats must be finite everywhere.

The memory admission (coordinator/admission.py) refuses what fits these bounds but
not the servers' memory; these bounds hold whether or not servers are registered yet.
"""

from __future__ import annotations

import dataclasses
import math

MAXIMA = {
    "model.n_layers": 1024,
    "model.d_model": 65536,
    "model.n_heads": 1024,
    "model.seq_len": 1 << 20,
    "model.vocab_size": 1 << 24,  # token files hold uint16 or uint32 ids
    "model.n_kv_heads": 1024,
    "model.ffn_hidden": 1 << 20,
    "model.pad_vocab_to": 1 << 16,
    "model.norm_eps": 1.0,
    "model.rope_theta": 1e12,
    "model.rope_scaling_factor": 1e6,  # Llama 3.1 stretches 8k positions by 8, 3.2 by 32
    "model.rope_low_freq_factor": 1e6,
    "model.rope_high_freq_factor": 1e6,
    "model.rope_original_positions": 1 << 20,  # a context trained before: at most model.seq_len's bound
    "parallel.dp": 4096,
    "parallel.tp": 256,
    "parallel.pp": 1024,
    "parallel.vpp": 64,
    "parallel.microbatches": 4096,
    "parallel.bucket_mb": float(1 << 20),  # a TiB: more than any chunk's gradient
    "train.steps": 10_000_000,
    "train.global_batch": 1 << 20,
    "train.warmup_steps": 10_000_000,
    "train.weight_decay": 10.0,
    "train.grad_clip": 1e6,
    "train.eps": 1.0,
    "train.min_lr_ratio": 1.0,
    "train.decay_fraction": 1.0,
    "train.recompute_layers": 1024,  # model.n_layers' bound
    "train.seed": 2**64 - 1,  # the wire's uint64
    "checkpoint.every": 10_000_000,
    "checkpoint.keep": 1_000_000,
    "recovery.max_restarts": 1000,
    "eval.every": 10_000_000,  # train.steps' bound
    "eval.samples": 1 << 20,  # train.global_batch's bound
    "recovery.progress_timeout_s": 86400.0,
    "recovery.compile_timeout_s": 86400.0,
}
"""Inclusive upper bounds by field. train.lr has none beyond being finite: a huge rate is
how the tests make a loss non-finite on purpose."""

MAX_RANKS = 65536
"""parallel.dp*parallel.tp*parallel.pp: the stage servers a job needs."""
MAX_PIPELINE_SLOTS = 16384
"""parallel.pp*parallel.vpp*parallel.microbatches: the forwards (and as many backwards)
of one step over all pipeline ranks, which the coordinator plans and simulates when a
job is submitted (about 5 s at this bound)."""
MAX_TEXT_CHARS = 4096
"""Any string value (a path: PATH_MAX on Linux)."""
MAX_SERVER_MEMORY_BYTES = 1 << 50
"""`interleaf plan --server-memory`: 1 PiB, thousands of times today's largest
accelerator (141 GB) or host; a figure beyond it is a typo (an extra digit group)."""


def violation(section: str, obj) -> str | None:
    """The first bound the section's values break, as one line naming field, value and
    rule; None when every value is within bounds."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{section}.{f.name}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name}={value} must be a finite number"
        bound = MAXIMA.get(name)
        if bound is not None and value > bound:
            return f"{name}={value} must be at most {bound}"
    return None


def shown(value, limit: int = 64) -> str:
    """`repr(value)`, shortened to about `limit` characters: an error message echoes what
    it refuses, and must stay one readable line (gRPC carries it in a trailer of 8 KiB)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:limit - 16]}...{size}"
