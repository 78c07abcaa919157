"""The memory ledger (stageserver/memory.py) and the coordinator's memory model
(coordinator/memory_model.py): bucket sizes against real ModelChunk parameters of both
architectures, the ZeRO state per stage against the table in memory_model.py's
docstring, that prediction against the ledger of real buckets, and admission
(coordinator/admission.py) of a Llama by it. All figures are integers of bytes: compared
exactly.
"""

from __future__ import annotations

import mmap

from types import SimpleNamespace

import pytest
import torch

from interleaf.coordinator.admission import AdmissionError, check_fits, needed_bytes
from interleaf.coordinator.config import load_config
from interleaf.coordinator.memory_model import (
    bucket_sizes,
    message_bytes,
    partial_grad_elements,
    predict,
    predict_rank,
    sent_bytes_per_step,
)
from interleaf.coordinator.memory_table import memory_table
from interleaf.common.buckets import BucketLayout
from interleaf.common.model.config import shape_of
from interleaf.common.model.params import TIED
from interleaf.coordinator.partition import chunks_of, partition
from interleaf.coordinator.plan import plan_programs
from interleaf.stageserver.memory import KINDS, MemoryLedger, reset_rss_peak, rss_peak_bytes
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.sharded_bucket import ShardedBucket
from interleaf.stageserver.transport import SoloTransport

# --- MemoryLedger -----------------------------------------------------------------------------


def test_ledger_tracks_current_and_peaks_by_kind_and_in_total():
    ledger = MemoryLedger()
    assert ledger.current == dict.fromkeys(KINDS, 0) == ledger.peak
    ledger.add("parameters", 100)
    ledger.add("gradients", 50)
    ledger.free("parameters", 60)
    ledger.add("activations", 30)
    ledger.add("parameters", 10)
    assert ledger.current == {**dict.fromkeys(KINDS, 0), "parameters": 50, "gradients": 50, "activations": 30}
    assert ledger.peak == {**dict.fromkeys(KINDS, 0), "parameters": 100, "gradients": 50, "activations": 30}
    # The total peak is the most held at once (150), not the sum of the kinds' peaks (180).
    assert ledger.total_peak == 150


def test_reset_peaks_starts_from_what_is_held_now():
    ledger = MemoryLedger()
    ledger.add("optimizer", 80)
    ledger.add("communication", 40)
    ledger.free("communication", 40)
    ledger.reset_peaks()
    assert ledger.peak == {**dict.fromkeys(KINDS, 0), "optimizer": 80}
    assert ledger.total_peak == 80
    ledger.add("communication", 10)
    assert ledger.peak["communication"] == 10 and ledger.total_peak == 90


def test_ledger_refuses_to_go_negative_naming_the_kind():
    ledger = MemoryLedger()
    ledger.add("gradients", 8)
    with pytest.raises(RuntimeError, match=r"memory ledger: gradients went negative \(-4 bytes\)"):
        ledger.free("gradients", 12)
    with pytest.raises(KeyError):
        ledger.add("weights", 1)


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_rss_peak_sees_a_touched_allocation_and_reset_forgets_it():
    size = 64 << 20
    reset_rss_peak()
    before = _vm_rss()
    # A mapping of its own, written so it is resident, and unmapped when closed: what
    # malloc does with a freed block depends on what the process did before (libraries
    # loaded earlier in the suite may tune it), an unmapped one is gone.
    block = mmap.mmap(-1, size)
    block.write(b"\1" * size)
    peak = rss_peak_bytes()
    assert peak >= before + size * 0.9
    block.close()
    reset_rss_peak()
    assert rss_peak_bytes() < peak - size * 0.5


# --- bucket sizes -----------------------------------------------------------------------------

MODEL = ["model.d_model=16", "model.n_heads=2", "model.seq_len=8", "model.vocab_size=64"]
LAYOUTS = {
    "one chunk (embedding and head)": (3, 1, 1),
    "embedding / middle / middle / head": (4, 2, 2),
    "uneven layers": (5, 2, 2),
}


def _config(n_layers: int, pp: int, vpp: int, *extra: str):
    schedule = "interleaved-1f1b" if vpp > 1 else "1f1b"
    return load_config("", MODEL + [f"model.n_layers={n_layers}", f"parallel.pp={pp}", f"parallel.vpp={vpp}",
                                    f"parallel.schedule={schedule}", "parallel.microbatches=2",
                                    "train.global_batch=12", *extra])


ARCHS = {
    "gpt2": [],
    "gpt2 untied": ["model.tie_embeddings=false"],
    "llama gqa untied": ["model.arch=llama", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=40"],
    "llama tied": ["model.arch=llama", "model.tie_embeddings=true"],
}
"""Every kind of chunk's parameters: with and without biases and learned positions, one
embedding or two, grouped-query attention; the vocabulary of 64 padded to 128·tp."""


def _split(names_numels, has_embedding: bool) -> list[int]:
    """stageserver/model_state.py's buckets of a model under parallel.bucket_mb: the input
    embedding alone (last where the chunk embeds, first where a head reads it), and the
    rest."""
    tied = [n for name, n in names_numels if name == TIED]
    rest = [sum(n for name, n in names_numels if name != TIED)]
    return rest + tied if has_embedding else tied + rest


@pytest.mark.parametrize("arch", ARCHS.values(), ids=ARCHS.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("tp", [1, 2])
def test_bucket_sizes_are_the_chunks_parameter_counts(tp, layout, arch):
    config = _config(*layout, f"parallel.tp={tp}", *arch)
    chunks = partition(config.model.n_layers, config.parallel.pp, config.parallel.vpp)
    assert any(c.has_embedding and not c.has_head for c in chunks) or len(chunks) == 1
    for chunk in chunks:
        for tp_rank in range(tp):
            # Building a chunk reads only its tensor group's size and rank.
            group = SimpleNamespace(size=tp, rank=tp_rank) if tp > 1 else SoloTransport()
            model = ModelChunk(shape_of(config.model), chunk.layers, chunk.has_embedding, chunk.has_head, group, 0)
            assert bucket_sizes(config, chunk) == _split([(n, p.numel()) for n, p in model.named_parameters()], chunk.has_embedding), \
                (chunk, tp_rank)
        # The input embedding's own bucket: the first chunk's, or a tied head's copy.
        assert len(bucket_sizes(config, chunk)) == 1 + (
            chunk.has_embedding or chunk.has_head and config.model.tie_embeddings)


# --- ZeRO state and peaks ---------------------------------------------------------------------

BYTES = {"fp32": (4, 4), "bf16": (2, 4), "fp64": (8, 8)}
"""precision -> (a, m): compute and master dtype bytes."""


def _padded(config, chunk, dp: int) -> list[int]:
    return [-(-n // dp) * dp for n in bucket_sizes(config, chunk)]


@pytest.mark.parametrize("precision", BYTES)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [1, 3])
def test_predicted_state_follows_the_zero_table(dp, zero, precision):
    # Two chunks per pipeline rank; dp=3 divides none of the buckets, so padding shows.
    config = _config(4, 2, 2, f"parallel.dp={dp}", f"parallel.zero={zero}", f"train.precision={precision}")
    a, m = BYTES[precision]
    programs, _ = plan_programs(config)
    predictions = predict(config, programs)
    chunks = partition(4, 2, 2)
    for rank, prediction in enumerate(predictions):
        assert prediction == predict_rank(config, programs[rank], rank)
        padded = [n for c in chunks_of(chunks, rank) for n in _padded(config, c, dp)]
        assert dp == 1 or sum(padded) > sum(n for c in chunks_of(chunks, rank) for n in bucket_sizes(config, c))
        psi = sum(padded)
        s = psi // dp
        expected = {
            0: (a * psi, a * psi, 2 * m * psi + (m * psi if a != m else 0)),
            1: (a * psi, a * psi + (m * s if a != m else 0), 2 * m * s + (m * s if a != m else 0)),
            2: (a * psi, m * s, 2 * m * s + (m * s if a != m else 0)),
            3: (a * s, m * s, 2 * m * s + (m * s if a != m else 0)),
        }[zero]
        got = (prediction["parameters_bytes"], prediction["gradients_bytes"], prediction["optimizer_bytes"])
        assert got == expected, f"pipeline rank {rank}"
    # The mixed-precision line of the ZeRO paper: (2+2+K)Ψ with K=12 at stage 0,
    # (2+2+K)Ψ/N_d at stage 3 plus 2Ψ/N_d: the gradient shard is kept in fp32 here.
    if precision == "bf16" and zero in (0, 3):
        p = predictions[0]
        state = p["parameters_bytes"] + p["gradients_bytes"] + p["optimizer_bytes"]
        psi = sum(n for c in chunks_of(chunks, 0) for n in _padded(config, c, dp))
        assert state == ((2 + 2 + 12) * psi if zero == 0 else (2 + 2 + 12 + 2) * psi // dp)


def _peaks(zero: int, a: int, m: int, psi: int, dp: int) -> tuple[int, int]:
    """One bucket's gradient and parameter peaks during a step: the full-size gradient
    (and at stage 0 in mixed precision its master-dtype copy for the optimizer, at
    stages 1-3 the reduced shard) beside the state; at stage 3 one gathered copy of the parameters beside the shard."""
    s = psi // dp
    if zero == 0:
        grads = a * psi + (m * psi if a != m else 0)
    else:  # fp32 stage 1 writes the reduced shard into the full gradient
        grads = a * psi + (0 if zero == 1 and a == m else m * s)
    params = a * s + a * psi if zero == 3 else a * psi
    return grads, params


@pytest.mark.parametrize("precision", BYTES)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_predicted_peaks_of_one_chunk_per_rank(zero, precision):
    config = _config(4, 2, 1, "parallel.dp=3", f"parallel.zero={zero}", f"train.precision={precision}")
    a, m = BYTES[precision]
    programs, _ = plan_programs(config)
    for rank, prediction in enumerate(predict(config, programs)):
        (chunk,) = chunks_of(partition(4, 2, 1), rank)
        padded = _padded(config, chunk, 3)
        # Both buckets of the chunk are held and released together.
        grads, params = _peaks(zero, a, m, sum(padded), 3)
        assert prediction["gradients_peak_bytes"] == grads, f"pipeline rank {rank}"
        assert prediction["parameters_peak_bytes"] == params, f"pipeline rank {rank}"


@pytest.mark.parametrize("arch", ["gpt2", "llama gqa untied"])
@pytest.mark.parametrize("precision", BYTES)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_prediction_equals_the_ledger_of_real_buckets(zero, precision, arch):
    """dp=1: every pipeline rank's chunks built and bucketed as a stage server does."""
    config = _config(4, 2, 2, f"parallel.zero={zero}", f"train.precision={precision}", *ARCHS[arch])
    dtype, master = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.float32),
                     "fp64": (torch.float64, torch.float64)}[precision]
    programs, _ = plan_programs(config)
    for rank in range(2):
        ledger = MemoryLedger()
        for chunk in chunks_of(partition(4, 2, 2), rank):
            gpt = ModelChunk(shape_of(config.model), chunk.layers, chunk.has_embedding, chunk.has_head, SoloTransport(), 0)
            named = list(gpt.named_parameters())
            for params in ([(n, p) for n, p in named if n == TIED], [(n, p) for n, p in named if n != TIED]):
                if params:
                    layout = BucketLayout.build([(n, p.numel()) for n, p in params], 1, 0)
                    ShardedBucket(params, layout, zero, dtype, master, SoloTransport(), ledger, set(), 0.1)
        prediction = predict_rank(config, programs[rank], rank)
        assert ledger.current == {**dict.fromkeys(KINDS, 0),
                                  "parameters": prediction["parameters_bytes"],
                                  "gradients": prediction["gradients_bytes"],
                                  "optimizer": prediction["optimizer_bytes"]}


# --- the table --------------------------------------------------------------------------------


def test_memory_table_prints_each_rank_in_mib():
    config = _config(4, 2, 2, "parallel.dp=3", "parallel.zero=3", "train.precision=bf16",
                     "model.d_model=256", "model.n_heads=4")
    programs, _ = plan_programs(config)
    predictions = predict(config, programs)
    lines = memory_table(config, predictions).splitlines()
    assert lines[0] == ("predicted memory per rank, MiB (ZeRO stage 3, bf16, recompute none; "
                        "state at the end of a step, peaks during it; the loss's forward temporaries on "
                        "the peak: what admission adds its reserve to):")
    assert lines[1].split("  ")[0].strip() == "pipeline rank"
    keys = ["parameters_bytes", "gradients_bytes", "optimizer_bytes", "parameters_peak_bytes",
            "gradients_peak_bytes", "activations_peak_bytes", "communication_peak_bytes", "peak_bytes",
            "loss_temporaries_bytes"]
    assert len(lines) == 2 + len(predictions)
    for rank, (line, prediction) in enumerate(zip(lines[2:], predictions)):
        cells = line.split()
        assert cells[0] == str(rank)
        assert cells[1:-1] == [f"{prediction[k] / (1 << 20):.2f}" for k in keys]
        assert cells[-1] == f"{(prediction['peak_bytes'] + prediction['loss_temporaries_bytes']) / (1 << 20):.2f}"
        assert float(cells[-3]) > 0.5  # the peak: a figure the MiB rounding does not hide
    assert float(lines[-1].split()[-2]) > 0 == float(lines[2].split()[-2])  # the head's rank only
    # Right-aligned columns: every line of the table is as wide as the header.
    assert len({len(line) for line in lines[1:]}) == 1


# --- admission --------------------------------------------------------------------------------

LLAMA_2_7B = ["model.arch=llama", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32",
              "model.seq_len=4096", "model.vocab_size=32000", "parallel.dp=8", "parallel.pp=1", "parallel.vpp=1",
              "parallel.schedule=1f1b", "parallel.microbatches=4", "train.global_batch=32",
              "train.precision=bf16"]
"""Llama-2 7B (ffn_hidden 11008 by the llama rule, untied head) on eight GPUs, one sample
of 4096 tokens per microbatch."""


def test_llama_2_7b_is_admitted_where_it_fits():
    """Its parameters are transformers' count of Llama-2 7B, 6,738,415,616. On 80 GB
    servers ZeRO-0 is refused: its state alone, (2+2+12)Ψ = 100 GiB, cannot fit. ZeRO-3
    is admitted: 14.1 GiB of shards (bf16 parameters; float32 gradients, master weights
    and moments), one gathered copy of the parameters, the bf16 gradients and their
    float32 staging, and 23.4 GiB of activations: 63.2 GiB with the process's reserve."""
    offers = [(f"gpu-{i}", 80 * 10**9) for i in range(8)]
    for zero, fits in ((0, False), (3, True)):
        config = load_config("", LLAMA_2_7B + [f"parallel.zero={zero}"])
        (chunk,) = partition(32, 1, 1)
        assert sum(bucket_sizes(config, chunk)) == 6_738_415_616
        programs, _ = plan_programs(config)
        needs = needed_bytes(config, programs)
        if fits:
            check_fits(needs, offers)
        else:
            with pytest.raises(AdmissionError, match=rf"^rank 0 needs {max(needs)} bytes .* offers 80000000000 bytes"):
                check_fits(needs, offers)
        assert (max(needs) < 80 * 10**9) == fits


def test_sequence_parallelism_admits_a_llama_plain_tensor_parallelism_cannot():
    """Llama-2 7B at tp=8 with two samples of 4096 tokens per microbatch: plain tensor
    parallelism keeps the norms' and residual stream's activations whole on every rank
    (21.6 GB predicted), sequence parallelism an eighth of them (6.4 GB): on 24 GB
    servers the one is refused and the other admitted."""
    offers = [(f"gpu-{i}", 24 * 10**9) for i in range(8)]
    tp8 = LLAMA_2_7B + ["parallel.dp=1", "parallel.tp=8", "train.global_batch=8"]
    peaks = {}
    for sp, fits in ((False, False), (True, True)):
        config = load_config("", tp8 + [f"parallel.sequence_parallel={str(sp).lower()}"])
        programs, _ = plan_programs(config)
        peaks[sp] = predict(config, programs)[0]["activations_peak_bytes"]
        needs = needed_bytes(config, programs)
        if fits:
            check_fits(needs, offers)
        else:
            with pytest.raises(AdmissionError, match=r"^rank \d+ needs \d+ bytes"):
                check_fits(needs, offers)
    assert 3 * peaks[True] < peaks[False]


def test_pipeline_messages_and_the_replicated_gradients_of_sequence_parallelism():
    """tp=2, pp=2, rows 2 of 16 tokens of d=32 in fp32: a message is 4096 bytes whole,
    2048 with scatter/gather or sequence parallelism; sequence parallelism sums over tp
    the gradients of a gpt2 stage's replicated parameters: on pipeline rank 0 (layers
    0-3, the embedding) 4 blocks' ln_1, ln_2, proj.bias and down.bias (6·32 each) and wpe
    (16·32), 1,280 elements."""
    base = ["model.n_layers=8", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.vocab_size=256",
            "parallel.tp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
                          "parallel.microbatches=4", "train.global_batch=8"]
    plain = load_config("", base + ["parallel.scatter_gather=false"])
    gathered = load_config("", base)
    split = load_config("", base + ["parallel.sequence_parallel=true"])
    assert message_bytes(plain) == 4096 and message_bytes(gathered) == message_bytes(split) == 2048
    assert partial_grad_elements(split, 0) == 4 * 6 * 32 + 16 * 32
    programs, _ = plan_programs(plain)
    assert sent_bytes_per_step(gathered, programs[0]) == sent_bytes_per_step(plain, programs[0]) // 2 == 4 * 2048


def test_the_loss_temporaries_are_added_to_the_head_ranks_peak_for_admission():
    """head_loss_temporaries_bytes' worked example (the 1.11B GPT of docs/gpus.md), and
    admission's need: the peak, the head rank's loss temporaries on top, the reserve."""
    from interleaf.common.model.config import ModelShape
    from interleaf.coordinator.activation_bytes import head_loss_temporaries_bytes
    from interleaf.coordinator.admission import RUNTIME_RESERVE_BYTES, needed_bytes
    from interleaf.coordinator.memory_model import with_temporaries

    gpt = ModelShape(n_layers=20, d_model=2048, n_heads=16, seq_len=2048, vocab_size=50304)
    assert head_loss_temporaries_bytes(gpt, 8, 1, "bf16") == 659_554_304
    assert head_loss_temporaries_bytes(gpt, 8, 1, "bf16", compiled=True) == 608_043_008
    # float32: the sum is the kept gradient itself, a chunk's logits become its gradient
    # in place, and the product with the chunk's input is the larger moment
    assert head_loss_temporaries_bytes(gpt, 8, 1, "fp32") == 16384 * 2048 * 4 + 16384 * 4 + 1280 * 50304 * 4 \
        + 50304 * 2048 * 4
    # sequence parallel at tp=2: half the vocabulary, ln_f's output on half the tokens,
    # their gather and its flattened copy
    assert head_loss_temporaries_bytes(gpt, 8, 2, "bf16", sequence_parallel=True) \
        - head_loss_temporaries_bytes(gpt, 8, 2, "bf16") == 2 * 16384 * 2048 * 2 - 8192 * 2048 * 2

    config = load_config("", ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"])
    programs, _ = plan_programs(config)
    predictions = predict(config, programs)
    assert predictions[0]["loss_temporaries_bytes"] == 0  # no head on the first rank
    assert predictions[1]["loss_temporaries_bytes"] == head_loss_temporaries_bytes(
        config.model, config.train.global_batch // config.parallel.microbatches, 1, config.train.precision)
    assert needed_bytes(config, programs) == [with_temporaries(p) + RUNTIME_RESERVE_BYTES for p in predictions]
