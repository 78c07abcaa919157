"""[model]: the architecture and shape of the network."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from interleaf.common.limits import shown
from interleaf.common.model.config import padded_vocab, resolve_defaults
from interleaf.coordinator.config.rules import ConfigError, _bounded, _positive

ARCHS = ("gpt2", "llama")
ROPE_SCALING = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_positions")
"""The fields of Llama 3's rotary scaling, which only llama with a scaling factor uses."""


@dataclass(frozen=True)
class ModelConfig:
    """[model]: the network's architecture and shape. Initial weights are a function of
    train.seed and each parameter's name in the unsplit model, so every layout starts
    from the same weights. With checkpoint.init the section is taken from those weights."""

    arch: str = "gpt2"
    """gpt2 (LayerNorm, GELU MLP, learned positions, biases) or llama (RMSNorm, SwiGLU
    MLP, rotary positions, grouped-query attention, no biases)."""
    n_layers: int = 4
    """Transformer blocks."""
    d_model: int = 128
    """Hidden size; must be divisible by n_heads (and d_model/n_heads even for llama,
    whose rotary embedding turns pairs of features)."""
    n_heads: int = 4
    """Attention heads; divisible by parallel.tp (heads are split across tensor ranks)."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention, llama; 0: n_heads). Divides n_heads, and
    is divisible by parallel.tp: key/value heads are split across tensor ranks too."""
    ffn_hidden: int = 0
    """MLP hidden size; 0: the architecture's rule (gpt2 4·d_model; llama 8/3·d_model
    rounded up to a multiple of 256). Divisible by parallel.tp."""
    seq_len: int = 128
    """Tokens per training sample (gpt2: also the number of learned positions)."""
    vocab_size: int = 256
    """Token ids are in [0, vocab_size); the byte tokenizer needs 256. Any size works
    with any tp (see pad_vocab_to). A vocabulary smaller than the data's (recorded in its
    token files' sidecars) or data.tokenizer's is refused at submission, naming both."""
    pad_vocab_to: int = 128
    """The embedding and head are padded to a multiple of this times parallel.tp
    (Megatron's make-vocab-size-divisible-by), so any vocabulary splits over any tp;
    padded logits never enter the softmax, and checkpoints and exports hold the true
    vocabulary only."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm (gpt2) or RMSNorm (llama)."""
    rope_theta: float = 10000.0
    """Base of llama's rotary position embedding (gpt2 has learned positions)."""
    rope_scaling_factor: float = 0.0
    """Llama 3's rotary frequency scaling (Llama 3.1 and later; transformers' rope_type
    llama3), which stretches a model trained on rope_original_positions to a longer
    context: rotary wavelengths longer than rope_original_positions/rope_low_freq_factor
    are multiplied by this factor, those shorter than
    rope_original_positions/rope_high_freq_factor kept, those between blended. 0 (the
    default): no scaling; otherwise at least 1. Llama only; checkpoint.init reads it."""
    rope_low_freq_factor: float = 1.0
    """Llama 3 scaling: wavelengths above rope_original_positions/this are fully scaled.
    Greater than 0."""
    rope_high_freq_factor: float = 4.0
    """Llama 3 scaling: wavelengths below rope_original_positions/this are kept. Greater
    than rope_low_freq_factor."""
    rope_original_positions: int = 8192
    """Llama 3 scaling: the context the model was pretrained for before scaling
    (transformers' original_max_position_embeddings)."""
    tie_embeddings: bool | None = None
    """The output head reuses the input embedding's weights; default true for gpt2,
    false for llama; both architectures take either. Tied and pipelined, the embedding
    lives on the first and the last stage, and its two copies sum their gradients."""

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ConfigError(f"model.arch={shown(self.arch)} must be one of {', '.join(ARCHS)}")
        _positive("model", self, "n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "pad_vocab_to",
                  "rope_original_positions")
        for name in ("n_kv_heads", "ffn_hidden"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be 0 (the default) or more")
        # Resolved here so everything downstream (the wire, checkpoints, the memory
        # model) sees one complete shape.
        resolve_defaults(self)
        _bounded("model", self)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}: "
                              f"each key/value head serves a group of query heads")
        if self.arch == "gpt2" and self.n_kv_heads != self.n_heads:
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} must equal model.n_heads={self.n_heads} "
                              f"for model.arch='gpt2' (grouped-query attention is llama's)")
        if self.arch == "llama" and self.head_dim % 2:
            raise ConfigError(f"model.d_model/model.n_heads={self.head_dim} must be even for model.arch='llama': "
                              f"rotary embeddings turn pairs of features")
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise ConfigError(f"model.norm_eps={self.norm_eps} and model.rope_theta={self.rope_theta} "
                              f"must be greater than 0")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        tuned = [f"model.{name}={getattr(self, name)}" for name in ROPE_SCALING
                 if getattr(self, name) != defaults[name]]
        if tuned and self.arch == "gpt2":
            raise ConfigError(f"{', '.join(tuned)} must be left out for model.arch='gpt2': they scale llama's "
                              f"rotary embedding, and gpt2 learns its positions")
        if tuned and not self.rope_scaling_factor:
            raise ConfigError(f"{', '.join(tuned)} must be left out while model.rope_scaling_factor=0 (no scaling): "
                              f"they tune the scaling")
        if self.rope_scaling_factor and self.rope_scaling_factor < 1:
            raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be 0 (no scaling) or at "
                              f"least 1 (Llama 3 slows long wavelengths down, never speeds them up)")
        if not self.rope_low_freq_factor > 0:
            raise ConfigError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} must be greater than 0")
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must be greater than "
                              f"model.rope_low_freq_factor={self.rope_low_freq_factor}: wavelengths between "
                              f"their bounds are blended")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab(self, tp)
