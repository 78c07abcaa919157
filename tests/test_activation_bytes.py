"""The coordinator's predicted activation bytes (coordinator/activation_bytes.py) against
what a stage server measures (stageserver/activation_meter.py) on a real ModelChunk fed by
the real sampler, for both architectures (grouped-query attention, untied heads, padded
vocabularies among them) and both recompute modes, at tp=1 in-process and tp=2 on gloo.

Tolerance: none, equality to the byte. Every kept tensor's size is a function of the
shapes and dtypes alone (no kernel chooses a layout from the data), so any difference is
a term the formula gets wrong.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import numpy as np
import pytest
import torch
from tests.gloo_world import run_world

from interleaf.common.model.config import ModelShape
from interleaf.common.model.recompute_modes import block_modes
from interleaf.coordinator.activation_bytes import block_activation_bytes, chunk_activation_bytes, chunk_input_bytes
from interleaf.stageserver.activation_meter import ActivationMeter, parameter_storages
from interleaf.stageserver.data.corpus import resolve_source
from interleaf.stageserver.data.sampler import Sampler
from interleaf.stageserver.data.tokenfile import write_tokens
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.model.compiled import compile_blocks
from interleaf.stageserver.model.fp8 import convert_blocks_to_fp8
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.transport import SoloTransport
from interleaf.stageserver.transport.metered import CommMeter, metered

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
ENDS = [(False, False), (True, False), (False, True), (True, True)]  # (embedding, head)


def _shape(seq: int, d: int, heads: int, vocab: int, **more) -> ModelShape:
    return ModelShape(n_layers=2, d_model=d, n_heads=heads, seq_len=seq, vocab_size=vocab, **more)


# name -> (rows, model). Odd sizes catch padded allocations; MLP widths off the 4·d rule,
# one, two and four query heads per key/value head, untied heads, and vocabularies padded
# to pad_vocab_to·tp (100 to 104, 64 to 128) beside unpadded ones.
SHAPES = {
    "gpt2-s8": (1, _shape(8, 32, 2, 64)),
    "gpt2-s13": (2, _shape(13, 64, 4, 128)),
    "gpt2-s16": (3, _shape(16, 48, 4, 256)),
    "gpt2-s11": (2, _shape(11, 32, 4, 256)),
    "gpt2-s9": (3, _shape(9, 64, 2, 64)),
    "gpt2-untied-padded": (2, _shape(10, 48, 4, 100, ffn_hidden=40, pad_vocab_to=8, tie_embeddings=False)),
    "llama-gqa2-padded": (2, _shape(13, 64, 4, 100, arch="llama", n_kv_heads=2, ffn_hidden=80, pad_vocab_to=8)),
    "llama-gqa4": (3, _shape(9, 64, 8, 256, arch="llama", n_kv_heads=2, ffn_hidden=176)),
    "llama-tied-padded": (1, _shape(16, 32, 4, 64, arch="llama", ffn_hidden=96, pad_vocab_to=128,
                                    tie_embeddings=True)),
    "llama-mha": (2, _shape(11, 48, 4, 128, arch="llama", ffn_hidden=64)),
}
# Sequence parallelism needs a sequence that splits over tp: grouped-query attention on one.
SP_SHAPES = {"llama-gqa2-s12": (2, _shape(12, 64, 4, 100, arch="llama", n_kv_heads=2, ffn_hidden=80, pad_vocab_to=8))}
ALL_SHAPES = {**SHAPES, **SP_SHAPES}
# Per architecture, every precision and chunk kind with 1 and 2 layers, its shapes dealt
# round-robin.
CASES = [
    (precision, emb, head, layers, names[i % len(names)])
    for names in ([n for n in SHAPES if n.startswith(arch)] for arch in ("gpt2", "llama"))
    for i, (precision, (emb, head), layers) in enumerate(itertools.product(DTYPES, ENDS, (1, 2)))
]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tokens") / "tokens.bin"
    # Ids below the smallest vocabulary, so any case can read them.
    write_tokens(path, np.random.default_rng(0).integers(0, 64, size=4096))
    return str(path)


def _built(chunk: ModelChunk, compiled: bool, fp8_recipe: str | None = None) -> ModelChunk:
    """The chunk as a server builds it: its blocks' linears in float8 (train.precision=
    fp8, emulated on the CPU) and its blocks through torch.compile (train.compile), with
    torch's compile caches cleared first, so each case compiles for its own shapes as a
    server's first step does (not as a shape-generic recompile)."""
    if fp8_recipe:
        convert_blocks_to_fp8(chunk, fp8_recipe, torch.device("cpu"))
    if compiled:
        torch._dynamo.reset()
        compile_blocks(chunk)
    return chunk


def _measure(tp, token_file: str, case: tuple, sequence_parallel: bool = False, compiled: bool = False,
             fp8_recipe: str | None = None) -> dict[str, int]:
    """Bytes the meter reports for one case: the plain forward, the recompute forward,
    and the recompute's rerun in the backward (run through a real backward, as the
    executor would). Sequence parallel: hidden states in and out are this rank's
    slice of the sequence."""
    precision, emb, head, layers, name = case
    rows, config = ALL_SHAPES[name]
    dtype = DTYPES[precision]
    chunk = _built(ModelChunk(config, range(layers), emb, head, tp, seed=5, sequence_parallel=sequence_parallel)
                   .to(dtype), compiled, fp8_recipe)
    meter = ActivationMeter(parameter_storages(chunk))
    ids, targets = Sampler(resolve_source(token_file), 0, config.seq_len, rows).microbatch(0, 0)
    tokens = config.seq_len // tp.size if sequence_parallel else config.seq_len
    hidden = torch.randn(rows, tokens, config.d_model, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = ids if emb else hidden.requires_grad_()
    targets = targets if head else None

    out, plain = meter.forward(chunk, x, targets)
    kept_out, kept = meter.forward_no_grad(chunk, x, targets)
    if fp8_recipe:  # inductor compiles the no-grad forward apart, and its scales can round
        # an operand to the next float8 value (e4m3: 3 mantissa bits, steps of 2**-3)
        torch.testing.assert_close(kept_out, out.detach(), rtol=2**-3, atol=1e-3)
    else:
        assert torch.equal(kept_out, out.detach())
    rerun, transient = meter.forward(chunk, x, targets)
    rerun.backward(None if head else torch.ones_like(rerun))
    return dict(plain=plain, recompute=kept, transient=transient)


def _predict(case: tuple, tp: int, sequence_parallel: bool = False, compiled: bool = False,
             fp8_recipe: str | None = None) -> dict[str, int]:
    precision, emb, head, layers, name = case
    rows, config = ALL_SHAPES[name]
    if fp8_recipe:
        precision = "fp8"  # bf16 with float8 products
    full = chunk_activation_bytes(config, layers, emb, head, rows, tp, precision, sequence_parallel,
                                  compiled=compiled, fp8_recipe=fp8_recipe or "tensorwise")
    kept = chunk_input_bytes(config, emb, rows, precision, tp, sequence_parallel)
    return dict(plain=full, recompute=kept, transient=full)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_prediction_equals_measurement(case, token_file):
    assert _measure(SoloTransport(), token_file, case) == _predict(case, 1)


def _measure_all(rank: int, tp, token_file: str, cases: list, sequence_parallel: bool = False) -> list[dict[str, int]]:
    return [_measure(tp, token_file, case, sequence_parallel) for case in cases]


def test_prediction_equals_measurement_tp2(token_file):
    # Grouped-query attention with one key/value head per rank, untied heads split over
    # the vocabulary, vocabularies padded to a multiple of pad_vocab_to·2.
    cases = [
        ("bf16", True, True, 2, "gpt2-s11"),
        ("fp32", False, False, 1, "gpt2-s13"),
        ("fp64", True, False, 1, "gpt2-s16"),
        ("fp32", True, True, 1, "gpt2-untied-padded"),
        ("bf16", True, True, 2, "llama-gqa2-padded"),
        ("fp32", False, True, 1, "llama-gqa4"),
        ("fp64", False, False, 2, "llama-tied-padded"),
        ("bf16", False, True, 1, "llama-tied-padded"),
    ]
    for rank, measured in enumerate(run_world(_measure_all, 2, token_file, cases)):
        for case, got in zip(cases, measured):
            assert got == _predict(case, 2), f"rank {rank}, case {case}"


def test_prediction_equals_measurement_sequence_parallel_tp2(token_file):
    """Sequence parallelism at tp=2, every chunk kind and precision, sequences of even
    length: grouped-query attention (two query heads per key/value head), untied and
    padded heads, the positions of gpt2's second half."""
    cases = [
        ("fp32", True, True, 2, "gpt2-s8"),
        ("bf16", False, False, 1, "gpt2-s16"),
        ("fp64", True, False, 2, "gpt2-untied-padded"),
        ("fp32", False, True, 1, "gpt2-untied-padded"),
        ("bf16", True, True, 2, "llama-tied-padded"),
        ("fp32", False, False, 2, "llama-gqa2-s12"),
        ("fp64", True, False, 1, "llama-gqa2-s12"),
        ("bf16", False, True, 1, "llama-gqa2-s12"),
    ]
    for rank, measured in enumerate(run_world(_measure_all, 2, token_file, cases, True)):
        for case, got in zip(cases, measured):
            assert got == _predict(case, 2, sequence_parallel=True), f"rank {rank}, case {case}"


def test_sequence_parallel_divides_a_gpt2_block_by_tp():
    rows, config = SHAPES["gpt2-s16"]
    for precision in DTYPES:
        whole = block_activation_bytes(config, rows, 1, precision)
        assert block_activation_bytes(config, rows, 2, precision, sequence_parallel=True) == whole // 2
        assert block_activation_bytes(config, rows, 4, precision, sequence_parallel=True) == whole // 4
        assert block_activation_bytes(config, rows, 2, precision) > whole // 2  # what plain tp keeps whole


@pytest.mark.parametrize("name", ["gpt2-s16", "llama-gqa4"])
def test_tp_shards_the_activations(name):
    # Fails if the formula ignored tp: the sharded terms halve, the replicated ones stay.
    rows, config = ALL_SHAPES[name]
    one = chunk_activation_bytes(config, 2, False, True, rows, 1, "fp32")
    two = chunk_activation_bytes(config, 2, False, True, rows, 2, "fp32")
    assert one > two > one // 2


@pytest.mark.parametrize("precision", DTYPES)
def test_measuring_changes_nothing(precision):
    """The meter's forward yields bit-identical outputs and gradients, and a forward
    whose backward never comes (an aborted step) frees its graph."""
    config = ModelShape(n_layers=1, d_model=32, n_heads=4, seq_len=8, vocab_size=64)
    chunk = ModelChunk(config, range(1), False, False, SoloTransport(), seed=5).to(DTYPES[precision])
    meter = ActivationMeter(parameter_storages(chunk))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(DTYPES[precision])
    grad = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2)).to(DTYPES[precision])

    grads = []
    for run in (lambda x: chunk(x), lambda x: meter.forward(chunk, x)[0]):
        chunk.zero_grad()
        leaf = x.clone().requires_grad_()
        out = run(leaf)
        out.backward(grad)
        grads.append([out.detach(), leaf.grad, *(p.grad.clone() for p in chunk.parameters())])
    for plain, metered in zip(*grads):
        assert torch.equal(plain, metered)

    leaf = x.clone().requires_grad_()
    out, _ = meter.forward(chunk, leaf)
    alive = weakref.ref(leaf)
    # The graph holds the leaf (its AccumulateGrad node) for as long as the graph lives.
    del leaf, out
    assert alive() is None, "an abandoned forward leaked its graph"


# --- selective recompute (train.recompute=selective, stageserver/model/recompute.py) ------


def _measure_selective(tp, token_file: str, case: tuple, recompute_layers: int,
                       sequence_parallel: bool = False, compiled: bool = False,
                       fp8_recipe: str | None = None) -> tuple[int, bool]:
    """(bytes the meter reports for a chunk whose blocks run under selective recompute,
    whether its output and every gradient equal the plain chunk's bit for bit). The
    chunk holds layers 1.. so that recompute_layers=2 recomputes its first block whole."""
    precision, emb, head, layers, name = case
    rows, config = ALL_SHAPES[name]
    config = dataclasses.replace(config, n_layers=1 + layers)
    dtype = DTYPES[precision]
    ids, targets = Sampler(resolve_source(token_file), 0, config.seq_len, rows).microbatch(0, 0)
    tokens = config.seq_len // tp.size if sequence_parallel else config.seq_len
    hidden = torch.randn(rows, tokens, config.d_model, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for recompute in (BlockRecompute(), BlockRecompute("selective", recompute_layers)):
        chunk = _built(ModelChunk(config, range(1, 1 + layers), emb, head, tp, seed=5,
                                  sequence_parallel=sequence_parallel, recompute=recompute).to(dtype), compiled,
                       fp8_recipe)
        x = ids if emb else hidden.clone().requires_grad_()
        out, kept = ActivationMeter(parameter_storages(chunk)).forward(chunk, x, targets if head else None)
        out.backward(None if head else torch.ones_like(out))
        results.append((kept, [out.detach(), *([] if emb else [x.grad]), *(p.grad for p in chunk.parameters())]))
    (_, plain), (kept, selective) = results
    return kept, all(torch.equal(a, b) for a, b in zip(plain, selective))


def _predict_selective(case: tuple, tp: int, recompute_layers: int, sequence_parallel: bool = False,
                       compiled: bool = False) -> int:
    precision, emb, head, layers, name = case
    rows, config = ALL_SHAPES[name]
    modes = block_modes(range(1, 1 + layers), "selective", recompute_layers)
    return chunk_activation_bytes(config, layers, emb, head, rows, tp, precision, sequence_parallel, modes, compiled)


@pytest.mark.parametrize("recompute_layers", [0, 2])
@pytest.mark.parametrize("case", CASES[::3], ids=lambda c: "-".join(map(str, c)))
def test_selective_prediction_equals_measurement(case, recompute_layers, token_file):
    kept, equal = _measure_selective(SoloTransport(), token_file, case, recompute_layers)
    assert equal, "selective recompute changed an output or a gradient"
    assert kept == _predict_selective(case, 1, recompute_layers)
    if recompute_layers == 0:  # it keeps less than the plain forward, more than its input
        plain = _predict(case, 1)
        assert plain["recompute"] < kept < plain["plain"]


def _measure_selective_all(rank: int, tp, token_file: str, cases: list, sequence_parallel: bool):
    return [_measure_selective(tp, token_file, case, layers_k, sequence_parallel) for case, layers_k in cases]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_selective_prediction_and_gradients_tp2(token_file, sequence_parallel):
    """On gloo: the rerun in the backward replays the blocks' forward collectives, blocks
    rerun whole (recompute_layers) issue theirs again in the same order on both ranks (no
    deadlock), what the replays hold is predicted, and every gradient is the plain chunk's."""
    cases = [
        (("fp32", True, True, 2, "gpt2-s8"), 0),
        (("bf16", False, False, 2, "gpt2-s16"), 2),
        (("fp64", True, False, 1, "llama-gqa2-s12"), 0),
        (("fp32", False, True, 2, "llama-gqa2-s12"), 2),
    ]
    for rank, measured in enumerate(run_world(_measure_selective_all, 2, token_file, cases, sequence_parallel)):
        for (case, layers_k), (kept, equal) in zip(cases, measured):
            assert equal, f"rank {rank}, case {case}: selective recompute changed a gradient"
            assert kept == _predict_selective(case, 2, layers_k, sequence_parallel), f"rank {rank}, case {case}"


def _collective_calls(rank: int, tp, token_file: str, cases: list, sequence_parallel: bool) -> list:
    """Per case, per recompute (none, selective, selective with every block rerun whole):
    the tensor group's calls per op in the forward and in the backward, counted by the
    metered transport the servers use, and whether every gradient is the plain chunk's."""
    meter = CommMeter()
    counted = metered(tp, "tp", meter)
    results = []
    for precision, emb, head, layers, name in cases:
        rows, config = ALL_SHAPES[name]
        dtype = DTYPES[precision]
        ids, targets = Sampler(resolve_source(token_file), 0, config.seq_len, rows).microbatch(0, 0)
        tokens = config.seq_len // tp.size if sequence_parallel else config.seq_len
        hidden = torch.randn(rows, tokens, config.d_model, generator=torch.Generator().manual_seed(1)).to(dtype)
        calls, grads = [], []
        for recompute in (BlockRecompute(), BlockRecompute("selective"), BlockRecompute("selective", 1)):
            chunk = ModelChunk(config, range(layers), emb, head, counted, seed=5, sequence_parallel=sequence_parallel,
                               recompute=recompute).to(dtype)
            x = ids if emb else hidden.clone().requires_grad_()
            meter.take()
            out = chunk(x, targets) if head else chunk(x)
            forward = {op: n for op, _, _, _, n in meter.take()}
            out.backward(None if head else torch.ones_like(out))
            backward = {op: n for op, _, _, _, n in meter.take()}
            calls.append((forward, backward))
            grads.append([*([] if emb else [x.grad]), *(p.grad for p in chunk.parameters())])
        equal = all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
        results.append((calls, equal))
    return results


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_selective_rerun_issues_no_forward_collective(token_file, sequence_parallel):
    """The backward of selectively recomputed blocks issues exactly the collectives of the
    plain backward (the rerun replays the forward's: none is issued again), with fp64
    gradients equal to the plain chunk's bit for bit; blocks rerun whole issue theirs
    again, which is what the count would show had the replay failed."""
    cases = [("fp64", True, True, 2, "gpt2-s8"), ("fp64", False, False, 2, "llama-gqa2-s12")]
    for rank, measured in enumerate(run_world(_collective_calls, 2, token_file, cases, sequence_parallel)):
        for case, (((plain_fwd, plain_bwd), (sel_fwd, sel_bwd), (whole_fwd, whole_bwd)), equal) in zip(cases, measured):
            where = f"rank {rank}, case {case}"
            assert equal, f"{where}: selective recompute changed a gradient"
            assert sel_fwd == plain_fwd == whole_fwd, where
            assert sum(plain_bwd.values()) > 0, f"{where}: the backward's own collectives were not counted"
            assert sel_bwd == plain_bwd, f"{where}: the rerun communicated ({sel_bwd} against {plain_bwd})"
            assert sum(whole_bwd.values()) > sum(plain_bwd.values()), f"{where}: a whole block's rerun was not counted"
