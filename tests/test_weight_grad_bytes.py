"""What a split backward's I keeps for its W, predicted (coordinator/activation_bytes.py's
weight_grad_bytes) against what the stage server's queue holds (stageserver/model/
weight_grads.py's WeightGrads.tensors, counted as the executor counts it: distinct
storages, parameters excluded) on a real ModelChunk fed by the real sampler: both
architectures, every chunk kind, every precision, tp 1 in-process and tp 2 on gloo,
sequence parallelism off and on, recompute none, selective (with blocks rerun whole)
and full.

Tolerance: none, equality to the byte, as tests/test_activation_bytes.py's: every kept
tensor's size is a function of the shapes and dtypes alone.
"""

from __future__ import annotations

import dataclasses

import torch
import pytest
from tests.gloo_world import run_world
from tests.test_activation_bytes import ALL_SHAPES, CASES, DTYPES, token_file  # noqa: F401 (a fixture)

from interleaf.coordinator.activation_bytes import weight_grad_bytes
from interleaf.stageserver.activation_meter import parameter_storages, storage_bytes
from interleaf.stageserver.data.corpus import resolve_source
from interleaf.stageserver.data.sampler import Sampler
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.model.weight_grads import WeightGrads
from interleaf.stageserver.transport import SoloTransport

RECOMPUTES = {
    "none": BlockRecompute(),
    "selective": BlockRecompute("selective"),
    "selective-2": BlockRecompute("selective", 2),  # the chunk's first block (layer 1) rerun whole
    "full": BlockRecompute(),  # the forward under no_grad, rerun with its graph by I, as the executor does
}


def _measure(tp, token_file: str, case: tuple, recompute: str, sequence_parallel: bool = False) -> int:
    """The bytes one I leaves queued for its W. The chunk holds layers 1.. so that
    selective-2 reruns its first block whole."""
    precision, emb, head, layers, name = case
    rows, config = ALL_SHAPES[name]
    config = dataclasses.replace(config, n_layers=1 + layers)
    dtype = DTYPES[precision]
    chunk = ModelChunk(config, range(1, 1 + layers), emb, head, tp, seed=5, sequence_parallel=sequence_parallel,
                       recompute=RECOMPUTES[recompute]).to(dtype)
    ids, targets = Sampler(resolve_source(token_file), 0, config.seq_len, rows).microbatch(0, 0)
    tokens = config.seq_len // tp.size if sequence_parallel else config.seq_len
    hidden = torch.randn(rows, tokens, config.d_model, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = ids if emb else hidden.requires_grad_()
    targets = targets if head else None
    call = (lambda: chunk(x, targets)) if head else (lambda: chunk(x))
    if recompute == "full":
        with torch.no_grad():
            call()
    weight_grads = WeightGrads()
    with weight_grads.recording():
        out = call()
    with weight_grads.deferred():
        out.backward(None if head else torch.ones_like(out))
    return storage_bytes(weight_grads.tensors(), parameter_storages(chunk))


def _predict(case: tuple, tp: int, sequence_parallel: bool = False) -> int:
    precision, emb, head, layers, name = case
    rows, config = ALL_SHAPES[name]
    return weight_grad_bytes(config, layers, emb, head, rows, tp, precision, sequence_parallel)


@pytest.mark.parametrize("case,recompute", [(case, "none") for case in CASES] + [
    (case, recompute) for recompute in ("selective", "selective-2", "full") for case in CASES[::3]],
    ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_prediction_equals_measurement(case, recompute, token_file):  # noqa: F811
    """Every case without recompute; a third of them, each architecture's chunk kinds and
    precisions among them, with each recompute mode."""
    assert _measure(SoloTransport(), token_file, case, recompute) == _predict(case, 1)


def _measure_all(rank: int, tp, token_file: str, cases: list, sequence_parallel: bool) -> list[int]:
    return [_measure(tp, token_file, case, recompute, sequence_parallel) for case, recompute in cases]


TP2_CASES = [
    (("bf16", True, True, 2, "gpt2-s8"), "none"),
    (("fp32", False, False, 1, "gpt2-s16"), "selective"),
    (("fp64", True, False, 2, "gpt2-untied-padded"), "full"),
    (("fp32", False, True, 2, "gpt2-untied-padded"), "selective-2"),
    (("bf16", True, True, 2, "llama-tied-padded"), "selective"),
    (("fp32", False, False, 2, "llama-gqa2-s12"), "none"),
    (("fp64", True, False, 1, "llama-gqa2-s12"), "selective-2"),
    (("bf16", False, True, 1, "llama-gqa2-s12"), "full"),
]
"""Sequences that split over tp=2 (sequence parallelism), every chunk kind and
precision, grouped-query attention with one key/value head per rank, untied and padded
heads, each recompute mode on each architecture."""


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_prediction_equals_measurement_tp2(token_file, sequence_parallel):  # noqa: F811
    for rank, measured in enumerate(run_world(_measure_all, 2, token_file, TP2_CASES, sequence_parallel)):
        for (case, recompute), got in zip(TP2_CASES, measured):
            assert got == _predict(case, 2, sequence_parallel), f"rank {rank}, case {case}, recompute {recompute}"
