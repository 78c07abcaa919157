"""Predicted activation bytes one (chunk, microbatch) keeps between its forward and its
backward, per tp rank: what stageserver/activation_meter.py measures, exactly.

Counted the way Korthikanti et al. 2022 (section 4.1) count sbh(34 + 5as/h), but tensor
by tensor for each architecture on torch 2.13's CPU kernels, and by distinct storage, so
what several saved tensors share counts once: q, k and v are three views of gpt2's one
qkv output; proj saves a view of the attention output; a norm's input is the residual
stream; the token ids are a view of the sampler's window.
Notation: b rows, s tokens, d d_model, h n_heads, hd head_dim, F ffn_hidden, V the
vocabulary padded for tp, t tp, a the compute dtype's bytes; f is the float32 floor (4
for bf16, else a) of what the kernels keep at float32 at least: softmax statistics, and
the float32 copy in which llama's RMSNorm normalises a bf16 input.

Per transformer block, per tp rank:
  gpt2    b*s*d*a*(4 + 4/t) + 2*b*s*F*a/t   residual stream (twice), LayerNorm outputs,
                                             q/k/v, attention output, up and GELU outputs
        + 4*b*s*a                            the two LayerNorms' mean and rstd
        + b*(h/t)*s*f                        the attention's logsumexp
  llama   2*b*s*d*f + b*s*d*a*(4 + 4/t)     the norms' inputs (as normalised), x*rsqrt and
        + 4*b*s*F*a/t                        outputs; q, k, v, attention output; SwiGLU's
                                             gate, SiLU, up and product
        + 2*b*s*f + b*(h/t)*s*f              the two reciprocal rms, the logsumexp
        + 2*s*hd*a                           the rotary cos and sin tables
Sequence parallelism (Korthikanti et al. 2022, section 4.2.2; parallel.sequence_parallel)
keeps every term that sits between the tensor-parallel regions on this rank's s/t
tokens: the norms' inputs, statistics and outputs (the column-parallel linears keep
their local input and gather it again in the backward), the chunk's input and output,
the embedding's positions; what sits inside them is as without it (every token of the
rank's heads and columns), as are the rotary tables, the token ids and the head's
input gradient over the whole sequence. A gpt2 block is then exactly its t=1 bytes over t.
No s^2 term: CPU scaled_dot_product_attention is the flash kernel, which saves only
q, k, v, its output and the logsumexp, not the attention matrix (nor, without dropout, a
mask). Grouped-query attention saves k and v repeated to every query head, so they are
as large as q whatever n_kv_heads. Parameters are excluded (the memory model counts them
as parameters).

Worked example, a Llama-2 7B block (d 4096, 32 heads, F 11008) at b=1, s=4096, t=1 in
bf16 (a=2, f=4): 4096*4096*(2*4 + 2*8) + 4*4096*11008*2 + 2*4096*4 + 32*4096*4
+ 2*4096*128*2 = 766,017,536 bytes, 730.5 MiB per layer and sample.

The chunk with the head keeps no logits: its fused loss (stageserver/model/fused_loss.py)
makes the head's gradients in the forward, a chunk of tokens at a time, and keeps only
them for the backward, the input's b*s*d*a (every token) and the head shard's
(V/t)*d*a, besides the final norm's own. (Unfused it kept the float32 softmax,
b*s*(V/t)*f, with the final norm's output and the targets: for the 8x2048 tokens, V
50304, d 2048 bf16 head, 3,296,722,944 + 67,108,864 + 147,456 bytes against the fused
67,108,864 + 206,045,184.) The transient of one chunk's logits in the forward, bounded
by loss_chunks.CHUNK_BYTES, is not on the ledger, as no forward temporary is; admission
adds it to the peak (head_loss_temporaries_bytes).

Blocks compiled by train.compile keep what inductor's partitioner chooses, counted by
compiled_block_bytes: for gpt2 the same as eager, for llama and for float8 blocks less;
under selective recompute compiled_selective_block_bytes, less than eager for every
architecture; the embedding, final norm and head stay eager.

A split backward (zero-bubble schedules) frees these at its input-gradient half I and
keeps until its weight-gradient half W only what the parameter gradients are computed
from: `weight_grad_bytes`, documented there.
"""

from __future__ import annotations

from interleaf.common.model.loss_chunks import chunk_tokens
from interleaf.coordinator.config import PRECISION_BYTES as _BYTES

_INT64 = 8
_BOOL = 1


def _dtype_bytes(precision: str) -> tuple[int, int]:
    """(compute dtype bytes, bytes of what the kernels keep in at least float32)."""
    if precision not in _BYTES:
        raise ValueError(f"precision={precision!r} must be one of {', '.join(_BYTES)}")
    a = _BYTES[precision]
    return a, max(a, 4)


def token_window_bytes(seq_len: int, rows: int) -> int:
    """The sampler's [rows, seq_len+1] int64 window, of which a microbatch's inputs and
    targets are two overlapping views: holding either keeps all of it."""
    return rows * (seq_len + 1) * _INT64


def _norm_bytes(arch: str, bs: int, d: int, a: int, f: int) -> tuple[int, int]:
    """(what a norm keeps of its input, what it keeps besides its input and its output).
    The output is the next matmul's input, counted there."""
    if arch == "gpt2":  # LayerNorm: its input, and mean and rstd in the compute dtype on CPU, even bf16
        return bs * d * a, 2 * bs * a
    # RMSNorm (llama/model.py): what it normalises - the input itself, or its float32
    # copy for bf16, whose bf16 original is then kept by nothing - its reciprocal rms,
    # and x*rsqrt cast back, which the scale's gradient reads.
    return bs * d * f, bs * f + bs * d * a


def _local_tokens(rows: int, seq_len: int, tp: int, sequence_parallel: bool) -> int:
    """Tokens of the residual stream one tp rank holds: its slice under sequence
    parallelism, else all of them."""
    return rows * seq_len // tp if sequence_parallel else rows * seq_len


def block_activation_bytes(model, rows: int, tp: int, precision: str, sequence_parallel: bool = False) -> int:
    """What one transformer block saves for its backward, on one tp rank; `model` has
    ModelShape's fields (a job's `[model]` section, a ModelShape)."""
    a, f = _dtype_bytes(precision)
    s, d = model.seq_len, model.d_model
    bs, local_heads = rows * s, model.n_heads // tp
    local = _local_tokens(rows, s, tp, sequence_parallel)
    norm_input, norm_own = _norm_bytes(model.arch, local, d, a, f)
    norms = 2 * (norm_input + norm_own + local * d * a)  # ln_1, ln_2; outputs: the q/k/v and up/gate input
    # SDPA's q, k and v: gpt2's qkv output, of which they are three views; llama's q and
    # k turned (fresh tensors) and v, with k and v repeated to every query head
    # (repeat_interleave copies) where n_kv_heads < n_heads.
    attention = (
        3 * bs * d // tp * a
        + bs * d // tp * a  # SDPA output, [b, s, h, hd] in memory: proj saves it as a view
        + rows * local_heads * s * f  # SDPA logsumexp [b, h/t, s], float32 for bf16
    )
    ffn = model.ffn_hidden // tp
    if model.arch == "gpt2":
        mlp = 2 * bs * ffn * a  # up output (GELU(tanh)'s input), GELU output (down's input)
    else:
        attention += 2 * s * model.head_dim * a  # the rotary cos and sin, made per forward
        mlp = 4 * bs * ffn * a  # gate output (SiLU's input), SiLU and up outputs, their product (down's)
    # The block's output is the next block's ln_1 input, or the chunk's output / ln_f input.
    return norms + attention + mlp


def compiled_block_bytes(model, rows: int, tp: int, precision: str, sequence_parallel: bool = False,
                         fp8_recipe: str = "tensorwise") -> int:
    """What one block compiled by train.compile (stageserver/model/compiled.py) saves for
    its backward, on one tp rank: what inductor's partitioner keeps, which recomputes
    in the backward whatever is cheap elementwise work on a kept tensor, measured tensor
    by tensor on torch 2.13's CPU kernels (tests/test_compiled_activation_bytes.py) and
    matching the GPU's ledger (docs/gpus.md). Per block:
      gpt2    as eager (block_activation_bytes): inductor keeps the same tensors
      llama   4*b*s_local*d*a                 the residual stream twice (the norms'
                                               inputs, in the compute dtype: no float32
                                               copy) and both norms' outputs
            + 2*b*s_local*f                   the two reciprocal rms
            + 4*b*s*d*a/t + b*(h/t)*s*f       q, k, v, the attention output, the logsumexp
            + 3*b*s*F*a/t                     gate and up outputs, SiLU(gate)*up (down's
                                               input); SiLU itself and the rotary tables
                                               are recomputed
    float8 (train.precision="fp8", tp=1 only; a=2, f=4): the norms' outputs and the MLP's
    activation are recomputed too (their float8 casts are, anyway):
      gpt2    6*b*s*d*a + 4*b*s*f + b*h*s*f   residual stream twice, q/k/v, attention
            + b*s*F*a                         output; LayerNorm statistics (float32); up
      llama   6*b*s*d*a + 2*b*s*f + b*h*s*f   likewise, the reciprocal rms
            + 2*b*s*F*a                       gate and up
    plus, with the tensorwise recipe, one compute-dtype scalar per linear (4 in a gpt2
    block, 7 in a llama one), the scale its backward reads."""
    a, f = _dtype_bytes(precision)
    s, d = model.seq_len, model.d_model
    bs = rows * s
    local = _local_tokens(rows, s, tp, sequence_parallel)
    ffn = model.ffn_hidden // tp
    attention = 4 * bs * d // tp * a + rows * (model.n_heads // tp) * s * f  # q, k, v, output; logsumexp
    if precision == "fp8":
        linears = 4 if model.arch == "gpt2" else 7
        scales = linears * a if fp8_recipe == "tensorwise" else 0
        if model.arch == "gpt2":
            return 2 * bs * d * a + attention + 4 * bs * f + bs * ffn * a + scales
        return 2 * bs * d * a + attention + 2 * bs * f + 2 * bs * ffn * a + scales
    if model.arch == "gpt2":
        return block_activation_bytes(model, rows, tp, precision, sequence_parallel)
    return 4 * local * d * a + 2 * local * f + attention + 3 * bs * ffn * a


def compiled_selective_block_bytes(model, rows: int, tp: int, precision: str, sequence_parallel: bool = False) -> int:
    """What one compiled block keeps under selective recompute, on one tp rank.

    The block and its checkpoint are compiled together (stageserver/model/recompute.py,
    SelectiveCheckpointed; its tensor-parallel collectives traced as graph nodes,
    traced_collectives.py), so inductor's partitioner sees the policy: it saves the
    matrix products' outputs, attention's and the forward collectives' (under sequence
    parallelism the gathered column-parallel products, whose operator keeps this rank's
    tokens of their input), and recomputes the rest in the compiled backward - but only
    what that backward reads. The last product's output (GPT-2's second MLP projection,
    Llama's down projection; at tp > 1 its sum over the group, this rank's tokens of it
    under sequence parallelism) goes into the residual sum alone, which no gradient
    reads, so it is not kept, where the eager policy keeps every product's output:
      selective_block_bytes - b*s_local*d*a
    Float8 blocks (tp = 1 only) keep the same: the products' bf16 outputs, their float8
    operands recast in the backward from the bf16 tensors kept anyway."""
    a = _dtype_bytes(precision)[0]
    local = _local_tokens(rows, model.seq_len, tp, sequence_parallel)
    return selective_block_bytes(model, rows, tp, precision, sequence_parallel) - local * model.d_model * a


def selective_block_bytes(model, rows: int, tp: int, precision: str, sequence_parallel: bool = False) -> int:
    """What one block keeps under selective recompute (stageserver/model/recompute.py),
    on one tp rank: its input, the outputs of its column-parallel matrix products and of
    attention (every token of the rank's heads and columns), and its two row-parallel
    outputs after their collective (summed over the group; sequence parallel: this
    rank's tokens of the sum). The row-parallel partial products and the gathered
    column-parallel inputs are temporaries of the forward, never kept. Per block:
      gpt2    b*s*a*(3d/t + d/t) + b*s*F*a/t        qkv, attention output; up
      llama   b*s*a*(d/t + 2*kv*hd/t + d/t)        q, k, v, attention output; gate, up
            + 2*b*s*F*a/t
      both  + 2*b*s_local*d*a                      proj and down, after g (or g')
            + b*(h/t)*s*f + b*s_local*d*a          the logsumexp, the block's input
    With tp > 1 the block's Tape holds the row-parallel outputs (and under sequence
    parallelism the column-parallel ones) instead of torch's cache: the same tensors,
    counted once."""
    a, f = _dtype_bytes(precision)
    s, d = model.seq_len, model.d_model
    bs = rows * s
    local = _local_tokens(rows, s, tp, sequence_parallel)
    ffn = model.ffn_hidden // tp
    if model.arch == "gpt2":
        columns = bs * a * (3 * d // tp) + bs * ffn * a
    else:
        columns = bs * a * (model.n_heads * model.head_dim // tp + 2 * (model.n_kv_heads * model.head_dim // tp)) \
            + 2 * bs * ffn * a
    rows_out = 2 * local * d * a
    attention = bs * d // tp * a + rows * (model.n_heads // tp) * s * f
    return local * d * a + columns + rows_out + attention


def _blocks_bytes(model, modes: list[str], rows: int, tp: int, precision: str, sequence_parallel: bool,
                  compiled: bool, fp8_recipe: str) -> int:
    """The blocks of a chunk, each as its recompute mode keeps it (recompute.block_modes),
    compiled or eager."""
    a, _ = _dtype_bytes(precision)
    if compiled:
        plain = compiled_block_bytes(model, rows, tp, precision, sequence_parallel, fp8_recipe)
        selective = compiled_selective_block_bytes(model, rows, tp, precision, sequence_parallel)
    else:
        plain = block_activation_bytes(model, rows, tp, precision, sequence_parallel)
        selective = selective_block_bytes(model, rows, tp, precision, sequence_parallel)
    kept = {"none": plain, "selective": selective,
            "full": _local_tokens(rows, model.seq_len, tp, sequence_parallel) * model.d_model * a}  # input only
    return sum(kept[mode] for mode in modes)


def chunk_activation_bytes(
    model, layers: int, has_embedding: bool, has_head: bool, rows: int, tp: int, precision: str,
    sequence_parallel: bool = False, block_modes: list[str] | None = None, compiled: bool = False,
    fp8_recipe: str = "tensorwise",
) -> int:
    """Bytes one tp rank keeps from a chunk's forward of `rows` samples of model.seq_len
    tokens until its backward (recompute=none, or per block `block_modes`, one of
    common/model/recompute_modes.py's block_modes), counting the chunk's input and
    output; `model` has ModelShape's fields; `compiled`: its blocks run through
    torch.compile (train.compile), the embedding, final norm and head eager. Also the
    transient peak of saved activations while recompute=full reruns the forward in the
    backward."""
    a, f = _dtype_bytes(precision)
    s, d = model.seq_len, model.d_model
    bs = rows * s
    local = _local_tokens(rows, s, tp, sequence_parallel)
    norm_input, norm_own = _norm_bytes(model.arch, local, d, a, f)
    modes = block_modes or ["none"] * layers
    total = _blocks_bytes(model, modes, rows, tp, precision, sequence_parallel, compiled, fp8_recipe)
    if has_embedding:
        total += (
            token_window_bytes(s, rows)  # x: the token ids, a view of the window
            + bs * _INT64  # the ids local to this rank's vocab slice (embedding's indices)
            + bs * _BOOL  # which ids are outside that slice (masked_fill's mask)
            + (local // rows * _INT64 if model.arch == "gpt2" else 0)  # this rank's positions (wpe's indices)
        )
    elif norm_input != local * d * a and modes[0] == "none" and not compiled:
        # x, the input, which the first eager block's norm keeps only as its float32 copy
        # (a recomputed or compiled block keeps the input itself, counted with the block)
        total += local * d * a
    if has_head:
        total += (
            norm_input + norm_own  # ln_f: its input is the last hidden states
            + bs * d * a  # grad_x, every token (sequence parallel: reduce-scattered in the backward)
            + model.padded_vocab(tp) // tp * d * a  # grad_W of this rank's head shard, padding rows included
            + f  # out: the scalar loss, float32 for bf16
        )  # the fused loss (stageserver/model/fused_loss.py) keeps no logits, softmax nor targets
    else:
        total += local * d * a  # out: the chunk's output, which no block keeps
    return total


def head_loss_temporaries_bytes(model, rows: int, tp: int, precision: str, sequence_parallel: bool = False,
                                compiled: bool = False) -> int:
    """The most the head chunk's forward holds for a moment beyond what it keeps (grad_x
    and grad_W among that): the fused loss's temporaries (stageserver/model/
    fused_loss.py), which no ledger counts, at their peak within one chunk of c tokens
    of the loop (c: common/model/loss_chunks.py), with V' = V/t:
      ln_f's output, the loss's input           b*s_local*d*a, for the whole loop
      its gather (sequence parallel)            b*s*d*a, and as much again for the copy
                                                that flattens it where rows > 1
      the per-token losses                      b*s*f
      grad_W's sum in float32 where narrower    V'*d*f, less the kept grad_W (V'*d*a),
                                                made from it at the end (where not
                                                narrower the sum is the kept grad_W)
      one chunk, the larger of two moments      the logits and the softmax-to-gradient
                                                tensor: eager c*V'*(a + f) (the float32
                                                copy, where a < f; else the logits
                                                themselves, c*V'*a), compiled 2*c*V'*a;
                                                then the gradient and its product with
                                                the chunk's input, c*V'*a + V'*d*a
    Worked example, the 1.11B GPT of docs/gpus.md (V 50304, d 2048, 8 x 2048 tokens,
    bf16, c = 1280): 67,108,864 + 65,536 + 206,045,184 + 386,334,720 = 659,554,304
    bytes eager; compiled the chunk's larger moment is the product's, 334,823,424, so
    608,043,008."""
    a, f = _dtype_bytes(precision)
    local_vocab, d = model.padded_vocab(tp) // tp, model.d_model
    tokens = rows * model.seq_len
    local = _local_tokens(rows, model.seq_len, tp, sequence_parallel)
    c = min(chunk_tokens(local_vocab, f), tokens)
    head = local_vocab * d
    gathered = tokens * d * a * (2 if rows > 1 else 1) if sequence_parallel and tp > 1 else 0
    summed = head * f - head * a if f != a else 0
    # beside the chunk's logits: the gradient (compiled), or the float32 copy (eager, a < f)
    beside = c * local_vocab * a if compiled else c * local_vocab * f if a < f else 0
    chunk = c * local_vocab * a + max(beside, head * a)
    return local * d * a + gathered + tokens * f + summed + chunk


def chunk_input_bytes(model, has_embedding: bool, rows: int, precision: str, tp: int = 1,
                      sequence_parallel: bool = False) -> int:
    """Bytes one tp rank keeps from a chunk's forward until its backward with
    recompute=full: only the input, token ids for the chunk with the embedding (the head
    chunk's targets are read again, not kept), else hidden states [rows, seq, d_model]
    (sequence parallel: this rank's seq/tp of them)."""
    if has_embedding:
        return token_window_bytes(model.seq_len, rows)
    a, _ = _dtype_bytes(precision)
    return _local_tokens(rows, model.seq_len, tp, sequence_parallel) * model.d_model * a


def _norm_weight_grad_bytes(arch: str, tokens: int, d: int, a: int) -> int:
    """What W needs of one norm over `tokens` tokens for its scale's (and bias's)
    gradient: gpt2's LayerNorm its input with mean and rstd (the compute dtype on CPU),
    from which x-hat is rebuilt; llama's RMSNorm its normalised input as cast back to the
    compute dtype (x*rsqrt, which the scale multiplies); both the output's gradient."""
    kept = tokens * d * a + (2 * tokens * a if arch == "gpt2" else 0)
    return kept + tokens * d * a


def block_weight_grad_bytes(model, rows: int, tp: int, precision: str, sequence_parallel: bool = False) -> int:
    """What one block keeps from its I until its W, on one tp rank: per parameter op its
    input and its output's gradient, each distinct storage once, in the compute dtype
    (s_local: this rank's s/t tokens under sequence parallelism, else s):
      ln_1, ln_2      2 * norm (see _norm_weight_grad_bytes) over b*s_local tokens
      qkv / q,k,v     input b*s*d (ln_1's output; under sequence parallelism gathered, the
                      whole sequence, so the weight gradient needs no collective); output
                      gradients b*s*(h + 2*kv)*hd/t (gpt2: kv = h)
      up / gate, up   input b*s*d (ln_2's output, one storage for both, likewise
                      gathered); output gradients b*s*F/t each
      proj            input b*s*h*hd/t, the attention output; output gradient b*s*d (the
                      residual stream's; under sequence parallelism as gathered in the
                      backward, every token)
      down            input b*s*F/t (GELU's output, or SiLU(gate)*up); output gradient b*s*d
      proj.bias,      (gpt2, sequence parallel) added after the reduce-scatter, they read
      down.bias       its output gradient, this rank's b*s_local*d of it, each a storage
                      apart from the gathered copy; without sequence parallelism that
                      is the linear's own output gradient, and the column-parallel
                      biases read their linear's
    The same whatever the recompute mode: I reruns what recompute dropped, and W reads
    the same tensors."""
    a, _ = _dtype_bytes(precision)
    s, d, hd = model.seq_len, model.d_model, model.head_dim
    bs = rows * s
    local = _local_tokens(rows, s, tp, sequence_parallel)
    ffn = model.ffn_hidden // tp
    kv_heads = model.n_heads if model.arch == "gpt2" else model.n_kv_heads
    attention_columns = (model.n_heads // tp + 2 * (kv_heads // tp)) * hd
    mlp_columns = ffn if model.arch == "gpt2" else 2 * ffn
    row_biases = 2 * local * d * a if model.arch == "gpt2" and sequence_parallel else 0
    return (
        2 * _norm_weight_grad_bytes(model.arch, local, d, a)
        + 2 * bs * d * a  # the attention's and the MLP's column-parallel input
        + bs * (attention_columns + mlp_columns) * a  # their output gradients
        + bs * (model.n_heads // tp * hd + ffn) * a  # proj's and down's inputs
        + 2 * bs * d * a  # proj's and down's output gradients
        + row_biases
    )


def weight_grads_read_input(model) -> bool:
    """Whether W reads a chunk's input hidden states themselves: gpt2's first LayerNorm
    keeps its input for its weight gradient; llama's RMSNorm keeps its normalised copy
    instead."""
    return model.arch == "gpt2"


def weight_grad_bytes(model, layers: int, has_embedding: bool, has_head: bool, rows: int, tp: int,
                      precision: str, sequence_parallel: bool = False) -> int:
    """Bytes one tp rank keeps of a chunk's microbatch from its input-gradient half I
    until its weight-gradient half W (Qi et al. 2024, section 2): what the parameter
    gradients are computed from, and nothing of what only the input gradient needed
    (attention's q, k, v and logsumexp, the activation functions' inputs, the head's gradients,
    the chunk's input and output as such). Arguments as chunk_activation_bytes's; no
    block_modes, since every recompute mode keeps the same for W (see
    block_weight_grad_bytes). Besides the blocks:
      embedding   the ids local to this rank's vocabulary slice (int64, b*s) and the
                  lookup's output gradient b*s*d, padding ids' rows zeroed (every token:
                  under sequence parallelism gathered in the backward); gpt2's wpe its
                  positions (int64, s_local) and its output gradient, summed over the
                  rows, s_local*d
      head        nothing: the final norm's parameter gradients are computed in I
                  (stageserver/model/weight_grads.at_once), and the head matmul's in
                  its forward (fused_loss.py) and handed to autograd by I

    Worked example, the Llama-2 7B block of the module's docstring (b=1, s=4096, t=1,
    bf16): 4096*4096*2*(4 + 4) + 4096*2*(4096 + 96*128) + 3*4096*11008*2 = 673,185,792
    bytes, 642 MiB, against the forward's 730.5 MiB: a deferred W holds most of what a
    B would have freed, because it keeps the linears' output gradients."""
    a, _ = _dtype_bytes(precision)
    s, d = model.seq_len, model.d_model
    bs = rows * s
    local = _local_tokens(rows, s, tp, sequence_parallel)
    total = layers * block_weight_grad_bytes(model, rows, tp, precision, sequence_parallel)
    if has_embedding:
        total += bs * _INT64 + bs * d * a
        if model.arch == "gpt2":
            positions = local // rows
            total += positions * _INT64 + positions * d * a
    return total
