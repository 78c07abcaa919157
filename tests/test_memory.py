"""Memory: what the stage servers' ledgers report against the coordinator's memory
model and the ZeRO accounting, and admission of jobs that would not fit. Real jobs on
the shared cluster.

The state kinds (parameters, gradients, optimizer) and the activation peak are exact
(bytes of tensors this system allocates, predicted from the same buffer plan); the
communication peak depends on when the network takes a send, so the total peak is held
to 10%.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from interleaf.coordinator.config import load_config
from interleaf.coordinator.grid import RankGrid
from interleaf.coordinator.memory_model import bucket_sizes, message_bytes, predict, sent_bytes_per_step
from interleaf.coordinator.partition import chunks_of, partition
from interleaf.coordinator.plan import plan_programs
from tests.conftest import TINY, run_job

EXACT = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "parameters_peak_bytes",
         "gradients_peak_bytes", "activations_peak_bytes")
PEAK_RTOL = 0.10

LAYOUTS = {
    "zero0-dp2-pp2-v2": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2"],
    "zero1-dp2-pp2-v2": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.zero=1"],
    "zero2-dp4-bf16": ["parallel.dp=4", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                       "parallel.zero=2", "train.global_batch=16", "train.precision=bf16"],
    "zero3-dp2-tp2-pp2-v2": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                             "parallel.zero=3"],
    "zero3-pp2-v4-recompute": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=4", "parallel.zero=3",
                               "train.recompute=full"],
    # Llama: grouped-query attention split over tp, an untied head, a vocabulary of 300
    # padded to 384 (tp=1) or 512 (tp=2); bf16 normalises in float32.
    "llama-gqa-zero3-dp2-tp2-pp2-v2": ["model.arch=llama", "model.n_kv_heads=2", "model.ffn_hidden=48",
                                       "model.vocab_size=300", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                                       "parallel.vpp=2", "parallel.zero=3"],
    "llama-bf16-zero1-dp2-pp2-v2-recompute": ["model.arch=llama", "model.vocab_size=300", "parallel.dp=2",
                                              "parallel.pp=2", "parallel.vpp=2", "parallel.zero=1",
                                              "train.precision=bf16", "train.recompute=full"],
    "llama-tied-fp64-zero2-dp2-pp2": ["model.arch=llama", "model.tie_embeddings=true", "parallel.dp=2",
                                      "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
                                      "parallel.zero=2", "train.precision=fp64"],
    # Sequence parallelism: activations and messages of s/tp tokens, replicated gradients
    # summed over tp at the step; scatter/gather: messages of 1/tp, gathered on receipt.
    "sp-zero1-dp2-tp2-pp2-v2": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                                "parallel.zero=1", "parallel.sequence_parallel=true"],
    "llama-sp-bf16-tp2-pp2-recompute": ["model.arch=llama", "model.n_kv_heads=2", "model.vocab_size=300",
                                        "parallel.tp=2", "parallel.pp=2", "parallel.vpp=1",
                                        "parallel.schedule=1f1b", "parallel.sequence_parallel=true",
                                        "train.precision=bf16", "train.recompute=full"],
    "sg-tp2-pp2-v2-recompute": ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "train.recompute=full"],
    # Selective recompute: each block keeps its input, matmul and attention outputs;
    # recompute_layers=2 keeps only the input of every second block (layers 1, 3, ...).
    "selective-zero2-dp2-pp2": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
                                "parallel.zero=2", "train.recompute=selective"],
    "llama-selective-k2-tp2-pp2-v2": ["model.arch=llama", "model.n_kv_heads=2", "model.vocab_size=300",
                                      "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                                      "train.recompute=selective", "train.recompute_layers=2"],
    # Zero-bubble schedules: each I keeps what its W reads until that W; the full-size
    # gradient from a chunk's first W (the head chunk's first I); zbv's V (chunks 0 and 3 on rank 0), at pp=1 with
    # the turn of the V handed over locally.
    "zbh1-zero2-dp2-pp2": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=zb-h1",
                           "parallel.zero=2"],
    "zbv-zero3-dp2-tp2-pp2": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                              "parallel.schedule=zbv", "parallel.zero=3"],
    "llama-zbv-sp-bf16-tp2-pp2-recompute": ["model.arch=llama", "model.n_kv_heads=2", "model.vocab_size=300",
                                            "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                                            "parallel.schedule=zbv", "parallel.sequence_parallel=true",
                                            "train.precision=bf16", "train.recompute=full"],
    # Gradient buckets of a block or two (parallel.bucket_mb), each reduced inside the
    # last backward: its staging taken there, the one before it waited and freed first.
    "buckets-zero2-dp2-bf16": ["parallel.dp=2", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                               "parallel.zero=2", "train.precision=bf16", "parallel.bucket_mb=0.06"],
    "buckets-zero0-dp2-pp2-v2-bf16": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "train.precision=bf16",
                                      "parallel.bucket_mb=0.06"],
    # 5 KiB: most parameters over the cap, alone, and left to the reduction action.
    "buckets-over-cap-zero2-dp2-pp2-bf16": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=1",
                                            "parallel.schedule=1f1b", "parallel.zero=2", "train.precision=bf16",
                                            "parallel.bucket_mb=0.005"],
    "buckets-zero3-dp2-tp2-pp2-v2": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2",
                                     "parallel.zero=3", "parallel.bucket_mb=0.06"],
    "zbv-selective-dp2-pp1": ["parallel.dp=2", "parallel.pp=1", "parallel.vpp=2", "parallel.schedule=zbv",
                              "parallel.zero=1", "train.recompute=selective"],
    # Compiled blocks (train.compile, inductor on the CPU): a llama block keeps less than
    # eager, and under selective recompute at tp=2 (compiled with its checkpoint, the
    # collectives traced) eager's less the last product's sum;
    # float8 (emulated) compiled keeps less again.
    "llama-compiled-bf16-dp2-pp2-v2": ["model.arch=llama", "model.n_kv_heads=2", "model.vocab_size=300",
                                       "parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "train.precision=bf16",
                                       "train.compile=true"],
    "llama-compiled-selective-tp2-pp2": ["model.arch=llama", "model.n_kv_heads=2", "model.vocab_size=300",
                                         "parallel.tp=2", "parallel.pp=2", "parallel.vpp=1",
                                         "parallel.schedule=1f1b", "train.recompute=selective",
                                         "train.compile=true"],
    # Compiled together with their checkpoints at tp=1 (recompute.SelectiveCheckpointed):
    # the products' outputs but the last one's, attention's, the input.
    "compiled-selective-bf16-dp2-pp2": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=1",
                                        "parallel.schedule=1f1b", "train.precision=bf16", "train.compile=true",
                                        "train.recompute=selective"],
    "compiled-fp8-k2-dp2-pp2": ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
                                "train.precision=fp8", "train.fp8_emulate=true", "train.compile=true",
                                "train.recompute=selective", "train.recompute_layers=2"],
}


def _measured_and_predicted(client, sets):
    config = load_config("", TINY + sets)
    final, steps = run_job(client, TINY + sets)
    assert final.state == "SUCCEEDED", final.error
    programs, _ = plan_programs(config)
    predictions = predict(config, programs)
    p = config.parallel
    grid = RankGrid(p.dp, p.pp, p.tp)
    last = steps[-1].ranks  # a steady step: after the first, the state exists at its start
    assert [r.rank for r in last] == list(range(grid.world_size))
    assert final.last.ranks == last  # status carries the same figures
    return config, [(r, predictions[grid.coord(r.rank).pp]) for r in last]


@pytest.mark.parametrize("name", LAYOUTS)
def test_reported_memory_matches_the_model(client, name):
    _, pairs = _measured_and_predicted(client, LAYOUTS[name])
    for measured, predicted in pairs:
        for key in EXACT:
            assert getattr(measured, key) == predicted[key], (measured.rank, key)
        assert abs(measured.peak_bytes - predicted["peak_bytes"]) <= PEAK_RTOL * predicted["peak_bytes"]
        assert measured.rss_peak_bytes > measured.peak_bytes  # the process holds more than tensors


def _zero_state(config, pipeline_rank: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer) bytes at a step's end by the ZeRO paper's
    accounting, written out independently of the memory model: Ψ per bucket padded to a
    multiple of dp, fp32 (a = m = 4), Adam's two moments."""
    p = config.parallel
    psi = sum(-(-n // p.dp) * p.dp for chunk in chunks_of(partition(config.model.n_layers, p.pp, p.vpp),
                                                         pipeline_rank)
              for n in bucket_sizes(config, chunk))
    shard = psi // p.dp
    return {0: (4 * psi, 4 * psi, 8 * psi), 1: (4 * psi, 4 * psi, 8 * shard),
            2: (4 * psi, 4 * shard, 8 * shard), 3: (4 * shard, 4 * shard, 8 * shard)}[p.zero]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_state_per_rank_follows_the_zero_accounting(client, zero):
    sets = ["parallel.dp=4", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
            f"parallel.zero={zero}", "train.global_batch=16"]
    config, pairs = _measured_and_predicted(client, sets)
    grid = RankGrid(4, 2, 1)
    for measured, _ in pairs:
        expected = _zero_state(config, grid.coord(measured.rank).pp)
        assert (measured.parameters_bytes, measured.gradients_bytes, measured.optimizer_bytes) == expected


def test_zero3_working_set_is_bounded_by_the_prefetch(client):
    """vpp=4: each rank holds 4 chunks. With prefetch 0 at most one is gathered at a
    time besides the rank's own shards, with prefetch 1 two (which at dp=2 can exceed
    ZeRO-2's full copy: the shards are half of it already)."""
    base = ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=4"]
    peaks = {}
    for name, extra in (("p0", ["parallel.zero=3", "parallel.zero_prefetch=0"]),
                        ("p1", ["parallel.zero=3", "parallel.zero_prefetch=1"]), ("zero2", ["parallel.zero=2"])):
        _, pairs = _measured_and_predicted(client, base + extra)
        peaks[name] = pairs[0][0].parameters_peak_bytes
        owned = pairs[0][0].parameters_bytes
    config = load_config("", TINY + base)
    chunk_bytes = sorted(4 * sum(bucket_sizes(config, c)) for c in chunks_of(partition(8, 2, 4), 0))
    assert peaks["p0"] <= owned + chunk_bytes[-1] + 64
    assert peaks["p1"] <= owned + chunk_bytes[-1] + chunk_bytes[-2] + 64
    assert peaks["p0"] < peaks["p1"] and peaks["p0"] < peaks["zero2"]


def test_sends_are_freed_as_the_network_takes_them(client):
    """Sixteen microbatches of interleaved 1F1B (pp=2, vpp=2), each rank sending 48 activations and
    gradients a step: the model frees each send at once, the executor when it reaps it,
    one action later. Gloo's sends said they were complete only once waited, and were
    held to the step's end: the communication peak came out 5.7 and 10.7 times the
    model's; reaped by a thread per group, it equalled the model's on both ranks."""
    sets = ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=16", "train.global_batch=32",
            "parallel.schedule=interleaved-1f1b"]
    _, pairs = _measured_and_predicted(client, sets)
    for measured, predicted in pairs:
        # Three times: room for a reaper thread the 2 cores schedule late, below the bug's 5.7.
        assert measured.communication_peak_bytes <= 3 * predicted["communication_peak_bytes"], measured.rank


def test_recompute_lowers_the_activation_peak_by_the_predicted_amount(client):
    base = ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.zero=1"]
    _, plain = _measured_and_predicted(client, base)
    _, recomputed = _measured_and_predicted(client, base + ["train.recompute=full"])
    for (m0, p0), (m1, p1) in zip(plain, recomputed):
        saved = m0.activations_peak_bytes - m1.activations_peak_bytes
        assert saved == p0["activations_peak_bytes"] - p1["activations_peak_bytes"]
        assert saved > 0.5 * m0.activations_peak_bytes


def _pipeline_traffic(client, sets) -> tuple[list[float], dict[tuple[str, str], int]]:
    """(losses, {(op, group): bytes} of tensor rank 0 of pipeline rank 0 in traced step 1)."""
    final, steps = run_job(client, TINY + sets)
    assert final.state == "SUCCEEDED", final.error
    report = next(r for r in client.trace(final.job_id, 1).reports if r.rank == 0)
    return [s.loss for s in steps], {(c.op, c.group): c.bytes for c in report.comm}


def test_scatter_gather_and_sequence_parallel_send_a_tpth_of_each_message(client):
    """tp=2, pp=2: every pipeline send carries half the hidden states with scatter/gather
    (gathered within the receiving stage's tensor group) and with sequence parallelism
    (each rank's half of the sequence, no gather): the bytes the transport counted are the
    memory model's, and half of what plain sends move. Scatter/gather moves the same
    values: the losses are bit for bit plain's."""
    base = ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"]
    layouts = {"plain": ["parallel.scatter_gather=false"], "sg": [], "sp": ["parallel.sequence_parallel=true"]}
    losses, sent = {}, {}
    for name, extra in layouts.items():
        config = load_config("", TINY + base + extra)
        losses[name], traffic = _pipeline_traffic(client, base + extra)
        programs, _ = plan_programs(config)
        sent[name] = traffic[("send", "pp")]
        assert sent[name] == sent_bytes_per_step(config, programs[0]), name
        gathered = traffic.get(("all_gather", "tp"), 0)
        if name == "sg":  # each received gradient gathered: one message of the whole per microbatch
            assert gathered >= config.parallel.microbatches * 2 * message_bytes(config)
    assert sent["sg"] == sent["sp"] == sent["plain"] // 2
    assert losses["sg"] == losses["plain"]


TOO_BIG = ["model.n_layers=48", "model.d_model=4096", "model.n_heads=32", "train.steps=1"]


def test_a_job_too_big_for_the_servers_is_refused_before_anything_runs(client):
    with pytest.raises(grpc.RpcError) as caught:
        client.submit("", TOO_BIG)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = caught.value.details()
    assert message.startswith("rank ") and " needs " in message and " bytes " in message
    assert "offers" in message
    assert all(s.state == "IDLE" for s in client.servers())


def test_cli_refuses_a_job_too_big_for_this_machine():
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "run",
                             *[a for o in TOO_BIG for a in ("--set", o)]],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: rank 0 needs ") and "offers" in result.stderr
    assert "starting" not in result.stderr
