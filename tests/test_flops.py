"""Model FLOPs per token (coordinator/flops.py), the numerator of MFU, held against the
model itself: its matrix parameters are the weights that take part in matrix
products (the blocks' projections and the tied head), counted from the module."""

from __future__ import annotations

from interleaf.coordinator.flops import flops_per_token, matrix_parameters
from interleaf.stageserver.model import ModelShape
from interleaf.stageserver.model.chunk import full_model


def test_matrix_parameters_are_the_models_matrix_weights():
    config = ModelShape(n_layers=3, d_model=64, n_heads=4, seq_len=32, vocab_size=256)
    model = full_model(config, seed=0)
    # 2-D weights, but the position table: a lookup, not a matrix product. The token
    # embedding counts once, for the head's product with it.
    counted = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name != "wpe.weight")
    assert matrix_parameters(3, 64, 256) == counted


def test_flops_per_token_is_six_per_matrix_parameter_plus_attention():
    # The 1.11B benchmark model: 6 * 1,109,655,552 + 12 * 20 * 2048 * 2048.
    assert flops_per_token(20, 2048, 50304, 2048) == 7_664_566_272
