"""The backward split into I and W (stageserver/model/weight_grads.py) against the fused
backward B, on real chunks: both architectures, tied and untied embeddings, tp=1
in-process and tp=2 on gloo with and without sequence parallelism, every recompute mode
that runs inside a chunk (none, selective, whole blocks; full recompute is the executor's
rerun, tests/test_split_executor.py), fp32, fp64 and bf16, and three kinds of chunk: the
whole model (embedding and head), a middle one and a last one (head only).

Each case runs B, then the same forward again with I and W apart, and checks:
  - after I alone, no parameter has a gradient but the head's (the final norm's and the
    output matmul's, computed in I so that the logits' gradient does not wait for W):
    every other operation that reads a parameter is split-aware (one that is not would
    write its gradient in I, and this fails);
  - I's input gradient equals B's;
  - W computes from what I left, never from a parameter's values: every parameter is
    overwritten with NaN between I and W, and W's gradients equal B's all the same.
Tolerance, relative to the largest element: fp64 1e-12, fp32 1e-6, bf16 2^-8 (measured:
equal to the bit, as I and W run B's operations on the same tensors, in the same order).
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from tests.gloo_world import run_world

from interleaf.common.model.config import ModelShape
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.model.weight_grads import WeightGrads
from interleaf.stageserver.transport import SoloTransport

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-6, "fp64": 1e-12, "bf16": 2**-8}
ROWS = 2


def _model(arch: str, tied: bool) -> ModelShape:
    if arch == "gpt2":
        return ModelShape(n_layers=3, d_model=32, n_heads=4, seq_len=8, vocab_size=64, tie_embeddings=tied)
    # Grouped-query attention and a vocabulary that padding splits (100 to 104, 112 at tp=2).
    return ModelShape(n_layers=3, d_model=32, n_heads=4, seq_len=8, vocab_size=100, arch="llama", n_kv_heads=2,
                      ffn_hidden=48, pad_vocab_to=8, tie_embeddings=tied)


CHUNKS = {"whole": (range(3), True, True), "middle": (range(1, 2), False, False), "last": (range(2, 3), False, True)}
RECOMPUTE = {"none": BlockRecompute(), "selective": BlockRecompute("selective"),
             "blocks": BlockRecompute("selective", 1)}  # every block rerun whole


def _cases(tp: int) -> list[tuple]:
    sp = (False, True) if tp > 1 else (False,)
    return list(itertools.product(("gpt2", "llama"), (True, False), sp, RECOMPUTE, DTYPES, CHUNKS))


def _case_id(case: tuple) -> str:
    arch, tied, sp, recompute, precision, kind = case
    return "-".join([arch, "tied" if tied else "untied", *(["sp"] if sp else []), recompute, precision, kind])


def _rel(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return float("inf")
    scale = want.abs().max().item() or 1.0
    return (got - want).abs().max().item() / scale


def _check(tp, case: tuple) -> list[str]:
    """The failures of one case, as sentences (none: it passed)."""
    arch, tied, sp, recompute, precision, kind = case
    config, dtype = _model(arch, tied), DTYPES[precision]
    layers, emb, head = CHUNKS[kind]
    chunk = ModelChunk(config, layers, emb, head, tp, seed=5, sequence_parallel=sp,
                       recompute=RECOMPUTE[recompute]).to(dtype)
    g = torch.Generator().manual_seed(3)  # the same on every tensor rank: any input is one
    ids = torch.randint(0, config.vocab_size, (ROWS, config.seq_len), generator=g)
    targets = torch.randint(0, config.vocab_size, (ROWS, config.seq_len), generator=g)
    tokens = config.seq_len // tp.size if sp else config.seq_len
    hidden = torch.randn(ROWS, tokens, config.d_model, generator=g, dtype=dtype)
    out_grad = torch.randn(ROWS, tokens, config.d_model, generator=g, dtype=dtype)

    def backward(weight_grads: WeightGrads | None) -> torch.Tensor | None:
        """B, or with a WeightGrads I: the input gradient (None for token ids)."""
        x = ids if emb else hidden.clone().requires_grad_()
        with weight_grads.recording() if weight_grads is not None else contextlib.nullcontext():
            out = chunk(x, targets) if head else chunk(x)
        with weight_grads.deferred() if weight_grads is not None else contextlib.nullcontext():
            out.backward(None if head else out_grad)
        return None if emb else x.grad

    fused_input = backward(None)
    fused = {}
    for name, p in chunk.named_parameters():
        assert p.grad is not None, f"B left {name} without a gradient"
        fused[name] = p.grad.clone()
    chunk.zero_grad(set_to_none=True)
    weight_grads = WeightGrads()
    split_input = backward(weight_grads)
    # The head's (final norm, output matmul) are computed in I on purpose (weight_grads.at_once).
    tied_head = head and chunk.config.tie_embeddings
    at_once = {name for name in fused if head and name.startswith(("ln_f.", "lm_head.")) or tied_head and name == "wte.weight"}
    failures = [f"{name} has a gradient after I: its operation is not split-aware"
                for name, p in chunk.named_parameters() if p.grad is not None and name not in at_once]
    failures += [f"{name} has no gradient after I, though the head's are computed at once"
                 for name, p in chunk.named_parameters() if p.grad is None and name in at_once]
    if not emb and _rel(split_input, fused_input) > TOL[precision]:
        failures.append(f"I's input gradient differs from B's by {_rel(split_input, fused_input):.3g}")
    with torch.no_grad():
        for p in chunk.parameters():
            p.fill_(float("nan"))  # W must not read them
    weight_grads.run()
    for name, p in chunk.named_parameters():
        if _rel(p.grad, fused[name]) > TOL[precision]:
            failures.append(f"W's gradient of {name} differs from B's by {_rel(p.grad, fused[name]):.3g}")
    if weight_grads.tensors():
        failures.append("W left tensors queued")
    return failures


@pytest.mark.parametrize("case", _cases(1), ids=_case_id)
def test_split_equals_fused_tp1(case):
    assert _check(SoloTransport(), case) == []


def _check_all(rank: int, tp, cases: list[tuple]) -> dict[str, list[str]]:
    return {_case_id(case): _check(tp, case) for case in cases}


@pytest.fixture(scope="module")
def tp2_results() -> list[dict[str, list[str]]]:
    """Every tp=2 case in one gloo world (spawning is the slow part)."""
    return run_world(_check_all, 2, _cases(2))


@pytest.mark.parametrize("case", _cases(2), ids=_case_id)
def test_split_equals_fused_tp2(case, tp2_results):
    for rank, results in enumerate(tp2_results):
        assert results[_case_id(case)] == [], f"rank {rank}"
