"""Decoder-only transformers (gpt2, llama) and their Megatron-style tensor-parallel layers."""

from interleaf.stageserver.model.chunk import ModelChunk, full_model
from interleaf.stageserver.model.config import ModelShape, shape_of
from interleaf.stageserver.model.params import ParamSpec

__all__ = ["ModelShape", "ModelChunk", "ParamSpec", "full_model", "shape_of"]
