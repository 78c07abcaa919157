"""Held-out validation without processes: the [eval] rules, the train/validation split,
the fixed evaluation set and the forward-only programs (docs/validation.md). The
end-to-end checks (eval loss against the reference per layout, resume, metrics-out, the
Python client) are in test_equivalence.py and test_eval_jobs.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from interleaf.coordinator.config import ConfigError, eval_points, load_config
from interleaf.coordinator.data_split import SplitChanged, job_split, resumed_split
from interleaf.coordinator.evaluations import (
    eval_allowance,
    eval_event,
    evaluated_in_block,
)
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
    open_eval_set,
    split_source,
    training_data,
)
from interleaf.stageserver.model_state import message_tag

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
    reports = [pb.StepReport(step=2, evaluation=pb.EvalReport(loss=2.0, tokens=128, seconds=0.5)),
               pb.StepReport(step=2, evaluation=pb.EvalReport(loss=4.0, tokens=128, seconds=0.7)),
               pb.StepReport(step=2, evaluation=pb.EvalReport(seconds=0.6))]  # a rank without the head
    event = eval_event(config, reports)
    assert (event.step, event.loss, event.tokens, event.samples, event.seconds) == (3, 3.0, 256, 8, 0.7)
    assert event.perplexity == pytest.approx(np.exp(3.0))


def test_an_evaluation_has_its_own_progress_allowance():
    # SMALL: 4 rows a microbatch (16 over 4 microbatches); 4000 samples are 1000 of them.
    config = load_config("", SMALL + ["eval.every=2", "eval.samples=4000", "recovery.progress_timeout_s=1",
                                      "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"])
    assert eval_allowance(config, step_s=0.02, slowest_eval_s=0.0) == pytest.approx(10 * 0.02 * 1000 / 4)
    assert eval_allowance(config, step_s=0.0, slowest_eval_s=3.0) == 30.0  # ten of the slowest seen
    assert eval_allowance(config, step_s=0.0, slowest_eval_s=0.0) == 1.0  # never below progress_timeout_s
    few = load_config("", SMALL + ["eval.every=2", "eval.samples=4", "parallel.pp=1", "parallel.vpp=1",
                                   "parallel.schedule=1f1b", "recovery.progress_timeout_s=1"])
    assert eval_allowance(few, step_s=0.5, slowest_eval_s=0.0) == 5.0  # never below a step's deadline


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
    train, evaluation = training_data(source, 0.2), open_eval_set(source, "", 0.2, 8, 6)
    cut = len(train.files[0])
    assert cut in starts
    held_out_docs = set(np.unique(np.asarray(TokenFile(path).tokens[cut:]))) - {0}
    sampler = Sampler(train, seed=3, seq_len=8, global_batch=16)
    trained = sampler.windows(0, 16 * 40).numpy()  # several epochs
    assert not set(np.unique(trained)) & held_out_docs  # no held-out document's token is trained on
    assert set(np.unique(evaluation.windows().numpy())) - {0} <= held_out_docs
    # The first windows of the held-out tokens, packed as training packs, the same each time.
    tokens = np.asarray(TokenFile(path).tokens[cut:], dtype=np.int64)
    assert np.array_equal(evaluation.windows().numpy(), np.stack([tokens[k * 8:k * 8 + 9] for k in range(6)]))
    again = open_eval_set(Source(str(path)), "", 0.2, 8, 6)
    assert np.array_equal(again.windows().numpy(), evaluation.windows().numpy())
    # Microbatches and replicas cut the set as the sampler cuts a step.
    inputs, targets = evaluation.microbatch(1, rows=2, replica=1, replicas=2)
    assert np.array_equal(inputs.numpy(), evaluation.windows()[3:4, :-1].numpy())
    assert np.array_equal(targets.numpy(), evaluation.windows()[3:4, 1:].numpy())


def _positions(tmp_path, documents: int, length: int):
    """A token file whose every token is its own position (documents of `length`,
    recorded in the sidecar), so that a window says where it was read."""
    path = tmp_path / "positions.bin"
    size = documents * length
    write_tokens(path, np.arange(size, dtype=np.int64), documents=documents, eos_id=None, vocab_size=size,
                 document_starts=list(range(0, size, length)))
    return path


def test_every_sampled_window_ends_before_the_cut(tmp_path):
    path = _positions(tmp_path, documents=50, length=20)  # 1000 tokens, documents start every 20
    train = training_data(Source(str(path)), 0.1)
    cut = len(train.files[0])
    assert cut == 900
    sampler = Sampler(train, seed=5, seq_len=8, global_batch=16)
    windows = sampler.windows(0, 16 * 60).numpy()  # many epochs of the 112 samples
    starts = windows[:, 0]
    assert np.array_equal(windows, starts[:, None] + np.arange(9))  # whole windows, read where they start
    assert starts.max() + 9 <= cut  # the last token read is before the first held-out one
    assert set(starts.tolist()) == set(range(0, (cut - 1) // 8 * 8, 8))  # and every sample before it is read
    # The set starts at the cut, a dtype-preserving view of the file, cut per microbatch.
    evaluation = open_eval_set(Source(str(path)), "", 0.1, 8, 4)
    assert evaluation.windows()[:, 0].tolist() == [900, 908, 916, 924]
    (_, _, tokens), = evaluation.parts
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and tokens.size == 4 * 8 + 1
    assert evaluation.microbatch(1, rows=2)[0].dtype == torch.int64


@pytest.mark.parametrize("overrides, held_out", [
    ([], 0.0),  # evaluation off: data.source whole
    (["eval.every=2", "eval.samples=8", "eval.source=other.bin"], 0.0),  # scored elsewhere: whole
    (["eval.every=2", "eval.samples=8", "eval.fraction=0.1"], 0.1),  # its last documents held out
])
def test_what_training_reads_follows_the_split(tmp_path, overrides, held_out):
    path, _ = _corpus(tmp_path, [30] * 20)
    config = load_config("", SMALL + overrides)
    assert job_split(config)["held_out_fraction"] == config.eval.held_out == held_out
    source = Source(str(path))
    reads = training_data(source, config.eval.held_out)
    whole = Sampler(Source(str(path)), seed=1, seq_len=8, global_batch=4).windows(0, 400).numpy()
    got = Sampler(reads, seed=1, seq_len=8, global_batch=4).windows(0, 400).numpy()
    if held_out:
        assert len(reads.files[0]) == 540 < len(source)  # documents 18 and 19 held out
        assert not set(np.unique(got)) & {19, 20}
    else:
        assert reads is source and np.array_equal(got, whole)  # exactly the samples without [eval]


def test_too_few_held_out_tokens_for_the_samples_is_refused(tmp_path):
    path, _ = _corpus(tmp_path, [30] * 20)
    with pytest.raises(ValueError, match=r"eval.samples=50 needs 50 windows .* holds only 7: lower eval.samples "
                                         r"or raise eval.fraction"):
        open_eval_set(Source(str(path)), "", 0.1, 8, 50)


def test_the_builtin_corpus_splits_at_a_document_start():
    source = Source("builtin")
    train, held = split_source(source, 0.05)
    cut = len(train.files[0])
    assert cut in source.files[0].meta["document_starts"]
    assert 0.04 < 1 - cut / len(source) < 0.2
    assert EvalSet(held, 32, 8, "builtin").windows().shape == (8, 33)


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


def test_tags_are_unique_over_a_step_and_an_evaluation_with_more_microbatches():
    """pp=2, vpp=2: 4 training microbatches, 12 evaluation ones. Tags numbered by the
    training count alone repeat within the evaluation (chunk 0's microbatch 8 and chunk
    2's microbatch 0 both cross from rank 0 to rank 1)."""
    from interleaf.coordinator.schedule import build_programs

    train = build_programs("interleaved-1f1b", 2, 2, 4, dp=1)
    evaluation = build_eval_programs("interleaved-1f1b", 2, 2, 12, 0)

    def tags(programs, count):
        keys = {op.message_key() for p in programs for a in p for op in (a.p2p_ops() or (a,))
                if op.kind in (Kind.SEND_ACT, Kind.SEND_GRAD)}
        return keys, {message_tag(*key, count) for key in keys}

    for programs in (train, evaluation):
        keys, unique = tags(programs, max(4, 12))
        assert len(unique) == len(keys) > 0
    keys, clashing = tags(evaluation, 4)
    assert len(clashing) < len(keys)  # what the training count alone gave


# -- what a resume keeps ----------------------------------------------------------------

ON = ["eval.every=2", "eval.samples=8", "eval.fraction=0.05"]


def test_a_resume_keeps_the_checkpoints_split_with_evaluation_off():
    saved = job_split(load_config("", SMALL + ON))
    assert saved == {"held_out_fraction": 0.05, "eval_source": "", "eval_samples": 8}
    off = load_config("", SMALL)
    assert resumed_split(saved, off, "ck") == saved  # still held out; the set carried
    assert resumed_split(saved, load_config("", SMALL + ON + ["eval.every=4"]), "ck") == saved
    # An older checkpoint, from before [eval], held nothing out.
    assert resumed_split(None, off, "ck")["held_out_fraction"] == 0.0
    assert resumed_split(None, load_config("", SMALL + ["eval.every=2", "eval.samples=8", "eval.source=v.bin"]),
                         "ck") == {"held_out_fraction": 0.0, "eval_source": "v.bin", "eval_samples": 8}


@pytest.mark.parametrize("change, named", [
    (["eval.fraction=0.1"], ("eval.fraction: 0.1 of data.source held out here, 0.05 of data.source held out "
                             "in the checkpoint")),
    (["eval.samples=16"], "eval.samples=16 here, 8 in the checkpoint"),
    (["eval.source=v.bin"], "eval.source='v.bin' here, '' in the checkpoint"),
])
def test_a_resume_that_changes_the_split_or_the_set_is_refused_naming_both_values(change, named):
    saved = job_split(load_config("", SMALL + ON))
    with pytest.raises(SplitChanged) as err:
        resumed_split(saved, load_config("", SMALL + ON + change), "ck/step-000002")
    assert named in str(err.value) and "checkpoint.resume='ck/step-000002'" in str(err.value)


def test_a_checkpoint_that_held_nothing_out_cannot_be_resumed_holding_out():
    saved = job_split(load_config("", SMALL))
    with pytest.raises(SplitChanged, match="eval.fraction: 0.05 of data.source held out here, nothing held out "
                                           "in the checkpoint"):
        resumed_split(saved, load_config("", SMALL + ON), "ck")


def test_setup_requests_carry_the_split_and_servers_check_it():
    from interleaf.coordinator.plan import ServerSlot, plan_job, setup_requests
    from interleaf.stageserver.setup_checks import SetupError, check_setup

    def requests(overrides, **kwargs):
        config = load_config("", SMALL + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"] + overrides)
        plan = plan_job(config, [ServerSlot("s0", "127.0.0.1:1", "h")])
        return setup_requests("job-1-00001", config, plan, ("127.0.0.1", 5000, "job-1/1"), 120.0, **kwargs)[0]

    assert requests([]).held_out_fraction == 0.0
    assert requests(ON).held_out_fraction == 0.05
    kept = requests([], held_out=0.05)  # evaluation off, resumed from a checkpoint that held 5% out
    assert kept.held_out_fraction == 0.05 and not kept.eval_program
    check_setup(kept)
    for bad, message in [(requests([], held_out=1.0), "held_out_fraction=1.0 must be at least 0 and below 1"),
                         (requests(ON, held_out=0.1), "held_out_fraction=0.1 must equal eval_fraction=0.05")]:
        with pytest.raises(SetupError, match=message):
            check_setup(bad)
