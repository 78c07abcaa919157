"""Data-parallel gradient buckets (parallel.bucket_mb) and their reductions started inside
the backward (parallel.overlap_grad_reduce): how a chunk is cut, where a program lets a
backward start them, the executed trace that shows each bucket reduced while the
backward still computes, and the equivalence contract with many buckets. Jobs run on the
shared cluster; the memory ledger against the model is in test_memory.py.
"""

from __future__ import annotations

import pytest

from interleaf.common.buckets import bucket_cap_bytes, chunk_buckets, split_buckets, starts_in_backward
from interleaf.common.overlapped_reductions import overlapped_reductions
from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.memory_model import bucket_sizes
from interleaf.coordinator.partition import partition
from interleaf.protos.actions import REDUCTION, parse
from tests.conftest import ARCHS, TINY, run_job
from tests.test_equivalence import check_equivalent, layout

SMALL_BUCKETS = ["parallel.bucket_mb=0.06"]
"""61,440 bytes, 15,360 fp32 elements: a TINY GPT block holds 12,704 parameters, so each
block is a bucket of its own (the final norm and the positions joining their neighbours'),
and in bf16 (twice the elements) two blocks are."""


def test_split_buckets_worked_example():
    assert split_buckets([("a", 4), ("b", 3), ("c", 2), ("d", 5)], 24, 4) == [["d"], ["b", "c"], ["a"]]
    assert split_buckets([("a", 4), ("b", 3)], 0, 4) == [["a", "b"]]  # no cap: one bucket
    assert split_buckets([("a", 9), ("b", 3)], 8, 4) == [["b"], ["a"]]  # larger than the cap: alone
    assert split_buckets([("a", 2), ("b", 3)], 1, 4) == [["b"], ["a"]]  # a cap under an element: each alone
    assert bucket_cap_bytes(25.0) == 25 << 20 and bucket_cap_bytes(1e-9) == 1


def test_a_bucket_over_the_cap_is_left_to_the_reduction_action():
    assert starts_in_backward(6, 24, 4) and not starts_in_backward(7, 24, 4)
    assert starts_in_backward(10**9, 0, 4)  # no cap: one bucket, started inside


def test_the_tied_embedding_is_bucketed_where_the_backward_finishes_it():
    sizes = [("wte", 10), ("a", 4), ("b", 4)]
    assert chunk_buckets(sizes, "wte", True, 32, 4) == [["a", "b"], ["wte"]]  # the embedding runs first
    assert chunk_buckets(sizes, "wte", False, 32, 4) == [["wte"], ["a", "b"]]  # the head's copy runs last
    assert chunk_buckets(sizes[1:], "wte", True, 32, 4) == [["a", "b"]]


def test_a_chunk_is_cut_into_buckets_of_at_most_bucket_mb():
    config = load_config("", TINY + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"] + SMALL_BUCKETS)
    (chunk,) = partition(8, 1, 1)
    sizes = bucket_sizes(config, chunk)
    # One per block (the final norm and the positions joining their neighbours), the
    # tied embedding last; whole, they are the model.
    assert len(sizes) == 9 and sizes[-1] == 256 * 32
    assert sum(sizes) == sum(bucket_sizes(load_config("", TINY + ["parallel.pp=1", "parallel.vpp=1",
                                                                  "parallel.schedule=1f1b"]), chunk))


def test_only_a_last_b_starts_its_chunks_reductions():
    def program(text):
        return [parse(t) for t in text.split()]

    assert overlapped_reductions(program("F0.0 B0.0 F0.1 B0.1 DP0")) == ({0: 1}, {0: "DP0"})
    # Interleaved: chunk 1's last backward comes before chunk 0's; each reduces after its own.
    assert overlapped_reductions(program("F0.0 F1.0 B1.0 RS1 B0.0 RS0 OPT")) == ({1: 0, 0: 0},
                                                                                {1: "RS1", 0: "RS0"})
    # A W writes the gradient outside autograd: its chunk is reduced by the action.
    assert overlapped_reductions(program("F0.0 I0.0 W0.0 RS0")) == ({}, {0: "RS0"})
    assert overlapped_reductions(program("F0.0 B0.0 OPT")) == ({}, {})  # nothing reduced: dp 1, ZeRO-0


@pytest.mark.parametrize("value, message", [
    ("0", "parallel.bucket_mb=0.0 must be > 0"), ("-1", "parallel.bucket_mb=-1.0 must be > 0"),
    ("2e6", "parallel.bucket_mb=2000000.0 must be at most 1048576.0"), ("nan", "parallel.bucket_mb=nan must be"),
])
def test_a_bad_bucket_mb_is_refused_naming_it(value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config("", [f"parallel.bucket_mb={value}"])


def _reductions_and_last_backward(client, overlap: bool):
    """Rank 0's traced spans of a dp2 one-stage job with a bucket per block: its bucket
    reductions in flight, and its last backward."""
    final, _ = run_job(client, TINY + ["parallel.dp=2", "parallel.pp=1", "parallel.vpp=1",
                                       "parallel.schedule=1f1b", "parallel.zero=1",
                                       f"parallel.overlap_grad_reduce={str(overlap).lower()}"] + SMALL_BUCKETS)
    assert final.state == "SUCCEEDED", final.error
    spans = client.trace(final.job_id).reports[0].spans
    backward = [s for s in spans if s.kind == "backward" and s.action == "B0.3"]
    return [s for s in spans if s.kind == REDUCTION], backward[0]


def test_each_bucket_is_reduced_while_the_last_backward_computes(client):
    """Nine buckets: the eight the last backward finishes before its end start inside it
    (a bucket waits for the one before it, so all but the last have landed by its end);
    the ninth, the embedding, when autograd writes it, at the backward's very end."""
    reductions, backward = _reductions_and_last_backward(client, overlap=True)
    assert len(reductions) == 9 and {s.action for s in reductions} == {"RS0"}
    inside = [s for s in reductions if backward.start_seconds < s.start_seconds < backward.end_seconds]
    assert len(inside) >= 8, [(s.start_seconds, s.end_seconds) for s in reductions]
    assert sum(s.end_seconds <= backward.end_seconds for s in reductions) >= 8


def test_without_overlap_every_bucket_starts_after_the_backward(client):
    reductions, backward = _reductions_and_last_backward(client, overlap=False)
    assert len(reductions) == 9
    assert all(s.start_seconds >= backward.end_seconds for s in reductions)


BUCKETED = {
    "zero0-dp2-pp2-v2": (layout(dp=2, pp=2, vpp=2), []),
    "zero1-dp4": (layout(dp=4, schedule="1f1b") + ["parallel.zero=1"], ["train.global_batch=16"]),
    "zero2-dp2-pp1-v2": (layout(dp=2, pp=1, vpp=2) + ["parallel.zero=2"], []),
    "zero3-dp2-tp2-sp-selective": (layout(dp=2, tp=2, schedule="1f1b")
                                   + ["parallel.zero=3", "parallel.sequence_parallel=true"],
                                   ["train.recompute=selective"]),
    "zero2-dp2-pp2-zbh1": (layout(dp=2, pp=2, schedule="zb-h1") + ["parallel.zero=2"], []),
    "zero1-dp2-pp2-over-cap": (layout(dp=2, pp=2, schedule="1f1b") + ["parallel.zero=1", "parallel.bucket_mb=0.005"],
                               []),
    "zero3-dp2-no-overlap": (layout(dp=2, schedule="1f1b") + ["parallel.zero=3", "parallel.overlap_grad_reduce=false"],
                             []),
}
"""Many buckets under each ZeRO stage, with pipelines (interleaved chunks on one rank, the
tied embedding's two copies), tensor and sequence parallelism with selective recompute,
a split backward (whose W leaves the reductions to the action), buckets over the cap
(most parameters alone, left to the action) and overlap off."""


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", BUCKETED)
def test_bucketed_reductions_keep_the_equivalence_contract(client, tmp_path, name, arch):
    sets, setup = BUCKETED[name]
    check_equivalent(client, SMALL_BUCKETS + sets, tmp_path, ARCHS[arch] + setup)
