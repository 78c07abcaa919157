"""The equivalence contract (DESIGN.md): every layout trains exactly like the
single-process reference. Each case is a real job on the shared local cluster.

Tolerances, fp32 on CPU: per-step loss and per-step gradient norm within 1e-5 relative;
every final parameter tensor within 1e-4 relative, in the 2-norm: |p - ref| <= 1e-4 |ref|.
Relative per tensor, not per element: an element near zero (a bias that started at 0,
a weight crossing 0) has no meaningful relative error of its own, and Adam turns the
last-bit differences of a split batch into update differences of up to ~lr*1e-3 on the
few elements whose gradient is as small as Adam's eps (measured at lr 1e-3: the largest
element difference on dp=2 is 3e-6 on a tensor of scale 0.016; the largest tensor-wise
relative error over the ZeRO layouts with tp=2 is 3.5e-5).

ZeRO layouts are in test_zero_equivalence.py; both use `check_equivalent`."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from interleaf.clients.reference import train
from interleaf.common.lr_schedule import Schedule
from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import load_config
from interleaf.stageserver.model import full_model
from tests.conftest import TINY, arch_setup, layout_free, load_parameters, reference, run_job

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4


def layout(dp=1, tp=1, pp=1, vpp=1, schedule="interleaved-1f1b"):
    return [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"parallel.vpp={vpp}", f"parallel.schedule={schedule}"]


PIPELINE_LAYOUTS = {
    "gpipe-pp2": layout(pp=2, schedule="gpipe"),
    "gpipe-pp4": layout(pp=4, schedule="gpipe"),
    "1f1b-pp2": layout(pp=2, schedule="1f1b"),
    "1f1b-pp4": layout(pp=4, schedule="1f1b"),
    "interleaved-pp2-v1": layout(pp=2, vpp=1),
    "interleaved-pp2-v2": layout(pp=2, vpp=2),
    "interleaved-pp4-v1": layout(pp=4, vpp=1),
    "interleaved-pp4-v2": layout(pp=4, vpp=2),
    "interleaved-pp1-v2": layout(pp=1, vpp=2),
}

PTD_LAYOUTS = {
    "dp2": layout(dp=2, schedule="1f1b"),
    "tp2": layout(tp=2, schedule="1f1b"),
    "tp4": layout(tp=4, schedule="1f1b"),
    "dp2-tp2": layout(dp=2, tp=2, schedule="1f1b"),
    "tp2-pp2-v2": layout(tp=2, pp=2, vpp=2),
    "dp2-pp2-v2": layout(dp=2, pp=2, vpp=2),
    "dp2-tp2-pp2-v2": layout(dp=2, tp=2, pp=2, vpp=2),
    # Pipeline sends with tp=2 carry half of each message by default (scatter/gather);
    # whole, as before it, here. Sequence parallelism over tp 2 and 4, with and without a
    # pipeline (its sends: each rank's slice of the sequence).
    "nosg-dp2-tp2-pp2-v2": layout(dp=2, tp=2, pp=2, vpp=2) + ["parallel.scatter_gather=false"],
    "sp-tp2-pp2-v2": layout(tp=2, pp=2, vpp=2) + ["parallel.sequence_parallel=true"],
    "sp-tp4": layout(tp=4, schedule="1f1b") + ["parallel.sequence_parallel=true"],
    "sp-dp2-tp2-pp2-1f1b": layout(dp=2, tp=2, pp=2, schedule="1f1b") + ["parallel.sequence_parallel=true"],
}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def check_equivalent(client, layout, tmp_path, setup=(), loss_rtol=LOSS_RTOL,
                     param_rtol=PARAM_RTOL):
    """Runs TINY + setup + layout and holds it to the reference of TINY + setup."""
    overrides = TINY + list(setup) + layout + [f"checkpoint.dir={tmp_path}"]
    final, steps = run_job(client, overrides)
    assert final.state == "SUCCEEDED", final.error
    history, expected = reference(layout_free(TINY + list(setup)))

    assert [s.step for s in steps] == list(range(len(history)))
    for got, want in zip(steps, history):
        assert abs(got.loss - want.loss) <= loss_rtol * abs(want.loss), (got.step, got.loss, want.loss)
        assert abs(got.grad_norm - want.grad_norm) <= loss_rtol * abs(want.grad_norm), \
            (got.step, got.grad_norm, want.grad_norm)

    params = load_parameters(final.checkpoint)
    assert sorted(params) == sorted(expected)
    for name, want in expected.items():
        assert params[name].dtype == want.dtype, name
        assert relative_error(params[name], want) <= param_rtol, (name, relative_error(params[name], want))
    # Training moved the weights: equal-to-reference is not equal-to-initial.
    initial = reference_initial(tuple(setup))
    moved = min(relative_error(expected[n].float(), initial[n]) for n in expected if initial[n].any())
    assert moved > 10 * param_rtol
    return steps


@functools.lru_cache(maxsize=None)
def reference_initial(setup: tuple[str, ...] = ()):
    config = load_config("", list(layout_free(TINY + list(setup))))
    m = config.model
    model = full_model(shape_of(m), config.train.seed)
    return model.unpadded_parameters()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("name", PIPELINE_LAYOUTS)
def test_pipeline_layouts_match_reference(client, tmp_path, name, arch):
    check_equivalent(client, PIPELINE_LAYOUTS[name], tmp_path, arch_setup(arch, PIPELINE_LAYOUTS[name]))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("name", PTD_LAYOUTS)
def test_data_and_tensor_parallel_layouts_match_reference(client, tmp_path, name, arch):
    check_equivalent(client, PTD_LAYOUTS[name], tmp_path, arch_setup(arch, PTD_LAYOUTS[name]))


# Both architectures with the other tying: a Llama whose embedding is tied over the
# pipeline ends (the tie reduction), a GPT-2 whose head is its own (none), each with a
# vocabulary only padding splits over tp=2.
TYINGS = {
    "llama-tied": ["model.arch=llama", "model.n_kv_heads=2", "model.tie_embeddings=true", "model.vocab_size=300"],
    "gpt2-untied": ["model.tie_embeddings=false", "model.vocab_size=259"],
}


@pytest.mark.parametrize("tying", TYINGS)
def test_either_tying_over_pipeline_and_tensor_ranks_matches_reference(client, tmp_path, tying):
    check_equivalent(client, layout(tp=2, pp=2, vpp=2), tmp_path, TYINGS[tying])


# The acceptance run's schedule (warm to the peak, hold it, decay to 0.2*lr at the last
# step), with AdamW's betas and eps away from their defaults.
WSD = ["train.steps=8", "train.lr_decay=wsd", "train.decay_fraction=0.5", "train.warmup_steps=2",
       "train.min_lr_ratio=0.2", "train.lr=0.001", "train.betas=0.8,0.99", "train.eps=1e-6"]


def test_optimizer_settings_and_wsd_match_reference_with_the_schedules_lr_each_step(client, tmp_path):
    steps = check_equivalent(client, layout(tp=2, pp=2, schedule="1f1b"), tmp_path, WSD)
    history, _ = reference(layout_free(TINY + WSD))
    schedule = Schedule.of(load_config("", TINY + WSD).train)
    # Exactly, not within a tolerance: every rank and the reference evaluate one function of the step.
    assert [s.lr for s in steps] == [h.lr for h in history] == [schedule.lr_at(k) for k in range(8)]
    assert [round(s.lr, 12) for s in steps] == [5e-4, 1e-3, 1e-3, 1e-3, 8e-4, 6e-4, 4e-4, 2e-4]


# Held-out validation ([eval], docs/validation.md): scored after steps 2 and 3 through each
# layout's own forward-only programs, on the reference's very samples.
EVAL = ["eval.every=2", "eval.samples=8", "eval.fraction=0.05"]
EVAL_LAYOUTS = {
    "tp2-pp2-1f1b": layout(tp=2, pp=2, schedule="1f1b"),
    "gpipe-pp4": layout(pp=4, schedule="gpipe"),
    "interleaved-pp1-v2": layout(pp=1, vpp=2),
    "dp2-tp2-pp2-v2": layout(dp=2, tp=2, pp=2, vpp=2),
    "zero3-dp2-pp2-v2": layout(dp=2, pp=2, vpp=2) + ["parallel.zero=3"],
    "sp-tp2-pp2-1f1b": layout(tp=2, pp=2, schedule="1f1b") + ["parallel.sequence_parallel=true"],
    "zero3-dp2-tp2": layout(dp=2, tp=2, schedule="1f1b") + ["parallel.zero=3"],
    # selective recompute's checkpointing is for the backward: an evaluation runs the blocks plainly
    "zero1-dp2-pp2-selective": layout(dp=2, pp=2, schedule="1f1b") + ["parallel.zero=1", "train.recompute=selective"],
    # Three times as many evaluation microbatches (12) as training ones (4), interleaved:
    # message tags must number the evaluation's microbatches, not the step's.
    "interleaved-pp2-v2-eval3x": layout(pp=2, vpp=2) + ["eval.samples=24"],
}


@functools.lru_cache(maxsize=None)
def reference_with_evals(overrides: tuple[str, ...]):
    evaluations = []
    history, _ = train(load_config("", list(overrides)), on_eval=evaluations.append)
    return history, evaluations


def run_with_evals(client, overrides: list[str]):
    """(final status, step events, eval events) of a job followed to its end."""
    status = client.submit("", overrides)
    steps, evaluations = [], []
    for event in client.watch(status.job_id, timeout_s=300):
        if event.HasField("step"):
            steps.append(event.step)
        elif event.HasField("eval"):
            evaluations.append(event.eval)
    return client.status(status.job_id), steps, evaluations


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("name", EVAL_LAYOUTS)
def test_eval_loss_matches_reference(client, name, arch):
    setup = arch_setup(arch, EVAL_LAYOUTS[name]) + EVAL
    final, steps, evaluations = run_with_evals(client, TINY + setup + EVAL_LAYOUTS[name])
    assert final.state == "SUCCEEDED", final.error
    history, expected = reference_with_evals(layout_free(TINY + setup + EVAL_LAYOUTS[name]))  # its eval.* kept
    # Training on what the split leaves still equals the reference, step by step.
    assert [s.step for s in steps] == list(range(len(history)))
    for got, want in zip(steps, history):
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)
    assert [e.step for e in evaluations] == [e.step for e in expected] == [2, 3]
    for got, want in zip(evaluations, expected):
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)
        samples = 24 if "eval.samples=24" in EVAL_LAYOUTS[name] else 8
        assert (got.samples, got.tokens) == (want.samples, want.tokens) == (samples, samples * 16)
        assert got.perplexity == pytest.approx(math.exp(got.loss), rel=1e-12)
    assert expected[1].loss != expected[0].loss  # scored with the weights of its step
