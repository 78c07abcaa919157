"""The fused linear + cross-entropy (stageserver/model/fused_loss.py) against
F.cross_entropy(F.linear(...)), on one process and on a real two-rank gloo group.

Tolerances, relative to the largest magnitude of each tensor: fp64 1e-12 on the loss
and every gradient; fp32 1e-6; bf16 the fp32 loss's 1e-6 (softmax and loss are float32)
and two bf16 roundings (2**-7) on the gradients (grad_W: each chunk's product, then
the float32 sum, is rounded to bf16; the reference rounds once). Shapes include chunks
that do not divide the tokens and padded vocabularies (ids from vocab_size on are
padding rows).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from tests.gloo_world import run_world

from interleaf.common.model.config import ModelShape
from interleaf.stageserver.model import full_model, fused_loss
from interleaf.stageserver.model.fused_loss import chunk_tokens, fused_linear_cross_entropy
from interleaf.stageserver.model.tensor_parallel import tp_shard, vocab_parallel_logits
from interleaf.stageserver.model.vocab_parallel_loss import vocab_parallel_cross_entropy
from interleaf.stageserver.transport import SoloTransport

TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-6, 2**-7)}  # (loss, grads)
# (b, s, d, padded rows, vocab_size, tokens per chunk)
SHAPES = [(2, 7, 16, 40, 40, 5), (3, 5, 8, 64, 50, 4), (2, 8, 16, 32, 32, None), (1, 9, 12, 24, 21, 1)]


def _case(b: int, s: int, d: int, rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d, generator=g, dtype=torch.float64)
    weight = torch.randn(rows, d, generator=g, dtype=torch.float64) / d**0.5 * 4  # logits ~N(0, 16)
    return x, weight, torch.randint(0, vocab, (b, s), generator=g), torch.tensor(0.25, dtype=torch.float64)


def _reference(x, weight, targets, scale, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """F.cross_entropy(F.linear(x, W)) over the unpadded rows, softmax at float32 or
    wider, backward from `scale`: (loss, grad x, grad W with the padding rows' zeros)."""
    x, weight = x.to(dtype, copy=True).requires_grad_(), weight.to(dtype, copy=True).requires_grad_()
    logits = F.linear(x, weight)[..., :vocab]
    loss = F.cross_entropy(logits.reshape(-1, vocab).to(fused_loss.softmax_dtype(dtype)), targets.reshape(-1))
    (loss * scale.to(loss.dtype)).backward()
    return loss.detach(), x.grad, weight.grad


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


# Compiled (train.compile): each chunk's softmax arithmetic through inductor; fewer
# shapes, each compiling its kernels (padded vocabularies, chunks that do not divide).
CASES = [(shape, False) for shape in SHAPES] + [(shape, True) for shape in SHAPES[1::2]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,compiled", CASES, ids=lambda c: "compiled" if c is True else "eager" if c is False else str(c))
def test_matches_linear_then_cross_entropy(shape, compiled, dtype):
    b, s, d, rows, vocab, step = shape
    if compiled:  # each case its own compiled kernels, never past dynamo's recompile limit (then eager)
        torch._dynamo.reset()
    x, weight, targets, scale = _case(b, s, d, rows, vocab)
    want = _reference(x, weight, targets, scale, vocab, dtype)
    xs, ws = x.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    loss = fused_linear_cross_entropy(xs, ws, targets, SoloTransport(), vocab, tokens_per_chunk=step,
                                      compiled=compiled)
    (loss * scale.to(loss.dtype)).backward()
    assert loss.dtype == fused_loss.softmax_dtype(dtype) and xs.grad.dtype == ws.grad.dtype == dtype
    loss_tol, grad_tol = TOL[dtype]
    assert _relative(loss, want[0]) <= loss_tol
    assert _relative(xs.grad, want[1]) <= grad_tol
    assert _relative(ws.grad, want[2]) <= grad_tol
    assert not ws.grad[vocab:].any()  # padding rows never enter the softmax


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_grad_computes_the_loss_only(compiled):
    torch._dynamo.reset()
    x, weight, targets, _ = _case(2, 6, 8, 24, 20)
    x.requires_grad_()
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, weight, targets, SoloTransport(), 20, tokens_per_chunk=5,
                                          compiled=compiled)
    assert loss.grad_fn is None
    assert _relative(loss, _reference(x.detach(), weight, targets, torch.tensor(1.0), 20, torch.float64)[0]) <= 1e-12


def test_chunk_size_keeps_a_chunks_softmax_within_the_budget():
    assert 2**28 // (50304 * 4) == 1334 and chunk_tokens(50304, torch.bfloat16) == 1280  # whole 128-row tiles
    assert chunk_tokens(50304, torch.float64) == 640
    assert chunk_tokens(2**22, torch.float32) == 16  # fewer than a tile fit: as many as fit
    assert chunk_tokens(2**40, torch.float32) == 1


def test_kept_for_the_backward_does_not_scale_with_tokens_times_vocab():
    """What the Function saves is grad_x [tokens, d] and grad_W [V, d]: with 256 tokens
    and a 4096-row vocabulary, (tokens + V) * d elements, a fifteenth of the logits'
    tokens * V."""
    b, s, d, rows = 4, 64, 16, 4096
    x, weight, targets, _ = _case(b, s, d, rows, rows)
    x, weight = x.float().requires_grad_(), weight.float().requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fused_linear_cross_entropy(x, weight, targets, SoloTransport(), rows, tokens_per_chunk=32)
    assert sorted(saved) == [b * s * d, rows * d]
    assert sum(saved) * 10 < b * s * rows  # 69,632 elements against the logits' 1,048,576
    loss.backward()


def _rank(rank: int, tp, case: tuple, vocab: int, step: int, sequence_parallel: bool, compiled: bool) -> dict:
    x, weight, targets, scale = case
    x = x.chunk(tp.size, dim=1)[rank] if sequence_parallel else x  # this rank's tokens
    x, w = x.detach().clone().requires_grad_(), tp_shard(weight, 0, tp).clone().requires_grad_()
    loss = fused_linear_cross_entropy(x, w, targets, tp, vocab, sequence_parallel, tokens_per_chunk=step,
                                      compiled=compiled)
    (loss * scale).backward()
    with torch.no_grad():
        evaluated = fused_linear_cross_entropy(x, w, targets, tp, vocab, sequence_parallel, tokens_per_chunk=step,
                                               compiled=compiled)
    return {"loss": loss.detach(), "evaluated": evaluated, "x": x.grad, "weight": w.grad}


@pytest.mark.parametrize("sequence_parallel,compiled", [(False, False), (True, False), (True, True)],
                         ids=["tp", "sequence-parallel", "sequence-parallel-compiled"])
def test_tp2_matches_the_unsharded_op(sequence_parallel, compiled):
    """fp64 on a two-rank gloo group, a padded vocabulary (60 rows, 50 ids: rank 1's
    slice is partly padding) and chunks of 5 of 16 tokens: the loss on both ranks, each
    rank's rows of grad_W and (sequence parallel: its tokens of) the summed grad_x;
    compiled, the collectives between the compiled kernels."""
    case = _case(2, 8, 12, 60, 50)
    loss, grad_x, grad_w = _reference(*case, 50, torch.float64)
    results = run_world(_rank, 2, case, 50, 5, sequence_parallel, compiled)
    for rank, got in enumerate(results):
        assert _relative(got["loss"], loss) <= 1e-12 and _relative(got["evaluated"], loss) <= 1e-12
        assert _relative(got["weight"], grad_w.chunk(2, 0)[rank]) <= 1e-12
        want_x = grad_x.chunk(2, dim=1)[rank] if sequence_parallel else grad_x
        assert _relative(got["x"], want_x) <= 1e-12


@pytest.mark.parametrize("arch,tied", [("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False)])
def test_model_matches_the_unfused_head(arch, tied):
    """A whole fp64 model (padded vocabulary, both ends in one chunk, so a tied wte sums
    the embedding's and the head's gradients): the loss and every parameter's gradient
    as with the unfused vocab_parallel_logits and vocab_parallel_cross_entropy."""
    extra = {"arch": arch, "n_kv_heads": 2, "ffn_hidden": 48} if arch == "llama" else {}
    config = ModelShape(n_layers=2, d_model=32, n_heads=4, seq_len=8, vocab_size=61, pad_vocab_to=8,
                        tie_embeddings=tied, **extra)
    tokens = torch.randint(0, 61, (3, 9), generator=torch.Generator().manual_seed(1))
    fused, plain = (full_model(config, seed=3).double() for _ in range(2))
    loss = fused(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    x = plain.embed(tokens[:, :-1])
    for block in plain.h.values():
        x = block(x)
    logits = vocab_parallel_logits(plain.ln_f(x), plain.head_weight(), plain.tp)
    want = vocab_parallel_cross_entropy(logits, tokens[:, 1:], plain.tp, 61)
    want.backward()
    assert _relative(loss, want) <= 1e-12
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert _relative(p.grad, q.grad) <= 1e-12, name


def test_compiled_runs_the_softmax_arithmetic_and_the_sum_as_four_graphs():
    """The row maxima, the target logits with the sums, the gradient, and the addition of
    a chunk's grad_W to their sum: four graphs without a break, the matrix products and
    collectives between them eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x, weight, targets, scale = _case(2, 8, 16, 40, 33)
    x, weight = x.float().requires_grad_(), weight.float().requires_grad_()
    loss = fused_linear_cross_entropy(x, weight, targets, SoloTransport(), 33, tokens_per_chunk=8, compiled=True)
    (loss * scale.float()).backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_the_compiled_sum_of_grad_w_adds_in_place_as_eager_does():
    """A chunk's bf16 share of grad_W into the float32 sum: compiled, the same float32
    sums bit for bit, written where the sum is, with no buffer allocated for it (inductor
    reinplaces the add; a copy would hold another float32 [V/t x d] tensor)."""
    from torch._inductor.utils import run_and_get_code

    from interleaf.stageserver.model.fused_loss import _accumulate, _compiled

    torch.manual_seed(0)
    total = torch.randn(300, 40)
    part = torch.randn(300, 40).bfloat16()
    want = total.clone().add_(part)
    address = total.data_ptr()
    torch._dynamo.reset()
    _compiled.cache_clear()
    with torch.no_grad():
        _, sources = run_and_get_code(_compiled(_accumulate), total, part)
    assert torch.equal(total, want) and total.data_ptr() == address
    call = "".join(sources).split("def call(")[1]
    assert "empty_strided" not in call, call
