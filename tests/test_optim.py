"""AdamW over flat buffers, the learning-rate schedule, clipping, and FlatParams.

Tolerances: AdamW parameters and both moments match torch.optim.AdamW to atol=1e-7,
rtol=0 after every step (the arithmetic is the same, so in practice they are bitwise
equal); schedule values to rel_tol=1e-12; the clipping factor to rtol=1e-6; flat
gradients equal ordinary autograd accumulation to rtol=1e-6, atol=1e-7.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from stageserver.flat import FlatParams
from stageserver.optim import AdamW, Schedule, clip_coefficient

STATE_TOL = dict(atol=1e-7, rtol=0.0)
GRAD_TOL = dict(atol=1e-7, rtol=1e-6)

# --- AdamW --------------------------------------------------------------------------------


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_matches_torch_with_a_decay_mask(foreach):
    g = torch.Generator().manual_seed(0)
    n, wd = 97, 0.5
    start = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) < 0.6).float()
    decayed, plain = mask.bool(), ~mask.bool()
    assert decayed.any() and plain.any()

    ours = AdamW(start.clone(), mask, wd)
    a = start[decayed].clone().requires_grad_()
    b = start[plain].clone().requires_grad_()
    ref = torch.optim.AdamW(
        [{"params": [a], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}],
        lr=1.0, betas=(0.9, 0.95), eps=1e-8, foreach=foreach,
    )
    # A warmup-like lr sequence, large enough that decay and bias correction both show.
    for lr in (1e-3, 5e-3, 2e-2, 1e-2, 3e-3, 1e-4):
        grad = torch.randn(n, generator=g) * 0.1
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
    # The parameters moved by far more than the tolerance, and decay mattered.
    assert (ours.params - start).abs().max() > 1e-2


def test_adamw_updates_the_buffer_it_was_given_in_place():
    params = torch.ones(4)
    opt = AdamW(params, torch.ones(4), weight_decay=0.1)
    opt.step(torch.tensor([1.0, -1.0, 0.0, 2.0]), lr=0.1)
    assert opt.params is params
    # Step 1 of Adam moves each element by lr*sign(g) (bias-corrected), after decay.
    expected = torch.ones(4) * (1 - 0.1 * 0.1) - 0.1 * torch.tensor([1.0, -1.0, 0.0, 1.0])
    torch.testing.assert_close(params, expected, atol=1e-6, rtol=0)


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


# --- FlatParams ------------------------------------------------------------------------------


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 3))


def _decays(module: nn.Module) -> dict[str, bool]:
    return {name: p.dim() >= 2 for name, p in module.named_parameters()}


def _loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).pow(2).mean()


def test_flat_params_are_views_of_the_flat_buffers():
    module = _module()
    original = {name: p.detach().clone() for name, p in module.named_parameters()}
    flat = FlatParams(module, _decays(module))

    total = sum(p.numel() for p in original.values())
    assert flat.data.shape == flat.grad.shape == flat.decay_mask.shape == (total,)
    assert flat.names == list(original)
    offset = 0
    for name, param in module.named_parameters():
        start, n = flat.offsets[name]
        assert (start, n) == (offset, param.numel())
        offset += n
        assert torch.equal(param.detach(), original[name])
        assert param.data_ptr() == flat.data[start:].data_ptr()
        assert param.grad.data_ptr() == flat.grad[start:].data_ptr()
        assert torch.equal(flat.view(name), original[name])
        assert flat.view(name, flat.grad).data_ptr() == param.grad.data_ptr()
        assert torch.equal(flat.decay_mask[start : start + n], torch.full((n,), float(param.dim() >= 2)))
    assert not flat.grad.any()

    # Writing the flat buffer (what the optimizer does) changes the module.
    x = torch.randn(2, 4)
    before = module(x)
    flat.data.mul_(0.5)
    assert torch.equal(module[0].weight.detach(), original["0.weight"] * 0.5)
    assert not torch.allclose(module(x), before)


def test_flat_grads_accumulate_microbatches_in_place():
    module = _module()
    ref = copy.deepcopy(module)
    flat = FlatParams(module, _decays(module))
    g = torch.Generator().manual_seed(2)
    micro = [torch.randn(5, 4, generator=g) for _ in range(2)]

    for x in micro:
        _loss(module, x).backward()
        flat.check_grads_in_place()
    for x in micro:
        _loss(ref, x).backward()

    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(flat.grad, expected, **GRAD_TOL)
    # Still views after accumulation, and zero_grad clears through them.
    for name, param in module.named_parameters():
        assert param.grad.data_ptr() == flat.grad[flat.offsets[name][0]:].data_ptr()
    flat.zero_grad()
    assert all(not p.grad.any() for p in module.parameters())
    _loss(module, micro[0]).backward()
    flat.check_grads_in_place()
    single = copy.deepcopy(ref)
    single.zero_grad()
    _loss(single, micro[0]).backward()
    torch.testing.assert_close(flat.grad, torch.cat([p.grad.reshape(-1) for p in single.parameters()]), **GRAD_TOL)


def test_check_grads_in_place_rejects_a_replaced_grad():
    module = _module()
    flat = FlatParams(module, _decays(module))
    _loss(module, torch.randn(3, 4)).backward()
    flat.check_grads_in_place()
    module[3].bias.grad = module[3].bias.grad.clone()
    with pytest.raises(RuntimeError, match="gradient of 3.bias left the flat buffer"):
        flat.check_grads_in_place()


def test_check_grads_in_place_rejects_grads_set_to_none():
    # torch's own zero_grad() defaults to set_to_none=True, which detaches .grad.
    module = _module()
    flat = FlatParams(module, _decays(module))
    module.zero_grad()
    with pytest.raises(RuntimeError, match="gradient of 0.weight left the flat buffer"):
        flat.check_grads_in_place()
