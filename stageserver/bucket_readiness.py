"""Which of a chunk's gradient buckets a backward has finished, so that each bucket's
data-parallel reduction starts inside the backward, as soon as its gradients are final
(parallel.overlap_grad_reduce: DDP's and Megatron-LM's overlap), rather than after it.

Each parameter carries a post-accumulate-grad hook, registered once when the chunk is
built: adding and removing hooks every step would change what torch.compile's guards
see. A hook does nothing unless its chunk is `armed`: the executor arms a chunk around
the one backward after which the step program reduces it (its last B of the step; a
split backward's W writes gradients outside autograd, so such a chunk is reduced by the
program's action as before). Armed, each bucket counts down its parameters as autograd
writes their gradients, and at zero the bucket's gradient is final: `start(bucket)` runs,
while autograd goes on computing the buckets before it.

Autograd runs a leaf's AccumulateGrad once per backward, after summing every use of it
(the tied embedding's two, in a chunk with both ends), so the count reaches zero exactly
at the last write. A bucket the backward left unfinished (a parameter that got no
gradient) is reported by `armed` and reduced by the program's action, as is a bucket
given with no parameters (one over the cap: common/buckets.py's `starts_in_backward`).

Worked example: buckets [[proj, fc], [qkv], [wpe]] (the first is the last layers'); the
backward writes fc, proj (bucket 0 starts), qkv (bucket 1 starts), wpe (bucket 2 starts),
each start while autograd still computes what comes before it in the forward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

from torch import nn


class BucketReadiness:
    def __init__(self, buckets: list[list[nn.Parameter]]):
        self._sizes = [sum(1 for p in params if p.requires_grad) for params in buckets]
        self._remaining: list[int] = []
        self._start: Callable[[int], None] | None = None
        for index, params in enumerate(buckets):
            for param in params:
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(functools.partial(self._written, index))

    @contextlib.contextmanager
    def armed(self, start: Callable[[int], None]) -> Iterator[set[int]]:
        """Around the chunk's last backward of a step: `start(bucket)` as each bucket's
        gradients are all written. Yields the set of buckets started, complete on exit."""
        started: set[int] = set()

        def starting(index: int) -> None:
            started.add(index)
            start(index)

        self._remaining, self._start = list(self._sizes), starting
        try:
            yield started
        finally:
            self._remaining, self._start = [], None

    def _written(self, index: int, _param: nn.Parameter) -> None:
        if self._start is None:
            return
        self._remaining[index] -= 1
        if self._remaining[index] == 0:
            self._start(index)
