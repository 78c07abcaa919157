"""The GPT model and its Megatron-style tensor-parallel layers."""

from interleaf.stageserver.model.config import GPTConfig
from interleaf.stageserver.model.gpt import GPTChunk, ParamSpec, full_model

__all__ = ["GPTConfig", "GPTChunk", "ParamSpec", "full_model"]
