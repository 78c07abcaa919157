"""Held-out validation without processes: the [eval] rules, the train/validation split,
the fixed evaluation set and the forward-only programs (docs/validation.md). The
end-to-end checks (eval loss against the reference per layout, resume, metrics-out, the
Python client) are in test_equivalence.py and test_eval_jobs.py."""

from __future__ import annotations

import numpy as np
import pytest
from interleaf.coordinator.config import ConfigError, eval_points, load_config
from interleaf.coordinator.evaluations import eval_event, evaluated_in_block
from interleaf.coordinator.plan import plan_eval_programs
from interleaf.coordinator.schedule import ProgramError, simulate, validate_programs
from interleaf.coordinator.schedule.forward_only import build_eval_programs
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.actions import Action, Kind, parse
from interleaf.stageserver.data import Sampler, TokenFile, write_tokens
from interleaf.stageserver.data.corpus import Source
from interleaf.stageserver.data.holdout import (
    EvalSet,
    document_cut,
    open_eval,
    split_source,
)

SMALL = ["model.d_model=64", "model.n_heads=4", "model.seq_len=32", "train.global_batch=16", "train.steps=8"]


@pytest.mark.parametrize("overrides, named", [
    (["eval.every=-1"], "eval.every=-1 must be 0"),
    (["eval.samples=0"], "eval.samples=0 must be at least 1"),
    (["eval.fraction=0"], "eval.fraction=0.0 must be between 0 and 1"),
    (["eval.fraction=1.5"], "eval.fraction=1.5 must be between 0 and 1"),
    (["eval.fraction=nan"], "eval.fraction=nan must be a finite number"),
    (["eval.every=3", "eval.samples=6"], ("eval.samples=6 must be a multiple of train.global_batch/"
                                          "parallel.microbatches=4")),
    (["eval.every=3", "eval.samples=4"], ("eval.samples=4 must be a multiple of train.global_batch/"
                                          "parallel.microbatches*parallel.pp=8 for interleaved-1f1b")),
    (["eval.every=1", "eval.samples=1048576"], "262144 evaluation microbatches=1048576 forwards, more than 16384"),
    (["eval.samples=2000000"], "eval.samples=2000000 must be at most 1048576"),
    (["eval.source=a.bin,b.bin"], "eval.source='a.bin,b.bin' must name one token file"),
    (["eval.often=1"], "unknown key eval.often"),
])
def test_each_eval_rule_is_named_in_its_error(overrides, named):
    with pytest.raises(ConfigError, match=None) as err:
        load_config("", SMALL + overrides)
    assert named in str(err.value)


def test_a_blank_eval_source_is_refused():
    with pytest.raises(ConfigError, match="eval.source=' ' must be a token file path"):
        load_config('[eval]\nsource = " "\n', SMALL)


def test_eval_off_by_default_and_its_rules_only_when_on():
    config = load_config("", SMALL + ["eval.samples=6"])  # off: its shape does not matter
    assert not config.eval.enabled and config.eval.held_out == 0.0
    on = load_config("", SMALL + ["eval.every=2", "eval.samples=8", "eval.fraction=0.05"])
    assert on.eval.held_out == 0.05
    assert load_config("", SMALL + ["eval.every=2", "eval.source=x.bin"]).eval.held_out == 0.0


def test_evaluation_points_are_a_function_of_the_step():
    assert eval_points(3, 8) == [3, 6, 8]
    assert eval_points(4, 8) == [4, 8]
    assert eval_points(10, 8) == [8]
    assert eval_points(0, 8) == []
    config = load_config("", SMALL + ["eval.every=3", "eval.samples=8"])
    # Blocks of any size, and any resume point, ask for the same points.
    for block in (1, 3, 8):
        for start in (0, 4):
            asked = [s + 1 for first in range(start, 8, block)
                     for s in evaluated_in_block(config, first, min(block, 8 - first))]
            assert asked == [p for p in [3, 6, 8] if p > start]


def test_eval_event_is_the_mean_over_every_scored_token():
    config = load_config("", SMALL + ["eval.every=3", "eval.samples=8"])
    reports = [pb.StepReport(step=2, eval_loss=2.0, eval_tokens=128, eval_seconds=0.5),
               pb.StepReport(step=2, eval_loss=4.0, eval_tokens=128, eval_seconds=0.7),
               pb.StepReport(step=2, eval_seconds=0.6)]  # a rank without the head
    event = eval_event(config, reports)
    assert (event.step, event.loss, event.tokens, event.samples, event.seconds) == (3, 3.0, 256, 8, 0.7)
    assert event.perplexity == pytest.approx(np.exp(3.0))


# -- the split -----------------------------------------------------------------------


def _corpus(tmp_path, documents: list[int], eos: int | None = 0, starts: bool = False, name="docs.bin"):
    """A token file of documents of the given lengths (each ending with `eos`, when set),
    every token of document d being d + 1, so a window says whose tokens it holds."""
    parts, offsets = [], []
    for d, length in enumerate(documents):
        offsets.append(sum(len(p) for p in parts))
        body = np.full(length - (eos is not None), d + 1, dtype=np.int64)
        parts.append(np.concatenate([body, [eos]]) if eos is not None else body)
    described = {"documents": len(documents), "eos_id": eos, "vocab_size": len(documents) + 2}
    if starts:
        described["document_starts"] = offsets
    path = tmp_path / name
    write_tokens(path, np.concatenate(parts), **described)
    return path, offsets


def test_whole_documents_are_held_out_at_the_first_boundary_past_the_fraction(tmp_path):
    path, _ = _corpus(tmp_path, [40, 50, 6, 4])  # starts 0, 40, 90, 96; 100 tokens
    assert document_cut(TokenFile(path), 0.1) == 90
    assert document_cut(TokenFile(path), 0.05) == 96
    assert document_cut(TokenFile(path), 0.5) == 90  # the first start at or after token 50
    path2, _ = _corpus(tmp_path, [40, 50, 6, 4], eos=None, starts=True, name="starts.bin")
    assert document_cut(TokenFile(path2), 0.1) == 90  # the sidecar's starts, no eos needed


def test_a_file_without_document_boundaries_or_a_late_one_is_refused(tmp_path):
    path, _ = _corpus(tmp_path, [40, 60], eos=None)
    with pytest.raises(ValueError, match="records no document boundaries"):
        document_cut(TokenFile(path), 0.1)
    path, _ = _corpus(tmp_path, [10, 90], name="long-last.bin")
    with pytest.raises(ValueError, match="no document starting in its last 0.1"):
        document_cut(TokenFile(path), 0.1)


def test_training_never_reads_a_held_out_document_and_the_set_is_fixed(tmp_path):
    lengths = [int(x) for x in np.random.default_rng(0).integers(20, 60, size=60)]
    path, starts = _corpus(tmp_path, lengths)
    source = Source(str(path))
    train, evaluation = open_eval(source, "", 0.2, 8, 6)
    cut = len(train.files[0])
    assert cut in starts
    held_out_docs = set(np.unique(np.asarray(TokenFile(path).tokens[cut:]))) - {0}
    sampler = Sampler(train, seed=3, seq_len=8, global_batch=16)
    trained = np.concatenate([sampler.windows(0, 16 * 40).numpy().ravel()])  # several epochs
    assert not set(np.unique(trained)) & held_out_docs  # no held-out document's token is trained on
    assert trained.max() <= cut  # (eos tokens aside, tokens number their document)
    assert set(np.unique(evaluation.windows.numpy())) - {0} <= held_out_docs
    # The first windows of the held-out tokens, packed as training packs, the same each time.
    tokens = np.asarray(TokenFile(path).tokens[cut:], dtype=np.int64)
    assert np.array_equal(evaluation.windows.numpy(), np.stack([tokens[k * 8:k * 8 + 9] for k in range(6)]))
    again = open_eval(Source(str(path)), "", 0.2, 8, 6)[1]
    assert np.array_equal(again.windows.numpy(), evaluation.windows.numpy())
    # Microbatches and replicas cut the set as the sampler cuts a step.
    inputs, targets = evaluation.microbatch(1, rows=2, replica=1, replicas=2)
    assert np.array_equal(inputs.numpy(), evaluation.windows[3:4, :-1].numpy())
    assert np.array_equal(targets.numpy(), evaluation.windows[3:4, 1:].numpy())


def test_eval_off_trains_on_exactly_the_same_samples(tmp_path):
    path, _ = _corpus(tmp_path, [30] * 20)
    whole = Sampler(Source(str(path)), seed=1, seq_len=8, global_batch=4)
    source = Source(str(path))
    assert open_eval(source, str(path), 0.1, 8, 2)[0] is source  # eval.source: data.source whole
    again = Sampler(source, seed=1, seq_len=8, global_batch=4)
    assert np.array_equal(whole.windows(0, 400).numpy(), again.windows(0, 400).numpy())


def test_too_few_held_out_tokens_for_the_samples_is_refused(tmp_path):
    path, _ = _corpus(tmp_path, [30] * 20)
    with pytest.raises(ValueError, match=r"eval.samples=50 needs 50 windows .* holds only 7: lower eval.samples "
                                         r"or raise eval.fraction"):
        open_eval(Source(str(path)), "", 0.1, 8, 50)


def test_the_builtin_corpus_splits_at_a_document_start():
    source = Source("builtin")
    train, held = split_source(source, 0.05)
    cut = len(train.files[0])
    assert cut in source.files[0].meta["document_starts"]
    assert 0.04 < 1 - cut / len(source) < 0.2
    assert EvalSet(held, 32, 8, "builtin").windows.shape == (8, 33)


# -- forward-only programs -------------------------------------------------------------

LAYOUTS = [("gpipe", 4, 1, 3), ("1f1b", 2, 1, 2), ("1f1b", 4, 1, 8), ("1f1b", 1, 1, 3),
           ("interleaved-1f1b", 2, 2, 2), ("interleaved-1f1b", 4, 2, 8), ("interleaved-1f1b", 1, 2, 3),
           ("interleaved-1f1b", 3, 3, 6)]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("schedule, pp, vpp, microbatches", LAYOUTS)
def test_eval_programs_are_forwards_only_valid_and_simulated(schedule, pp, vpp, microbatches, zero):
    programs = build_eval_programs(schedule, pp, vpp, microbatches, zero, prefetch=1)
    validate_programs(programs, pp, vpp, microbatches, zero, forward_only=True)
    result = simulate(programs)
    assert 0 <= result.bubble_fraction < 1
    kinds = {op.kind for program in programs for a in program for op in (a.p2p_ops() or (a,))}
    allowed = {Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.EXCHANGE}
    assert kinds - allowed <= ({Kind.GATHER_PARAMS, Kind.RELEASE_PARAMS} if zero == 3 else set())
    for rank, program in enumerate(programs):  # every forward of every chunk the rank owns, once
        forwards = sorted((a.chunk, a.microbatch) for a in program if a.kind is Kind.FORWARD)
        assert forwards == [(c, m) for c in range(rank, pp * vpp, pp) for m in range(microbatches)]
    # The wire form parses back to the same programs.
    assert [[parse(str(a)) for a in p] for p in programs] == programs


def test_the_validator_refuses_a_backward_or_a_reduction_in_a_forward_only_program():
    programs = build_eval_programs("1f1b", 2, 1, 2, zero=0)
    with pytest.raises(ProgramError, match="a forward-only program has no BACKWARD"):
        validate_programs([programs[0], programs[1] + [Action(Kind.BACKWARD, 1, 0)]], 2, 1, 2, forward_only=True)
    with pytest.raises(ProgramError, match="no REDUCE_GRADS"):
        validate_programs([programs[0] + [Action(Kind.REDUCE_GRADS, 0)], programs[1]], 2, 1, 2, forward_only=True)
    zero3 = build_eval_programs("1f1b", 2, 1, 2, zero=3)
    unreleased = [a for a in zero3[0] if a.kind is not Kind.RELEASE_PARAMS]
    with pytest.raises(ProgramError, match="still gathered at the end"):
        validate_programs([unreleased, zero3[1]], 2, 1, 2, zero=3, forward_only=True)


def test_the_plan_carries_eval_programs_only_when_evaluating():
    assert plan_eval_programs(load_config("", SMALL)) == []
    config = load_config("", SMALL + ["eval.every=3", "eval.samples=16", "parallel.zero=3", "parallel.dp=2"])
    programs = plan_eval_programs(config)
    assert len(programs) == 2 and all(a.kind is not Kind.BACKWARD for p in programs for a in p)
    assert sum(a.kind is Kind.FORWARD for a in programs[0]) == 2 * 4  # vpp=2 chunks x 4 microbatches
