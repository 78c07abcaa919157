"""Which blocks of a chunk recompute what (train.recompute, train.recompute_layers), as
the stage servers run them (stageserver/model/recompute.py) and the coordinator's memory
model counts them (coordinator/activation_bytes.py).

recompute_layers = K (with selective): torchtitan's layer-wise option instead of the
operator-level one. The blocks whose global index i has (i + 1) % K == 0 keep only their
input and rerun whole in the backward; the others keep everything, as without recompute.

Worked example, 6 layers: selective recomputes part of every block; selective with
recompute_layers=2 reruns blocks 1, 3 and 5 whole and none of 0, 2 and 4; with
recompute_layers=1 every block whole (full recompute, block by block).
"""

from __future__ import annotations

MODES = ("none", "selective", "full")
"""train.recompute: none; selective (inside every block, or whole blocks with
recompute_layers); full (the whole chunk, rerun by the executor)."""


def block_modes(layers: range, recompute: str, recompute_layers: int = 0) -> list[str]:
    """How each block of `layers` (global indices) is run: "none", "selective" or
    "full" (kept input only). train.recompute=full reruns the whole chunk instead, so its
    blocks run plainly inside that rerun."""
    if recompute != "selective":
        return ["none"] * len(layers)
    if not recompute_layers:
        return ["selective"] * len(layers)
    return ["full" if (i + 1) % recompute_layers == 0 else "none" for i in layers]
