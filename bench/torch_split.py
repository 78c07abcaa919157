"""Whether torch's zero-bubble split (pipelining/_backward.py) handles Interleaf's own
autograd Functions, in one process.

torch splits a stage's backward by walking its autograd graph: the input-gradient half
(stage_backward_input) runs autograd.grad to the stage's inputs, keeping the graph and
recording the output gradients of the "intermediate" nodes where a parameter's path
joins the input's; the weight-gradient half (stage_backward_weight) runs autograd.grad
from those nodes to the parameters. A node whose inputs include a parameter is such an
intermediate and runs in both halves: a built-in op computes only the gradients each
half asks for, but a custom autograd.Function's backward computes all of its gradients
every time it runs.

The check: a head chunk (final norm, tied head, Interleaf's fused _FusedLinearCrossEntropy)
behind the row-parallel matmul's Function (_LinearAllReduce, which tp>1 uses; here over
a group of one), backward fused (loss.backward()) and split (torch's two halves);
the gradients of both, and how many times each Function's backward ran.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import load_config
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.model import fused_loss, tensor_parallel
from interleaf.stageserver.transport import SoloTransport

SHAPE = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.vocab_size=256"]
FUNCTIONS = {"_FusedLinearCrossEntropy": fused_loss._FusedLinearCrossEntropy,
             "_LinearAllReduce": tensor_parallel._LinearAllReduce}


def _backward(split: bool, runs: dict[str, int]) -> tuple[list[torch.Tensor | None], dict]:
    chunk = ModelChunk(shape_of(load_config("", SHAPE).model), range(3, 4), False, True, SoloTransport(), seed=0)
    row = torch.nn.Parameter(torch.randn(32, 32, generator=torch.Generator().manual_seed(1)) / 32)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2)).requires_grad_()
    targets = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = chunk(tensor_parallel._LinearAllReduce.apply(x, row, SoloTransport()), targets)
    params = [*chunk.parameters(), row]
    before = dict(runs)
    if split:
        _, groups = stage_backward_input([loss], None, [x], iter(params))
        after_input = dict(runs)
        stage_backward_weight(iter(params), groups)
    else:
        loss.backward()
        after_input = dict(runs)
    counts = {name: {"input_half": after_input[name] - before[name], "weight_half": runs[name] - after_input[name]}
              for name in FUNCTIONS}
    return [x.grad, *(q.grad for q in params)], counts


def check() -> dict:
    """{"bitwise_equal": split gradients == fused, "fused": {Function: runs}, "split":
    {Function: {"input_half": runs, "weight_half": runs}}}."""
    runs = dict.fromkeys(FUNCTIONS, 0)

    def counting(name, backward):
        def wrapped(ctx, *grads):
            runs[name] += 1
            return backward(ctx, *grads)
        return staticmethod(wrapped)

    with contextlib.ExitStack() as patches:
        for name, fn in FUNCTIONS.items():
            patches.enter_context(mock.patch.object(fn, "backward", counting(name, fn.backward)))
        fused, fused_runs = _backward(False, runs)
        split, split_runs = _backward(True, runs)
    return {"bitwise_equal": all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(fused, split)),
            "fused": {name: c["input_half"] for name, c in fused_runs.items()}, "split": split_runs}


if __name__ == "__main__":
    print(check())
