"""The equivalence contract (DESIGN.md): every layout trains exactly like the
single-process reference. Each case is a real job on the shared local cluster.

Tolerances, fp32 on CPU: per-step loss within 1e-5 relative; final parameters within
1e-4 (absolute, on values of order 0.02-1)."""

from __future__ import annotations

import functools

import pytest
import torch

from coordinator.config import load_config
from stageserver.model import GPTConfig, full_model
from tests.conftest import TINY, layout_free, load_parameters, reference, run_job

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4


def _layout(dp=1, tp=1, pp=1, vpp=1, schedule="interleaved-1f1b"):
    return [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"parallel.vpp={vpp}", f"parallel.schedule={schedule}"]


PIPELINE_LAYOUTS = {
    "gpipe-pp2": _layout(pp=2, schedule="gpipe"),
    "gpipe-pp4": _layout(pp=4, schedule="gpipe"),
    "1f1b-pp2": _layout(pp=2, schedule="1f1b"),
    "1f1b-pp4": _layout(pp=4, schedule="1f1b"),
    "interleaved-pp2-v1": _layout(pp=2, vpp=1),
    "interleaved-pp2-v2": _layout(pp=2, vpp=2),
    "interleaved-pp4-v1": _layout(pp=4, vpp=1),
    "interleaved-pp4-v2": _layout(pp=4, vpp=2),
    "interleaved-pp1-v2": _layout(pp=1, vpp=2),
}

PTD_LAYOUTS = {
    "dp2": _layout(dp=2, schedule="1f1b"),
    "tp2": _layout(tp=2, schedule="1f1b"),
    "tp4": _layout(tp=4, schedule="1f1b"),
    "dp2-tp2": _layout(dp=2, tp=2, schedule="1f1b"),
    "tp2-pp2-v2": _layout(tp=2, pp=2, vpp=2),
    "dp2-pp2-v2": _layout(dp=2, pp=2, vpp=2),
    "dp2-tp2-pp2-v2": _layout(dp=2, tp=2, pp=2, vpp=2),
}


def _check_equivalent(client, layout, tmp_path):
    overrides = TINY + layout + [f"checkpoint.dir={tmp_path}"]
    final, steps = run_job(client, overrides)
    assert final.state == "SUCCEEDED", final.error
    history, expected = reference(layout_free(TINY))

    assert [s.step for s in steps] == list(range(len(history)))
    for got, want in zip(steps, history):
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)

    params = load_parameters(final.checkpoint)
    assert sorted(params) == sorted(expected)
    for name, want in expected.items():
        torch.testing.assert_close(params[name], want, rtol=0, atol=PARAM_ATOL, msg=name)
    # Training moved the weights: equal-to-reference is not equal-to-initial.
    moved = max((expected[n] - reference_initial()[n]).abs().max().item() for n in expected)
    assert moved > 10 * PARAM_ATOL


@functools.lru_cache(maxsize=1)
def reference_initial():
    config = load_config("", list(layout_free(TINY)))
    m = config.model
    model = full_model(GPTConfig(m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size), config.train.seed)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", PIPELINE_LAYOUTS)
def test_pipeline_layouts_match_reference(client, tmp_path, name):
    _check_equivalent(client, PIPELINE_LAYOUTS[name], tmp_path)


@pytest.mark.parametrize("name", PTD_LAYOUTS)
def test_data_and_tensor_parallel_layouts_match_reference(client, tmp_path, name):
    _check_equivalent(client, PTD_LAYOUTS[name], tmp_path)
