"""The model's shape, as the stage server receives it (see protos: ModelSpec).

The fields and their defaults mirror the job config's `[model]` section
(coordinator/config/model.py), which validates them for users; a checkpoint's manifest records
them by name, so `ModelShape(**manifest["model"])` rebuilds the model it holds."""

from __future__ import annotations

from dataclasses import dataclass, fields

INIT_STD = 0.02
"""GPT-2's initializer scale; residual output projections use INIT_STD/sqrt(2*n_layers)."""

JOB_OWN = ("seq_len", "pad_vocab_to")
"""Model fields a job keeps whatever it starts from: the training length, and the
padding of its vocabulary (never part of saved weights)."""


def default_ffn_hidden(arch: str, d_model: int) -> int:
    """The MLP width of `arch` when model.ffn_hidden is not given: GPT-2's 4·d_model, or
    Llama's 2/3 of it (SwiGLU has three matrices, not two) rounded up to a multiple of
    256 (Touvron et al. 2023, section 2.2; Meta's `multiple_of`)."""
    if arch == "llama":
        return -(-(8 * d_model // 3) // 256) * 256
    return 4 * d_model


def padded_vocab(model, tp: int) -> int:
    """Rows of the embedding and head of `model` (anything with vocab_size and
    pad_vocab_to) under `tp` tensor ranks: vocab_size rounded up to a multiple of
    pad_vocab_to·tp (Megatron's make-vocab-size-divisible-by), so any vocabulary splits
    evenly over any tp."""
    multiple = max(model.pad_vocab_to, 1) * tp
    return -(-model.vocab_size // multiple) * multiple


def resolve_defaults(model) -> None:
    """Fills a frozen model description's architecture-dependent defaults in place
    (n_kv_heads 0, ffn_hidden 0, tie_embeddings None), for ModelShape and the job
    config's `[model]` alike, so every reader sees one complete shape."""
    if not model.n_kv_heads:
        object.__setattr__(model, "n_kv_heads", model.n_heads)
    if not model.ffn_hidden:
        object.__setattr__(model, "ffn_hidden", default_ffn_hidden(model.arch, model.d_model))
    if model.tie_embeddings is None:
        object.__setattr__(model, "tie_embeddings", model.arch == "gpt2")


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    """Transformer blocks in the whole (unsplit) model."""
    d_model: int
    """Hidden size."""
    n_heads: int
    """Attention heads; d_model // n_heads is the head size."""
    seq_len: int
    """Tokens per training sample; gpt2's number of learned positions."""
    vocab_size: int
    """Token ids are in [0, vocab_size): the true vocabulary, unpadded."""
    arch: str = "gpt2"
    """gpt2 or llama (common/model/architectures.py)."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: n_heads."""
    ffn_hidden: int = 0
    """MLP hidden size; 0: the architecture's rule (default_ffn_hidden)."""
    pad_vocab_to: int = 1
    """Embedding and head rows are padded to a multiple of this times tp."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 0.0
    """Llama 3's rotary frequency scaling (llama/rope.py): the slowdown of the longest
    wavelengths; 0: none. The three fields below tune it."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    """The context the model was first trained for, before its positions were scaled."""
    tie_embeddings: bool | None = None
    """The head reuses the input embedding; None: the architecture's default (gpt2 ties)."""

    def __post_init__(self):
        resolve_defaults(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab(self, tp)


def shape_of(model) -> ModelShape:
    """The shape of anything with ModelShape's fields as attributes (the job config's
    `[model]` section, a ModelSpec off the wire)."""
    return ModelShape(**{f.name: getattr(model, f.name) for f in fields(ModelShape)})
