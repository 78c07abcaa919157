"""AdamW over flat buffers with weight decay on [start, end) segments, the learning-rate
schedule, clipping and the float64 squared norm.

Tolerances: AdamW parameters and both moments match torch.optim.AdamW to atol=1e-7,
rtol=0 after every step (the arithmetic is the same, so in practice they are bitwise
equal); schedule values to rel_tol=1e-12; the clipping factor to rtol=1e-6; the squared
norm to rel_tol=1e-12 of a float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from interleaf.common.lr_schedule import Schedule
from interleaf.stageserver.optim import SLICE, AdamW, clip_coefficient, squared_norm

STATE_TOL = dict(atol=1e-7, rtol=2.4e-7)
"""Against torch's for-loop and foreach AdamW: the same formula, evaluated by another
kernel, may round an element one float32 ulp apart (1.2e-7 relative)."""

# --- AdamW --------------------------------------------------------------------------------


def _mask(n: int, segments: list[tuple[int, int]]) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for start, end in segments:
        mask[start:end] = True
    return mask


# A buffer of more than two SLICEs, with segments that start at 0, are longer than a
# slice, cross slice boundaries, touch each other without merging, and end at the end.
N = 2 * SLICE + 1000
SEGMENTS = [(0, 37), (500, 900), (1000, SLICE + 2000), (SLICE + 2000, SLICE + 2060),
            (2 * SLICE - 300, 2 * SLICE + 200), (N - 11, N)]


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
def test_adamw_with_decay_segments_matches_torch_with_two_param_groups(implementation):
    g = torch.Generator().manual_seed(0)
    wd = 0.5
    start = torch.randn(N, generator=g)
    decayed = _mask(N, SEGMENTS)
    plain = ~decayed
    assert decayed[SLICE - 1] and decayed[SLICE] and decayed[2 * SLICE] and plain.any()

    ours = AdamW(start.clone(), SEGMENTS, wd)
    a = start[decayed].clone().requires_grad_()
    b = start[plain].clone().requires_grad_()
    ref = torch.optim.AdamW(
        [{"params": [a], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}],
        lr=1.0, betas=(0.9, 0.95), eps=1e-8, foreach=implementation == "foreach",
        fused=implementation == "fused" or None,
    )
    # A warmup-like lr sequence, large enough that decay and bias correction both show.
    for lr in (1e-3, 5e-3, 2e-2, 1e-2, 3e-3, 1e-4):
        grad = torch.randn(N, generator=g) * 0.1
        ours.step(grad, lr)
        for group in ref.param_groups:
            group["lr"] = lr
        a.grad, b.grad = grad[decayed].clone(), grad[plain].clone()
        ref.step()

        torch.testing.assert_close(ours.params[decayed], a.detach(), **STATE_TOL)
        torch.testing.assert_close(ours.params[plain], b.detach(), **STATE_TOL)
        for key, mine in (("exp_avg", ours.exp_avg), ("exp_avg_sq", ours.exp_avg_sq)):
            torch.testing.assert_close(mine[decayed], ref.state[a][key], **STATE_TOL)
            torch.testing.assert_close(mine[plain], ref.state[b][key], **STATE_TOL)
    assert ours.steps == 6
    # The parameters moved by far more than the tolerance; decay (wd*lr up to 1e-2 of
    # each value) is far above it too, so decaying any element outside the segments, or
    # missing one inside (the slice boundary), fails the comparison above.
    assert (ours.params - start).abs().max() > 1e-2


def test_adamw_updates_the_buffer_it_was_given_in_place():
    params = torch.ones(4)
    opt = AdamW(params, [(0, 4)], weight_decay=0.1)
    opt.step(torch.tensor([1.0, -1.0, 0.0, 2.0]), lr=0.1)
    assert opt.params is params
    # Step 1 of Adam moves each element by lr*sign(g) (bias-corrected), after decay.
    expected = torch.ones(4) * (1 - 0.1 * 0.1) - 0.1 * torch.tensor([1.0, -1.0, 0.0, 1.0])
    torch.testing.assert_close(params, expected, atol=1e-6, rtol=0)


def test_adamw_decays_only_inside_its_segments():
    # Zero gradients: Adam's update is 0/(0+eps) = 0, so only the decay moves anything.
    params = torch.full((10,), 2.0, dtype=torch.float64)
    opt = AdamW(params, [(1, 3), (7, 8)], weight_decay=0.25)
    opt.step(torch.zeros(10, dtype=torch.float64), lr=0.2)
    expected = torch.full((10,), 2.0, dtype=torch.float64)
    expected[[1, 2, 7]] = 2.0 * (1 - 0.2 * 0.25)
    assert torch.equal(params, expected)


def test_adamw_state_bytes_are_two_moments_of_the_buffer():
    assert AdamW(torch.zeros(7, dtype=torch.float64), [], 0.1).state_bytes == 2 * 7 * 8
    assert AdamW(torch.zeros(5), [], 0.1).state_bytes == 2 * 5 * 4
    # The moments have the buffer's dtype (fp32 master weights keep fp32 moments).
    opt = AdamW(torch.zeros(3, dtype=torch.float64), [], 0.1)
    assert opt.exp_avg.dtype == opt.exp_avg_sq.dtype == torch.float64


def test_squared_norm_sums_slices_in_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * SLICE + 17, generator=g) * 1e3
    expected = float((x.double() ** 2).sum())
    assert math.isclose(squared_norm(x), expected, rel_tol=1e-12)
    # Squares that overflow float32 (2**132 > 2**128) are exact here.
    big = torch.full((SLICE + 1,), 2.0**66)
    assert squared_norm(big) == (SLICE + 1) * 2.0**132
    assert squared_norm(torch.zeros(0)) == 0.0


# --- Schedule -------------------------------------------------------------------------------


def test_schedule_linear_warmup_then_cosine_to_a_tenth():
    lr, warmup, steps = 3e-3, 4, 25
    s = Schedule(lr=lr, warmup_steps=warmup, steps=steps)
    for step in range(warmup):
        assert math.isclose(s.lr_at(step), lr * (step + 1) / warmup, rel_tol=1e-12)
    assert math.isclose(s.lr_at(warmup - 1), lr, rel_tol=1e-12)
    assert math.isclose(s.lr_at(warmup), lr, rel_tol=1e-12)
    # Half way through the decay (step 14 of 4..24) the cosine is at its midpoint.
    assert math.isclose(s.lr_at(14), lr / 10 + 0.5 * (lr - lr / 10), rel_tol=1e-12)
    assert math.isclose(s.lr_at(steps - 1), lr / 10, rel_tol=1e-12)
    # Past the end it stays at the floor.
    assert math.isclose(s.lr_at(steps + 10), lr / 10, rel_tol=1e-12)

    decay = [s.lr_at(step) for step in range(warmup, steps)]
    assert all(x > y for x, y in zip(decay, decay[1:]))
    warm = [s.lr_at(step) for step in range(warmup)]
    assert all(x < y for x, y in zip(warm, warm[1:]))


def test_schedule_matches_the_cosine_formula_everywhere():
    lr, warmup, steps = 1.0, 3, 13
    s = Schedule(lr=lr, warmup_steps=warmup, steps=steps)
    for step in range(warmup, steps):
        progress = (step - warmup) / (steps - 1 - warmup)
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        assert math.isclose(s.lr_at(step), expected, rel_tol=1e-12)


def test_schedule_without_warmup():
    s = Schedule(lr=0.01, warmup_steps=0, steps=10)
    assert math.isclose(s.lr_at(0), 0.01, rel_tol=1e-12)
    assert math.isclose(s.lr_at(9), 0.001, rel_tol=1e-12)
    values = [s.lr_at(step) for step in range(10)]
    assert all(x > y for x, y in zip(values, values[1:]))
    # One step, no warmup: the single step trains at the peak.
    assert math.isclose(Schedule(lr=0.01, warmup_steps=0, steps=1).lr_at(0), 0.01, rel_tol=1e-12)


def test_the_default_schedule_is_the_cosine_it_always_was():
    """Bit for bit: the pre-lr_decay formula, evaluated here as it was written."""
    lr, warmup, steps = 3e-3, 20, 200
    s = Schedule.of(type("T", (), dict(lr=lr, warmup_steps=warmup, steps=steps, lr_decay="cosine",
                                       min_lr_ratio=0.1, decay_fraction=0.2)))
    assert s == Schedule(lr, warmup, steps)
    for step in range(steps + 3):
        if step < warmup:
            old = lr * (step + 1) / warmup
        else:
            progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
            old = lr * 0.1 + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - lr * 0.1)
        assert s.lr_at(step) == old


def test_wsd_worked_example():
    """common/lr_schedule.py's docstring, and the acceptance run's schedule."""
    s = Schedule(lr=1e-3, warmup_steps=2, steps=8, decay="wsd", min_lr_ratio=0.2, decay_fraction=0.5)
    expected = [5e-4, 1e-3, 1e-3, 1e-3, 8e-4, 6e-4, 4e-4, 2e-4]
    for step, want in enumerate(expected):
        assert math.isclose(s.lr_at(step), want, rel_tol=1e-12), step
    assert s.lr_at(7) == 1e-3 * 0.2  # exactly the floor


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
@pytest.mark.parametrize("warmup,steps,ratio,fraction", [(0, 10, 0.0, 0.3), (4, 25, 0.1, 0.2), (3, 7, 0.5, 1.0),
                                                         (2, 50, 1.0, 0.05), (0, 2, 0.2, 0.01)])
def test_every_decay_warms_up_then_falls_monotonically_to_exactly_the_floor(decay, warmup, steps, ratio, fraction):
    lr = 2e-3
    s = Schedule(lr, warmup, steps, decay, ratio, fraction)
    values = [s.lr_at(step) for step in range(steps)]
    assert values[:warmup] == [lr * (k + 1) / warmup for k in range(warmup)]
    assert max(values) == lr
    peak = values.index(lr)
    assert all(b <= a for a, b in zip(values[peak:], values[peak + 1:]))
    assert values[-1] == lr * ratio  # the last step is at the floor, exactly
    assert s.lr_at(steps + 5) == lr * ratio  # and past the end stays there (a longer resumed job)


def test_linear_decay_falls_by_equal_steps():
    s = Schedule(1.0, 2, 12, "linear", 0.0)
    decay = [s.lr_at(step) for step in range(2, 12)]  # from the peak at step 2 to 0 at step 11
    assert [round(a - b, 12) for a, b in zip(decay, decay[1:])] == [round(1 / 9, 12)] * 9


def test_wsd_holds_the_peak_until_its_decay_fraction():
    lr, steps, warmup = 1.0, 100, 10
    s = Schedule(lr, warmup, steps, "wsd", 0.1, 0.2)
    values = [s.lr_at(step) for step in range(steps)]
    # The last 20 steps (80..99) are below the peak; 9..79 hold it.
    assert values[9:80] == [lr] * 71
    assert all(v < lr for v in values[80:])
    assert math.isclose(values[80], 0.1 + 0.9 * 19 / 20, rel_tol=1e-12)
    # A decay phase longer than what follows the warmup starts at the warmup's end:
    # decay_fraction 1 is linear decay.
    assert Schedule(lr, warmup, steps, "wsd", 0.1, 1.0).lr_at(50) == Schedule(lr, warmup, steps, "linear", 0.1).lr_at(50)


def test_constant_holds_the_peak_after_warmup():
    s = Schedule(0.5, 3, 10, "constant")
    assert [s.lr_at(step) for step in range(12)] == [0.5 / 3, 1 / 3, 0.5] + [0.5] * 9


# The edges the Schedule docstring states, each exactly.

@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_a_warmup_ending_on_the_second_to_last_step_leaves_the_last_at_the_peak(decay):
    s = Schedule(1.0, 4, 5, decay, 0.1)
    # The last step is the decay's start: the formula at progress 0, the peak to rounding.
    assert [s.lr_at(step) for step in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0], rel=1e-15)


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_one_step_without_warmup_trains_at_the_peak(decay):
    assert Schedule(0.01, 0, 1, decay, 0.1, 1.0).lr_at(0) == pytest.approx(0.01, rel=1e-15)


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_a_warmup_as_long_as_the_run_or_longer_is_all_there_is(decay):
    # The tests' steps=3 under the default warmup_steps=20: a third of a twentieth, ...
    assert [Schedule(1.0, 20, 3, decay).lr_at(step) for step in range(3)] == [1 / 20, 2 / 20, 3 / 20]
    assert [Schedule(1.0, 3, 3, decay).lr_at(step) for step in range(3)] == [1 / 3, 2 / 3, 1.0]


def test_wsd_decay_fraction_one_decays_every_step_after_the_warmup():
    """D = steps, capped at steps-1-warmup_steps: the linear decay, from step 0 or the
    warmup's end."""
    for warmup in (0, 3):
        wsd, linear = Schedule(1.0, warmup, 10, "wsd", 0.0, 1.0), Schedule(1.0, warmup, 10, "linear", 0.0)
        assert [wsd.lr_at(step) for step in range(10)] == [linear.lr_at(step) for step in range(10)]
        assert wsd.decay_start() == warmup
    values = [Schedule(1.0, 0, 4, "wsd", 0.0, 1.0).lr_at(step) for step in range(4)]
    assert values == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0], abs=1e-15) and values[-1] == 0.0


@pytest.mark.parametrize("fraction,steps,decaying", [
    (0.5, 5, 3),     # 2.5 rounds half up (Python's round gives 2)
    (0.5, 7, 4),     # 3.5
    (0.3, 5, 2),     # 1.5
    (0.7, 45, 32),   # 31.499999999999996 in binary: meant as 31.5
    (0.2, 10, 2),
    (0.01, 10, 1),   # 0.1: at least the last step
])
def test_wsd_decays_decay_fraction_of_the_steps_rounded_half_up(fraction, steps, decaying):
    s = Schedule(1.0, 0, steps, "wsd", 0.0, fraction)
    values = [s.lr_at(step) for step in range(steps)]
    assert sum(v < 1.0 for v in values) == decaying  # the last `decaying` steps are below the peak
    assert values[:steps - decaying] == [1.0] * (steps - decaying) and values[-1] == 0.0


@pytest.mark.parametrize("kwargs,message", [
    (dict(decay="step"), "decay='step' must be one of cosine, linear, wsd, constant"),
    (dict(min_lr_ratio=1.5), "min_lr_ratio=1.5 must be between 0 and 1"),
    (dict(decay_fraction=0.0), "decay_fraction=0.0 must be more than 0 and at most 1"),
])
def test_a_schedule_refuses_what_no_config_allows(kwargs, message):
    with pytest.raises(ValueError) as caught:
        Schedule(1.0, 0, 10, **kwargs)
    assert str(caught.value) == message


def test_adamw_uses_its_betas_and_eps():
    g = torch.Generator().manual_seed(5)
    start = torch.randn(300, generator=g)
    ours = AdamW(start.clone(), [(0, 100)], 0.1, betas=(0.5, 0.8), eps=1e-3)
    a, b = start[:100].clone().requires_grad_(), start[100:].clone().requires_grad_()
    ref = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.5, 0.8), eps=1e-3)
    for _ in range(4):
        grad = torch.randn(300, generator=g) * 1e-3  # small: eps=1e-3 shows in every update
        ours.step(grad, 1e-2)
        a.grad, b.grad = grad[:100].clone(), grad[100:].clone()
        ref.step()
    # torch's defaults (0.9, 0.999, 1e-8) would move these elements differently by far more.
    torch.testing.assert_close(ours.params, torch.cat([a.detach(), b.detach()]), **STATE_TOL)


# --- clipping -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.05, 0.5, 3.0, 100.0])
def test_clip_coefficient_matches_clip_grad_norm(max_norm):
    g = torch.Generator().manual_seed(1)
    params = [torch.zeros(shape, requires_grad=True) for shape in ((5, 3), (7,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.3
    grads = [p.grad.clone() for p in params]
    total = float(torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in grads])))

    returned = torch.nn.utils.clip_grad_norm_(params, max_norm)
    assert math.isclose(float(returned), total, rel_tol=1e-6)

    coef = clip_coefficient(total, max_norm)
    assert 0.0 < coef <= 1.0
    assert (coef < 1.0) == (max_norm < total)
    for before, p in zip(grads, params):
        torch.testing.assert_close(before * coef, p.grad, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
def test_clip_coefficient_is_one_when_disabled(max_norm):
    assert clip_coefficient(1e6, max_norm) == 1.0
    assert clip_coefficient(0.0, max_norm) == 1.0


def test_clip_coefficient_values():
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert math.isclose(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6), rel_tol=1e-12)

