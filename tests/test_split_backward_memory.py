"""The memory a split backward holds: what a chunk's input-gradient half I keeps for its
weight-gradient half W (coordinator/activation_bytes.py's weight_grad_bytes), and the
memory model's walk of programs with I and W (coordinator/memory_model.py). Programs
are the planned ones with each B split by hand (tests/split_backward.py), so these need
no zero-bubble schedule.
All figures are integers of bytes: compared exactly.
"""

from __future__ import annotations

import pytest

from interleaf.common.model.config import ModelShape, shape_of
from interleaf.common.model.recompute_modes import block_modes
from interleaf.coordinator.activation_bytes import (
    block_weight_grad_bytes,
    chunk_activation_bytes,
    weight_grad_bytes,
)
from interleaf.coordinator.config import load_config
from interleaf.coordinator.memory_model import bucket_sizes, predict, predict_rank
from interleaf.coordinator.partition import chunks_of, partition
from interleaf.coordinator.plan import plan_programs
from interleaf.protos.actions import Action, Kind
from tests.split_backward import split_backwards

BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}

# --- what W keeps, tensor by tensor -----------------------------------------------------------


def _kept_by_op(model: ModelShape, rows: int, tp: int, precision: str, sp: bool, emb: bool, head: bool,
                layers: int) -> dict[str, int]:
    """Every tensor W reads, named by the op that reads it, as (elements, bytes each):
    a second count, op by op, of what weight_grad_bytes sums term by term."""
    a, s, d, hd = BYTES[precision], model.seq_len, model.d_model, model.head_dim
    bs = rows * s
    local = bs // tp if sp else bs  # the residual stream's tokens on this rank
    h, kv, ffn = model.n_heads // tp, model.n_kv_heads // tp, model.ffn_hidden // tp
    gpt2 = model.arch == "gpt2"

    def norm(name: str) -> dict[str, int]:
        kept = {f"{name} input": local * d * a, f"{name} mean": local * a, f"{name} rstd": local * a} if gpt2 \
            else {f"{name} normalised input": local * d * a}
        return {**kept, f"{name} output grad": local * d * a}

    tensors: dict[str, int] = {}
    for layer in range(layers):
        block = {
            **norm("ln_1"), **norm("ln_2"),
            "attention input (ln_1 output, gathered under sp)": bs * d * a,
            "proj input (attention output)": bs * h * hd * a,
            "proj output grad": bs * d * a,
            "mlp input (ln_2 output, gathered under sp)": bs * d * a,
            "down input": bs * ffn * a,
            "down output grad": bs * d * a,
        }
        if gpt2:
            block |= {"qkv output grad": bs * 3 * h * hd * a, "up output grad": bs * ffn * a}
            if sp:  # the row-parallel biases' output gradients, this rank's tokens
                block |= {"proj.bias output grad": local * d * a, "down.bias output grad": local * d * a}
        else:
            block |= {"q output grad": bs * h * hd * a, "k output grad": bs * kv * hd * a,
                      "v output grad": bs * kv * hd * a, "gate output grad": bs * ffn * a,
                      "up output grad": bs * ffn * a}
        tensors |= {f"h.{layer} {name}": n for name, n in block.items()}
    if emb:
        tensors |= {"wte local ids": bs * 8, "wte output grad": bs * d * a}
        if gpt2:
            tensors |= {"wpe positions": local // rows * 8, "wpe output grad": local // rows * d * a}
    # The head's (ln_f and the output matmul) are computed in I (weight_grads.at_once):
    # nothing of it, the logits' gradient least of all, waits for W.
    return tensors


GPT2 = ModelShape(n_layers=4, d_model=48, n_heads=4, seq_len=12, vocab_size=100, pad_vocab_to=8)
LLAMA = ModelShape(n_layers=4, d_model=64, n_heads=4, seq_len=12, vocab_size=100, arch="llama", n_kv_heads=2,
                   ffn_hidden=80, pad_vocab_to=8)


@pytest.mark.parametrize("precision", BYTES)
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-sp"])
@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_weight_grad_bytes_is_each_kept_tensor_once(model, tp, sp, precision):
    for emb, head, layers in [(False, False, 1), (True, False, 2), (False, True, 1), (True, True, 3)]:
        expected = sum(_kept_by_op(model, 3, tp, precision, sp, emb, head, layers).values())
        assert weight_grad_bytes(model, layers, emb, head, 3, tp, precision, sp) == expected, (emb, head, layers)


def test_the_llama_2_7b_worked_example():
    llama_7b = ModelShape(arch="llama", n_layers=32, d_model=4096, n_heads=32, seq_len=4096, vocab_size=32000)
    assert block_weight_grad_bytes(llama_7b, 1, 1, "bf16") == 673_185_792


def test_sequence_parallelism_keeps_the_gathered_inputs_whole():
    """The norms' terms shrink with t, the column-parallel inputs and the row-parallel
    output gradients, gathered, do not: at t=2 a llama block keeps its two norms'
    normalised input and output gradient halved with sequence parallelism, 2*b*s*d*a
    fewer bytes, not half; a gpt2 block its norms' input, statistics and output
    gradient halved, 2*b*s*d*a + 2*b*s*a fewer, less the b*s*d*a its row-parallel
    biases then keep, their halves of the sums' gradients."""
    rows, a = 2, 4
    bs = rows * LLAMA.seq_len
    plain = block_weight_grad_bytes(LLAMA, rows, 2, "fp32")
    split = block_weight_grad_bytes(LLAMA, rows, 2, "fp32", sequence_parallel=True)
    assert plain - split == 2 * bs * LLAMA.d_model * a
    assert split > plain // 2
    bs = rows * GPT2.seq_len
    plain = block_weight_grad_bytes(GPT2, rows, 2, "fp32")
    split = block_weight_grad_bytes(GPT2, rows, 2, "fp32", sequence_parallel=True)
    assert plain - split == 2 * bs * GPT2.d_model * a + 2 * bs * a - bs * GPT2.d_model * a


# --- the memory model's walk of split programs ------------------------------------------------

MODEL = ["model.d_model=32", "model.n_heads=2", "model.seq_len=8", "model.vocab_size=64"]


def _config(n_layers: int, pp: int, vpp: int, *extra: str):
    """pp=2: 4 microbatches of 1 sample per data-parallel rank; pp=1: 3 of 2 samples."""
    schedule = "interleaved-1f1b" if vpp > 1 else "1f1b"
    batch = ["parallel.microbatches=4", "train.global_batch=8"] if pp > 1 else \
        ["parallel.microbatches=3", "train.global_batch=6"]
    return load_config("", MODEL + [f"model.n_layers={n_layers}", f"parallel.pp={pp}", f"parallel.vpp={vpp}",
                                    f"parallel.schedule={schedule}", *batch, *extra])


@pytest.mark.parametrize("arch", [[], ["model.arch=llama", "model.n_kv_heads=1"]], ids=["gpt2", "llama"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("deferred", [False, True], ids=["w-at-once", "w-deferred"])
def test_a_split_backward_holds_the_state_and_gradients_a_fused_one_does(deferred, zero, arch):
    """The full-size gradient lives from the chunk's first W (I writes none) to its
    reduction, after its last W: the state at the step's end and the parameter peak are
    B's; so is the gradient peak with each W right after its I, while W's deferred to
    each chunk's reduction hold one chunk's full-size gradient at a time at ZeRO-2/3,
    where B's interleaved order held both of a rank's."""
    config = _config(4, 2, 2, "parallel.dp=2", f"parallel.zero={zero}", "train.precision=bf16", *arch)
    programs, _ = plan_programs(config)
    fused = predict(config, programs)
    split = predict(config, [split_backwards(program, deferred) for program in programs])
    same = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "parameters_peak_bytes")
    for rank, (b, iw) in enumerate(zip(fused, split)):
        assert {k: iw[k] for k in same} == {k: b[k] for k in same}, f"pipeline rank {rank}"
        if deferred and zero >= 2:
            chunks = chunks_of(partition(4, 2, 2), rank)
            full = min(2 * sum(-(-n // 2) * 2 for n in bucket_sizes(config, c)) for c in chunks)  # bf16, padded
            assert iw["gradients_peak_bytes"] <= b["gradients_peak_bytes"] - full, f"pipeline rank {rank}"
        else:
            assert iw["gradients_peak_bytes"] == b["gradients_peak_bytes"], f"pipeline rank {rank}"
        assert iw["activations_peak_bytes"] >= b["activations_peak_bytes"] > 0


@pytest.mark.parametrize("recompute", [["train.recompute=none"], ["train.recompute=full"],
                                       ["train.recompute=selective", "train.recompute_layers=2"]],
                         ids=["none", "full", "selective"])
@pytest.mark.parametrize("arch", [[], ["model.arch=llama", "model.n_kv_heads=1"]], ids=["gpt2", "llama"])
def test_deferred_weight_gradients_hold_what_w_reads_until_w(arch, recompute):
    """One chunk on one rank, 3 microbatches, each W after all three I's: F0 I0 F1 I1 F2
    I2 W0 W1 W2. Each I frees its forward's activations (under full recompute, after
    rerunning it) and keeps W's; so after I_k, k+1 W's are held, and the most held is
    at the last forward, 2 W's beside a whole forward, or at the last I, 3 W's: with
    m=3, (m-1)*W + max(forward, W), whatever the recompute mode keeps between F and I."""
    config = _config(2, 1, 1, "train.precision=fp32", *arch, *recompute)
    (chunk,) = partition(2, 1, 1)
    model, rows = shape_of(config.model), 6 // 3
    forward = chunk_activation_bytes(model, 2, True, True, rows, 1, "fp32", False,
                                     block_modes(chunk.layers, config.train.recompute,
                                                 config.train.recompute_layers))
    w = weight_grad_bytes(model, 2, True, True, rows, 1, "fp32")
    programs, _ = plan_programs(config)
    split = split_backwards(programs[0], deferred=True)
    assert [str(a) for a in split if a.kind in (Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)] == \
        "F0.0 I0.0 F0.1 I0.1 F0.2 I0.2 W0.0 W0.1 W0.2".split()
    assert predict_rank(config, split, 0)["activations_peak_bytes"] == 2 * w + max(forward, w)
    # W at once after each I: one microbatch at a time.
    at_once = predict_rank(config, split_backwards(programs[0], deferred=False), 0)
    assert at_once["activations_peak_bytes"] == max(forward, w)


def test_a_w_without_its_i_is_refused():
    """W frees what its I kept: a program that runs W first (which validation refuses)
    is refused rather than predicted."""
    config = _config(2, 1, 1)
    program = [Action(Kind.FORWARD, 0, 0), Action(Kind.BACKWARD_WEIGHT, 0, 0), Action(Kind.BACKWARD_INPUT, 0, 0)]
    with pytest.raises(ValueError, match=r"^W0\.0 has no I before it"):
        predict_rank(config, program, 0)


def test_zero3_weight_gradients_need_no_gathered_parameters():
    """Deferred W's placed after the chunk's RP (W reads no parameter): the parameter
    peak is the fused program's, one gathered chunk at a time per run."""
    config = _config(4, 2, 2, "parallel.dp=2", "parallel.zero=3")
    programs, _ = plan_programs(config)
    for rank, program in enumerate(programs):
        split = split_backwards(program, deferred=True)
        for chunk in chunks_of(partition(4, 2, 2), rank):
            release = max(i for i, a in enumerate(split) if a.kind is Kind.RELEASE_PARAMS and a.chunk == chunk.index)
            assert any(a.kind is Kind.BACKWARD_WEIGHT for a in split[release:])
        assert predict_rank(config, split, rank)["parameters_peak_bytes"] == \
            predict_rank(config, program, rank)["parameters_peak_bytes"]


@pytest.mark.parametrize("arch", [[], ["model.arch=llama", "model.n_kv_heads=1"]], ids=["gpt2", "llama"])
def test_an_input_handed_over_locally_is_counted_once(arch):
    """pp=1, two chunks: chunk 1's input is chunk 0's output o, counted among chunk 0's
    activations, so chunk 1's forward does not count it again, nor its I for W1 (gpt2's
    first LayerNorm reads o) until I0.0 frees chunk 0's activations: o then moves to
    W1.0's account (stageserver/deferred_grads.py's worked example). F0.0 F1.0 I1.0 I0.0
    W1.0 W0.0: the most held is after both forwards, after I1.0 (chunk 0's forward and
    W1.0's less o) or after I0.0 (both W's whole)."""
    config = _config(4, 1, 2, "parallel.microbatches=1", "train.global_batch=2", *arch)
    model, rows, a = shape_of(config.model), 2, 4
    hidden = rows * model.seq_len * model.d_model * a
    first, second = partition(4, 1, 2)
    forward = [chunk_activation_bytes(model, 2, c.has_embedding, c.has_head, rows, 1, "fp32") for c in (first, second)]
    forward[1] -= hidden
    w = [weight_grad_bytes(model, 2, c.has_embedding, c.has_head, rows, 1, "fp32") for c in (first, second)]
    borrowed = hidden if config.model.arch == "gpt2" else 0
    program = [Action(Kind.FORWARD, 0, 0), Action(Kind.FORWARD, 1, 0), Action(Kind.BACKWARD_INPUT, 1, 0),
               Action(Kind.BACKWARD_INPUT, 0, 0), Action(Kind.BACKWARD_WEIGHT, 1, 0),
               Action(Kind.BACKWARD_WEIGHT, 0, 0), Action(Kind.OPTIMIZER_STEP)]
    peak = predict_rank(config, program, 0)["activations_peak_bytes"]
    assert peak == max(forward[0] + forward[1], forward[0] + w[1] - borrowed, w[0] + w[1])
    if borrowed:  # both W's decide it: o counted once there, and counted at all
        assert peak == w[0] + w[1]
    # W1.0 before I0.0: o is chunk 0's until then, and W1.0 frees only what it counted.
    early = program[:3] + [program[4], program[3], program[5], program[6]]
    assert predict_rank(config, early, 0)["activations_peak_bytes"] == max(
        forward[0] + forward[1], forward[0] + w[1] - borrowed, w[0])


# --- the zero-bubble schedules' own programs --------------------------------------------------


def test_zb_h1_holds_its_forwards_and_the_ws_it_owes():
    """zb-h1, pp=2, 4 microbatches (coordinator/schedule/zero_bubble.py's example):
    rank 0 runs each W right after its I, so it holds its two warmup forwards, or one
    forward and one W's bytes; rank 1 runs each W a microbatch late, so it holds one W
    beside a forward, or two W's."""
    config = _config(4, 2, 1, "parallel.schedule=zb-h1")
    model, rows = shape_of(config.model), 8 // 4
    programs, _ = plan_programs(config)
    for rank, chunk in enumerate(partition(4, 2, 1, "zb-h1")):
        forward = chunk_activation_bytes(model, 2, chunk.has_embedding, chunk.has_head, rows, 1, "fp32")
        w = weight_grad_bytes(model, 2, chunk.has_embedding, chunk.has_head, rows, 1, "fp32")
        expected = forward + max(forward, w) if rank == 0 else w + max(forward, w)
        assert predict_rank(config, programs[rank], rank)["activations_peak_bytes"] == expected, f"rank {rank}"


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zbv_holds_the_state_of_the_chunks_its_v_places(zero):
    """zbv, pp=2: rank 0 holds chunks 0 and 3 (the embedding and the head), rank 1
    chunks 1 and 2; the state each rank ends the step with is that of its chunks as
    the V places them, whatever the order of their computes."""
    config = _config(4, 2, 2, "parallel.schedule=zbv", "parallel.dp=2", f"parallel.zero={zero}")
    chunks = partition(4, 2, 2, "zbv")
    assert [[c.index for c in chunks_of(chunks, rank)] for rank in (0, 1)] == [[0, 3], [1, 2]]
    programs, _ = plan_programs(config)
    for rank, prediction in enumerate(predict(config, programs)):
        psi = sum(-(-n // 2) * 2 for c in chunks_of(chunks, rank) for n in bucket_sizes(config, c))
        assert prediction["parameters_bytes"] == 4 * (psi // 2 if zero == 3 else psi), f"rank {rank}"
        assert prediction["gradients_bytes"] == 4 * (psi if zero < 2 else psi // 2), f"rank {rank}"
        assert prediction["activations_peak_bytes"] > 0
