"""The GPT model in one process: pipeline chunks chain to the full model, initialisation
depends on (seed, name) alone, parameter specs describe every shard, and layouts that
cannot be split fail with messages that name the rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import ParamSpec
from interleaf.stageserver.model import ModelChunk, full_model
from interleaf.common.model.config import INIT_STD
from interleaf.stageserver.model.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

CONFIG = ModelShape(n_layers=4, d_model=32, n_heads=4, seq_len=16, vocab_size=64)
SEED = 5


class _RankOf:
    """Stands in for a tp group at construction time, which needs no communication."""

    def __init__(self, rank: int, size: int):
        self.name, self.rank, self.size = "tp", rank, size


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.seq_len), generator=g)
    return ids, torch.randint(0, CONFIG.vocab_size, (3, CONFIG.seq_len), generator=g)


def test_chunks_chain_to_the_full_model():
    ids, targets = _batch()
    full = full_model(CONFIG, SEED)
    full_loss = full(ids, targets)
    full_loss.backward()

    solo = full.tp
    chunks = [
        ModelChunk(CONFIG, range(0, 1), True, False, solo, SEED),
        ModelChunk(CONFIG, range(1, 3), False, False, solo, SEED),
        ModelChunk(CONFIG, range(3, 4), False, True, solo, SEED),
    ]
    # Detach between chunks as a pipeline does: each chunk's backward starts from the
    # gradient of its output, received from the next chunk.
    first = chunks[0](ids)
    middle_in = first.detach().requires_grad_()
    middle = chunks[1](middle_in)
    last_in = middle.detach().requires_grad_()
    loss = chunks[2](last_in, targets)
    loss.backward()
    middle.backward(last_in.grad)
    first.backward(middle_in.grad)

    assert torch.equal(loss, full_loss)
    held = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            assert torch.equal(param, full.get_parameter(name)), f"init of {name}"
            held.setdefault(name, []).append(param.grad)
    assert set(held) == {name for name, _ in full.named_parameters()}
    for name, grads in held.items():
        if name == "wte.weight":
            # Both ends hold a copy; the pipeline sums their gradients.
            assert len(grads) == 2
            summed = grads[0] + grads[1]
            torch.testing.assert_close(summed, full.wte.weight.grad, rtol=1e-6, atol=1e-9)
        else:
            assert len(grads) == 1
            assert torch.equal(grads[0], full.get_parameter(name).grad), f"grad of {name}"


def test_init_is_a_function_of_seed_and_name():
    a, b = full_model(CONFIG, SEED), full_model(CONFIG, SEED)
    other = full_model(CONFIG, SEED + 1)
    for (name, pa), pb, po in zip(a.named_parameters(), b.parameters(), other.parameters()):
        assert torch.equal(pa, pb), name
        random = name.endswith("weight") and not name.split(".")[-2].startswith("ln_")
        assert random != torch.equal(pa, po), name
    # Same shape, different names: independent draws.
    assert not torch.equal(a.h["0"].mlp.up.weight, a.h["1"].mlp.up.weight)


def test_init_follows_the_nanogpt_scheme():
    model = full_model(CONFIG, SEED)
    residual_std = INIT_STD / math.sqrt(2 * CONFIG.n_layers)
    for name, param in model.named_parameters():
        if name.split(".")[-2].startswith("ln_"):
            expected = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(param == expected), name
        elif name.endswith("bias"):
            assert torch.all(param == 0), name
        else:
            residual = name.endswith(("attn.proj.weight", "mlp.down.weight"))
            want = residual_std if residual else INIT_STD
            assert abs(param.mean().item()) < 0.1 * want, name
            assert param.std().item() == pytest.approx(want, rel=0.1), name


def test_param_specs_describe_every_shard():
    full = full_model(CONFIG, SEED)
    full_specs = full.param_specs()
    assert list(full_specs) == [name for name, _ in full.named_parameters()]
    for name, spec in full_specs.items():
        assert isinstance(spec, ParamSpec)
        assert spec.full_shape == tuple(full.get_parameter(name).shape), name
        assert spec.weight_decay == (len(spec.full_shape) == 2), name
        assert spec.tied == (name == "wte.weight"), name
    expected_dims = {
        "wte.weight": 0, "wpe.weight": None, "h.0.ln_1.weight": None,
        "h.0.attn.qkv.weight": 0, "h.0.attn.qkv.bias": 0,
        "h.0.attn.proj.weight": 1, "h.0.attn.proj.bias": None,
        "h.0.mlp.up.weight": 0, "h.0.mlp.up.bias": 0,
        "h.0.mlp.down.weight": 1, "h.0.mlp.down.bias": None, "ln_f.bias": None,
    }
    for name, dim in expected_dims.items():
        assert full_specs[name].tp_dim == dim, name

    # Every tp rank's shard is the slice of the single model's tensor, bit for bit.
    for rank in range(4):
        shard = ModelChunk(CONFIG, range(CONFIG.n_layers), True, True, _RankOf(rank, 4), SEED)
        assert shard.param_specs() == full_specs
        for name, param in shard.named_parameters():
            whole, dim = full.get_parameter(name), full_specs[name].tp_dim
            assert torch.equal(param, whole if dim is None else whole.chunk(4, dim)[rank]), name


def test_qkv_weight_is_head_major():
    model = full_model(CONFIG, SEED)
    attn = model.h["0"].attn
    with torch.no_grad():
        attn.qkv.bias.normal_()
    x = torch.randn(2, CONFIG.seq_len, CONFIG.d_model)
    h, hd = CONFIG.n_heads, CONFIG.head_dim
    # Rows [q_h, k_h, v_h] for each head h, each head_dim long.
    qkv = F.linear(x, attn.qkv.weight, attn.qkv.bias).view(2, CONFIG.seq_len, h, 3, hd)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    causal = torch.ones(CONFIG.seq_len, CONFIG.seq_len, dtype=torch.bool).triu(1)
    y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
    want = attn.proj(y.transpose(1, 2).reshape(2, CONFIG.seq_len, CONFIG.d_model))
    torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ColumnParallelLinear(8, 10, _RankOf(0, 4)), "out_features=10 must be divisible"),
        (lambda: RowParallelLinear(10, 8, _RankOf(0, 4)), "in_features=10 must be divisible"),
        (lambda: VocabParallelEmbedding(50, 8, _RankOf(0, 4)), "rows=50 must be divisible"),
        (
            lambda: ModelChunk(ModelShape(2, 24, 6, 8, 64), range(2), True, True, _RankOf(0, 4), 0),
            "n_heads=6 must be divisible by the tensor-parallel size 4",
        ),
        (
            lambda: ModelChunk(ModelShape(2, 30, 4, 8, 64), range(2), True, True, _RankOf(0, 1), 0),
            "d_model=30 must be divisible by n_heads=4",
        ),
        (
            lambda: ModelChunk(ModelShape(2, 32, 4, 8, 64, n_kv_heads=2, arch="llama"), range(2), True, True,
                               _RankOf(0, 4), 0),
            "n_kv_heads=2 must be divisible by the tensor-parallel size 4",
        ),
        (
            lambda: ModelChunk(CONFIG, range(3, 5), False, False, _RankOf(0, 1), 0),
            "must be a contiguous range within",
        ),
    ],
)
def test_unsplittable_layouts_are_rejected(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_head_needs_targets():
    ids, _ = _batch()
    with pytest.raises(ValueError, match="needs targets"):
        full_model(CONFIG, SEED)(ids)
