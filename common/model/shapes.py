"""The parameters a chunk holds, from the model's shape alone: what ModelChunk
(stageserver/model/chunk.py) would describe, without building it or any tensor, so the
coordinator can size memory and FLOPs for any model in microseconds. The architectures
declare their blocks' and norms' parameters; the parts every architecture shares (the
embedding, learned positions, the untied head) are laid out here as ModelChunk lays them
out, and tests hold the two to each other.
"""

from __future__ import annotations

import math

from interleaf.common.model.architectures import architecture
from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import HEAD, TIED, ParamSpec, Shapes


def chunk_param_specs(config: ModelShape, layers: range, has_embedding: bool, has_head: bool,
                      tp: int) -> dict[str, ParamSpec]:
    """ModelChunk(config, layers, has_embedding, has_head, tp).param_specs(): every
    parameter's unsharded description, in the chunk's named_parameters order."""
    arch = architecture(config.arch)
    d, vocab = config.d_model, config.vocab_size
    shapes: Shapes = {}
    if has_embedding or (has_head and config.tie_embeddings):
        shapes[TIED] = ((vocab, d), 0)
    if has_embedding and arch.LEARNED_POSITIONS:
        shapes["wpe.weight"] = ((config.seq_len, d), None)
    block = arch.block_parameters(config)
    for i in layers:
        shapes.update({f"h.{i}.{name}": shape for name, shape in block.items()})
    if has_head:
        shapes.update({f"ln_f.{name}": shape for name, shape in arch.norm_parameters(config).items()})
        if not config.tie_embeddings:
            shapes[HEAD] = ((vocab, d), 0)
    rows = config.padded_vocab(tp)
    return {name: ParamSpec(full, dim, len(full) >= 2, name == TIED and config.tie_embeddings,
                            rows if name in (TIED, HEAD) else None)
            for name, (full, dim) in shapes.items()}


def local_numel(spec: ParamSpec, tp: int) -> int:
    """Elements of one tp rank's shard: a padded table's rows first, then 1/tp of the
    split dimension. A vocabulary of 61 padded to 64 at tp=2, d=32: 32*32 = 1,024."""
    shape = list(spec.full_shape)
    if spec.padded_rows is not None:
        shape[0] = spec.padded_rows
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= tp
    return math.prod(shape)
