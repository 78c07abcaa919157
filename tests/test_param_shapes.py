"""The parameters a chunk holds, from the model's shape alone (common/model/shapes.py,
which the memory model and the FLOP count read), against the ModelChunk built from that
shape: the same names in the same order, the same unsharded shapes, tensor-parallel
dimensions, padded rows, decay and tying, and each tp rank's shard as many elements as
the module's parameter. Exact: these are integers.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from interleaf.common.model.config import ModelShape
from interleaf.common.model.shapes import chunk_param_specs, local_numel
from interleaf.stageserver.model import ModelChunk

# (arch, d_model, n_heads, n_kv_heads, ffn_hidden, vocab_size, pad_vocab_to): grouped
# queries 1, 2 and 4 to a key/value head, MLP widths off the 4·d rule, vocabularies that
# need padding and one that does not.
SHAPES = [
    ("gpt2", 32, 4, 4, 128, 64, 1), ("gpt2", 48, 4, 4, 40, 61, 8), ("gpt2", 64, 8, 8, 96, 300, 128),
    ("llama", 32, 4, 2, 48, 61, 8), ("llama", 64, 8, 2, 176, 256, 128), ("llama", 48, 4, 4, 40, 100, 1),
    ("llama", 64, 8, 8, 256, 1000, 64),
]
ENDS = [(False, False), (True, False), (False, True), (True, True)]  # (embedding, head)
CASES = [(*shape, tie, tp) for shape, tie, tp in itertools.product(SHAPES, (True, False), (1, 2, 4))
         if shape[2] % tp == 0 == shape[3] % tp]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_specs_and_shards_are_the_modules(case):
    arch, d, heads, kv_heads, ffn, vocab, pad, tie, tp = case
    config = ModelShape(n_layers=3, d_model=d, n_heads=heads, seq_len=12, vocab_size=vocab, arch=arch,
                        n_kv_heads=kv_heads, ffn_hidden=ffn, pad_vocab_to=pad, tie_embeddings=tie)
    for (emb, head), layers in itertools.product(ENDS, (range(0, 1), range(1, 3))):
        specs = chunk_param_specs(config, layers, emb, head, tp)
        for tp_rank in range(tp):
            # Building a chunk reads only its tensor group's size and rank.
            model = ModelChunk(config, layers, emb, head, SimpleNamespace(size=tp, rank=tp_rank), seed=0)
            assert list(specs.items()) == list(model.param_specs().items()), (emb, head, layers)
            assert {n: local_numel(specs[n], tp) for n in specs} == \
                {n: p.numel() for n, p in model.named_parameters()}, (emb, head, layers, tp_rank)
