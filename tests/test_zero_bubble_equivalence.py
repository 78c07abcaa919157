"""The zero-bubble schedules keep the equivalence contract (DESIGN.md): zb-h1 and zbv,
whose backwards run as input- and weight-gradient halves, train exactly like the
single-process reference on the layouts the suite holds interleaved 1F1B to: pipeline
alone, with data and tensor parallelism (sequence parallelism and scatter/gather), ZeRO
1-3, selective and full recompute, both architectures, fp32 and a long fp64 run. Real
jobs on the shared cluster, with test_equivalence's tolerances."""

from __future__ import annotations

import pytest

from tests.conftest import ARCHS, TINY
from tests.test_checkpoint_resume import resume_through
from tests.test_equivalence import check_equivalent, layout
from tests.test_zero_equivalence import LONG

ZB = {
    "zb-h1-pp4": layout(pp=4, schedule="zb-h1"),
    "zbv-pp4": layout(pp=4, vpp=2, schedule="zbv"),
    "zbv-dp2-tp2-pp2": layout(dp=2, tp=2, pp=2, vpp=2, schedule="zbv"),
}
"""Run for both architectures; those below for gpt2 (a suite on two cores has its budget)."""

GPT2_ONLY = {
    "zb-h1-pp2": layout(pp=2, schedule="zb-h1"),
    "zbv-pp2": layout(pp=2, vpp=2, schedule="zbv"),
    "zbv-pp1": layout(pp=1, vpp=2, schedule="zbv"),  # the V on one rank: both chunks, split
    "zbv-tp2-pp2-nosg": layout(tp=2, pp=2, vpp=2, schedule="zbv") + ["parallel.scatter_gather=false"],
}

COMPOSED = {
    "zbv-tp2-pp2-sp": (layout(tp=2, pp=2, vpp=2, schedule="zbv") + ["parallel.sequence_parallel=true"], []),
    "zb-h1-dp2-tp2-pp2-sp": (layout(dp=2, tp=2, pp=2, schedule="zb-h1") + ["parallel.sequence_parallel=true"], []),
    "zbv-zero1-dp2-pp2": (layout(dp=2, pp=2, vpp=2, schedule="zbv") + ["parallel.zero=1"], []),
    "zb-h1-zero2-dp2-pp2-selective": (layout(dp=2, pp=2, schedule="zb-h1") + ["parallel.zero=2"],
                                      ["train.recompute=selective"]),
    "zbv-zero3-dp2-tp2-pp2": (layout(dp=2, tp=2, pp=2, vpp=2, schedule="zbv") + ["parallel.zero=3"], []),
    "zbv-zero3-dp2-pp2-recompute": (layout(dp=2, pp=2, vpp=2, schedule="zbv") + ["parallel.zero=3"],
                                    ["train.recompute=full"]),
    "zb-h1-tp2-pp2-recompute": (layout(tp=2, pp=2, schedule="zb-h1"), ["train.recompute=full"]),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ZB)
def test_zero_bubble_layouts_match_reference(client, tmp_path, name, arch):
    check_equivalent(client, ZB[name], tmp_path, ARCHS[arch])


@pytest.mark.parametrize("name", GPT2_ONLY)
def test_zero_bubble_layouts_match_reference_gpt2(client, tmp_path, name):
    check_equivalent(client, GPT2_ONLY[name], tmp_path)


@pytest.mark.parametrize("name", COMPOSED)
def test_zero_bubble_composed_with_sp_zero_and_recompute_matches_reference(client, tmp_path, name):
    layout_, setup = COMPOSED[name]
    check_equivalent(client, layout_, tmp_path, setup)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp64_long_run_of_zbv_with_ptd_zero3_matches_reference_to_1e9(client, tmp_path, arch):
    """20 steps of dp2·tp2·pp2 in zbv's V with ZeRO-3, in fp64 (test_zero_equivalence's
    long run, shortened: the suite runs on two cores): every W on its chunk's saved
    inputs and output gradients, to 1e-9 relative."""
    check_equivalent(client, layout(dp=2, tp=2, pp=2, vpp=2, schedule="zbv") + ["parallel.zero=3"], tmp_path,
                     ARCHS[arch] + LONG + ["train.steps=20"], loss_rtol=1e-9, param_rtol=1e-9)


# The same four chunks round-robin, then in the V (chunks 2 and 3 change ranks), then
# four ranks of one chunk: checkpoints are written by parameter name, so each hop
# reshards between placements like between any layouts.
PLACEMENTS = [
    ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.zero=3"],
    ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv", "parallel.zero=1"],
    ["parallel.pp=4", "parallel.vpp=1", "parallel.schedule=zb-h1", "parallel.microbatches=8"],
]


def test_resuming_between_placements_equals_the_uninterrupted_run(client, tmp_path):
    resume_through(client, tmp_path, TINY + ["train.steps=6"], PLACEMENTS)
