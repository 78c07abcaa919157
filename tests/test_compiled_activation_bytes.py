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
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.transport import SoloTransport

__all__ = ["token_file"]  # the fixture, shared

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
    """On gloo: the collectives break each block's graph into pieces, which keep what the
    formula says on both ranks (the residual stream and norms on this rank's tokens
    under sequence parallelism)."""
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


def _backward_products(chunk, x) -> tuple[int, torch.Tensor]:
    """(matrix products - aten::mm, addmm, bmm - the chunk's backward runs, by the
    profiler; the forward's output)."""
    from torch.profiler import profile
    out = chunk(x)
    with profile() as prof:
        out.backward(torch.ones_like(out))
    return sum(1 for event in prof.events() if event.name in ("aten::mm", "aten::addmm", "aten::bmm")), out


@pytest.mark.parametrize("arch", ["llama-mha", "gpt2-s16"])
def test_compiled_selective_reruns_no_matrix_product_at_tp1(arch):
    """At tp = 1 the block and its checkpoint compile together (SelectiveCheckpointed), so
    the backward runs exactly the plain compiled chunk's products - none rerun, where the
    compiled block inside an eager checkpoint reran every one. Its output and the no-grad
    forward's equal the plain compiled chunk's bit for bit; its gradients to bf16
    rounding (two units in the last place of each tensor's largest element; Llama's
    are bit for bit, GPT-2's bf16 ones are not): the backward recomputes the norms and
    activations inside kernels that inductor fuses otherwise than the forward's. It keeps
    b*s*d*a less per block than eager selective recompute."""
    rows, config = ALL_SHAPES[arch]
    config = dataclasses.replace(config, n_layers=3)
    hidden = torch.randn(rows, config.seq_len, config.d_model, generator=torch.Generator().manual_seed(1))
    results = {}
    for recompute in ("none", "selective"):
        chunk = ModelChunk(config, range(1, 3), False, False, SoloTransport(), seed=5,
                           recompute=BlockRecompute(recompute)).to(torch.bfloat16)
        torch._dynamo.reset()
        compile_blocks(chunk)
        assert sorted(chunk.recompute.compiled_selective) == ([1, 2] if recompute == "selective" else [])
        x = hidden.to(torch.bfloat16).requires_grad_()
        products, out = _backward_products(chunk, x)
        with torch.no_grad():
            no_grad = chunk(hidden.to(torch.bfloat16))
        assert torch.equal(no_grad, out.detach())
        results[recompute] = products, [no_grad, x.grad, *(p.grad for p in chunk.parameters())]
    (plain_products, plain), (products, selective) = results["none"], results["selective"]
    assert products == plain_products > 0
    assert torch.equal(plain[0], selective[0])  # the no-grad forward
    for a, b in zip(plain[1:], selective[1:], strict=True):
        assert (a.float() - b.float()).abs().max() <= 2**-6 * a.float().abs().max(), "beyond bf16 rounding"
    bsda = rows * config.seq_len * config.d_model * 2
    assert compiled_selective_block_bytes(config, rows, 1, "bf16") == selective_block_bytes(config, rows, 1, "bf16") - bsda


@pytest.mark.parametrize("case,recipe", [(("bf16", False, False, 2, "llama-mha"), "rowwise"),
                                         (("bf16", False, True, 1, "gpt2-s16"), "tensorwise")],
                         ids=["llama-rowwise", "gpt2-tensorwise-head"])
def test_compiled_float8_selective_keeps_the_eager_checkpoint(case, recipe, token_file):
    """Float8 blocks stay compiled inside the eager checkpoint (compiled.py says why):
    the prediction equals the measurement and every gradient the plain compiled float8
    chunk's."""
    kept, equal = _measure_selective(SoloTransport(), token_file, case, 0, compiled=True, fp8_recipe=recipe)
    assert equal, f"{case}: selective recompute changed an output or a gradient"
    _, emb, head, layers, name = case
    rows, config = ALL_SHAPES[name]
    modes = block_modes(range(1, 1 + layers), "selective", 0)
    assert kept == chunk_activation_bytes(config, layers, emb, head, rows, 1, "fp8", False, modes, True, recipe)


def _measure_selective_compiled(rank: int, tp, token_file: str, cases: list, sequence_parallel: bool) -> list:
    return [_measure_selective(tp, token_file, case, 0, sequence_parallel, compiled=True) for case in cases]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_compiled_selective_prediction_equals_measurement_tp2(token_file, sequence_parallel):
    # The Tape records the row-parallel outputs, and under sequence parallelism the
    # column-parallel products as well: there a compiled block keeps what an eager one does.
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
