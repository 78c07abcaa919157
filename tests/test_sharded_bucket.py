"""ShardedBucket and BucketLayout: a bucket of parameters held as its ZeRO stage says.

In one process (SoloTransport, dp=1) for ZeRO 0-3 and fp32/bf16/fp64: the module's
parameters and their .grad are views of the bucket's buffers, autograd accumulates in
place, released storage holds 0 bytes and a gather restores it (also under a forward's
saved tensors), and one step is torch.optim.AdamW's step. On real gloo groups of 2 and
4 ranks (one spawn of 4: the pairs are groups of their own), one reduce and step equal
a single-process bucket stepping on the averaged gradient, and the memory ledger holds
what coordinator/memory_model.py's table says.

Tolerances: gradients are compared exactly where the arithmetic is the same (bucket vs
plain autograd, bf16 included); one AdamW step matches torch to atol=1e-7 (fp32, and
the fp32 master of bf16), 1e-15 (fp64), one bf16 ulp (bf16 working parameters). The
ranks' gradients are made dyadic (multiples of 2**-16, below 2**4) so that their sums
are exact in float32 whatever order gloo adds them in; the reduced shards are then
compared exactly.
"""

from __future__ import annotations

import copy
import datetime
import itertools

import pytest
import torch
import torch.distributed as dist
from tests.gloo_world import TIMEOUT_S, run_world
from torch import nn

from interleaf.common.buckets import BucketLayout, clip_segments
from interleaf.stageserver.memory import KINDS, MemoryLedger
from interleaf.stageserver.sharded_bucket import ShardedBucket
from interleaf.stageserver.transport import SoloTransport, connect_gloo

DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.float32),
          "fp64": (torch.float64, torch.float64)}
"""precision -> (compute dtype, master dtype), as stageserver/model_state.py maps them."""
PRECISIONS = tuple(DTYPES)
ZEROS = (0, 1, 2, 3)
WD, LR = 0.1, 1e-2
DECAYED = {"0.weight", "3.weight"}
NORM_NAMES = ("0.weight", "1.bias", "3.weight")
"""Not neighbours in the bucket: count_norm gets several segments, cut by the shards."""
STEP_TOL = {"fp32": dict(atol=1e-7, rtol=0.0), "bf16": dict(atol=1e-7, rtol=0.0),
            "fp64": dict(atol=1e-15, rtol=0.0)}
BF16_ULP = dict(atol=0.0, rtol=2.0**-7)


def _module() -> nn.Module:
    """69 parameters: no dp of 2 or 4 divides them, so every bucket is padded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 3))


NUMEL = 69


def _loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).pow(2).mean()


def _input(seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bucket(module: nn.Module, zero: int, precision: str, dp=None, ledger=None) -> ShardedBucket:
    dp = dp or SoloTransport("dp")
    cd, md = DTYPES[precision]
    params = list(module.named_parameters())
    layout = BucketLayout.build([(n, p.numel()) for n, p in params], dp.size, dp.rank)
    return ShardedBucket(params, layout, zero, cd, md, dp, ledger or MemoryLedger(), DECAYED, WD)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _state(zero: int, precision: str, padded: int, dp: int) -> dict[str, int]:
    """coordinator/memory_model.py's table for one bucket, written out again here."""
    cd, md = DTYPES[precision]
    a, m = cd.itemsize, md.itemsize
    shard = padded // dp
    owned = padded if zero == 0 else shard
    state = dict.fromkeys(KINDS, 0)
    state["parameters"] = a * (shard if zero == 3 else padded)
    shard_apart = zero >= 2 or zero == 1 and a != m  # fp32 stage 1 writes it into the full one
    state["gradients"] = (a * padded if zero < 2 else 0) + (m * shard if shard_apart else 0)
    state["optimizer"] = 2 * m * owned + (m * owned if a != m else 0)
    return state


# --- BucketLayout ----------------------------------------------------------------------------


def test_layout_docstring_example():
    # a (6 elements) and b (3), dp=4 -> padded 12, S=3.
    layouts = [BucketLayout.build([("a", 6), ("b", 3)], 4, r) for r in range(4)]
    for layout in layouts:
        assert layout.offsets == {"a": (0, 6), "b": (6, 3)}
        assert (layout.numel, layout.padded, layout.shard_size) == (9, 12, 3)
        assert layout.names == ("a", "b")
    assert [layout.shard for layout in layouts] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    a, b = layouts[0].segments(["a"]), layouts[0].segments(["b"])
    assert [clip_segments(a, layout.shard) for layout in layouts] == [[(0, 3)], [(0, 3)], [], []]
    assert [clip_segments(b, layout.shard) for layout in layouts] == [[], [], [(0, 3)], []]


@pytest.mark.parametrize("numel, dp, padded", [(9, 4, 12), (8, 4, 8), (69, 2, 70), (69, 4, 72),
                                               (1, 3, 3), (7, 1, 7)])
def test_layout_pads_to_a_multiple_of_dp_and_shards_cover_it(numel, dp, padded):
    layouts = [BucketLayout.build([("x", numel)], dp, r) for r in range(dp)]
    assert {(layout.numel, layout.padded) for layout in layouts} == {(numel, padded)}
    shards = [layout.shard for layout in layouts]
    assert shards[0][0] == 0 and shards[-1][1] == padded
    assert all(hi - lo == padded // dp for lo, hi in shards)
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(shards))


def test_segments_merge_neighbours_in_buffer_order():
    layout = BucketLayout.build([("a", 3), ("b", 2), ("c", 4), ("d", 1)], 2, 0)
    assert layout.segments(["c", "a", "b"]) == [(0, 9)]
    assert layout.segments(["a", "c"]) == [(0, 3), (5, 9)]
    assert layout.segments(["d", "a"]) == [(0, 3), (9, 10)]
    assert layout.segments(["b", "d", "c"]) == [(3, 10)]
    assert layout.segments([]) == []


def test_clip_segments_cuts_and_shifts_into_the_window():
    assert clip_segments([(2, 7)], (3, 6)) == [(0, 3)]
    assert clip_segments([(2, 4), (5, 8)], (3, 6)) == [(0, 1), (2, 3)]
    # Touching the window's edge from outside selects nothing in it.
    assert clip_segments([(0, 3), (6, 9)], (3, 6)) == []
    assert clip_segments([(4, 5)], (3, 6)) == [(1, 2)]
    assert clip_segments([(0, 100)], (40, 60)) == [(0, 20)]


def test_clip_segments_selects_what_the_mask_selects_in_every_window():
    g = torch.Generator().manual_seed(4)
    n = 60
    for _ in range(50):
        cuts = sorted(set(torch.randint(0, n + 1, (8,), generator=g).tolist()))
        segments = [(s, e) for s, e in zip(cuts[::2], cuts[1::2]) if s < e]
        mask = torch.zeros(n, dtype=torch.bool)
        for s, e in segments:
            mask[s:e] = True
        lo = int(torch.randint(0, n, (1,), generator=g))
        hi = int(torch.randint(lo + 1, n + 1, (1,), generator=g))
        clipped = torch.zeros(hi - lo, dtype=torch.bool)
        for s, e in clip_segments(segments, (lo, hi)):
            assert 0 <= s < e <= hi - lo
            clipped[s:e] = True
        assert torch.equal(clipped, mask[lo:hi]), (segments, lo, hi)


# --- one process: views, in-place accumulation, release, step ------------------------------


def _hold(bucket: ShardedBucket) -> None:
    """What the program does before a chunk's first backward."""
    if bucket.zero == 3:
        bucket.gather().wait()
    if bucket.zero >= 2:
        bucket.hold_grads()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("zero", ZEROS)
def test_parameters_and_grads_are_views_of_the_buckets(zero, precision):
    cd, _ = DTYPES[precision]
    module = _module()
    original = {name: p.detach().clone() for name, p in module.named_parameters()}
    bucket = _bucket(module, zero, precision)
    _hold(bucket)

    assert bucket.params.shape == bucket.grads.shape == (NUMEL,)
    offset = 0
    for name, param in module.named_parameters():
        start, n = bucket.layout.offsets[name]
        assert (start, n) == (offset, param.numel())
        offset += n
        assert param.dtype == param.grad.dtype == cd
        assert param.data_ptr() == bucket.params[start:].data_ptr()
        assert param.grad.data_ptr() == bucket.grads[start:].data_ptr()
        start, n = bucket.layout.offsets[name]
        assert bucket.params[start:start + n].data_ptr() == param.data_ptr()
        assert torch.equal(param.detach(), original[name].to(cd))
    assert not bucket.grads.any()

    # Writing the buffer (what the optimizer and the gathers do) changes the module.
    x = _input(1, cd)
    before = module(x)
    bucket.params.mul_(0.5)
    assert torch.equal(module[0].weight.detach(), original["0.weight"].to(cd) * 0.5)
    assert not torch.equal(module(x), before)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("zero", ZEROS)
def test_grads_accumulate_in_place_over_two_backwards(zero, precision):
    cd, _ = DTYPES[precision]
    module = _module()
    ref = copy.deepcopy(module).to(cd)
    bucket = _bucket(module, zero, precision)
    _hold(bucket)
    micro = [_input(2, cd), _input(3, cd)]

    for x in micro:
        _loss(module, x).backward()
    for x in micro:
        _loss(ref, x).backward()
    expected = _flat(p.grad for p in ref.parameters())
    assert expected.abs().max() > 1e-3
    assert torch.equal(bucket.grads, expected)
    for name, param in module.named_parameters():
        assert param.grad.data_ptr() == bucket.grads[bucket.layout.offsets[name][0]:].data_ptr()

    # zero_grad clears through the views; one more backward is then one microbatch's.
    bucket.zero_grad()
    assert all(not p.grad.any() for p in module.parameters())
    _loss(module, micro[0]).backward()
    ref.zero_grad()
    _loss(ref, micro[0]).backward()
    assert torch.equal(bucket.grads, _flat(p.grad for p in ref.parameters()))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_release_leaves_zero_bytes_and_gather_restores_the_values(precision):
    cd, _ = DTYPES[precision]
    module = _module()
    original = _flat(p.detach() for p in module.parameters()).to(cd)
    ledger = MemoryLedger()
    bucket = _bucket(module, 3, precision, ledger=ledger)
    a = cd.itemsize

    def storage_bytes():
        return [p.untyped_storage().nbytes() for p in module.parameters()]

    # ZeRO-3 starts released: only the shard (all of it at dp=1) is held.
    assert storage_bytes() == [0] * 6 and bucket.params.untyped_storage().nbytes() == 0
    assert ledger.current["parameters"] == a * NUMEL
    for _ in range(2):
        bucket.gather().wait()
        assert storage_bytes() == [a * NUMEL] * 6
        assert torch.equal(_flat(p.detach() for p in module.parameters()), original)
        assert ledger.current["parameters"] == 2 * a * NUMEL
        with pytest.raises(RuntimeError, match="already gathered"):
            bucket.gather()
        bucket.release()
        assert storage_bytes() == [0] * 6
        assert ledger.current["parameters"] == a * NUMEL
        with pytest.raises(RuntimeError, match="only gathered ZeRO-3 parameters can be released"):
            bucket.release()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_backward_after_release_and_regather_equals_one_without(precision):
    cd, _ = DTYPES[precision]
    x = _input(5, cd)
    grads = []
    for release_between in (True, False):
        module = _module()
        bucket = _bucket(module, 3, precision)
        bucket.gather().wait()
        loss = _loss(module, x)  # saves views of the parameters for the backward
        if release_between:
            bucket.release()
            assert module[0].weight.untyped_storage().nbytes() == 0
            bucket.gather().wait()
        bucket.hold_grads()
        loss.backward()
        grads.append(bucket.grads.clone())
    assert grads[0].abs().max() > 1e-3
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("zero", ZEROS)
def test_one_step_equals_torch_adamw(zero, precision):
    cd, md = DTYPES[precision]
    scale = 0.5  # the 1/dp average and the clipping factor in one
    module = _module()
    names = [name for name, _ in module.named_parameters()]
    ref_params = {name: p.detach().to(md).clone().requires_grad_() for name, p in module.named_parameters()}
    ledger = MemoryLedger()
    bucket = _bucket(module, zero, precision, ledger=ledger)
    _hold(bucket)
    _loss(module, _input(6, cd)).backward()
    # A copy: the step scales the gradient in place, and stage 2/3 reductions release it.
    grad = bucket.grads.to(md, copy=True)
    if zero == 3:
        bucket.release()
    if zero:
        bucket.reduce().wait()
    bucket.step(LR, scale)
    if zero:
        bucket.gather().wait()

    ref = torch.optim.AdamW(
        [{"params": [ref_params[n] for n in names if n in DECAYED], "weight_decay": WD},
         {"params": [ref_params[n] for n in names if n not in DECAYED], "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95), eps=1e-8,
    )
    for name in names:
        start, n = bucket.layout.offsets[name]
        ref_params[name].grad = grad[start:start + n].view_as(ref_params[name]) * scale
    ref.step()
    expected = _flat(ref_params[n].detach() for n in names)
    start = _flat(p.detach().to(md) for p in _module().parameters())
    assert (expected - start).abs().max() > 1e-3

    if cd != md:
        torch.testing.assert_close(bucket.master, expected, **STEP_TOL[precision])
        assert torch.equal(bucket.params, bucket.master.to(cd))
    else:
        torch.testing.assert_close(bucket.params, expected, **STEP_TOL[precision])
    assert torch.equal(_flat(p.detach() for p in module.parameters()), bucket.params)
    if zero == 3:
        bucket.release()
    assert ledger.current == _state(zero, precision, NUMEL, 1)


def test_pending_finishes_once():
    ledger = MemoryLedger()
    bucket = _bucket(_module(), 1, "bf16", ledger=ledger)
    pending = bucket.reduce()
    assert ledger.current["communication"] == 4 * NUMEL + 4 * NUMEL  # fp32 copy + shard
    pending.wait()
    pending.wait()
    assert ledger.current["communication"] == 0
    assert ledger.current == _state(1, "bf16", NUMEL, 1)


# --- gloo groups of 2 and 4 ------------------------------------------------------------------


def _replica_step(group, zero: int, precision: str) -> dict:
    """One training step of this data-parallel rank, as the program orders it."""
    cd, _ = DTYPES[precision]
    module = _module()
    ledger = MemoryLedger()
    bucket = _bucket(module, zero, precision, dp=group, ledger=ledger)
    out = {"built": dict(ledger.current)}
    ledger.reset_peaks()
    _hold(bucket)
    out["holding"] = dict(ledger.current)
    _loss(module, _input(100 + group.rank, cd)).backward()
    with torch.no_grad():  # in place: the gradients must stay in the bucket
        for param in module.parameters():
            param.grad.copy_(torch.round(param.grad * 2.0**16) / 2.0**16)
    # What this rank contributes (the parent sums them: its own backward could differ
    # in the last bits, as reductions inside kernels depend on the thread count).
    out["local"] = bucket.grads[:NUMEL].clone()
    if zero == 3:
        bucket.release()
    bucket.reduce().wait()
    out["reduced"] = dict(ledger.current)
    out["grads_storage"] = bucket.grads.untyped_storage().nbytes()
    out["optimizer_grad"] = bucket.optimizer_grad().clone()
    out["norm_parts"] = torch.cat(bucket.count_norm(bucket.layout.segments(NORM_NAMES)))
    bucket.step(LR, 1.0 / group.size)
    if zero:
        bucket.gather().wait()
    out["params"] = bucket.params.clone()
    out["module"] = _flat(p.detach() for p in module.parameters())
    out["master"] = bucket.master.clone()
    if zero == 3:
        bucket.release()
    out["end"] = dict(ledger.current)
    out["peak"] = dict(ledger.peak)
    return out


def _replicas(rank: int, world, port: int) -> dict:
    """Every (dp, precision, zero) case: dp=4 on the world, dp=2 on pairs {0,1}, {2,3}
    joined through the test's own store."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    first = rank // 2 * 2
    pair = connect_gloo(store, f"pair{first}", [first, first + 1], rank, TIMEOUT_S, "127.0.0.1")
    results = {}
    for dp, group in ((2, pair), (4, world)):
        for precision in PRECISIONS:
            for zero in ZEROS:
                results[(dp, precision, zero)] = _replica_step(group, zero, precision)
    # The world's collectives above completed on every rank, so no pair collective is
    # still running anywhere.
    pair.close()
    return results


@pytest.fixture(scope="module")
def replicas() -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return run_world(_replicas, 4, store.port, group="dp")


CASES = [(dp, zero, precision) for dp in (2, 4) for zero in ZEROS for precision in PRECISIONS]


def _groups(results: list[dict], dp: int, key) -> list[list[dict]]:
    """Each data-parallel group's results (pairs {0,1} and {2,3}, or all 4), by group rank."""
    return [[results[r][key] for r in range(first, first + dp)] for first in range(0, 4, dp)]


def _summed(group: list[dict], precision: str, padded: int) -> torch.Tensor:
    """The sum of the group's gradients, padded (exact: see the module docstring)."""
    _, md = DTYPES[precision]
    total = torch.zeros(padded, dtype=md)
    for out in group:
        total[:NUMEL] += out["local"].to(md)
    return total


@pytest.mark.parametrize("dp, zero, precision", CASES)
def test_reduce_and_step_equal_one_process_on_the_averaged_gradient(replicas, dp, zero, precision):
    cd, md = DTYPES[precision]
    padded = -(-NUMEL // dp) * dp
    shard = padded // dp
    for group in _groups(replicas, dp, (dp, precision, zero)):
        contributions = [out["local"] for out in group]
        assert all(not torch.equal(contributions[0], other) for other in contributions[1:])
        # Dyadic and below 2**4: every partial sum is exact (module docstring).
        assert all((x.double() * 2.0**16).frac().abs().max() == 0 and x.abs().max() < 2**4
                   for x in contributions)
        summed = _summed(group, precision, padded)

        # A single-process bucket in the master dtype stepping on the averaged gradient.
        reference = _bucket(_module(), 0, "fp64" if md == torch.float64 else "fp32")
        reference.grads.copy_(summed[:NUMEL])
        reference.step(LR, 1.0 / dp)
        expected = torch.cat([reference.params, torch.zeros(padded - NUMEL, dtype=md)])

        for rank, out in enumerate(group):
            window = slice(0, padded) if zero == 0 else slice(rank * shard, (rank + 1) * shard)
            assert torch.equal(out["optimizer_grad"], summed[window])
            params = out["params"]
            assert params.shape == (padded,) and params.dtype == cd
            assert torch.equal(out["module"], params[:NUMEL])  # the module sees the bucket
            if cd != md:
                torch.testing.assert_close(out["master"], expected[window], **STEP_TOL[precision])
                torch.testing.assert_close(params, expected.to(cd), **BF16_ULP)
                assert torch.equal(params[window], out["master"].to(cd))
            else:
                torch.testing.assert_close(params, expected, **STEP_TOL[precision])
            assert not params[NUMEL:].any()  # padding stays zero


@pytest.mark.parametrize("dp, zero, precision", CASES)
def test_count_norm_takes_disjoint_shards_of_the_sum(replicas, dp, zero, precision):
    padded = -(-NUMEL // dp) * dp
    layout = BucketLayout.build([(n, p.numel()) for n, p in _module().named_parameters()], dp, 0)
    for group in _groups(replicas, dp, (dp, precision, zero)):
        summed = _summed(group, precision, padded)
        expected = torch.cat([summed[s:e] for s, e in layout.segments(NORM_NAMES)])
        assert torch.equal(torch.cat([out["norm_parts"] for out in group]), expected)


@pytest.mark.parametrize("dp, zero, precision", CASES)
def test_ledger_holds_the_memory_model_table(replicas, dp, zero, precision):
    cd, md = DTYPES[precision]
    a, m = cd.itemsize, md.itemsize
    padded = -(-NUMEL // dp) * dp
    shard = padded // dp
    assert padded > NUMEL
    state = _state(zero, precision, padded, dp)
    for out in itertools.chain(*_groups(replicas, dp, (dp, precision, zero))):
        assert out["built"] == state
        assert out["end"] == state
        holding = dict(state)
        if zero >= 2:  # the full-size gradient from the first backward to the reduction
            holding["gradients"] += a * padded
        if zero == 3:
            holding["parameters"] += a * padded
        assert out["holding"] == holding
        if zero >= 2:
            assert out["grads_storage"] == 0
            assert out["reduced"]["gradients"] == m * (padded // dp)
        else:
            assert out["grads_storage"] == a * padded
        # Peaks (memory_model.py walks the program to the same figures): the full
        # gradient beside the shard, or at stage 0 in mixed precision beside its fp32
        # copy; a gathered copy beside the parameter shard; the fp32 staging copy and
        # the reduce-scatter's 1/dp output.
        staged = m * padded if a != m else 0
        peak = {"parameters": a * padded + (a * shard if zero == 3 else 0),
                "gradients": a * padded + (staged if zero == 0 else m * shard if zero >= 2 or a != m else 0),
                "optimizer": state["optimizer"], "activations": 0,
                "communication": staged + (m * shard if zero else 0)}
        assert out["peak"] == peak
