"""Decoder-only transformers (gpt2, llama) and their Megatron-style tensor-parallel layers.
The model's description (its shape, parameters and architectures as shapes) is
common/model/."""

from interleaf.stageserver.model.chunk import ModelChunk, full_model

__all__ = ["ModelChunk", "full_model"]
