"""The GPT model and its Megatron-style tensor-parallel layers."""

from stageserver.model.config import GPTConfig
from stageserver.model.gpt import GPTChunk, ParamSpec, full_model

__all__ = ["GPTConfig", "GPTChunk", "ParamSpec", "full_model"]
