"""ZeRO stages 1-3 keep the equivalence contract (DESIGN.md): each stage at dp 2 and 4,
composed with tensor and pipeline parallelism, with recomputation, and in fp64 over a
long run, against the single-process reference. Real jobs on the shared cluster.

bf16 is held to its own reference (the same job in one process, in bf16) and to fp32,
with tolerances set by bf16's 8-bit mantissa: see test_bf16_tracks_its_reference_and_fp32.
"""

from __future__ import annotations

import pytest

from tests.conftest import ARCHS, TINY, layout_free, reference, run_job
from tests.test_equivalence import check_equivalent, layout, reference_with_evals, run_with_evals

# dp=4 needs a global batch divisible by dp*microbatches = 16.
DP4 = ["train.global_batch=16"]

STAGES = {
    f"zero{zero}-dp{dp}": (layout(dp=dp, schedule="1f1b") + [f"parallel.zero={zero}"], DP4 if dp == 4 else [])
    for zero in (1, 2, 3) for dp in (2, 4)
}

COMPOSED = {
    "zero3-dp2-pp2-v2": (layout(dp=2, pp=2, vpp=2) + ["parallel.zero=3"], []),
    "zero3-dp2-pp2-v2-prefetch0": (layout(dp=2, pp=2, vpp=2) + ["parallel.zero=3", "parallel.zero_prefetch=0"], []),
    "zero2-dp2-tp2": (layout(dp=2, tp=2, schedule="1f1b") + ["parallel.zero=2"], []),
    "zero1-dp2-tp2-pp2": (layout(dp=2, tp=2, pp=2, schedule="1f1b") + ["parallel.zero=1"], []),
    "zero3-dp2-pp2-v2-recompute": (layout(dp=2, pp=2, vpp=2) + ["parallel.zero=3"], ["train.recompute=full"]),
    "zero3-pp1-v2": (layout(pp=1, vpp=2) + ["parallel.zero=3"], []),
    # Sequence parallelism: the replicated parameters' gradients summed over tp on the
    # ZeRO shards; with recompute, the rerun forward gathers and scatters again.
    "zero3-dp2-tp2-sp": (layout(dp=2, tp=2, schedule="1f1b") + ["parallel.zero=3", "parallel.sequence_parallel=true"],
                         []),
    "zero2-dp2-tp2-pp2-sp-recompute": (layout(dp=2, tp=2, pp=2, schedule="1f1b")
                                       + ["parallel.zero=2", "parallel.sequence_parallel=true"],
                                       ["train.recompute=full"]),
    # Selective recompute: the blocks rerun their cheap operations, and their collectives,
    # in the backward; with recompute_layers=2, every second block whole and the others plainly.
    "zero2-dp2-pp2-selective": (layout(dp=2, pp=2, schedule="1f1b") + ["parallel.zero=2"],
                                ["train.recompute=selective"]),
    "zero3-dp2-tp2-selective": (layout(dp=2, tp=2, schedule="1f1b") + ["parallel.zero=3"],
                                ["train.recompute=selective"]),
    "zero1-tp2-pp2-v2-selective-k2": (layout(tp=2, pp=2, vpp=2) + ["parallel.zero=1"],
                                      ["train.recompute=selective", "train.recompute_layers=2"]),
    "zero3-dp2-tp2-sp-selective": (layout(dp=2, tp=2, schedule="1f1b")
                                   + ["parallel.zero=3", "parallel.sequence_parallel=true"],
                                   ["train.recompute=selective"]),
    # Every axis at once: the replayed gathers and reduce-scatters inside interleaved chunks
    # whose parameters ZeRO-3 gathers for the forward and again for the rerun.
    "zero3-dp2-tp2-pp2-v2-sp-selective": (layout(dp=2, tp=2, pp=2, vpp=2)
                                          + ["parallel.zero=3", "parallel.sequence_parallel=true"],
                                          ["train.recompute=selective"]),
}




@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", STAGES)
def test_each_zero_stage_matches_reference(client, tmp_path, name, arch):
    sets, setup = STAGES[name]
    check_equivalent(client, sets, tmp_path, ARCHS[arch] + setup)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", COMPOSED)
def test_zero_composed_with_tp_pp_and_recompute_matches_reference(client, tmp_path, name, arch):
    sets, setup = COMPOSED[name]
    check_equivalent(client, sets, tmp_path, ARCHS[arch] + setup)


LONG = ["train.steps=50", "train.warmup_steps=5", "train.lr=0.003", "train.precision=fp64"]


@pytest.mark.parametrize("arch", ARCHS)
def test_fp64_long_run_of_ptd_zero3_matches_reference_to_1e9(client, tmp_path, arch):
    """50 steps of dp2·tp2·pp2·vpp2 with ZeRO-3 at the default learning rate, in fp64:
    with no rounding noise to hide behind, every step's loss and gradient norm agree
    to 1e-9 relative (measured: 1.1e-14 on losses, 6.5e-13 on gradient norms, 3.4e-13
    tensor-wise on the final parameters)."""
    check_equivalent(client, layout(dp=2, tp=2, pp=2, vpp=2) + ["parallel.zero=3"], tmp_path, ARCHS[arch] + LONG,
                     loss_rtol=1e-9, param_rtol=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp64_long_run_with_sequence_parallelism_matches_reference_to_1e9(client, tmp_path, arch):
    """The same 50 steps with sequence parallelism over dp2·tp2·pp2·vpp2 at ZeRO-1: the
    norms and residual adds on half the sequence each, the replicated parameters'
    gradients summed over tp before the optimizer, held to 1e-9 in fp64."""
    check_equivalent(client, layout(dp=2, tp=2, pp=2, vpp=2) + ["parallel.zero=1", "parallel.sequence_parallel=true"],
                     tmp_path, ARCHS[arch] + LONG, loss_rtol=1e-9, param_rtol=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp64_long_run_with_every_practitioner_feature_matches_reference_to_1e9(client, arch):
    """50 fp64 steps through dp2·tp2·pp2·vpp2 with ZeRO-3, sequence parallelism,
    selective recompute, a WSD schedule with its own betas and eps, and held-out
    evaluations every 10 steps (forward-only programs that gather each chunk's shards):
    every evaluation, and every step trained on what the split leaves, equal the
    reference's to 1e-9."""
    setup = TINY + ARCHS[arch] + LONG + ["eval.every=10", "eval.samples=8", "eval.fraction=0.05",
                                         "train.recompute=selective", "train.lr_decay=wsd",
                                         "train.decay_fraction=0.3", "train.min_lr_ratio=0.05",
                                         "train.betas=0.9,0.99", "train.eps=1e-6"]
    final, steps, evaluations = run_with_evals(client, setup + layout(dp=2, tp=2, pp=2, vpp=2)
                                               + ["parallel.zero=3", "parallel.sequence_parallel=true"])
    assert final.state == "SUCCEEDED", final.error
    history, expected = reference_with_evals(layout_free(setup))
    assert [e.step for e in evaluations] == [e.step for e in expected] == [10, 20, 30, 40, 50]
    for got, want in zip(evaluations, expected):
        assert abs(got.loss - want.loss) <= 1e-9 * abs(want.loss), (got.step, got.loss, want.loss)
    assert len(steps) == len(history) == 50
    for got, want in zip(steps, history):
        assert abs(got.loss - want.loss) <= 1e-9 * abs(want.loss), (got.step, got.loss, want.loss)


BF16 = ["train.steps=50", "train.warmup_steps=5", "train.lr=0.003"]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_tracks_its_reference_and_fp32(client, arch):
    """bf16 keeps 8 bits of mantissa (a rounding is up to 2^-9 = 2e-3 relative), and over
    50 steps of Adam the roundings move the trajectory rather than average out. What
    bf16 costs this run is the bf16 reference's own departure from fp32: 3.1e-3 relative
    per step on average (measured), single steps up to 1.7e-2. A parallel layout rounds
    different partial sums in a different order, so it is another bf16 run of the same
    computation, at a distance of that order from either reference. Bounds, over 50
    steps of dp2·pp2·vpp2 ZeRO-2: mean per-step relative difference at most 1e-2 (about
    3x the measured 0.8e-3 against fp32 and 2.7e-3 against the bf16 reference), any
    single step at most 5e-2 (about 2x the largest spike measured over three layouts,
    2.6e-2); and it must train."""
    model = ARCHS[arch]
    sets = TINY + model + BF16 + layout(dp=2, pp=2, vpp=2) + ["parallel.zero=2", "train.precision=bf16"]
    final, steps = run_job(client, sets)
    assert final.state == "SUCCEEDED", final.error
    bf16_ref, _ = reference(layout_free(TINY + model + BF16 + ["train.precision=bf16"]))
    fp32_ref, _ = reference(layout_free(TINY + model + BF16))
    assert len(steps) == len(bf16_ref) == len(fp32_ref) == 50

    def differences(a, b):
        return [abs(x.loss - y.loss) / y.loss for x, y in zip(a, b)]

    assert sum(differences(bf16_ref, fp32_ref)) / 50 <= 1e-2  # the premise, checked
    for ref in (fp32_ref, bf16_ref):
        diffs = differences(steps, ref)
        assert sum(diffs) / 50 <= 1e-2 and max(diffs) <= 5e-2, (sum(diffs) / 50, max(diffs))
    assert max(differences(steps, fp32_ref)) > 1e-5  # really computed in bf16
    assert steps[-1].loss < 0.7 * steps[0].loss
