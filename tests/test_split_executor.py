"""The executor's I and W (stageserver/executor.py) against B: one rank holding two
chunks of a real ModelState (pp=1, vpp=2, the embedding tied to the head across them),
fed by the real sampler, stepping twice through hand-written programs whose only
difference is B or I and W; the W's deferred past every other backward, and at ZeRO-3
past their chunk's release (RP), which is what a zero-bubble program does. At tp=1
in-process, and at tp=2 on gloo with and without sequence parallelism.

What must hold: the same losses, gradient norms and parameters after each step (fp64:
1e-12 relative, fp32: 1e-6; measured equal to the bit, bf16 included), in every
recompute mode; the activation account holding exactly what the W's will read, and
back to zero at each step's end; a traced step's I and W timed as computes of their
own kinds; and a program that lacks a W, or runs one with no I before it, refused with
the action named.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.gloo_world import run_world

from interleaf.common.model.config import ModelShape
from interleaf.protos.actions import parse_program
from interleaf.stageserver.data.corpus import resolve_source
from interleaf.stageserver.data.sampler import Sampler
from interleaf.stageserver.data.tokenfile import write_tokens
from interleaf.stageserver.activation_meter import parameter_storages, storage_bytes
from interleaf.stageserver.executor import Executor, StepError, _StepState
from interleaf.stageserver.model_state import ChunkPlan, ModelState, TrainPlan
from interleaf.stageserver.transport import SoloTransport, Transport
from interleaf.stageserver.transport.metered import CommMeter, metered

MICROBATCHES, ROWS = 2, 2
CONFIG = ModelShape(n_layers=4, d_model=32, n_heads=4, seq_len=8, vocab_size=64)
LLAMA = ModelShape(n_layers=4, d_model=32, n_heads=4, seq_len=8, vocab_size=64, arch="llama", n_kv_heads=2,
                   ffn_hidden=48, tie_embeddings=True)
TOL = {"fp32": 1e-6, "fp64": 1e-12}

FUSED = "F0.0 F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 B0.1 TIE OPT"
SPLIT = "F0.0 F1.0 I1.0 F0.1 I0.0 F1.1 I1.1 I0.1 W1.0 W0.0 W1.1 W0.1 TIE OPT"
FUSED_ZERO3 = "AG0 AG1 F0.0 F1.0 B1.0 F0.1 B0.0 F1.1 B1.1 RP1 RS1 B0.1 RP0 RS0 TIE OPT"
SPLIT_ZERO3 = "AG0 AG1 F0.0 F1.0 I1.0 F0.1 I0.0 F1.1 I1.1 RP1 I0.1 RP0 W1.0 W1.1 RS1 W0.0 W0.1 RS0 TIE OPT"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tokens") / "tokens.bin"
    write_tokens(path, np.random.default_rng(0).integers(0, 64, size=4096))
    return str(path)


def _model(token_file: str, config: ModelShape, zero: int, precision: str, recompute: str,
           recompute_layers: int = 0, tp: Transport | None = None, sequence_parallel: bool = False) -> ModelState:
    """One rank's state: the pipeline and data-parallel groups of one, the tensor group
    `tp` (also the world, for the gradient norm)."""
    groups: dict[str, Transport] = {role: SoloTransport(role) for role in ("pp", "dp", "tp", "tie", "world")}
    if tp is not None:
        groups["tp"] = groups["world"] = tp
    train = TrainPlan(microbatches=MICROBATCHES, rows=ROWS, lr=1e-2, warmup_steps=1, steps=2, weight_decay=0.1,
                      grad_clip=1.0, seed=3, precision=precision, recompute=recompute,
                      recompute_layers=recompute_layers)
    sampler = Sampler(resolve_source(token_file), train.seed, config.seq_len, ROWS * MICROBATCHES, MICROBATCHES)
    chunks = [ChunkPlan(0, range(0, 2), True, False), ChunkPlan(1, range(2, 4), False, True)]
    return ModelState(config, chunks, groups, sampler, train, last_chunk=1, zero=zero,
                      sequence_parallel=sequence_parallel)


def _train(token_file: str, program: str, **model) -> tuple[list, list[torch.Tensor], Executor]:
    """Two steps of `program`: each step's (loss, gradient norm), the master weights after."""
    state = _model(token_file, **model)
    executor = Executor(state, parse_program(program), rank=0)
    steps = []
    for step in range(2):
        stats = executor.run_step(step)
        assert state.ledger.current["activations"] == 0, f"step {step} left activations on the ledger"
        steps.append((stats.loss, stats.grad_norm))
    masters = [bucket.master.clone() for buckets in state.buckets.values() for bucket in buckets]
    return steps, masters, executor


def _rel(got: float | torch.Tensor, want: float | torch.Tensor) -> float:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return ((got - want).abs().max() / want.abs().max()).item()


CASES = [
    ("gpt2", 0, "fp64", "none", 0), ("gpt2", 0, "fp32", "none", 0), ("gpt2", 0, "fp64", "full", 0),
    ("gpt2", 3, "fp64", "none", 0), ("gpt2", 3, "fp32", "selective", 0), ("llama", 0, "fp64", "selective", 2),
    ("llama", 3, "fp64", "full", 0), ("llama", 3, "bf16", "none", 0),
]


@pytest.mark.parametrize("arch,zero,precision,recompute,layers", CASES, ids=lambda v: str(v))
def test_split_program_trains_as_the_fused_one(token_file, arch, zero, precision, recompute, layers):
    model = dict(config=CONFIG if arch == "gpt2" else LLAMA, zero=zero, precision=precision, recompute=recompute,
                 recompute_layers=layers)
    fused, split = (FUSED, SPLIT) if zero == 0 else (FUSED_ZERO3, SPLIT_ZERO3)
    want_steps, want, _ = _train(token_file, fused, **model)
    got_steps, got, executor = _train(token_file, split, **model)
    tol = TOL.get(precision, 0.0)  # bf16: the same operations in the same order, so equal too
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got_steps, want_steps)):
        assert _rel(loss, want_loss) <= tol and _rel(norm, want_norm) <= tol, f"step {step}"
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w) <= tol
    assert executor.model.ledger.peak["activations"] > 0


def _compare_tp2(rank: int, tp, token_file: str, cases: list[tuple]) -> dict[str, list[str]]:
    """Each case's failures on this rank, and whether the two programs' tensor groups
    moved the same bytes in the same calls (W adds none)."""
    meter = CommMeter()
    counted = metered(tp, "tp", meter)
    failures = {}
    for arch, zero, precision, recompute, sp in cases:
        model = dict(config=CONFIG if arch == "gpt2" else LLAMA, zero=zero, precision=precision,
                     recompute=recompute, tp=counted, sequence_parallel=sp)
        fused, split = (FUSED, SPLIT) if zero == 0 else (FUSED_ZERO3, SPLIT_ZERO3)
        want_steps, want, _ = _train(token_file, fused, **model)
        want_traffic = [(op, nbytes, calls) for op, _, _, nbytes, calls in meter.take()]
        got_steps, got, _ = _train(token_file, split, **model)
        traffic = [(op, nbytes, calls) for op, _, _, nbytes, calls in meter.take()]
        tol = TOL[precision]
        failures[str((arch, zero, precision, recompute, sp))] = [
            f"step {step} {what}" for step, (g, w) in enumerate(zip(got_steps, want_steps))
            for what, i in (("loss", 0), ("gradient norm", 1)) if _rel(g[i], w[i]) > tol
        ] + [f"master weights {i}" for i, (g, w) in enumerate(zip(got, want)) if _rel(g, w) > tol] + (
            [] if traffic == want_traffic and want_traffic else [f"tensor-group traffic {traffic}, not {want_traffic}"])
    return failures


TP2_CASES = [("gpt2", 0, "fp64", "full", True), ("gpt2", 3, "fp64", "selective", True),
             ("llama", 0, "fp32", "full", False), ("llama", 3, "fp64", "none", True)]


def test_split_program_trains_as_the_fused_one_at_tp2(token_file):
    """The same at tp=2 on gloo (sequence parallel or not): I's tensor-parallel
    collectives are B's; W issues none."""
    for rank, failures in enumerate(run_world(_compare_tp2, 2, token_file, TP2_CASES)):
        assert failures == {str(case): [] for case in TP2_CASES}, f"rank {rank}"


def test_traced_split_step_times_each_i_and_w(token_file):
    state = _model(token_file, CONFIG, zero=0, precision="fp32", recompute="none")
    stats = Executor(state, parse_program(SPLIT), rank=0).run_step(0, trace=True)
    kinds = {text[0]: kind for text, kind, _, _ in stats.spans if kind != "wait"}
    assert kinds["I"] == "input-grad" and kinds["W"] == "weight-grad"


@pytest.mark.parametrize("program,message", [
    (SPLIT.replace(" W0.1", ""), "no weight-gradient pass after I0.1"),
    ("F0.0 F1.0 I1.0 W0.0 I0.0 W1.0 TIE OPT", "no I0.0 ran before W0.0"),
])
def test_programs_missing_their_halves_are_refused(token_file, program, message):
    state = _model(token_file, CONFIG, zero=0, precision="fp32", recompute="none")
    with pytest.raises(StepError, match=message):
        Executor(state, parse_program(program), rank=0).run_step(0)


def test_what_w_reads_stays_on_the_activation_account(token_file):
    """After I1.0 and I0.0, the account holds exactly the distinct storages the two W's
    will read: chunk 1's input, chunk 0's output, counted once (by chunk 0 until I0.0
    frees chunk 0's activations, by W1.0 after: stageserver/deferred_grads.py); W1.0
    leaves W0.0's, and W0.0 nothing."""
    model = _model(token_file, CONFIG, zero=0, precision="fp32", recompute="none")
    program = parse_program("F0.0 F1.0 I1.0 I0.0 W1.0 W0.0")
    executor = Executor(model, program, rank=0)
    state = _StepState(0)
    model.zero_grad()
    for action in program[:4]:
        executor.handlers[action.kind](action, state)
    params = frozenset().union(*(parameter_storages(chunk) for chunk in model.chunks.values()))
    queued = {key: state.deferred.queue(key).tensors() for key in ((1, 0), (0, 0))}
    assert model.ledger.current["activations"] == storage_bytes(queued[1, 0] + queued[0, 0], params)
    executor.handlers[program[4].kind](program[4], state)
    assert model.ledger.current["activations"] == storage_bytes(queued[0, 0], params)
    executor.handlers[program[5].kind](program[5], state)
    assert model.ledger.current["activations"] == 0
