"""Both architectures behind one chunk builder: Llama's parts (RMSNorm, rotary positions,
SwiGLU, grouped-query attention, untied head) and what both share (vocabulary padding,
tied or untied embeddings, the key/value cache), in one process and on real gloo
tensor-parallel groups against the single model.

Tolerances as tests/test_tensor_parallel.py: loss within 1e-5 relative, gradients
rtol=1e-4, atol=1e-6; exact where the arithmetic is the same.
"""

from __future__ import annotations

import pytest
import torch
from tests.gloo_world import run_world

from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import HEAD, TIED
from interleaf.stageserver.model import ModelChunk, full_model
from interleaf.stageserver.model.attention import LayerCache
from interleaf.stageserver.model.chunk import all_logits, next_token_logits
from interleaf.stageserver.model.tensor_parallel import tp_shard

GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
SEED = 9
LLAMA = ModelShape(n_layers=2, d_model=32, n_heads=4, seq_len=8, vocab_size=61, arch="llama", n_kv_heads=2,
                   ffn_hidden=48, pad_vocab_to=8)
"""GQA with two query heads per key/value head, an untied head, and a vocabulary of 61
padded to 64 (a multiple of pad_vocab_to·tp for tp 1, 2 and 4)."""


def _batch(config: ModelShape, rows: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (rows, config.seq_len), generator=g)
    return ids, torch.randint(0, config.vocab_size, (rows, config.seq_len), generator=g)


def test_llama_parts_are_llamas():
    model = full_model(LLAMA, SEED)
    names = {n for n, _ in model.named_parameters()}
    assert HEAD in names and TIED in names and "wpe.weight" not in names
    assert not any(n.endswith(".bias") for n in names), "llama has no biases"
    assert model.get_parameter("h.0.attn.k.weight").shape == (2 * 8, 32)  # n_kv_heads * head_dim
    assert model.get_parameter("h.0.mlp.gate.weight").shape == (48, 32)
    assert model.get_parameter(TIED).shape == (64, 32)  # padded to a multiple of pad_vocab_to
    assert model.param_specs()[TIED].full_shape == (61, 32)
    assert not model.param_specs()[TIED].tied


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tie", [True, False])
def test_both_archs_accept_both_tyings(arch, tie):
    config = ModelShape(2, 32, 4, 8, 61, arch=arch, tie_embeddings=tie, pad_vocab_to=8)
    model = full_model(config, SEED)
    assert (HEAD in dict(model.named_parameters())) == (not tie)
    assert model.param_specs()[TIED].tied == tie
    ids, targets = _batch(config)
    loss = model(ids, targets)
    loss.backward()
    assert torch.isfinite(loss)


def test_llama_chunks_chain_to_the_full_model():
    """Untied embeddings split over the pipeline ends: the first chunk alone holds wte,
    the last alone lm_head; every gradient equals the single model's."""
    ids, targets = _batch(LLAMA)
    full = full_model(LLAMA, SEED)
    full_loss = full(ids, targets)
    full_loss.backward()
    solo = full.tp
    first = ModelChunk(LLAMA, range(0, 1), True, False, solo, SEED)
    last = ModelChunk(LLAMA, range(1, 2), False, True, solo, SEED)
    assert HEAD not in dict(first.named_parameters()) and TIED not in dict(last.named_parameters())
    hidden = first(ids)
    last_in = hidden.detach().requires_grad_()
    loss = last(last_in, targets)
    loss.backward()
    hidden.backward(last_in.grad)
    assert torch.equal(loss, full_loss)
    for chunk in (first, last):
        for name, param in chunk.named_parameters():
            assert torch.equal(param, full.get_parameter(name)), f"init of {name}"
            torch.testing.assert_close(param.grad, full.get_parameter(name).grad, **GRAD_TOL)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_padding_changes_neither_loss_nor_gradients(arch):
    """Padded rows are zeros no token looks up and no softmax sees: the loss and the real
    rows' gradients are the unpadded model's, the padding's gradients zero."""
    plain = ModelShape(2, 32, 4, 8, 61, arch=arch, pad_vocab_to=1, tie_embeddings=arch == "gpt2")
    padded = ModelShape(2, 32, 4, 8, 61, arch=arch, pad_vocab_to=128, tie_embeddings=arch == "gpt2")
    ids, targets = _batch(plain)
    losses, grads = [], []
    for config in (plain, padded):
        model = full_model(config, SEED)
        loss = model(ids, targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0.0)
    for name, grad in grads[0].items():
        rows = grad.size(0)
        torch.testing.assert_close(grads[1][name][:rows], grad, **GRAD_TOL)
        assert not grads[1][name][rows:].any(), f"{name}'s padding has a gradient"


def _run_chunk(rank: int, tp, config: ModelShape, ids, targets) -> dict:
    model = ModelChunk(config, range(config.n_layers), True, True, tp, SEED)
    loss = model(ids, targets)
    loss.backward()
    return dict(loss=loss.detach(), grads={n: p.grad for n, p in model.named_parameters()},
                specs=model.param_specs())


@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (4, 4)])
def test_llama_tensor_parallel_matches_single_model(tp, kv_heads):
    """Query and key/value heads split over tp ranks, vocab-parallel untied head over a
    vocabulary of 61 that only padding makes divisible."""
    config = ModelShape(2, 32, 4, 8, 61, arch="llama", n_kv_heads=kv_heads, ffn_hidden=48, pad_vocab_to=8)
    ids, targets = _batch(config)
    ref = full_model(ModelShape(**{**config.__dict__, "pad_vocab_to": 1}), SEED)
    ref_loss = ref(ids, targets)
    ref_loss.backward()
    for rank, got in enumerate(run_world(_run_chunk, tp, config, ids, targets)):
        torch.testing.assert_close(got["loss"], ref_loss.detach(), rtol=1e-5, atol=0.0)
        for name, spec in got["specs"].items():
            want = ref.get_parameter(name).grad
            if spec.padded_rows is not None:
                want = torch.cat([want, want.new_zeros(spec.padded_rows - want.size(0), *want.shape[1:])])
            want = tp_shard(want, spec.tp_dim, type("Rank", (), {"rank": rank, "size": tp}))
            torch.testing.assert_close(got["grads"][name], want, **GRAD_TOL,
                                       msg=lambda m, name=name: f"rank {rank} grad of {name}: {m}")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_key_value_cache_gives_the_logits_of_the_whole_sequence(arch):
    """Prefill then one token at a time through the cache: each position's logits equal
    those of the sequence run whole."""
    config = ModelShape(2, 32, 4, 8, 61, arch=arch, n_kv_heads=2 if arch == "llama" else 0)
    model = full_model(config, SEED).eval()
    ids, _ = _batch(config, rows=2)
    with torch.no_grad():
        whole = all_logits(model, ids)
        cache = [LayerCache() for _ in range(config.n_layers)]
        steps = [next_token_logits(model, ids[:, :3], cache)]
        steps += [next_token_logits(model, ids[:, i:i + 1], cache) for i in range(3, config.seq_len)]
    assert cache[0].length == config.seq_len
    torch.testing.assert_close(torch.stack(steps, dim=1), whole[:, 2:], rtol=1e-5, atol=1e-6)
    assert whole.size(-1) == config.vocab_size
