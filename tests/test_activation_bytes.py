"""The coordinator's predicted activation bytes (coordinator/activation_bytes.py) against
what a stage server measures (stageserver/activation_meter.py) on a real ModelChunk fed by
the real sampler, for both recompute modes, at tp=1 in-process and tp=2 on gloo.

Tolerance: none, equality to the byte. Every kept tensor's size is a function of the
shapes and dtypes alone (no kernel chooses a layout from the data), so any difference is
a term the formula gets wrong.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np
import pytest
import torch
from gloo_world import run_world

from interleaf.coordinator.activation_bytes import chunk_activation_bytes, chunk_input_bytes
from interleaf.stageserver.activation_meter import ActivationMeter, parameter_storages
from interleaf.stageserver.data.sampler import Sampler
from interleaf.stageserver.data.tokenfile import TokenFile, write_tokens
from interleaf.stageserver.model import ModelChunk, ModelShape
from interleaf.stageserver.transport import SoloTransport

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
ENDS = [(False, False), (True, False), (False, True), (True, True)]  # (embedding, head)
# (rows, seq_len, d_model, n_heads, vocab_size); odd sizes catch padded allocations.
SHAPES = [
    (1, 8, 32, 2, 64), (2, 13, 64, 4, 128), (3, 16, 48, 4, 256), (2, 11, 32, 4, 256),
    (3, 9, 64, 2, 64),
]
# Every precision and chunk kind with 1 and 2 layers, the shapes dealt round-robin.
CASES = [
    (precision, emb, head, layers, *SHAPES[i % len(SHAPES)])
    for i, (precision, (emb, head), layers) in enumerate(itertools.product(DTYPES, ENDS, (1, 2)))
]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tokens") / "tokens.bin"
    # Ids below the smallest vocabulary, so any case can read them.
    write_tokens(path, np.random.default_rng(0).integers(0, 64, size=4096))
    return str(path)


def _measure(tp, token_file: str, case: tuple) -> dict[str, int]:
    """Bytes the meter reports for one case: the plain forward, the recompute forward,
    and the recompute's rerun in the backward (run through a real backward, as the
    executor would)."""
    precision, emb, head, layers, rows, seq, d, heads, vocab = case
    dtype = DTYPES[precision]
    config = ModelShape(n_layers=layers, d_model=d, n_heads=heads, seq_len=seq, vocab_size=vocab)
    chunk = ModelChunk(config, range(layers), emb, head, tp, seed=5).to(dtype)
    meter = ActivationMeter(parameter_storages(chunk))
    ids, targets = Sampler(TokenFile(token_file), 0, seq, rows).microbatch(0, 0)
    hidden = torch.randn(rows, seq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = ids if emb else hidden.requires_grad_()
    targets = targets if head else None

    out, plain = meter.forward(chunk, x, targets)
    kept_out, kept = meter.forward_no_grad(chunk, x, targets)
    assert torch.equal(kept_out, out.detach())
    rerun, transient = meter.forward(chunk, x, targets)
    rerun.backward(None if head else torch.ones_like(rerun))
    return dict(plain=plain, recompute=kept, transient=transient)


def _predict(case: tuple, tp: int) -> dict[str, int]:
    precision, emb, head, layers, rows, seq, d, heads, vocab = case
    full = chunk_activation_bytes(d, heads, seq, vocab, layers, emb, head, rows, tp, precision)
    kept = chunk_input_bytes(d, seq, emb, rows, precision)
    return dict(plain=full, recompute=kept, transient=full)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_prediction_equals_measurement(case, token_file):
    assert _measure(SoloTransport(), token_file, case) == _predict(case, 1)


def _measure_all(rank: int, tp, token_file: str, cases: list) -> list[dict[str, int]]:
    return [_measure(tp, token_file, case) for case in cases]


def test_prediction_equals_measurement_tp2(token_file):
    cases = [
        ("bf16", True, True, 2, 2, 8, 32, 4, 64),
        ("fp32", False, False, 1, 3, 16, 64, 2, 256),
        ("fp64", True, False, 1, 1, 13, 48, 4, 128),
    ]
    for rank, measured in enumerate(run_world(_measure_all, 2, token_file, cases)):
        for case, got in zip(cases, measured):
            assert got == _predict(case, 2), f"rank {rank}, case {case}"


def test_tp_shards_the_activations():
    # Fails if the formula ignored tp: the sharded terms halve, the replicated ones stay.
    one = chunk_activation_bytes(64, 4, 16, 256, 2, False, True, 2, 1, "fp32")
    two = chunk_activation_bytes(64, 4, 16, 256, 2, False, True, 2, 2, "fp32")
    assert one > two > one // 2


@pytest.mark.parametrize("precision", DTYPES)
def test_measuring_changes_nothing(precision):
    """The meter's forward yields bit-identical outputs and gradients, and a forward
    whose backward never comes (an aborted step) frees its graph."""
    config = ModelShape(n_layers=1, d_model=32, n_heads=4, seq_len=8, vocab_size=64)
    chunk = ModelChunk(config, range(1), False, False, SoloTransport(), seed=5).to(DTYPES[precision])
    meter = ActivationMeter(parameter_storages(chunk))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(DTYPES[precision])
    grad = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2)).to(DTYPES[precision])

    grads = []
    for run in (lambda x: chunk(x), lambda x: meter.forward(chunk, x)[0]):
        chunk.zero_grad()
        leaf = x.clone().requires_grad_()
        out = run(leaf)
        out.backward(grad)
        grads.append([out.detach(), leaf.grad, *(p.grad.clone() for p in chunk.parameters())])
    for plain, metered in zip(*grads):
        assert torch.equal(plain, metered)

    leaf = x.clone().requires_grad_()
    out, _ = meter.forward(chunk, leaf)
    alive = weakref.ref(leaf)
    # The graph holds the leaf (its AccumulateGrad node) for as long as the graph lives.
    del leaf, out
    assert alive() is None, "an abandoned forward leaked its graph"
