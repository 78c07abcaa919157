"""Tensor-parallel layers on real gloo groups against their unsharded torch counterparts.

Tolerances: layers rtol=1e-5, atol=1e-6; the whole model at tp=2 vs tp=1 has an exact
initialisation, loss within 1e-5 relative and gradients within rtol=1e-4, atol=1e-6.
The cross-entropy of bf16 logits has the fp32 loss's tolerance and a gradient within one
bf16 rounding (rtol=2**-8) of the fp32 gradient.
tp=1 runs in-process on a SoloTransport and must reduce to the plain ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.gloo_world import run_world
from torch import nn

from interleaf.common.model.config import ModelShape
from interleaf.stageserver.model import ModelChunk, full_model
from interleaf.stageserver.model.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_shard,
)
from interleaf.stageserver.model.vocab_parallel_loss import vocab_parallel_cross_entropy
from interleaf.stageserver.transport import SoloTransport

LAYER_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
BF16_GRAD_TOL = dict(rtol=2**-8, atol=1e-6)  # one bf16 rounding of the fp32 gradient
IN, OUT, VOCAB, DIM = 8, 12, 20, 6
GPT = ModelShape(n_layers=2, d_model=32, n_heads=4, seq_len=8, vocab_size=64)


def _case() -> dict[str, torch.Tensor]:
    """Full weights, inputs and upstream gradients, shared by the ranks and the reference."""
    g = torch.Generator().manual_seed(7)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "col.weight": r(OUT, IN), "col.bias": r(OUT), "col.x": r(2, 3, IN), "col.gy": r(2, 3, OUT),
        "row.weight": r(OUT, IN), "row.bias": r(OUT), "row.x": r(2, 3, IN), "row.gy": r(2, 3, OUT),
        "emb.weight": r(VOCAB, DIM), "emb.gy": r(2, 5, DIM),
        "emb.ids": torch.randint(0, VOCAB, (2, 5), generator=g),
        # Scaled so the stabilising max matters; targets hit every rank's vocab slice.
        "ce.logits": 30 * r(2, 5, VOCAB),
        "ce.targets": torch.arange(10).view(2, 5) * 2 % VOCAB,
    }


def _load(layer: nn.Module, case: dict, prefix: str, tp) -> None:
    with torch.no_grad():
        for leaf, param in layer.named_parameters():
            param.copy_(tp_shard(case[f"{prefix}.{leaf}"], layer.TP_DIMS[leaf], tp))


def _run_layers(rank: int, tp, case: dict) -> dict:
    """Forward and backward of every sharded layer; returns outputs and gradients."""
    out = {}
    col = ColumnParallelLinear(IN, OUT, tp)
    _load(col, case, "col", tp)
    x = case["col.x"].clone().requires_grad_()
    y = col(x)
    (y * tp_shard(case["col.gy"], -1, tp)).sum().backward()
    out["col"] = dict(y=y.detach(), x=x.grad, weight=col.weight.grad, bias=col.bias.grad)

    row = RowParallelLinear(IN, OUT, tp)
    _load(row, case, "row", tp)
    x = tp_shard(case["row.x"], -1, tp).clone().requires_grad_()
    y = row(x)
    (y * case["row.gy"]).sum().backward()
    out["row"] = dict(y=y.detach(), x=x.grad, weight=row.weight.grad, bias=row.bias.grad)

    emb = VocabParallelEmbedding(VOCAB, DIM, tp)
    _load(emb, case, "emb", tp)
    y = emb(case["emb.ids"])
    (y * case["emb.gy"]).sum().backward()
    out["emb"] = dict(y=y.detach(), weight=emb.weight.grad)

    logits = tp_shard(case["ce.logits"], -1, tp).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, case["ce.targets"], tp)
    # A non-unit upstream gradient checks that backward scales by it.
    (3.0 * loss).backward()
    out["ce"] = dict(loss=loss.detach(), logits=logits.grad)

    logits = tp_shard(case["ce.logits"], -1, tp).to(torch.bfloat16).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, case["ce.targets"], tp)
    (3.0 * loss).backward()
    out["ce_bf16"] = dict(loss=loss.detach(), logits=logits.grad)
    return out


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def sharded(request):
    """(tp size, case, per-rank results): one gloo world per tp size serves every test."""
    tp, case = request.param, _case()
    if tp == 1:
        return tp, case, [_run_layers(0, SoloTransport(), case)]
    return tp, case, run_world(_run_layers, tp, case)


def _chunk(full: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return full.chunk(tp, dim=dim)[rank]


def test_column_parallel_linear(sharded):
    tp, case, results = sharded
    ref = nn.Linear(IN, OUT)
    with torch.no_grad():
        ref.weight.copy_(case["col.weight"])
        ref.bias.copy_(case["col.bias"])
    x = case["col.x"].clone().requires_grad_()
    y = ref(x)
    (y * case["col.gy"]).sum().backward()
    for rank, got in enumerate(r["col"] for r in results):
        torch.testing.assert_close(got["y"], _chunk(y.detach(), -1, tp, rank), **LAYER_TOL)
        torch.testing.assert_close(got["x"], x.grad, **LAYER_TOL)
        torch.testing.assert_close(got["weight"], _chunk(ref.weight.grad, 0, tp, rank), **LAYER_TOL)
        torch.testing.assert_close(got["bias"], _chunk(ref.bias.grad, 0, tp, rank), **LAYER_TOL)


def test_row_parallel_linear(sharded):
    tp, case, results = sharded
    ref = nn.Linear(IN, OUT)
    with torch.no_grad():
        ref.weight.copy_(case["row.weight"])
        ref.bias.copy_(case["row.bias"])
    x = case["row.x"].clone().requires_grad_()
    y = ref(x)
    (y * case["row.gy"]).sum().backward()
    for rank, got in enumerate(r["row"] for r in results):
        torch.testing.assert_close(got["y"], y.detach(), **LAYER_TOL)
        torch.testing.assert_close(got["x"], _chunk(x.grad, -1, tp, rank), **LAYER_TOL)
        torch.testing.assert_close(got["weight"], _chunk(ref.weight.grad, 1, tp, rank), **LAYER_TOL)
        torch.testing.assert_close(got["bias"], ref.bias.grad, **LAYER_TOL)


def test_vocab_parallel_embedding(sharded):
    tp, case, results = sharded
    ref = nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        ref.weight.copy_(case["emb.weight"])
    y = ref(case["emb.ids"])
    (y * case["emb.gy"]).sum().backward()
    for rank, got in enumerate(r["emb"] for r in results):
        torch.testing.assert_close(got["y"], y.detach(), **LAYER_TOL)
        torch.testing.assert_close(got["weight"], _chunk(ref.weight.grad, 0, tp, rank), **LAYER_TOL)


def test_vocab_parallel_cross_entropy(sharded):
    tp, case, results = sharded
    logits = case["ce.logits"].clone().requires_grad_()
    loss = F.cross_entropy(logits.view(-1, VOCAB), case["ce.targets"].view(-1))
    (3.0 * loss).backward()
    for rank, got in enumerate(r["ce"] for r in results):
        torch.testing.assert_close(got["loss"], loss.detach(), **LAYER_TOL)
        torch.testing.assert_close(got["logits"], _chunk(logits.grad, -1, tp, rank), **LAYER_TOL)


def test_vocab_parallel_cross_entropy_bf16(sharded):
    """bf16 logits: softmax and loss in fp32 (DESIGN.md, Precision), so the loss is the
    fp32 loss of the same (bf16-rounded) values; the gradient comes back in bf16."""
    tp, case, results = sharded
    logits = case["ce.logits"].to(torch.bfloat16).float().requires_grad_()
    loss = F.cross_entropy(logits.view(-1, VOCAB), case["ce.targets"].view(-1))
    (3.0 * loss).backward()
    for rank, got in enumerate(r["ce_bf16"] for r in results):
        assert got["loss"].dtype == torch.float32
        assert got["logits"].dtype == torch.bfloat16
        torch.testing.assert_close(got["loss"], loss.detach(), **LAYER_TOL)
        torch.testing.assert_close(
            got["logits"].float(), _chunk(logits.grad, -1, tp, rank), **BF16_GRAD_TOL
        )


def _run_gpt(rank: int, tp, config: ModelShape, seed: int, ids, targets) -> dict:
    model = ModelChunk(config, range(config.n_layers), True, True, tp, seed)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = model(ids, targets)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return dict(loss=loss.detach(), params=params, grads=grads, specs=model.param_specs())


def test_gpt_tp2_matches_single_model():
    seed, g = 11, torch.Generator().manual_seed(3)
    ids = torch.randint(0, GPT.vocab_size, (2, GPT.seq_len), generator=g)
    targets = torch.randint(0, GPT.vocab_size, (2, GPT.seq_len), generator=g)
    ref = full_model(GPT, seed)
    ref_params = {name: p.detach().clone() for name, p in ref.named_parameters()}
    ref_loss = ref(ids, targets)
    ref_loss.backward()

    for rank, got in enumerate(run_world(_run_gpt, 2, GPT, seed, ids, targets)):
        assert list(got["params"]) == list(ref_params)
        for name, spec in got["specs"].items():
            full, dim = ref_params[name], spec.tp_dim
            want = full if dim is None else _chunk(full, dim, 2, rank)
            assert torch.equal(got["params"][name], want), f"rank {rank} init of {name}"
            torch.testing.assert_close(
                got["grads"][name],
                ref.get_parameter(name).grad if dim is None
                else _chunk(ref.get_parameter(name).grad, dim, 2, rank),
                **GRAD_TOL, msg=lambda m, name=name: f"rank {rank} grad of {name}: {m}",
            )
        torch.testing.assert_close(got["loss"], ref_loss.detach(), rtol=1e-5, atol=0.0)


# Sequence parallelism: both architectures (llama with grouped-query attention, an
# untied head and rotary positions applied after the gather), whole models at tp=2.
SP_MODELS = {
    "gpt2": GPT,
    "llama": ModelShape(n_layers=2, d_model=32, n_heads=4, seq_len=8, vocab_size=64, arch="llama",
                        n_kv_heads=2, ffn_hidden=48),
}


def _run_sp(rank: int, tp, config: ModelShape, seed: int, ids, targets) -> dict:
    model = ModelChunk(config, range(config.n_layers), True, True, tp, seed, sequence_parallel=True)
    hidden = model.embed(ids)
    loss = model(ids, targets)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return dict(loss=loss.detach(), hidden=hidden.detach(), grads=grads, specs=model.param_specs())


@pytest.mark.parametrize("arch", SP_MODELS)
def test_sequence_parallel_tp2_matches_single_model(arch):
    """Each rank holds its half of the sequence after the embedding; the loss is the
    whole model's; sharded parameters get their slice of the gradient, and replicated
    ones (norms, row-parallel biases, wpe), which see only a rank's tokens, gradients
    that sum over the ranks to the whole model's."""
    config = SP_MODELS[arch]
    seed, g = 11, torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    targets = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    ref = full_model(config, seed)
    ref_hidden = ref.embed(ids).detach()
    ref_loss = ref(ids, targets)
    ref_loss.backward()

    got = run_world(_run_sp, 2, config, seed, ids, targets)
    for rank, result in enumerate(got):
        torch.testing.assert_close(result["loss"], ref_loss.detach(), rtol=1e-5, atol=0.0)
        assert torch.equal(result["hidden"], ref_hidden[:, rank * 4:(rank + 1) * 4])
        for name, spec in result["specs"].items():
            want = ref.get_parameter(name).grad
            if spec.tp_dim is None:
                grad, what = sum(r["grads"][name] for r in got), "summed over ranks"
                assert not torch.allclose(result["grads"][name], want), f"{name} is partial on rank {rank}"
            else:
                grad, what, want = result["grads"][name], f"rank {rank}", _chunk(want, spec.tp_dim, 2, rank)
            torch.testing.assert_close(grad, want, **GRAD_TOL, msg=lambda m, n=name, w=what: f"{w} grad of {n}: {m}")
