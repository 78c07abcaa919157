"""What a step's input-gradient passes (I) leave for their weight-gradient passes (W),
and the bytes that keeps on the memory ledger's activation account from one to the
other (each method returns what the executor enters in the ledger).

After I, a (chunk, microbatch)'s activations are gone but for what its queued weight
gradients read (model/weight_grads.py): each parameter operation's input and output
gradient. Those are counted as the activation meter counts a forward's
(activation_meter.py): distinct storages, parameters' excluded, and a chunk's input
handed over locally by the previous chunk on this rank counted by that chunk - until
that chunk's own backward frees its activations; from then on the input is alive for
this W alone, and moves to its account (`previous_freed`).

Worked example, pp=1 with chunks 0 and 1 and the program F0.0 F1.0 I1.0 I0.0 W1.0 W0.0:
F0.0 counts chunk 0's activations, its output o among them; F1.0 chunk 1's, less o;
I1.0 frees chunk 1's and counts what W1.0 reads less o (chunk 0 still counts it);
I0.0 frees chunk 0's, o included, counts what W0.0 reads, and moves o (read by W1.0:
the first block's norm of chunk 1 reads it) to W1.0's account; W1.0 and W0.0 free
theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interleaf.stageserver.activation_meter import storage_bytes
from interleaf.stageserver.model.weight_grads import WeightGrads

Key = tuple[int, int]  # (chunk, microbatch)


@dataclass
class _Held:
    weight_grads: WeightGrads
    counted: int  # bytes on the activation account
    borrowed: int  # bytes of the local input it reads, still counted by the previous chunk


class DeferredGrads:
    def __init__(self):
        self._held: dict[Key, _Held] = {}

    def keep(self, key: Key, weight_grads: WeightGrads, exclude: frozenset[int],
             local_input: torch.Tensor | None = None) -> int:
        """After I: the bytes of `weight_grads`' tensors, but `exclude`'s storages (the
        chunk's parameters) and `local_input`'s (the previous chunk's output)."""
        tensors = weight_grads.tensors()
        borrowed = 0
        if local_input is not None:
            ptr = local_input.untyped_storage().data_ptr()
            exclude = exclude | {ptr}
            if any(t.untyped_storage().data_ptr() == ptr for t in tensors):
                borrowed = storage_bytes([local_input])
        counted = storage_bytes(tensors, exclude)
        self._held[key] = _Held(weight_grads, counted, borrowed)
        return counted

    def previous_freed(self, key: Key) -> int:
        """The chunk before `key`'s freed its activations (its B or I): the bytes of a
        local input that key's W still reads, counted here from now on."""
        held = self._held.get(key)
        if held is None or not held.borrowed:
            return 0
        moved, held.borrowed = held.borrowed, 0
        held.counted += moved
        return moved

    def queue(self, key: Key) -> WeightGrads:
        """What W runs (then `done`)."""
        if key not in self._held:
            raise RuntimeError(f"no I{key[0]}.{key[1]} ran before W{key[0]}.{key[1]}: there are no weight "
                               f"gradients to compute")
        return self._held[key].weight_grads

    def done(self, key: Key) -> int:
        """W has run: the bytes its queue held, gone."""
        return self._held.pop(key).counted

    def left(self) -> list[Key]:
        """I's whose W has not run (at a step's end: a program without them)."""
        return sorted(self._held)
