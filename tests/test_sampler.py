"""The samples of a step (stageserver/data/sampler.py) and blends (blend.py): packed
seq_len+1 windows, walked in seeded epochs without replacement, each step the next
global_batch of them, split by microbatch and replica only afterwards.

Samples are token ids, so every comparison of them is equality; the one trained
comparison (the reference at two microbatch counts) holds losses to DESIGN.md's 1e-5.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import torch

from interleaf.clients.reference import train
from interleaf.common.data.blend import BLOCK, apportion, block_order, parse_source
from interleaf.coordinator.config import ConfigError, load_config
from interleaf.stageserver.data import Sampler, resolve_source, write_tokens
from tests.conftest import TINY, layout_free, reference, run_job
from tests.test_equivalence import LOSS_RTOL

SEQ, N = 16, 5000
PER_EPOCH = (N - 1) // SEQ  # 312 samples


@pytest.fixture(scope="module")
def random_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sampler") / "random.tokens"
    write_tokens(path, np.random.default_rng(3).integers(0, 256, size=N))
    return str(path)


def _step(sampler: Sampler, step: int, microbatches: int = 1, replicas: int = 1) -> torch.Tensor:
    """A step's inputs as every replica's slice of every microbatch, concatenated."""
    rows = [sampler.microbatch(step, j, d, replicas)[0] for j in range(microbatches) for d in range(replicas)]
    return torch.cat(rows)


def _starts(sampler: Sampler, step: int) -> list[int]:
    """Where each sample of a step starts in the file (the file holds arange tokens)."""
    return _step(sampler, step)[:, 0].tolist()


# --- packing and epochs ---------------------------------------------------------------


def test_the_docstring_example(tmp_path):
    """sampler.py's worked example: 13 tokens at seq_len 4 are samples [0, 5), [4, 9),
    [8, 13); seed 0 walks them 2, 0, 1 in epoch 0 and 1, 2, 0 in epoch 1."""
    path = tmp_path / "thirteen.tokens"
    write_tokens(path, np.arange(13))
    sampler = Sampler(resolve_source(str(path)), seed=0, seq_len=4, global_batch=2)
    window = lambda k: list(range(4 * k, 4 * k + 4))  # noqa: E731 - a sample's inputs
    assert _step(sampler, 0).tolist() == [window(2), window(0)]
    assert _step(sampler, 1).tolist() == [window(1), window(1)]
    assert [sampler.epochs_begun(s) for s in range(3)] == [[], [("thirteen.tokens", 1, 3)], []]
    # Microbatch 1 of 2, or replica 1 of 2 at one microbatch: sample 0.
    assert Sampler(resolve_source(str(path)), 0, 4, 2, microbatches=2).microbatch(0, 1)[0].tolist() == [window(0)]
    assert sampler.microbatch(0, 0, replica=1, replicas=2)[0].tolist() == [window(0)]


def test_an_epoch_is_a_permutation_of_every_packed_sample(tmp_path):
    """Two epochs, with a global batch that does not divide an epoch (steps straddle its
    end): each epoch holds every window [k*SEQ, k*SEQ+SEQ+1) exactly once, in an order of
    its own, and targets are inputs shifted by one."""
    path = tmp_path / "arange.tokens"
    write_tokens(path, np.arange(N))
    sampler = Sampler(resolve_source(str(path)), seed=9, seq_len=SEQ, global_batch=10)
    steps = -(-2 * PER_EPOCH // 10)
    starts = [s for step in range(steps) for s in _starts(sampler, step)]
    first, second = starts[:PER_EPOCH], starts[PER_EPOCH:2 * PER_EPOCH]
    assert sorted(first) == sorted(second) == [k * SEQ for k in range(PER_EPOCH)]
    assert first != second
    inputs, targets = sampler.microbatch(0, 0)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets, inputs + 1)  # arange: the next token
    # Sample 312 begins epoch 1 in step 31 (samples 310-319), sample 624 epoch 2 in step 62.
    begun = {s: sampler.epochs_begun(s) for s in range(steps) if sampler.epochs_begun(s)}
    assert begun == {31: [("arange.tokens", 1, PER_EPOCH)], 62: [("arange.tokens", 2, PER_EPOCH)]}


@pytest.mark.parametrize("global_batch", [8, 16])
def test_a_steps_samples_are_the_same_at_every_microbatch_count_and_dp(random_file, global_batch):
    """Microbatch j holds rows [j*G/m, (j+1)*G/m) of its step, replica d the d-th slice of
    those: whatever the cut, the concatenation is the step. Step 312 // G begins the
    second epoch at G=8 and straddles its beginning at G=16."""
    source = resolve_source(random_file)
    whole = Sampler(source, seed=7, seq_len=SEQ, global_batch=global_batch)
    for step in (0, 5, 312 // global_batch, 40):
        want = _step(whole, step)
        assert want.shape == (global_batch, SEQ)
        for microbatches in (1, 2, 4, 8):
            for replicas in (1, 2):
                if global_batch % (microbatches * replicas):
                    continue  # train.global_batch must divide by dp*microbatches
                cut = Sampler(source, seed=7, seq_len=SEQ, global_batch=global_batch, microbatches=microbatches)
                assert torch.equal(_step(cut, step, microbatches, replicas), want), (step, microbatches, replicas)


def test_samples_differ_across_steps_and_seeds(random_file):
    source = resolve_source(random_file)
    base = _step(Sampler(source, 1, SEQ, 8), 3)
    assert not torch.equal(_step(Sampler(source, 1, SEQ, 8), 4), base)
    assert not torch.equal(_step(Sampler(source, 2, SEQ, 8), 3), base)
    # Another instance over the same file, asked in another order: the same tokens.
    again = Sampler(resolve_source(random_file), 1, SEQ, 8)
    _step(again, 40)
    assert torch.equal(_step(again, 3), base)


def test_a_data_position_goes_on_where_the_data_left_off(random_file):
    """A resumed job is handed (its checkpoint's step, the samples consumed before it):
    under the same global batch it sees the uninterrupted run's steps; under a doubled one
    its first step is the next two steps of the old batch."""
    source = resolve_source(random_file)
    whole = Sampler(source, 5, SEQ, 8)
    resumed = Sampler(source, 5, SEQ, 8, start_step=6, start_samples=48)
    for step in (6, 7, 45):
        assert torch.equal(_step(resumed, step), _step(whole, step))
    doubled = Sampler(source, 5, SEQ, 16, start_step=6, start_samples=48)
    assert torch.equal(_step(doubled, 6), torch.cat([_step(whole, 6), _step(whole, 7)]))
    with pytest.raises(ValueError, match=r"step 5 comes before this job's data position \(step 6\)"):
        resumed.first_sample(5)


def test_replica_and_length_rules_are_named(random_file, tmp_path):
    with pytest.raises(ValueError, match="4 rows per microbatch do not split over 3 replicas"):
        Sampler(resolve_source(random_file), 0, SEQ, 8, microbatches=2).microbatch(0, 0, replica=0, replicas=3)
    short = tmp_path / "short.tokens"
    write_tokens(short, np.arange(SEQ))
    with pytest.raises(ValueError, match=r"data\.source=.*short\.tokens.* has 16 tokens, fewer than "
                                         r"model\.seq_len\+1=17"):
        Sampler(resolve_source(str(short)), 0, SEQ, 2)
    edge = tmp_path / "edge.tokens"
    write_tokens(edge, np.arange(SEQ + 1))  # exactly one sample: every row is it
    inputs, targets = Sampler(resolve_source(str(edge)), 0, SEQ, 4).microbatch(3, 0)
    assert torch.equal(inputs, torch.arange(SEQ).expand(4, SEQ)) and torch.equal(targets, inputs + 1)


def test_the_reference_trains_alike_at_microbatches_2_and_8():
    """`interleaf reference` at 2 and at 8 microbatches: the same samples, so the same
    losses and parameters up to the order gradients are summed in (issue 17 found three
    different step-0 losses at 2, 4 and 8 before)."""
    model = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=16",
             "train.steps=3", "train.global_batch=16", "train.lr=0.001", "train.warmup_steps=1",
             "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"]
    two, params_two = train(load_config("", model + ["parallel.microbatches=2"]))
    eight, params_eight = train(load_config("", model + ["parallel.microbatches=8"]))
    for a, b in zip(two, eight):
        assert abs(a.loss - b.loss) <= LOSS_RTOL * abs(b.loss), (a.step, a.loss, b.loss)
    for name, value in params_eight.items():
        torch.testing.assert_close(params_two[name], value, rtol=1e-4, atol=1e-6)


# --- blends ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blend_files(tmp_path_factory) -> list[str]:
    """Three files whose ids tell them apart: a holds 0-99, b 100-199, c 200-255."""
    folder = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(4)
    paths = []
    for name, low, high, size in (("a", 0, 100, 4000), ("b", 100, 200, 900), ("c", 200, 256, 3000)):
        paths.append(str(folder / f"{name}.tokens"))
        write_tokens(paths[-1], rng.integers(low, high, size=size))
    return paths


def _files_of(inputs: torch.Tensor) -> np.ndarray:
    return np.digitize(inputs[:, 0].numpy(), [100, 200])  # 0: a, 1: b, 2: c


def test_parse_source_reads_weights_and_names_every_rule():
    assert parse_source("builtin") == [("builtin", 1.0)]
    assert parse_source(" a.bin:0.7, /d/b:c.bin:3e-1 ") == [("a.bin", 0.7), ("/d/b:c.bin", 0.3)]
    assert parse_source("/d/b:c.bin") == [("/d/b:c.bin", 1.0)]  # no number after the ':'
    for source, rule in [
        ("a.bin:0.7,b.bin", "'b.bin' has no weight; every file of a blend needs one"),
        ("a.bin:0,b.bin:1", "'a.bin' has weight 0.0; weights must be positive finite numbers"),
        ("a.bin:nan,b.bin:1", "'a.bin' has weight nan; weights must be positive finite numbers"),
        ("a.bin:-1", "'a.bin' has weight -1.0; weights must be positive finite numbers"),
        ("a.bin:1,,b.bin:1", "has an empty entry"),
        ("a.bin:1e-6,b.bin:1", f"'a.bin' has weight 1e-06, 1e-06 of the blend, below the smallest share a "
                               f"blend draws, 1/{BLOCK}"),
    ]:
        with pytest.raises(ValueError, match="^data.source=") as caught:
            parse_source(source)
        assert rule in str(caught.value)
        with pytest.raises(ConfigError, match=f"^data.source={source!r}"):  # refused at submit too
            load_config("", [f"data.source={source}"])


def test_a_block_deals_each_file_its_share_evenly():
    assert apportion([0.7, 0.3], block=10) == [7, 3]
    assert apportion([1, 1, 1], block=10) == [4, 3, 3]
    assert block_order([2, 1]) == ([0, 1, 0], [0, 0, 1])  # blend.py's worked example
    counts = apportion([2, 1, 1])
    files, ranks = block_order(counts)
    assert sum(counts) == len(files) == BLOCK
    for i, count in enumerate(counts):
        assert [r for f, r in zip(files, ranks) if f == i] == list(range(count))
        # Every prefix of the block holds each file within one sample of its share.
        drawn = np.cumsum(np.array(files) == i)
        share = np.arange(1, BLOCK + 1) * count / BLOCK
        assert np.abs(drawn - share).max() <= 1


def test_a_blend_hits_its_proportions_step_by_step(blend_files):
    a, b, c = blend_files
    sampler = Sampler(resolve_source(f"{a}:2,{b}:1,{c}:1"), seed=3, seq_len=SEQ, global_batch=40)
    seen = np.zeros(3)
    for step in range(60):
        seen += np.bincount(_files_of(_step(sampler, step)), minlength=3)
        # Every prefix of the data order holds each file within one sample of its share.
        assert np.abs(seen - (step + 1) * 40 * np.array([0.5, 0.25, 0.25])).max() <= 1, (step, seen)


def test_a_blend_walks_each_files_epochs_and_resumes_from_any_step(blend_files):
    """b (56 samples an epoch) drawn at a quarter of 40 samples a step: each of its
    epochs is a permutation of its samples, its epochs begin in the steps that hold its
    56th and 112th draw, and a sampler started at any step, a block's end included,
    sees the uninterrupted one's samples."""
    a, b, c = blend_files
    source = f"{a}:2,{b}:1,{c}:1"
    whole = Sampler(resolve_source(source), seed=3, seq_len=SEQ, global_batch=40)
    b_starts = []
    for step in range(12):
        inputs = _step(whole, step)
        b_starts += [tuple(row) for row in inputs[_files_of(inputs) == 1, :4].tolist()]
    per_epoch = (900 - 1) // SEQ
    assert len(set(b_starts[:per_epoch])) == len(set(b_starts[per_epoch:2 * per_epoch])) == per_epoch
    assert set(b_starts[:per_epoch]) == set(b_starts[per_epoch:2 * per_epoch])
    assert [s for s in range(12) if ("b.tokens", 1, per_epoch) in whole.epochs_begun(s)] == [5]
    assert [s for s in range(12) if ("b.tokens", 2, per_epoch) in whole.epochs_begun(s)] == [11]
    for step in (1, 7, BLOCK // 40, BLOCK // 40 + 1, 5000):
        resumed = Sampler(resolve_source(source), 3, SEQ, 40, start_step=step, start_samples=step * 40)
        assert torch.equal(_step(resumed, step), _step(whole, step)), step


def test_servers_compare_a_blend_by_its_files_and_weights(blend_files):
    a, b, _ = blend_files
    single = resolve_source(a)
    assert single.sha256 == single.files[0].sha256
    blend = resolve_source(f"{a}:0.7,{b}:0.3")
    assert len(blend) == 4000 + 900
    assert blend.sha256 not in (single.sha256, resolve_source(f"{a}:0.6,{b}:0.4").sha256)
    assert blend.sha256 == resolve_source(f"{a}:0.7,{b}:0.3").sha256


def test_a_blend_job_equals_the_reference_and_logs_its_epochs(cluster, client, tmp_path):
    """A blend on real servers (dp=2, pp=2): the servers agree on its files and weights,
    every step's loss is the reference's, and the server that reports the loss logs each
    epoch boundary. b is 4 samples an epoch, drawn 4 a step, so it wraps in steps 1 and 2."""
    rng = np.random.default_rng(8)
    write_tokens(tmp_path / "a.tokens", rng.integers(0, 256, size=3000))
    write_tokens(tmp_path / "b.tokens", rng.integers(0, 256, size=80))
    source = f"data.source={tmp_path / 'a.tokens'}:1,{tmp_path / 'b.tokens'}:1"
    history, _ = reference(layout_free(TINY + [source]))
    final, steps = run_job(client, TINY + [source, "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"])
    assert final.state == "SUCCEEDED", final.error
    assert [s.loss for s in steps] == pytest.approx([h.loss for h in history], rel=LOSS_RTOL)
    config = load_config("", TINY + [source])
    sampler = Sampler(resolve_source(config.data.source), config.train.seed, config.model.seq_len,
                      config.train.global_batch)
    begun = [(step, name, epoch) for step in range(3) for name, epoch, _ in sampler.epochs_begun(step)]
    assert [(step, name) for step, name, _ in begun] == [(1, "b.tokens"), (2, "b.tokens")]
    logs = "".join(p.read_text() for p in pathlib.Path(cluster.log_dir).glob("stage-server-*.log"))
    for step, name, epoch in begun:
        assert len(re.findall(f"job {final.job_id}: step {step} begins epoch {epoch} of {name} ", logs)) == 1
