"""Forward collectives that selective recompute replays instead of issuing again.

A block under selective recompute (recompute.py) runs twice: in the forward, and again
in the backward, where torch's checkpoint reruns it to rebuild what its policy did not
keep. The tensor-parallel collectives inside it (tensor_parallel.py's all-reduce,
sequence_parallel.py's all-gather and reduce-scatter) go through our Transport, which
torch's dispatcher does not see, so no policy can keep their outputs. A Tape does: the
block's first run records each forward collective's output, in order; the rerun gets
them back in the same order and communicates nothing. The rerun computes the same bits
from the same inputs, so each replayed output is exactly what the collective would
return again, and the tensor group moves no more in a step than without recompute (as
in Megatron's selective recompute, which never reruns communication). The collectives of
the backward direction (the autograd Functions' backward methods) do not go through
here and run as always.

Each recorded output is held from the forward until the rerun hands it back, in place of
the copy torch's selective-checkpoint cache would have kept of the same matrix product
(the activation meter counts it, coordinator/activation_bytes.py predicts it). A recorded output that something later writes into in place would replay
the wrong values: the rerun refuses it (the same rule as torch's selective checkpoint
cache), as it refuses a collective the first run did not issue.

A recorded unit may hold the computation around its collective too (a row-parallel
matmul and its reduce; an all-gather and the column-parallel matmuls that read it): the
rerun skips all of it, so the first run hides it from the selective-checkpoint dispatch
mode, whose cache counts the ops it sees per call and would otherwise hand later ops
the wrong outputs. (They are hidden from every dispatch mode then: an operation counter
wrapped around a selectively recomputed block would not see the recorded matmuls.) What is recorded is then only what the block needed anyway, never the
unit's temporaries (the partial sum before a reduce, the gathered input).

Worked example, a gpt2 block at tp=2 without sequence parallelism: its forward records
two summed outputs, attention's proj and the MLP's down (matmul and all-reduce each),
[b, s, d] each; the rerun in the backward replays both and issues no collective and no
matmul for them; the backward's own all-reduces (the input gradients of qkv and up) run
as they do without recompute.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

_tape: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("collective_tape", default=None)


def replayable(collective: Callable[[], torch.Tensor]) -> torch.Tensor:
    """collective() - a forward collective, returning its output - or, inside a block's
    rerun, the output its first run recorded. Outside a recording block: collective()."""
    tape = _tape.get()
    return collective() if tape is None else tape.next(collective)


class Tape:
    """One block's forward collectives' outputs: recorded by its first run, handed back
    once each, in order, by the rerun, and all let go when the rerun ends."""

    def __init__(self):
        self._outputs: list[tuple[tuple[torch.Tensor, ...], tuple[int, ...], bool] | None] = []  # (detached outputs, versions, a tuple?)
        self._replaying = False
        self._cursor = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one run of the block: the first records, the later ones replay."""
        token = _tape.set(self)
        self._cursor = 0
        try:
            yield
        finally:
            _tape.reset(token)
            if self._replaying:  # torch's checkpoint reruns a block once, and may stop it early:
                self._outputs.clear()  # what it did not reach is not needed either
            self._replaying = True

    def next(self, collective: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not self._replaying:
            # Unseen by selective checkpointing's dispatch mode: the rerun skips these ops
            # (the matmul before a reduce, the gather before the matmuls), so neither the
            # policy's cache nor its per-op call counters may hold them.
            with _disable_current_modes():
                out = collective()
            # Detached: the tape must not hold the forward's graph through out's grad_fn.
            outs = out if isinstance(out, tuple) else (out,)
            self._outputs.append((tuple(t.detach() for t in outs), tuple(t._version for t in outs),
                                  isinstance(out, tuple)))
            return out
        index = self._cursor
        self._cursor += 1
        entry = self._outputs[index] if index < len(self._outputs) else None
        if entry is None:
            raise RuntimeError(f"forward collective {index} of a selectively recomputed block was not recorded by "
                               f"its first run (or was replayed already): the rerun must issue the same collectives")
        recorded, versions, is_tuple = entry
        if any(t._version != v for t, v in zip(recorded, versions)):
            raise RuntimeError(f"forward collective {index}'s recorded output was written in place after its first "
                               f"run: replaying it would not give the collective's output")
        self._outputs[index] = None  # handed back once: freed as soon as the rerun is done with it
        return recorded if is_tuple else recorded[0]

    def tensors(self) -> list[torch.Tensor]:
        """The outputs still held (the activation meter's view)."""
        return [t for entry in self._outputs if entry is not None for t in entry[0]]
