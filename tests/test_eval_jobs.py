"""Held-out validation end to end, on the shared local cluster: a resume keeps the split
and the evaluation set (and one that would change the training data is refused), and
the evaluations reach --metrics-out, the Python client and Prometheus.
The eval loss against the reference per layout is in test_equivalence.py."""

from __future__ import annotations

import json
import math
import urllib.request

import grpc
import numpy as np
import pytest
from interleaf.clients.follow import MetricsOut, follow
from interleaf.stageserver.data.tokenfile import write_tokens
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY, layout_free
from tests.test_equivalence import LOSS_RTOL, layout, reference_with_evals, run_with_evals

EVAL = ["eval.every=2", "eval.samples=8", "eval.fraction=0.05", "train.steps=4"]


@pytest.fixture(scope="module")
def evaluated(client, tmp_path_factory):
    """A job scored after steps 2 and 4, with a checkpoint after each."""
    folder = tmp_path_factory.mktemp("evaluated")
    overrides = TINY + EVAL + layout(tp=2, pp=2, schedule="1f1b") + [f"checkpoint.dir={folder}", "checkpoint.every=2"]
    final, steps, evaluations = run_with_evals(client, overrides)
    assert final.state == "SUCCEEDED", final.error
    assert [e.step for e in evaluations] == [2, 4]
    return final, steps, evaluations, folder


def test_a_resume_keeps_the_split_and_scores_the_same_set(client, evaluated, tmp_path):
    _, steps, evaluations, folder = evaluated
    # Resumed from step 2 under another layout: the same training samples and the same
    # evaluation at step 4 (within the equivalence tolerance: another layout).
    resumed = TINY + EVAL + layout(dp=2, pp=2, vpp=2) + [f"checkpoint.resume={folder / 'step-000002'}",
                                                        f"checkpoint.dir={tmp_path}"]
    final, again, evaluated_again = run_with_evals(client, resumed)
    assert final.state == "SUCCEEDED", final.error
    assert [s.step for s in again] == [2, 3]
    for got, want in zip(again, steps[2:]):
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)
    assert [e.step for e in evaluated_again] == [4]
    assert abs(evaluated_again[0].loss - evaluations[1].loss) <= LOSS_RTOL * evaluations[1].loss
    manifest = json.loads((folder / "step-000004" / "manifest.json").read_text())
    assert manifest["data_split"] == {"held_out_fraction": 0.05, "eval_source": "", "eval_samples": 8}


def test_a_resume_with_evaluation_off_still_skips_the_held_out_documents(client, evaluated, tmp_path):
    _, steps, _, folder = evaluated
    resumed = TINY + ["train.steps=4"] + layout(pp=2, schedule="1f1b") + [
        f"checkpoint.resume={folder / 'step-000002'}", f"checkpoint.dir={tmp_path}"]
    final, again, evaluated_again = run_with_evals(client, resumed)
    assert final.state == "SUCCEEDED", final.error
    assert not evaluated_again
    # The very samples of the run that held them out (data.source whole would differ).
    for got, want in zip(again, steps[2:], strict=True):
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)
    manifest = json.loads((tmp_path / "step-000004" / "manifest.json").read_text())
    assert manifest["data_split"] == {"held_out_fraction": 0.05, "eval_source": "", "eval_samples": 8}


@pytest.mark.parametrize("change, named", [
    (["eval.fraction=0.1"], ("eval.fraction: 0.1 of data.source held out here, 0.05 of data.source held out "
                             "in the checkpoint")),
    (["eval.samples=16"], "eval.samples=16 here, 8 in the checkpoint"),
])
def test_a_resume_that_would_change_the_split_or_the_set_is_refused(client, evaluated, tmp_path, change, named):
    folder = evaluated[3]
    overrides = TINY + EVAL + change + [f"checkpoint.resume={folder / 'step-000002'}", f"checkpoint.dir={tmp_path}"]
    final, steps, _ = run_with_evals(client, overrides)
    assert final.state == "FAILED" and not steps
    assert named in final.error, final.error
    assert "a resume keeps the checkpoint's train/validation split" in final.error


def test_a_long_evaluation_is_progress_not_a_stuck_job_nor_step_time(client):
    """An evaluation far longer than recovery.progress_timeout_s and ten steps: the job
    goes on, and neither the next step's tokens/s nor the block's control time count it."""
    overrides = TINY + layout(pp=1, schedule="1f1b") + [
        "eval.every=2", "eval.samples=4000", "eval.fraction=0.05", "train.steps=4",
        "recovery.progress_timeout_s=1"]
    final, steps, evaluations = run_with_evals(client, overrides)
    assert final.state == "SUCCEEDED", final.error
    assert [e.step for e in evaluations] == [2, 4] and all(e.tokens == 4000 * 16 for e in evaluations)
    slowest_step = max(s.step_seconds for s in steps[1:])
    assert min(e.seconds for e in evaluations) > max(1.0, 10 * slowest_step)  # past the step deadline
    after = steps[2]  # the step after the first evaluation
    assert after.tokens / after.tokens_per_second < evaluations[0].seconds / 2
    assert steps[-1].block_steps == 4 and steps[-1].block_control_seconds < evaluations[0].seconds / 2


def test_evaluations_reach_metrics_out_the_python_client_and_prometheus(
        cluster, client, evaluated, tmp_path):
    final, _, evaluations, _ = evaluated
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsOut(str(path))
    assert follow(client, final.job_id, 4, metrics) == 0  # the job's kept events, replayed
    metrics.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "step"] == [0, 1, 2, 3]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [(r["step"], r["loss"], r["samples"], r["tokens"]) for r in evals] == [
        (e.step, e.loss, 8, 8 * 16) for e in evaluations]
    assert set(evals[0]) == {"kind", "step", "loss", "perplexity", "samples", "tokens", "seconds"}
    assert all(r["perplexity"] == pytest.approx(math.exp(r["loss"])) and r["seconds"] > 0 for r in evals)
    saved = [r for r in rows if r.get("kind") == "checkpoint"]
    assert [(r["checkpoint"], r["step"]) for r in saved] == [("saved", 2), ("saved", 4)]
    assert {r.get("kind") for r in rows} == {"step", "eval", "checkpoint"}  # every row has its kind

    api = cluster.connect()
    try:
        got = list(api.job(final.job_id).evaluations(timeout_s=60))
    finally:
        api.close()
    assert [(e.step, e.loss, e.perplexity) for e in got] == [(e.step, e.loss, e.perplexity) for e in evaluations]

    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {(s.name, s.labels.get("job")): s.value for family in text_string_to_metric_families(text)
               for s in family.samples}
    assert samples[("interleaf_eval_loss", final.job_id)] == evaluations[-1].loss
    assert samples[("interleaf_eval_step", final.job_id)] == 4


def _eval_file(folder, vocab_size: int = 256, ids: int = 256, **described):
    """A token file of 600 seeded ids below `ids`, its sidecar recording `vocab_size`."""
    path = folder / "held-out.bin"
    write_tokens(path, np.random.default_rng(7).integers(0, ids, 600), documents=1, vocab_size=vocab_size,
                 **described)
    return path


def test_an_eval_source_file_is_scored_as_the_reference_scores_it(client, tmp_path):
    """eval.source: its first samples, scored through a tp2·pp2 layout, equal the
    reference's; training reads all of data.source (nothing held out)."""
    setup = TINY + ["eval.every=2", "eval.samples=8", f"eval.source={_eval_file(tmp_path)}", "train.steps=3"]
    final, steps, evaluations = run_with_evals(client, setup + layout(tp=2, pp=2, schedule="1f1b"))
    assert final.state == "SUCCEEDED", final.error
    history, expected = reference_with_evals(layout_free(setup))
    unsplit, _ = reference_with_evals(layout_free(TINY))  # the same training samples as with eval off
    assert [e.step for e in evaluations] == [e.step for e in expected] == [2, 3]
    for got, want in zip(evaluations, expected):
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)
    for got, want, plain in zip(steps, history, unsplit, strict=True):
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss) and want.loss == plain.loss


def test_an_eval_source_the_model_cannot_hold_is_refused_at_submit(client, tmp_path):
    path = _eval_file(tmp_path, vocab_size=300, ids=300)
    with pytest.raises(grpc.RpcError) as refused:
        client.submit("", TINY + ["eval.every=2", "eval.samples=8", f"eval.source={path}"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (f"model.vocab_size=256 is smaller than the vocabulary of eval.source={str(path)!r} (300"
            in refused.value.details())


def test_a_missing_eval_source_fails_the_job_naming_it(client, tmp_path):
    missing = tmp_path / "nowhere.bin"  # a remote coordinator need not see it: the servers say so
    final, steps, _ = run_with_evals(client, TINY + ["eval.every=2", "eval.samples=8", f"eval.source={missing}"])
    assert final.state == "FAILED" and not steps
    assert f"eval.source={str(missing)!r}: no token file" in final.error, final.error
