"""What every parameter is, independent of layout: its unsharded shape, how tensor
ranks split it, and which rows of a padded table hold real tokens. The coordinator's
memory model and FLOP count read these as the stage servers build from them; the
initial values are the servers' (stageserver/model/params.py).
"""

from __future__ import annotations

from dataclasses import dataclass

TIED = "wte.weight"
"""The input embedding, which doubles as the output head when the model ties them."""
HEAD = "lm_head.weight"
"""The output head of a model with untied embeddings."""

Shapes = dict[str, tuple[tuple[int, ...], int | None]]
"""Parameters by name: (unsharded shape, the dimension tp ranks split it along or None),
as an architecture declares its block and norm without building them."""


@dataclass(frozen=True)
class ParamSpec:
    full_shape: tuple[int, ...]
    """Shape of the unsharded tensor: the true vocabulary for the embedding and head."""
    tp_dim: int | None
    """Dimension the (padded) full tensor is split along across tp ranks (rank t holds
    full.chunk(tp, dim=tp_dim)[t]); None when every rank holds all of it."""
    weight_decay: bool
    """True for matrices and embeddings; biases and norm parameters are not decayed."""
    tied: bool
    """True for the embedding shared with the output head (a copy on the first and last
    pipeline stage whose gradients the pipeline sums)."""
    padded_rows: int | None = None
    """The embedding and head: rows of the padded table (dim 0) that tp ranks split;
    rows from full_shape[0] on are zeros that no token looks up and no logit scores."""


def true_rows(spec: ParamSpec, tp_rank: int, tp_size: int) -> int | None:
    """Of this rank's local rows of a padded table, how many hold real tokens (the rest
    are padding); None for a parameter that is not padded."""
    if spec.padded_rows is None:
        return None
    local = spec.padded_rows // tp_size
    return max(0, min(local, spec.full_shape[0] - tp_rank * local))
