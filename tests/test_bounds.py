"""Bounds, with no processes: every config value has an upper bound and floats must be
finite (common/limits.py); a stage server checks a SetupRequest whole; a job keeps a
bounded event history; a registration names a real address; servers long dead are forgotten."""

from __future__ import annotations

import pytest

from interleaf.common import wire
from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.jobs import MAX_EVENTS, JobRecord
from interleaf.coordinator.plan import ServerSlot, plan_job, setup_requests
from interleaf.coordinator.registry import DEAD_AFTER_S, FORGET_DEAD_AFTER_S, Registry
from interleaf.coordinator.service import _registration_refused, _submission_refused
from interleaf.protos import interleaf_pb2 as pb
from interleaf.stageserver.job import model_shape
from interleaf.stageserver.setup_checks import SetupError, check_setup
from tests.conftest import TINY

OUT_OF_BOUNDS = [
    (["train.steps=1e12"], "train.steps=1000000000000 must be at most 10000000"),
    (["model.d_model=1000000000"], "model.d_model=1000000000 must be at most 65536"),
    (["model.vocab_size=4294967296"], "model.vocab_size=4294967296 must be at most 16777216"),
    (["train.weight_decay=nan"], "train.weight_decay=nan must be a finite number"),
    (["train.lr=inf"], "train.lr=inf must be a finite number"),
    (["recovery.progress_timeout_s=1e9"], "recovery.progress_timeout_s=1000000000.0 must be at most 86400.0"),
    (["train.seed=18446744073709551616"], "train.seed=18446744073709551616 must be at most 18446744073709551615"),
    (["parallel.dp=256", "parallel.tp=256", "parallel.pp=2"],
     "parallel.dp*parallel.tp*parallel.pp=131072 must be at most 65536: one stage server per rank"),
    (["parallel.pp=8", "parallel.vpp=4", "parallel.microbatches=1024", "model.n_layers=32"],
     "parallel.pp*parallel.vpp*parallel.microbatches=32768 must be at most 16384: the coordinator plans "
     "every forward and backward of a step"),
    (["data.source=" + "x" * 5000], "data.source='xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... (5000 characters) "
                                    "must be at most 4096 characters"),
]


@pytest.mark.parametrize("overrides,message", OUT_OF_BOUNDS, ids=[m.split("=")[0] for _, m in OUT_OF_BOUNDS])
def test_values_beyond_their_bounds_are_refused(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config("", overrides)
    assert str(caught.value) == message


@pytest.mark.parametrize("toml,message", [
    ("[model]\nn_layers = [4]\n", "model.n_layers=[4] must be int"),
    ("[train]\nlr = 1979-05-27\n", "train.lr=datetime.date(1979, 5, 27) must be float"),
    ("[train]\nsteps = 99999999999999999999\n", "train.steps=99999999999999999999 must be at most 10000000"),
    ("a = " + "[" * 100000 + "]" * 100000, "config nests arrays or inline tables too deeply to be a job config"),
])
def test_toml_of_the_wrong_shape_is_refused(toml, message):
    with pytest.raises(ConfigError) as caught:
        load_config(toml)
    assert str(caught.value) == message


def test_submission_and_registration_bounds():
    assert _submission_refused(pb.SubmitJobRequest(config_toml="x" * wire.MAX_CONFIG_BYTES)) == ""
    assert _submission_refused(pb.SubmitJobRequest(overrides=["x" * wire.MAX_CONFIG_BYTES, "y"])) == \
        f"overrides of {wire.MAX_CONFIG_BYTES + 1} bytes must be at most {wire.MAX_CONFIG_BYTES} bytes"
    assert _registration_refused(pb.RegisterRequest(address="10.0.0.2:50051", device="cuda:0")) == ""
    assert _registration_refused(pb.RegisterRequest(address="10.0.0.2")) == \
        "address='10.0.0.2' must be HOST:PORT with a port from 1 to 65535"
    assert _registration_refused(pb.RegisterRequest(address="h:1", device="d" * 65)).startswith("device='ddd")


def test_a_job_keeps_its_newest_events_and_counts_the_dropped():
    record = JobRecord("job-1", load_config("", TINY))
    for step in range(MAX_EVENTS + 5):
        record.add_step(pb.StepEvent(step=step))
    record.set_state("SUCCEEDED")
    replayed = list(record.follow())
    assert record.status().events_dropped == 6  # the first 5 steps and the oldest of the rest
    assert len(replayed) == MAX_EVENTS
    assert [e.step.step for e in replayed[:-1]] == list(range(6, MAX_EVENTS + 5))
    assert replayed[-1].status.state == "SUCCEEDED"
    assert record.status().last.step == MAX_EVENTS + 4


def test_servers_dead_for_long_are_forgotten_unless_they_hold_a_job():
    servers = Registry()
    ids = [servers.register(f"127.0.0.1:{7000 + i}", "", "cpu", 1 << 30) for i in range(3)]
    servers.claim("job-1-00001", lambda idle: [s for s in idle if s.server_id == ids[2]], timeout_s=1)
    entries = {e.server_id: e for e in servers.servers()}
    entries[ids[0]].last_seen -= DEAD_AFTER_S + 1  # dead a moment: still shown as DEAD
    for busy_or_long_dead in ids[1:]:
        entries[busy_or_long_dead].last_seen -= DEAD_AFTER_S + FORGET_DEAD_AFTER_S + 1
    assert {e.server_id: e.state for e in servers.servers()} == {ids[0]: "DEAD", ids[2]: "DEAD"}
    assert not servers.heartbeat(ids[1])  # the server hears NOT_FOUND and registers afresh


LLAMA3 = ["model.arch=llama", "model.rope_scaling_factor=32", "model.rope_low_freq_factor=0.5",
          "model.rope_high_freq_factor=2", "model.rope_original_positions=8"]


@pytest.mark.parametrize("layout", [["parallel.pp=2"], ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"],
                                    ["parallel.pp=4", "parallel.zero=3"], ["parallel.pp=2", *LLAMA3],
                                    ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
                                    # tp=3: each size split on its own (3 | 3 | 6 = 7 is not what divides)
                                    ["parallel.tp=3", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                     "model.n_heads=3", "model.d_model=24", "model.ffn_hidden=6"]])
def test_stage_servers_accept_what_the_coordinator_plans(layout):
    """And build the very model the config describes from the request."""
    config = load_config("", TINY + layout)
    plan = plan_job(config, [ServerSlot(f"s{i}", f"127.0.0.1:{i + 1}", "h") for i in range(config.parallel.world_size)])
    for request in setup_requests("job-1-00001", config, plan, ("127.0.0.1", 5000, "job-1/1"), 120.0):
        check_setup(request)
        assert model_shape(request.model) == shape_of(config.model)


@pytest.mark.parametrize("change,message", [
    (lambda r: r.grid.__setattr__("dp", 0), "grid.dp=0 must be between 1 and 4096"),
    (lambda r: r.__setattr__("rank", 7), "rank=7 must be between 0 and 1"),
    (lambda r: r.model.__setattr__("d_model", 2**31), "model.d_model=2147483648 must be between 1 and 65536"),
    (lambda r: r.train.__setattr__("microbatches", 3),
     "train.global_batch=8 must be divisible by grid.dp*train.microbatches=3"),
    (lambda r: r.train.__setattr__("lr", float("nan")), "train.lr=nan must be a finite number greater than 0"),
    (lambda r: r.__setattr__("comm_timeout_s", 0.0),
     "comm_timeout_s=0.0 must be more than 0 and at most 86400.0"),
    (lambda r: r.__setattr__("job_id", ""), "job_id='' must be 1 to 128 printable characters"),
    (lambda r: (r.model.__setattr__("rope_scaling_factor", 8.0), r.model.__setattr__("rope_low_freq_factor", 4.0)),
     "model.rope_scaling_factor=8.0 must be at least 1, and model.rope_high_freq_factor=4.0 greater than "
     "model.rope_low_freq_factor=4.0"),
    (lambda r: r.model.__setattr__("rope_original_positions", 1 << 21),
     "model.rope_original_positions=2097152 must be between 0 and 1048576"),
    (lambda r: r.train.__setattr__("beta2", 1.0), "train.beta2=1.0 must be at least 0 and less than 1"),
    (lambda r: r.train.__setattr__("eps", 0.0), "train.eps=0.0 must be more than 0 and at most 1.0"),
    (lambda r: r.train.__setattr__("lr_decay", ""), "train.lr_decay='' must be one of cosine, linear, wsd, constant"),
    (lambda r: r.train.__setattr__("min_lr_ratio", -0.5), "train.min_lr_ratio=-0.5 must be between 0.0 and 1.0"),
    (lambda r: r.train.__setattr__("decay_fraction", float("nan")),
     "train.decay_fraction=nan must be more than 0 and at most 1"),
    (lambda r: r.__setattr__("sequence_parallel", True),
     "sequence_parallel needs grid.tp>=2 dividing model.seq_len=16 (grid.tp=1): each tensor rank holds an equal "
     "slice of the sequence"),
    (lambda r: r.train.__setattr__("recompute_layers", 2),
     "train.recompute_layers=2 needs train.recompute='selective', not 'none'"),
])
def test_stage_servers_refuse_setups_out_of_range(change, message):
    config = load_config("", TINY + ["parallel.pp=2", "parallel.vpp=1"])
    plan = plan_job(config, [ServerSlot(f"s{i}", f"127.0.0.1:{i + 1}", "h") for i in range(2)])
    request = setup_requests("job-1-00001", config, plan, ("127.0.0.1", 5000, "job-1/1"), 120.0)[0]
    change(request)
    with pytest.raises(SetupError) as caught:
        check_setup(request)
    assert str(caught.value) == message
