"""Model FLOPs per token (coordinator/flops.py), the numerator of MFU, held against the
model itself: its matrix parameters are the weights that take part in matrix products
(the blocks' projections and the head, at the padded vocabulary), counted from the
module, for both architectures; and the worked examples of the docstring."""

from __future__ import annotations

import pytest

from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import TIED
from interleaf.coordinator.config import load_config
from interleaf.coordinator.flops import flops_per_token, matrix_parameters
from interleaf.stageserver.model.chunk import full_model

MODELS = {
    "gpt2": ModelShape(n_layers=3, d_model=64, n_heads=4, seq_len=32, vocab_size=256),
    "gpt2 untied, narrow MLP, padded": ModelShape(n_layers=2, d_model=48, n_heads=4, seq_len=16, vocab_size=61,
                                                  ffn_hidden=40, pad_vocab_to=8, tie_embeddings=False),
    "llama gqa, padded": ModelShape(n_layers=3, d_model=64, n_heads=8, seq_len=32, vocab_size=300, arch="llama",
                                    n_kv_heads=2, ffn_hidden=176, pad_vocab_to=128),
    "llama tied": ModelShape(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=64, arch="llama",
                             ffn_hidden=96, tie_embeddings=True),
}


@pytest.mark.parametrize("config", MODELS.values(), ids=MODELS.keys())
def test_matrix_parameters_are_the_models_matrix_weights(config):
    model = full_model(config, seed=0)
    # 2-D weights, but the lookups: the position table, and the token embedding unless
    # it is also the head (then it counts once, for the head's product with it). The
    # head's rows are the padded vocabulary's.
    lookups = {"wpe.weight"} | (set() if config.tie_embeddings else {TIED})
    counted = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name not in lookups)
    assert matrix_parameters(config) == counted
    assert flops_per_token(config) == 6 * counted + 12 * config.n_layers * config.d_model * config.seq_len


def test_the_worked_examples():
    # The 1.11B benchmark model: 6 * 1,109,655,552 + 12 * 20 * 2048 * 2048.
    gpt = ModelShape(n_layers=20, d_model=2048, n_heads=16, seq_len=2048, vocab_size=50304)
    assert flops_per_token(gpt) == 7_664_566_272
    # Llama-2 7B from a job's [model] section, as the coordinator's MFU reads it: the
    # llama rule gives ffn_hidden 11008 and an untied head; 32000 needs no padding.
    llama = load_config("", ["model.arch=llama", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32",
                             "model.seq_len=4096", "model.vocab_size=32000"]).model
    assert matrix_parameters(llama) == 6_607_077_376
    assert flops_per_token(llama) == 46_084_915_200
