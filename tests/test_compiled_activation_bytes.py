"""The memory model's bytes for compiled blocks (train.compile, inductor on the CPU here)
and compiled float8 blocks (train.precision=fp8, torchao's emulation on the CPU) against
what the activation meter measures, to the byte, as tests/test_activation_bytes.py
holds eager blocks: coordinator/activation_bytes.py's compiled_block_bytes and
compiled_selective_block_bytes.

Inductor's partitioner decides what a compiled block keeps for its backward, and keeps
less than eager autograd for llama blocks and for float8 ones (docs/gpus.md, "Memory:
predicted against measured", where the same formulas meet the GPU's ledger). Each case
compiles its chunk afresh (several seconds on the CPU), so the cases are few and each
covers several things at once: chunk kinds, precisions, grouped-query attention, padded
vocabularies, the recompute modes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.gloo_world import run_world
from tests.test_activation_bytes import (
    ALL_SHAPES,
    _measure,
    _measure_selective,
    _predict,
    _predict_selective,
    token_file,
)
from interleaf.common.model.recompute_modes import block_modes
from interleaf.coordinator.activation_bytes import (
    chunk_activation_bytes,
    compiled_selective_block_bytes,
    selective_block_bytes,
)
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.model.compiled import compile_blocks
from interleaf.stageserver.model.fp8 import convert_blocks_to_fp8
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.transport import SoloTransport

__all__ = ["token_file"]  # the fixture, shared

FLOAT8_ROUNDING = 0.05
"""How far (relative to its norm) a float8 chunk's output or gradient may move when only
the fusion of its casts changes (a quarter of tests/test_fp8.py's bound against bf16;
seen: at most 0.024): test_compiled_selective_reruns_no_matrix_product_at_tp1."""

COMPILED = [
    ("bf16", True, True, 2, "llama-gqa2-padded"),  # embedding and head, two blocks
    ("fp32", False, False, 1, "llama-gqa4"),
    ("fp64", False, True, 2, "llama-mha"),
    ("bf16", True, False, 1, "gpt2-s13"),  # gpt2: inductor keeps what eager does
]


@pytest.mark.parametrize("case", COMPILED, ids=lambda c: "-".join(map(str, c)))
def test_compiled_prediction_equals_measurement(case, token_file):
    # The plain forward, recompute=full's kept input, and its rerun's transient peak.
    measured = _measure(SoloTransport(), token_file, case, compiled=True)
    assert measured == _predict(case, 1, compiled=True)
    if case[-1].startswith("llama"):  # what the formula is for: fails if it fell back to eager's
        assert measured["plain"] < _predict(case, 1)["plain"]
    else:
        assert measured == _predict(case, 1)


@pytest.mark.parametrize("case, recipe", [
    (("bf16", True, True, 1, "gpt2-s11"), "tensorwise"),
    (("bf16", False, False, 2, "llama-gqa2-padded"), "rowwise"),
], ids=["gpt2-tensorwise", "llama-rowwise"])
def test_compiled_fp8_prediction_equals_measurement(case, recipe, token_file):
    measured = _measure(SoloTransport(), token_file, case, compiled=True, fp8_recipe=recipe)
    assert measured == _predict(case, 1, compiled=True, fp8_recipe=recipe)
    assert measured["plain"] < _predict(case, 1)["plain"]  # float8 compiled keeps less than bf16 eager


def _measure_compiled(rank: int, tp, token_file: str, cases: list, sequence_parallel: bool) -> list:
    return [_measure(tp, token_file, case, sequence_parallel, compiled=True) for case in cases]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_compiled_prediction_equals_measurement_tp2(token_file, sequence_parallel):
    """On gloo: the collectives are nodes of each block's graph (traced_collectives.py;
    under sequence parallelism they break it into pieces), which keeps what the formula
    says on both ranks (the residual stream and norms on this rank's tokens under
    sequence parallelism)."""
    cases = [("bf16", False, True, 1, "llama-gqa2-s12"), ("fp32", True, False, 1, "gpt2-s16")]
    for rank, measured in enumerate(run_world(_measure_compiled, 2, token_file, cases, sequence_parallel)):
        for case, got in zip(cases, measured):
            assert got == _predict(case, 2, sequence_parallel, compiled=True), f"rank {rank}, case {case}"


def test_compiled_selective_prediction_equals_measurement(token_file):
    # Selective recompute of a compiled block at tp=1 compiles it with its checkpoint
    # (the products' outputs kept, but the last one's); recompute_layers=2 reruns the
    # first block whole and keeps the second as compiled. Gradients equal the plain
    # compiled chunk's bit for bit in these cases (bf16 GPT-2's agree to rounding:
    # test_compiled_selective_reruns_no_matrix_product_at_tp1).
    for case in [("bf16", False, False, 2, "llama-mha"), ("fp32", True, True, 1, "gpt2-s13")]:
        for recompute_layers in (0, 2):
            kept, equal = _measure_selective(SoloTransport(), token_file, case, recompute_layers, compiled=True)
            assert equal, f"{case}: selective recompute changed an output or a gradient"
            assert kept == _predict_selective(case, 1, recompute_layers, compiled=True), (case, recompute_layers)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |a|, Frobenius norms."""
    return ((a.float() - b.float()).norm() / a.float().norm()).item()


def _backward_products(chunk, x) -> tuple[int, torch.Tensor]:
    """(matrix products - aten::mm, addmm, bmm - the chunk's backward runs, by the
    profiler; the forward's output)."""
    from torch.profiler import profile
    out = chunk(x)
    with profile() as prof:
        out.backward(torch.ones_like(out))
    return sum(1 for event in prof.events() if event.name in ("aten::mm", "aten::addmm", "aten::bmm")), out


@pytest.mark.parametrize("arch,recipe", [("llama-mha", None), ("gpt2-s16", None), ("llama-mha", "rowwise"),
                                         ("gpt2-s16", "tensorwise")],
                         ids=["llama", "gpt2", "llama-fp8-rowwise", "gpt2-fp8-tensorwise"])
def test_compiled_selective_reruns_no_matrix_product_at_tp1(arch, recipe):
    """At tp = 1 the block and its checkpoint compile together (SelectiveCheckpointed), so
    the backward runs exactly the plain compiled chunk's products - none rerun, where the
    compiled block inside an eager checkpoint reran every one. Its output and the no-grad
    forward's equal the plain compiled chunk's bit for bit; its gradients to bf16
    rounding (two units in the last place of each tensor's largest element; Llama's
    are bit for bit, GPT-2's bf16 ones are not): the backward recomputes the norms and
    activations inside kernels that inductor fuses otherwise than the forward's. It keeps
    b*s*d*a less per block than eager selective recompute.

    Float8 blocks (train.precision=fp8, emulated): the same products, none rerun; their
    outputs and gradients differ from the plain compiled chunk's by float8 rounding, as
    the plain compiled chunk's differ from the eager one's - inductor fuses the casts
    and scales otherwise, and one e4m3 operand rounded the other way moves a product by
    up to an eighth of that operand's term - so they are held to FLOAT8_ROUNDING. So
    is a float8 chunk's no-grad forward against its forward with grad, compiled as a
    graph of its own (plain compiled chunks' too)."""
    rows, config = ALL_SHAPES[arch]
    config = dataclasses.replace(config, n_layers=3)
    hidden = torch.randn(rows, config.seq_len, config.d_model, generator=torch.Generator().manual_seed(1))
    results = {}
    for recompute in ("none", "selective"):
        chunk = ModelChunk(config, range(1, 3), False, False, SoloTransport(), seed=5,
                           recompute=BlockRecompute(recompute)).to(torch.bfloat16)
        if recipe:
            convert_blocks_to_fp8(chunk, recipe, torch.device("cpu"))
        torch._dynamo.reset()
        compile_blocks(chunk)
        assert sorted(chunk.recompute.compiled_selective) == ([1, 2] if recompute == "selective" else [])
        x = hidden.to(torch.bfloat16).requires_grad_()
        products, out = _backward_products(chunk, x)
        with torch.no_grad():
            no_grad = chunk(hidden.to(torch.bfloat16))
        if recipe:
            # the no-grad graph is compiled on its own, its casts fused otherwise (float8
            # rounding again) when the checkpoint's region shapes the training graph
            assert _relative(out.detach(), no_grad) <= FLOAT8_ROUNDING
        else:
            assert torch.equal(no_grad, out.detach())
        results[recompute] = products, [no_grad, x.grad, *(p.grad for p in chunk.parameters())]
    (plain_products, plain), (products, selective) = results["none"], results["selective"]
    assert products == plain_products > 0
    if recipe:
        differences = [_relative(a, b) for a, b in zip(plain, selective, strict=True)]
        assert max(differences) <= FLOAT8_ROUNDING, differences
        return
    assert torch.equal(plain[0], selective[0])  # the no-grad forward
    for a, b in zip(plain[1:], selective[1:], strict=True):
        assert (a.float() - b.float()).abs().max() <= 2**-6 * a.float().abs().max(), "beyond bf16 rounding"
    bsda = rows * config.seq_len * config.d_model * 2
    assert compiled_selective_block_bytes(config, rows, 1, "bf16") == selective_block_bytes(config, rows, 1, "bf16") - bsda


def _tp2_products_and_results(rank: int, tp, arch: str, sequence_parallel: bool) -> dict:
    """On one rank of a tensor pair: for a plain compiled chunk and a selective one,
    the backward's matrix products, graph breaks, and the output and gradients."""
    rows, config = ALL_SHAPES[arch]
    config = dataclasses.replace(config, n_layers=3)
    tokens = config.seq_len // 2 if sequence_parallel else config.seq_len
    hidden = torch.randn(rows, tokens, config.d_model, generator=torch.Generator().manual_seed(1 + rank * sequence_parallel))
    results = {}
    for recompute in ("none", "selective"):
        chunk = ModelChunk(config, range(1, 3), False, False, tp, seed=5, sequence_parallel=sequence_parallel,
                           recompute=BlockRecompute(recompute)).to(torch.bfloat16)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compile_blocks(chunk)
        x = hidden.to(torch.bfloat16).requires_grad_()
        chunk(x).backward(torch.ones(x.shape, dtype=x.dtype))  # compiled, the backward's graph too: not profiled
        x.grad = None
        chunk.zero_grad(set_to_none=True)
        products, out = _backward_products(chunk, x)
        results[recompute] = dict(products=products, breaks=sum(torch._dynamo.utils.counters["graph_break"].values()),
                                  selective=sorted(chunk.recompute.compiled_selective),
                                  tensors=[out.detach(), x.grad, *(p.grad for p in chunk.parameters())])
    return results


@pytest.mark.parametrize("arch,sequence_parallel", [("llama-gqa2-s12", False), ("gpt2-s16", False),
                                                    ("llama-gqa2-s12", True), ("gpt2-s16", True)],
                         ids=["llama", "gpt2", "llama-sp", "gpt2-sp"])
def test_compiled_selective_reruns_no_matrix_product_at_tp2(arch, sequence_parallel):
    """At tp = 2 the block's collectives are graph nodes (traced_collectives.py; under
    sequence parallelism the gather with the column-parallel products that read it, as
    one operator): the block compiles whole, with no graph break, together with its
    selective checkpoint, and its backward runs exactly the plain compiled chunk's
    products, none rerun (inside an eager checkpoint it reran the column-parallel ones);
    its output equals the plain compiled chunk's, its gradients to bf16 rounding."""
    for rank, results in enumerate(run_world(_tp2_products_and_results, 2, arch, sequence_parallel)):
        plain, selective = results["none"], results["selective"]
        assert plain["breaks"] == selective["breaks"] == 0, (rank, plain["breaks"], selective["breaks"])
        assert selective["selective"] == [1, 2] and plain["selective"] == []
        assert selective["products"] == plain["products"] > 0, rank
        assert torch.equal(plain["tensors"][0], selective["tensors"][0])
        for a, b in zip(plain["tensors"][1:], selective["tensors"][1:], strict=True):
            assert (a.float() - b.float()).abs().max() <= 2**-6 * a.float().abs().max(), "beyond bf16 rounding"


def test_past_the_recompile_limit_a_compiled_chunk_fails_rather_than_runs_eager():
    """Dynamo runs a function eagerly past its recompile limit, on one server and maybe
    not on its tensor peer, whose compiled blocks may order their collectives otherwise
    (a gather that reads only a kept input scheduled early): servers raise the limit
    (compiled.RECOMPILE_LIMIT) and a block's call fails past it, where a silent fallback
    would pair the peers' collectives wrongly."""
    from interleaf.stageserver.model.compiled import RECOMPILE_LIMIT

    rows, config = ALL_SHAPES["gpt2-s16"]
    chunk = ModelChunk(config, range(1, 2), False, False, SoloTransport(), seed=5,
                       recompute=BlockRecompute("selective"))
    torch._dynamo.reset()
    compile_blocks(chunk)
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
    assert not torch._dynamo.config.fail_on_recompile_limit_hit  # the loss's functions may still run eager
    limit = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 1
        chunk(torch.randn(rows, config.seq_len, config.d_model))
        with pytest.raises(Exception, match="recompile_limit|cache_size_limit|[Rr]ecompil"):
            chunk(torch.randn(rows + 1, config.seq_len, config.d_model, dtype=torch.float64).to(torch.float32)
                  .requires_grad_())
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()


@pytest.mark.parametrize("case,recipe", [(("bf16", True, False, 2, "llama-gqa2-padded"), "rowwise"),
                                         (("bf16", False, True, 1, "gpt2-s16"), "tensorwise")],
                         ids=["llama-rowwise-embedding", "gpt2-tensorwise-head"])
def test_compiled_float8_selective_prediction_equals_measurement(case, recipe, token_file):
    """Float8 blocks compile with their checkpoints as bf16 ones do and keep what they
    keep (the products' bf16 outputs; the casts are recomputed): the prediction equals
    the measurement, with recompute_layers=2 rerunning the first block whole. Their
    gradients track the plain compiled chunk's: test_compiled_selective_reruns_no_matrix_product_at_tp1."""
    _, emb, head, layers, name = case
    rows, config = ALL_SHAPES[name]
    for recompute_layers in (0, 2):
        kept, _ = _measure_selective(SoloTransport(), token_file, case, recompute_layers, compiled=True,
                                     fp8_recipe=recipe)
        modes = block_modes(range(1, 1 + layers), "selective", recompute_layers)
        assert kept == chunk_activation_bytes(config, layers, emb, head, rows, 1, "fp8", False, modes, True,
                                              recipe), recompute_layers


def _measure_selective_compiled(rank: int, tp, token_file: str, cases: list, sequence_parallel: bool) -> list:
    return [_measure_selective(tp, token_file, case, 0, sequence_parallel, compiled=True) for case in cases]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_compiled_selective_prediction_equals_measurement_tp2(token_file, sequence_parallel):
    # Without sequence parallelism the block compiles with its checkpoint, as at tp = 1,
    # its collectives' outputs kept but the last; under sequence parallelism the Tape
    # records the row- and column-parallel products: it keeps what an eager block does.
    cases = [("bf16", False, False, 1, "llama-gqa2-s12")]
    for rank, measured in enumerate(run_world(_measure_selective_compiled, 2, token_file, cases, sequence_parallel)):
        for case, (kept, equal) in zip(cases, measured):
            assert equal, f"rank {rank}, case {case}: selective recompute changed a gradient"
            assert kept == _predict_selective(case, 2, 0, sequence_parallel, compiled=True), f"rank {rank}, {case}"


def test_the_memory_model_predicts_compiled_blocks_where_the_servers_compile():
    """train.compile="auto" compiles on CUDA servers only: the prediction for them is the
    compiled blocks', smaller for a llama; for CPU servers, or a zero-bubble schedule
    (never compiled), eager's. Mixed servers are predicted as CPU ones (eager's bytes, the
    larger), so admission errs toward refusing."""
    from interleaf.common.model.compile_modes import device_type_of
    from interleaf.coordinator.config import load_config
    from interleaf.coordinator.memory_model import predict
    from interleaf.coordinator.plan import plan_programs

    def peaks(overrides: list[str], device_type: str) -> list[int]:
        config = load_config("", ["model.arch=llama", "model.n_layers=4", "model.d_model=64", "model.n_heads=4",
                                  "model.seq_len=32", "model.vocab_size=256", "parallel.pp=2", "parallel.vpp=1",
                                  "train.precision=bf16", *overrides])
        return [p["activations_peak_bytes"] for p in predict(config, plan_programs(config)[0], device_type)]

    assert peaks([], "cuda") < peaks([], "cpu") == peaks(["train.compile=false"], "cuda")
    assert peaks(["train.compile=true"], "cpu") == peaks([], "cuda")
    zero_bubble = ["parallel.schedule=zb-h1"]
    assert peaks(zero_bubble, "cuda") == peaks(zero_bubble, "cpu")
    assert device_type_of(["cuda:0", "cuda:1"]) == "cuda"
    assert device_type_of(["cuda (NVIDIA H100 80GB HBM3)"]) == "cuda"
    assert device_type_of(["cuda:0", "cpu"]) == device_type_of([]) == "cpu"


def test_schedule_shows_the_prediction_for_gpu_servers(capsys):
    """`interleaf schedule --device cuda`: the memory table for servers that compile (a
    llama's activations smaller than for CPU servers, the default); the state the same."""
    from interleaf.clients.cli import main

    def table(device: str) -> list[list[float]]:
        assert main(["schedule", "--set", "model.arch=llama", "--set", "model.n_layers=4", "--set", "parallel.pp=2",
                     "--set", "parallel.vpp=1", "--set", "parallel.schedule=1f1b", "--device", device]) == 0
        lines = capsys.readouterr().out.splitlines()
        header = next(i for i, line in enumerate(lines) if "activations peak" in line)
        return [[float(v) for v in line.split()[1:]] for line in lines[header + 1:header + 3]]

    cpu, cuda = table("cpu"), table("cuda")
    for on_cpu, on_gpu in zip(cpu, cuda):
        assert on_gpu[:5] == on_cpu[:5]  # parameters, gradients, optimizer and their peaks
        assert on_gpu[5] < on_cpu[5]  # activations


def test_placement_holds_each_server_to_its_own_device_types_need():
    """The driver's placement (plan.place_servers with a need per device type): a GPU
    server, whose blocks compile, may hold a job a CPU server of the same memory may not."""
    from interleaf.coordinator.config import load_config
    from interleaf.coordinator.plan import ServerSlot, place_servers

    config = load_config("", ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"])
    needs = {"cpu": 3000, "cuda": 2000}
    gpus = [ServerSlot(f"g{i}", f"10.0.0.{i}:1", f"h{i}", 2500, "cuda:0") for i in range(2)]
    cpus = [ServerSlot(f"c{i}", f"10.0.1.{i}:1", f"h{i}", 2500, "cpu") for i in range(2)]
    assert sorted(place_servers(config, gpus, need_bytes=needs), key=gpus.index) == gpus
    assert place_servers(config, cpus, need_bytes=needs) is None
    assert place_servers(config, [gpus[0], cpus[0]], need_bytes=needs) is None  # one fits: too few
    assert place_servers(config, gpus, need_bytes=2500) is not None  # one need for every server, as before
    assert place_servers(config, gpus, need_bytes={"cpu": 3000}) is None  # a type left out: the largest need
