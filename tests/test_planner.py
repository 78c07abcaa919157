"""The planner's pure parts (coordinator/planner/): candidates, cost laws, the bound, the
search against brute force, memory pruning against admission, and what it prints.
Costs come from a fixed device profile here; tests/test_planner_jobs.py measures one on
real servers and runs the plans."""

from __future__ import annotations

import dataclasses
import io
import json
import re

import pytest

from interleaf.clients import plan_command, plan_profile
from interleaf.coordinator.admission import AdmissionError, check_fits, needed_bytes
from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.executed_step import replay_by_latency
from interleaf.coordinator.memory_model import message_bytes
from interleaf.coordinator.partition import partition
from interleaf.coordinator.planner import costs as costs_module, fitting
from interleaf.coordinator.planner.candidates import Layout, apply, grids, head_balanced_split, pipelines, valid_configs
from interleaf.coordinator.planner.costs import (DeviceProfile, Law, LayoutCosts, chunk_forward_flops,
                                                chunk_parameters, collective_s, layout_costs, normalized)
from interleaf.coordinator.planner.explain import Outcome, explain, variant_lines
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.actions import CATEGORIES
from interleaf.coordinator.planner.search import (VARIANT_TIE, Cluster, compute_bound, programs_for, search,
                                                  simulate_layout)

SMALL = ["model.n_layers=8", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "train.global_batch=16"]
GIB = 1 << 30


def profile(overhead_s=2e-3, flops=1e9, link_rate=1e9, latency_s=1e-4) -> DeviceProfile:
    """A device: affine compute laws (a backward twice a forward's arithmetic) and links."""
    return DeviceProfile("cpu", Law(overhead_s, flops), Law(overhead_s, flops / 2), Law(overhead_s / 2, flops),
                         Law(overhead_s / 2, flops), {"p2p": Law(latency_s, link_rate),
                                                      "allreduce": Law(latency_s, link_rate)}, 1e-8)


def test_candidates_worked_example():
    """candidates.py's docstring: 2 servers on one host, 4 layers, global batch 8."""
    config = load_config("", ["model.n_layers=4", "train.global_batch=8"])
    assert sorted(grids(config, 2, 2)) == [(1, 1, 2), (1, 2, 1), (2, 1, 1)]
    assert list(pipelines(2, 4)) == [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2)]
    kept, refused = valid_configs(config, 2, 2)
    zbv = sorted({(l.microbatches, l.recompute) for l, _ in kept if l.schedule == "zbv"})
    assert zbv == [(m, r) for m in (2, 4, 8) for r in ("full", "none", "selective")]
    assert refused == 0
    # tp within a host: one server per host allows no tensor parallelism
    assert all(tp == 1 for _, tp, _ in grids(config, 2, 1))
    # 12 servers, 6 a host: groups of 4 would straddle the hosts (a host holds one of the three)
    wide = load_config("", ["model.n_heads=60", "model.n_kv_heads=60", "model.d_model=120", "model.ffn_hidden=480",
                            "train.global_batch=60"])
    assert sorted({tp for _, tp, _ in grids(wide, 12, 6)}) == [1, 2, 3, 6]
    assert sorted({tp for _, tp, _ in grids(wide, 12, 12)}) == [1, 2, 3, 4, 6, 12]
    assert sorted({tp for _, tp, _ in grids(wide, 10, 6)}) == [1, 2]  # hosts of 6 and 4: groups of 5 do not fit
    assert sorted({tp for _, tp, _ in grids(wide, 10, 10)}) == [1, 2, 5, 10]
    # a coordinator's hosts of 6, 3 and 3: 2 servers a group fit 3 + 1 + 1 of the 6 needed
    assert sorted({tp for _, tp, _ in grids(wide, 12, 6, (6, 3, 3))}) == [1, 3]


def test_a_coordinators_uneven_hosts_keep_tensor_groups_whole():
    """remote_cluster passes the idle servers' hosts as they are: hosts of 6, 3 and 3 plan
    no tp=2 (one group would straddle two hosts), where hosts of 6 and 6 would."""
    def servers(sizes):
        return [pb.ServerInfo(server_id=f"s{h}-{i}", host=f"h{h}", device="cpu", state="IDLE", memory_bytes=8 * GIB)
                for h, size in enumerate(sizes) for i in range(size)]

    config = load_config("", ["model.n_heads=6", "model.n_kv_heads=6", "model.d_model=96", "model.ffn_hidden=384",
                              "model.n_layers=4", "train.global_batch=12"])
    uneven, _ = plan_command.remote_cluster(servers([3, 6, 3]))
    assert uneven.host_sizes == (6, 3, 3) and uneven.servers_per_host == 6
    from interleaf.coordinator.planner.search import hosts_text
    assert hosts_text(uneven) == "hosts of 6, 3 and 3" and hosts_text(Cluster(4, GIB, 4)) == "4 a host"
    assert {layout.tp for layout, _ in valid_configs(config, 12, 6, host_sizes=uneven.host_sizes)[0]} == {1, 3}
    even, _ = plan_command.remote_cluster(servers([6, 6]))
    assert {layout.tp for layout, _ in valid_configs(config, 12, 6, host_sizes=even.host_sizes)[0]} == {1, 2, 3, 6}


def test_a_profiles_provenance_counts_its_jobs_in_one_clause_each():
    """plan_profile.counted's worked example: shape timings and traced jobs each grow
    their own clause in place, however many there are."""
    from interleaf.clients.plan_profile import counted

    once = counted("2 servers", "refined from", "traced job", 1)
    assert once == "2 servers; refined from 1 traced job"
    assert counted(once, "refined from", "traced job", 2) == "2 servers; refined from 3 traced jobs"
    shapes = counted(once, "chunk shapes of the top plans in", "job", 6)
    assert counted(counted(shapes, "chunk shapes of the top plans in", "job", 1), "refined from", "traced job", 1) \
        == "2 servers; refined from 2 traced jobs; chunk shapes of the top plans in 7 jobs"


def test_every_candidate_is_a_valid_config():
    config = load_config("", SMALL)
    kept, _ = valid_configs(config, 4, 4)
    assert len(kept) > 100
    for layout, cfg in kept:
        assert cfg.parallel.world_size == 4 and cfg.parallel.plan == ""
        sets = plan_command.overrides({"parallel": layout.parallel(), "train": layout.train()})
        assert load_config("", SMALL + sets) == cfg


def test_head_balanced_split_worked_example():
    assert head_balanced_split(8, 4, 2.0) == (3, 2, 2, 1)
    assert head_balanced_split(8, 4, 0.0) == ()  # the even split itself
    assert head_balanced_split(4, 4, 3.0) == ()  # no layer to move
    assert sum(head_balanced_split(32, 8, 4.0)) == 32


def test_cost_law_worked_example():
    """costs.py's docstring: 2 GPT-2 layers of d_model 64 at 4 rows of 32 tokens."""
    config = load_config("", ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32",
                              "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"])
    (chunk,) = partition(2, 1, 1)
    body = dataclasses.replace(chunk, has_head=False)
    assert chunk_forward_flops(config, body, 4) == 27_262_976
    assert Law(2e-3, 1e9).seconds(27_262_976) == pytest.approx(29.26e-3, rel=1e-3)


def test_tensor_parallel_divides_the_arithmetic_and_adds_collectives():
    base = load_config("", SMALL + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                    "parallel.microbatches=1"])
    tp2 = apply(base, Layout(1, 2, 1, 1, "1f1b", 1, 0, "none"))
    one, two = layout_costs(base, profile()), layout_costs(tp2, profile())
    assert one.tp_collective_s == 0 and two.tp_collective_s > 0
    arithmetic = lambda costs: costs.forward_s[0] - costs.tp_collective_s - 2e-3
    assert arithmetic(two) == pytest.approx(arithmetic(one) / 2, rel=0.02)  # the head's padding differs


def test_recompute_adds_the_rerun_to_the_backward():
    base = load_config("", SMALL + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"])
    costs = {r: layout_costs(dataclasses.replace(base, train=dataclasses.replace(base.train, recompute=r)), profile())
             for r in ("none", "selective", "full")}
    assert costs["none"].backward_s[0] < costs["selective"].backward_s[0] < costs["full"].backward_s[0]
    assert costs["full"].backward_s[0] - costs["none"].backward_s[0] == pytest.approx(
        costs["none"].forward_s[0] - 2e-3)


@pytest.mark.parametrize("servers", [2, 4])
def test_the_bound_never_exceeds_the_simulated_step(servers):
    """compute_bound is a lower bound: what makes the search's pruning exact."""
    config = load_config("", SMALL)
    for layout, cfg in valid_configs(config, servers, servers)[0]:
        costs = layout_costs(cfg, profile())
        step = simulate_layout(cfg, programs_for(cfg), costs).makespan_s
        assert compute_bound(cfg, costs) <= step * (1 + 1e-9), layout.describe()


@pytest.mark.parametrize("schedule, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1),
                                           ("zbv", 2)])
def test_the_bound_holds_when_a_later_rank_updates_longest(schedule, vpp):
    """The drain and the last rank's update overlap: the bound counts the longer."""
    config = load_config("", SMALL + [f"parallel.schedule={schedule}", f"parallel.vpp={vpp}", "parallel.pp=2",
                                      "parallel.microbatches=2"])
    chunks = 2 * vpp
    costs = LayoutCosts([1.0] * chunks, [2.0] * chunks, [1.0] * chunks, [1.0] * chunks, 0.0, 0.0, 0.0,
                        [0.1, 1.0], 0.0)
    step = simulate_layout(config, programs_for(config), costs).makespan_s
    assert compute_bound(config, costs) <= step * (1 + 1e-9)


@pytest.mark.parametrize("link_rate", [1e9, 1e7])
def test_search_finds_the_brute_force_best(link_rate):
    """Every fitting candidate simulated: the search's best is as fast, within its
    tolerance, for compute-bound and for link-bound devices."""
    config = load_config("", SMALL)
    device = profile(link_rate=link_rate)
    cluster = Cluster(4, 64 * GIB, servers_per_host=4)
    report = search(config, cluster, device, top=3)
    everything = []
    for layout, cfg in valid_configs(config, 4, 4)[0]:
        everything.append(simulate_layout(cfg, programs_for(cfg), layout_costs(cfg, device)).makespan_s)
    assert report.plans[0].step_s <= min(everything) * 1.01
    assert [p.step_s for p in report.plans] == sorted(p.step_s for p in report.plans)
    assert report.simulated < len(everything) / 4  # the bound pruned most


def test_ranked_plans_pass_admission_and_memory_prunes():
    config = load_config("", SMALL + ["model.d_model=256", "model.n_layers=16", "model.seq_len=256",
                                      "train.global_batch=64"])
    roomy = search(config, Cluster(4, 64 * GIB, 4), profile(), top=8)
    needs = sorted(max(needed_bytes(p.config, programs_for(p.config))) for p in roomy.plans)
    tight = needs[len(needs) // 2]  # half the roomy plans would not fit
    report = search(config, Cluster(4, tight, 4), profile(), top=8)
    assert report.plans and report.refused_by_memory > 0
    for plan in report.plans:
        need = needed_bytes(plan.config, programs_for(plan.config))
        check_fits(need, [(f"s{i}", tight) for i in range(4)])  # admission admits every ranked plan
        assert plan.admission_bytes == max(need) <= tight
    with pytest.raises(plan_command.PlanError, match="no layout of 4 servers fits"):
        plan_command.run_search(config, Cluster(4, 520 << 20, 4), profile(), 3)
    with pytest.raises(AdmissionError):
        check_fits(needed_bytes(roomy.plans[0].config, programs_for(roomy.plans[0].config)),
                   [(f"s{i}", 520 << 20) for i in range(4)])


def test_the_explanation_says_why_each_variant_lost():
    """Each plan's ZeRO, recompute and sequence-parallel lines (explain.variant_lines)
    compare it with the same layout at another value, and every claim holds when
    recomputed: a variant that "does not fit" needs that much more than a server has,
    and a simulated one's step and peak differ by what is printed. The variant ranked
    is, of those within VARIANT_TIE of the shape's fastest, the leanest."""
    config = load_config("", SMALL + ["model.d_model=256", "model.n_layers=16", "model.seq_len=256",
                                      "train.global_batch=64"])
    roomy = search(config, Cluster(4, 64 * GIB, 4), profile(), top=8)
    needs = sorted(max(needed_bytes(p.config, programs_for(p.config))) for p in roomy.plans)
    tight = needs[len(needs) // 2]
    report = search(config, Cluster(4, tight, 4), profile(), top=8)

    def mib(count: int, sign: str = "") -> str:
        assert abs(count) < GIB
        return f"{count / 2**20:{sign}.1f} MiB" if abs(count) >= 2**20 else f"{count / 1024:{sign}.1f} KiB"

    verdicts = []
    for plan in report.plans:
        assert plan.why_variants == tuple(line for line in explain(plan) if "against:" in line)
        plan_need = max(needed_bytes(plan.config, programs_for(plan.config)))
        for line in plan.why_variants:
            called, rest = line.split("=", 1)
            name = {"zero": "zero", "recompute": "recompute", "sequence parallelism": "sequence_parallel"}[called]
            for part in rest.split("against: ", 1)[1].split("; "):
                label, verdict = re.fullmatch(r"(zero\d|none|selective|full|no sp|sp) (.*)", part).groups()
                value = {"zero": lambda: int(label[4:]), "recompute": lambda: label,
                         "sequence_parallel": lambda: label == "sp"}[name]()
                cfg = apply(config, dataclasses.replace(plan.layout, **{name: value}))
                programs = programs_for(cfg)
                need = max(needed_bytes(cfg, programs))
                if verdict.startswith("does not fit"):
                    assert verdict == f"does not fit: needs {mib(need - tight)} more than a server's " \
                                      f"{tight / GIB:.2f} GiB"
                else:
                    step = simulate_layout(cfg, programs, layout_costs(cfg, profile())).makespan_s
                    slower = step / plan.step_s - 1
                    assert need <= tight and verdict == (f"{slower:+.{1 if abs(slower) >= 0.01 else 2}%} step, "
                                                         f"{mib(need - plan_need, '+')} peak")
                    assert slower > -VARIANT_TIE and (slower != 0 or need >= plan_need)
                verdicts.append(verdict.split(":")[0])
        peak = max(plan.peak_bytes)  # in MiB under a GiB (where "0.05 GiB" would hide a tenth of it)
        assert f"peak memory {mib(peak)} (+0.5 GiB process reserve)" in "\n".join(explain(plan))
    assert "does not fit" in verdicts and any("step" in v for v in verdicts)
    # a server under a GiB is named in MiB too (docs/planning.md's 600,000,000-byte servers)
    layout = Layout(2, 1, 1, 1, "1f1b", 1, 1, "none", False, ())
    refused = Outcome("refused", needed_bytes=600_000_000 + 6_186_598)
    assert variant_lines(layout, 1.0, 0, 600_000_000, {dataclasses.replace(layout, zero=0): refused}) == [
        "zero=1, against: zero0 does not fit: needs 5.9 MiB more than a server's 572.2 MiB"]


def test_a_shape_ranks_its_leanest_variant_within_the_tie_of_its_fastest():
    """Variants each 0.09% slower and leaner than the last: within VARIANT_TIE (0.1%) of
    the fastest only the second is, so it is ranked, not the last of a chain of ties."""
    from interleaf.coordinator.planner.search import RankedPlan, _chosen_variant

    config = load_config("", SMALL)

    def variant(zero: int, step_s: float, peak: int) -> RankedPlan:
        layout = Layout(2, 1, 1, 1, "1f1b", 1, zero, "none")
        cfg = apply(config, layout)
        return RankedPlan(layout, cfg, step_s, 0.0, [peak], layout_costs(cfg, profile()), step_s)

    chain = [variant(z, 1 + 0.0009 * z, (4 - z) * GIB) for z in range(4)]
    assert _chosen_variant(chain).layout.zero == 1
    assert _chosen_variant(chain[::-1]).layout.zero == 1  # whatever order they were simulated in
    assert _chosen_variant([variant(0, 1.0, GIB), variant(1, 1.0, GIB)]).layout.zero == 0  # as lean: lower stage


def test_a_7b_model_on_64_servers():
    """The issue's search: a 7B-class model on 64 servers of 80 GB, no server needed."""
    config = load_config("", ["model.n_layers=32", "model.d_model=4096", "model.n_heads=32",
                              "model.seq_len=2048", "train.global_batch=512"])
    gpu = profile(overhead_s=1e-4, flops=4e14, link_rate=2e11, latency_s=1e-5)
    report = search(config, Cluster(64, 80_000_000_000, 8), gpu, top=5)
    assert len(report.plans) == 5 and not report.stopped_by_time
    for plan in report.plans:
        assert plan.config.parallel.world_size == 64 and plan.admission_bytes <= 80_000_000_000
    assert report.refused_by_memory > 0  # dp64 without ZeRO or recompute cannot hold 7B's state


def test_json_and_text_reports():
    config = load_config("", SMALL)
    report = search(config, Cluster(4, 2_000_000_000, 4), profile(), top=4)
    out = io.StringIO()
    plan_command.print_json(report, out)
    plans = json.loads(out.getvalue())
    assert len(plans) == 4
    assert set(plans[0]) >= {"parallel", "train", "predicted_step_seconds", "predicted_peak_bytes", "why"}
    assert plans[0]["why"] == explain(report.plans[0])
    assert [p["predicted_step_seconds"] for p in plans] == sorted(p["predicted_step_seconds"] for p in plans)
    text = plan_command.report_text(report, Cluster(4, 2_000_000_000, 4), profile(), config)
    assert "searched" in text and "run the best: --set parallel.dp=" in text
    assert text.count("lower bound") == 4
    assert "\n4 servers of 1.86 GiB, 4 a host\n" in text
    # the table's columns end where their headers do, however long a step (a 7B model's
    # 29,679.8436 s ran one character past its column), and one server is one
    slow = dataclasses.replace(report, plans=[dataclasses.replace(report.plans[0], step_s=29679.8436)])
    text = plan_command.report_text(slow, Cluster(1, 2_000_000_000, 1), profile(), config)
    header, row = [line for line in text.splitlines() if line.startswith((" #", " 1  "))]
    assert header.index("step s") + len("step s") == row.index("29679.8436") + len("29679.8436"), (header, row)
    assert len(header) == len(row), (header, row)  # the last column, right-aligned, ends with its header
    assert "\n1 server of 1.86 GiB, 1 a host\n" in text


def test_fit_line_recovers_a_law():
    points = [(x, 0.003 + x / 2e9) for x in (1e6, 5e6, 2e7, 8e7)]
    law = fitting.fit_line(points)
    assert law.overhead_s == pytest.approx(0.003) and law.rate == pytest.approx(2e9)
    # negative intercepts are not costs: the line goes through the origin
    assert fitting.fit_line([(1.0, 1.0), (2.0, 3.0)]).overhead_s == 0


def test_profile_round_trips_through_json(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = load_config("", SMALL)
    setup = plan_profile.profile_setup(config, "cpu", None)
    assert plan_profile.load_cached(setup, "cpu") is None
    plan_profile.store(profile(), setup)
    assert plan_profile.load_cached(setup, "cpu") == profile()
    assert plan_profile.load_cached(setup, "cuda (NVIDIA H100)") is None  # per device kind
    bf16 = plan_profile.profile_setup(load_config("", SMALL + ["train.precision=bf16"]), "cpu", None)
    assert plan_profile.load_cached(bf16, "cpu") is None  # and per precision


def test_a_profile_file_that_costs_cannot_use_is_refused_naming_the_field(tmp_path, capsys):
    """--profile takes a file a user may have edited: a rate of zero, NaN, a negative
    overhead, a missing link law, a law of the wrong shape are each one line naming the
    field and the rule (before: tracebacks, or a plan of negative seconds)."""
    from interleaf.clients.cli import main

    good = profile().to_json()
    edits = [
        (lambda d: d["forward"].update(rate=0), "forward.rate=0 must be a finite number > 0"),
        (lambda d: d["forward"].update(rate=float("nan")), "forward.rate=nan must be a finite number > 0"),
        (lambda d: d["forward"].update(rate="fast"), "forward.rate='fast' must be a finite number > 0"),
        (lambda d: d["backward"].update(overhead_s=-5), "backward.overhead_s=-5 must be a finite number >= 0"),
        (lambda d: d["links"].pop("allreduce"), "must be an object with at least p2p and allreduce laws"),
        (lambda d: d.update(links=[1, 2]), "links=[1, 2] must be an object with at least p2p and allreduce"),
        (lambda d: d.update(update_s_per_param=-1.0), "update_s_per_param=-1.0 must be a finite number >= 0"),
        (lambda d: d.clear(), "it lacks device, forward, backward, input_grad, weight_grad, links"),
        (lambda d: d.update(device="tpu"), "device='tpu' must be \"cpu\" or a GPU's kind"),
        (lambda d: d.update(device=7), "device=7 must be \"cpu\" or a GPU's kind"),
        (lambda d: d.update(update_overhead_s=-0.5), "update_overhead_s=-0.5 must be a finite number >= 0"),
    ]
    for edit, message in edits:
        data = json.loads(json.dumps(good))
        edit(data)
        path = tmp_path / "profile.json"
        path.write_text(json.dumps(data))
        assert main(["plan", "--servers", "2", "--profile", str(path), "--server-memory", str(GIB)]) == 2
        err = capsys.readouterr().err
        assert f"--profile {path}: not a device profile (" in err and message in err and "Traceback" not in err, err
    assert costs_module.DeviceProfile.from_json(json.loads(json.dumps(good))) == profile()


def test_a_large_model_is_profiled_through_a_proxy():
    config = load_config("", ["model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.seq_len=2048"])
    proxy = plan_profile.profile_model(config, "cpu", None)
    assert proxy["d_model"] < 4096 and proxy["arch"] == "gpt2" and proxy["n_layers"] == 8
    load_config("", [f"model.{k}={v}" for k, v in proxy.items()])  # a valid model
    # ...that a tensor pair can split, for the link jobs, Llama's grouped kv heads too
    load_config("", [f"model.{k}={v}" for k, v in proxy.items()] + ["parallel.tp=2", "parallel.pp=1",
                                                                       "parallel.vpp=1", "parallel.schedule=1f1b"])
    llama = load_config("", ["model.arch=llama", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32",
                             "model.n_kv_heads=8", "model.ffn_hidden=14336", "model.seq_len=2048"])
    narrow = plan_profile.profile_model(llama, "cpu", None)
    assert narrow["n_heads"] >= 2 and narrow["n_kv_heads"] == 2
    load_config("", [f"model.{k}={v}" for k, v in narrow.items()] + ["parallel.tp=2", "parallel.pp=1",
                                                                        "parallel.vpp=1", "parallel.schedule=1f1b"])
    small = load_config("", SMALL)
    assert plan_profile.profile_model(small, "cpu", None) == dataclasses.asdict(small.model)


def test_a_gpu_profiles_models_to_about_2b_at_their_own_widths():
    """A narrow proxy's products do not fill a GPU (an H200 ran a d_model-128 proxy at
    2.9 TFLOP/s, the model it stood for at about 430), so on a GPU the profile runs the
    model itself where a CPU's would narrow it, and a larger model's proxy stays wide."""
    gpu = "cuda (NVIDIA H200)"
    bench = load_config("", ["model.n_layers=12", "model.d_model=1024", "model.n_heads=16", "model.seq_len=1024",
                             "model.vocab_size=50304", "train.precision=bf16"])  # bench/planner.py's GPU model
    assert plan_profile.profile_model(bench, gpu, None) == dataclasses.asdict(bench.model)
    assert plan_profile.profile_model(bench, "cpu", None)["d_model"] < 1024
    gpt = load_config("", ["model.n_layers=20", "model.d_model=2048", "model.n_heads=16", "model.seq_len=2048"])
    assert plan_profile.profile_model(gpt, gpu, None) == dataclasses.asdict(gpt.model)  # 1.11B
    llama = load_config("", ["model.arch=llama", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32",
                             "model.n_kv_heads=8", "model.ffn_hidden=11008", "model.seq_len=4096"])
    wide, narrow = plan_profile.profile_model(llama, gpu, None), plan_profile.profile_model(llama, "cpu", None)
    assert (wide["d_model"], wide["seq_len"], wide["n_layers"]) == (2048, 2048, 8)
    assert narrow["d_model"] < wide["d_model"]
    # cached apart, so a CPU's profile of the model is never read as a GPU's
    assert plan_profile.profile_setup(bench, gpu, None) != plan_profile.profile_setup(bench, "cpu", None)


def test_the_profile_jobs_fit_the_servers_memory():
    """Every profile job must fit a server (admission would refuse it, and the profile
    with it): a model whose jobs do not is profiled as its first PROXY_LAYERS layers,
    and where those do not fit either, through a narrower proxy."""
    h100 = "cuda (NVIDIA H100 80GB HBM3)"
    usable = int(79.2 * GIB)
    gpt27 = load_config("", ["model.n_layers=32", "model.d_model=2560", "model.n_heads=32", "model.seq_len=2048",
                             "train.precision=bf16"])
    assert not plan_profile.profile_jobs_fit(gpt27, dataclasses.asdict(gpt27.model), h100, usable)
    shorter = plan_profile.profile_model(gpt27, h100, usable)
    assert shorter == dict(dataclasses.asdict(gpt27.model), n_layers=plan_profile.PROXY_LAYERS)
    assert plan_profile.profile_jobs_fit(gpt27, shorter, h100, usable)
    gpt = load_config("", ["model.n_layers=20", "model.d_model=2048", "model.n_heads=16", "model.seq_len=2048",
                           "train.precision=bf16"])
    assert plan_profile.profile_model(gpt, h100, usable) == dataclasses.asdict(gpt.model)
    assert plan_profile.profile_model(gpt, h100, 24 * GIB)["n_layers"] == plan_profile.PROXY_LAYERS
    narrow = plan_profile.profile_model(gpt, h100, 8 * GIB)
    assert narrow["d_model"] < 2048 and plan_profile.profile_jobs_fit(gpt, narrow, h100, 8 * GIB)
    # the first layers keep the model's chunk shapes, which search_timed then times; a proxy's are not the model's
    assert plan_profile.own_widths(gpt, plan_profile.profile_model(gpt, h100, 24 * GIB))
    assert not plan_profile.own_widths(gpt, narrow)
    # on CPU servers the link jobs run too: a data-parallel pair holds more than one server's compute jobs
    llama = load_config("", ["model.arch=llama", "model.n_layers=8", "model.d_model=256", "model.n_heads=4",
                             "model.n_kv_heads=2", "model.seq_len=128", "model.vocab_size=50304",
                             "train.precision=bf16"])
    whole = dataclasses.asdict(llama.model)
    assert plan_profile.profile_jobs_fit(llama, whole, h100, int(1.44 * GIB))
    assert not plan_profile.profile_jobs_fit(llama, whole, "cpu", int(1.44 * GIB))
    assert plan_profile.profile_model(llama, "cpu", int(1.44 * GIB))["d_model"] < 256
    # where nothing fits, the profile says so rather than submit a job admission refuses
    tiny = load_config("", ["model.n_layers=8", "model.d_model=32", "model.n_heads=4", "model.seq_len=16"])
    with pytest.raises(plan_profile.ProfileJobFailed, match=r"no profile job of this model fits a server's 256\.0 "
                                                            r"MiB, not even through a proxy of 8 layers of d_model 32"):
        plan_profile.profile_model(tiny, "cpu", GIB // 4)


def test_host_slowdown():
    assert plan_command.host_slowdown(4, 1, 2) == 2.0
    assert plan_command.host_slowdown(2, 1, 2) == 1.0


@pytest.mark.parametrize("given, message", [
    (["parallel.layers=3,3,1"], "parallel.layers=[3,3,1] must give one count per chunk"),
    (["parallel.layers=4,4,0,0"], "must give every chunk at least 1 layer"),
    (["parallel.layers=3,3,1,2"], "must sum to model.n_layers=8, not 9"),
    (["parallel.plan=manual"], "parallel.plan='manual' must be \"auto\""),
])
def test_bad_plan_settings_are_refused(given, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config("", ["model.n_layers=8"] + given)


def test_uneven_layers_reach_every_rank():
    config = load_config("", ["model.n_layers=8", "parallel.layers=3,3,1,1"])
    from interleaf.coordinator.plan import ServerSlot, plan_job

    plan = plan_job(config, [ServerSlot(f"s{i}", f"a{i}", "h") for i in range(2)])
    assert [len(c.layers) for c in plan.chunks] == [3, 3, 1, 1]


def test_split_laws_keep_the_measured_ratio_to_the_whole_backward():
    """I and W priced as shares of B measured at the same chunks: a split backward costs
    what it was measured to cost beside a whole one, at every size."""
    observations = []
    for amount, b in ((1e9, 0.050), (4e9, 0.170)):
        observations += [{"kind": "forward", "amount": amount, "seconds": b / 2},
                         {"kind": "backward", "amount": amount, "seconds": b}]
    observations += [{"kind": "input_grad", "amount": 4e9, "seconds": 0.102},
                     {"kind": "weight_grad", "amount": 4e9, "seconds": 0.085}]
    fitted = fitting.fit(observations, "cpu", profile().links, "synthetic")
    assert fitted.backward.overhead_s == pytest.approx(0.010) and fitted.backward.rate == pytest.approx(25e9)
    for amount in (5e8, 1e9, 4e9, 1.6e10):
        whole = fitted.backward.seconds(amount)
        split = fitted.input_grad.seconds(amount) + fitted.weight_grad.seconds(amount)
        assert split == pytest.approx(whole * 0.187 / 0.170)
        assert fitted.input_grad.seconds(amount) / split == pytest.approx(0.102 / 0.187)


def test_collective_laws_scale_from_two_members_and_back():
    """A call's law between two members prices it among any number (a ring's steps and
    bytes), and a call measured among m members normalizes back onto that law."""
    law = Law(1e-3, 1e9)
    assert collective_s(law, 1, 1e6) == 0.0
    assert collective_s(law, 2, 1e6) == pytest.approx(1e-3 + 1e-3)
    assert collective_s(law, 4, 1e6) == pytest.approx(3e-3 + 1.5e-3)
    for members in (2, 3, 8):
        amount, seconds = normalized(members, 4e6, collective_s(law, members, 4e6))
        assert law.seconds(amount) == pytest.approx(seconds)


def test_link_laws_are_fitted_per_group_kind_from_the_servers_calls():
    """StepReport.comm's held seconds, bytes and calls per (op, group) become one
    observation each; two mean call sizes fit each kind's line, which layout_costs then
    prices that kind's collectives with (a kind not measured falls back to the probe)."""
    config = load_config("", SMALL + ["parallel.dp=2", "parallel.tp=2", "parallel.pp=1", "parallel.vpp=1",
                                      "parallel.schedule=1f1b", "parallel.microbatches=2", "parallel.zero=3"])
    tp, dp, rs = Law(2e-3, 5e8), Law(1e-3, 2e9), Law(3e-3, 1e8)
    observations = []
    for size in (1e5, 4e6):
        report = pb.StepReport(comm=[
            pb.CommStat(op="all_reduce", group="tp", seconds=3 * tp.seconds(size), bytes=int(3 * size), calls=3),
            pb.CommStat(op="all_reduce", group="dp", seconds=dp.seconds(size), bytes=int(size), calls=1),
            pb.CommStat(op="reduce_scatter", group="dp", seconds=2 * rs.seconds(size), bytes=int(2 * size), calls=2),
            pb.CommStat(op="all_reduce", group="world", seconds=9.0, bytes=8, calls=1),  # the grad norm: no law
            pb.CommStat(op="send", group="pp", seconds=9.0, bytes=int(size), calls=1)])
        observations += plan_profile.observe_links(pb.StepTrace(reports=[report]), config)
    assert sorted({o["kind"] for o in observations}) == ["link:dp", "link:dp_reduce_scatter", "link:tp"]
    fitted = fitting.fit(observations + [{"kind": "forward", "amount": 1e9, "seconds": 1.0},
                                         {"kind": "backward", "amount": 1e9, "seconds": 2.0}],
                         "cpu", profile().links, "synthetic")
    for kind, law in (("tp", tp), ("dp", dp), ("dp_reduce_scatter", rs)):
        assert fitted.links[kind].overhead_s == pytest.approx(law.overhead_s)
        assert fitted.links[kind].rate == pytest.approx(law.rate)
    # a kind not measured: its group's all-reduce moving half the bytes, else the probe's
    assert fitted.link("dp_all_gather").overhead_s == pytest.approx(dp.overhead_s / 2)
    assert fitted.link("dp_all_gather").rate == pytest.approx(dp.rate * 2)
    assert profile().link("tp_all_gather") == Law(profile().links["allreduce"].overhead_s / 2,
                                                  profile().links["allreduce"].rate * 2)
    # a group of four calls the same laws at four members' scaling
    four = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, dp=4))
    amount, seconds = 1e6, collective_s(dp, 4, 1e6)
    seen = plan_profile.observe_links(pb.StepTrace(reports=[pb.StepReport(comm=[
        pb.CommStat(op="all_reduce", group="dp", seconds=seconds, bytes=int(amount), calls=1)])]), four)
    assert dp.seconds(seen[0]["amount"]) == pytest.approx(seen[0]["seconds"])
    # the tensor group's all-reduces are its law without sequence parallelism, its
    # reduce-scatters and all-gathers with it (the other ops are the loss's and update's)
    sp = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, sequence_parallel=True))
    mixed = pb.StepTrace(ranks=[pb.RankInfo(rank=0)], reports=[pb.StepReport(rank=0, comm=[
        pb.CommStat(op="all_reduce", group="tp", seconds=1.0, bytes=8, calls=1),
        pb.CommStat(op="all_gather", group="tp", seconds=1.0, bytes=8, calls=1),
        pb.CommStat(op="reduce_scatter", group="tp", seconds=1.0, bytes=8, calls=1)])])
    assert [o["kind"] for o in plan_profile.observe_links(mixed, config)] == ["link:tp"]
    assert sorted(o["kind"] for o in plan_profile.observe_links(mixed, sp)) == ["link:tp_all_gather",
                                                                              "link:tp_reduce_scatter"]
    # a CUDA server's calls return once queued: neither they nor its shards' compute are observed
    assert plan_profile.observations(mixed, config, "cuda (NVIDIA H100 80GB HBM3)") == []
    assert len(plan_profile.observations(mixed, config, "cpu")) == 1
    costs = layout_costs(config, fitted)
    hidden = 16 // (2 * 2) * 32 * 64 * 4  # a microbatch's rows * seq_len * d_model * fp32
    assert costs.tp_collective_s == pytest.approx((8 * 2 + 1) * collective_s(tp, 2, hidden))  # blocks, embedding
    assert costs.reduce_s == pytest.approx(collective_s(rs, 2, max(chunk_parameters(config, c) for c in
                                                                   partition(8, 1, 1, "1f1b")) * 4))
    # ZeRO-1 reduce-scatters too (each replica steps its shard); ZeRO 0 all-reduces
    for zero, law in ((0, dp), (1, rs), (2, rs)):
        staged = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, zero=zero))
        grads = max(chunk_parameters(config, c) for c in partition(8, 1, 1, "1f1b")) * 4
        assert layout_costs(staged, fitted).reduce_s == pytest.approx(collective_s(law, 2, grads))


def test_tensor_group_calls_per_block_follow_the_architecture():
    """What a block calls over the tensor group (stageserver/model/tensor_parallel.py,
    sequence_parallel.py): without sequence parallelism an all-reduce per row-parallel
    linear forward and per column-parallel linear backward (gpt2 2 and 2, llama 2 and
    5); with it 2 all-gathers + 2 reduce-scatters forward, 4 + 2 backward. The embedding
    and the head add one call each way between them. Selective recompute replays the
    forward's calls; a block rerun whole (full, or selective's every K-th) makes them again."""
    ar, ag, rs = Law(1e-3, 1e9), Law(2e-3, 5e8), Law(3e-3, 2e8)
    measured = dataclasses.replace(profile(), links={**profile().links, "tp": ar, "tp_all_gather": ag,
                                                     "tp_reduce_scatter": rs})
    base = ["parallel.tp=2", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
            "parallel.microbatches=2", "train.global_batch=16"]
    gpt2 = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32"]
    llama = ["model.arch=llama", "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
             "model.seq_len=32"]
    hidden = 8 * 32 * 64 * 4
    a, g, r = (collective_s(law, 2, hidden) for law in (ar, ag, rs))
    untouched = dataclasses.replace(measured, tp_compute_factor=None)
    # (model, sp, a block's forward and backward calls, the embedding's and head's forward and backward)
    for model, sp, forward, backward, ends_f, ends_b in (
            (gpt2, False, 2 * a, 2 * a, a, a),
            (llama, False, 2 * a, 5 * a, a, a),
            (gpt2, True, 2 * g + 2 * r, 4 * g + 2 * r, r + g, g + r),
            (llama, True, 2 * g + 2 * r, 4 * g + 2 * r, r + g, g + r)):
        config = load_config("", model + base + [f"parallel.sequence_parallel={str(sp).lower()}"])
        costs = layout_costs(config, untouched)
        chunk = partition(2, 1, 1, "1f1b")[0]
        flops = chunk_forward_flops(config, chunk, 8)
        assert costs.tp_collective_s == pytest.approx(2 * forward + ends_f)
        assert costs.forward_s[0] == pytest.approx(untouched.forward.seconds(flops) + 2 * forward + ends_f)
        assert costs.backward_s[0] == pytest.approx(untouched.backward.seconds(flops) + 2 * backward + ends_b)
        full = dataclasses.replace(config, train=dataclasses.replace(config.train, recompute="full"))
        assert layout_costs(full, untouched).backward_s[0] == pytest.approx(
            costs.backward_s[0] + flops / untouched.forward.rate + 2 * forward)
        # selective: a share of the arithmetic rerun, none of the calls (replayed)...
        selective = dataclasses.replace(config, train=dataclasses.replace(config.train, recompute="selective"))
        share = dataclasses.replace(untouched, selective_share=0.25)
        assert layout_costs(selective, share).backward_s[0] == pytest.approx(
            costs.backward_s[0] + 0.25 * flops / untouched.forward.rate)
        # ...but every K-th block rerun whole, calls and all (here K=1: every block)
        every = dataclasses.replace(config, train=dataclasses.replace(config.train, recompute="selective",
                                                                      recompute_layers=1))
        assert layout_costs(every, share).backward_s[0] == pytest.approx(
            costs.backward_s[0] + flops / untouched.forward.rate + 2 * forward)
    # scatter/gather messages: each received message all-gathered over the tensor group
    piped = load_config("", gpt2 + ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
                                    "parallel.microbatches=2", "train.global_batch=16"])
    assert piped.parallel.scatter_gather
    plain = dataclasses.replace(piped, parallel=dataclasses.replace(piped.parallel, scatter_gather=False))
    gathered, whole = layout_costs(piped, untouched), layout_costs(plain, untouched)
    assert gathered.forward_s == pytest.approx([whole.forward_s[0], whole.forward_s[1] + g])
    assert gathered.backward_s == pytest.approx([whole.backward_s[0] + g, whole.backward_s[1]])


def test_selective_recomputes_forward_is_priced_at_what_it_measured_against_a_plain_one():
    """A forward under selective recompute decides op by op what to keep, and takes longer
    than a plain one (7-18% on the planner bench's CPU chunks): the profile's selective
    job times its forwards as "forward_selective", the fit takes their median ratio to
    plain forwards of the same FLOPs, and a selective layout's forwards are priced at it
    (a plain layout's, and one with recompute_layers, whose other blocks run plain, not)."""
    plain = [{"kind": k, "amount": a, "seconds": s * a / 1e9} for k, s in (("forward", 0.010), ("backward", 0.020))
             for a in (1e9, 2e9) for _ in range(4)]
    kept = [{"kind": "forward_selective", "amount": 2e9, "seconds": 0.022 + 0.001 * i} for i in range(4)]
    fitted = fitting.fit(plain + kept, "cpu", profile().links, "synthetic")
    assert fitted.selective_forward_factor == pytest.approx(0.02225 / 0.020)  # lower quartiles
    assert fitting.fit(plain, "cpu", profile().links, "synthetic").selective_forward_factor is None
    # a ratio below 1 is noise: no selective forward is cheaper than a plain one
    faster = [dict(o, seconds=0.019) for o in kept]
    assert fitting.fit(plain + faster, "cpu", profile().links, "synthetic").selective_forward_factor == 1.0
    assert DeviceProfile.from_json(json.loads(json.dumps(fitted.to_json()))).selective_forward_factor == \
        fitted.selective_forward_factor
    base = SMALL + ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b", "parallel.microbatches=2"]
    none = layout_costs(load_config("", base), fitted)
    selective = layout_costs(load_config("", base + ["train.recompute=selective"]), fitted)
    assert selective.forward_s == pytest.approx([f * fitted.selective_forward_factor for f in none.forward_s])
    layered = layout_costs(load_config("", base + ["train.recompute=selective", "train.recompute_layers=2"]), fitted)
    assert layered.forward_s == pytest.approx(none.forward_s)
    # the profile job's traced step: a selective job's forwards and backwards are its own kinds
    config = load_config("", base + ["train.recompute=selective"])
    trace = pb.StepTrace(ranks=[pb.RankInfo(rank=0, coordinates=pb.Coordinates(pp=0))], reports=[pb.StepReport(
        rank=0, spans=[pb.ActionSpan(action="F0.0", kind="forward", start_seconds=1.0, end_seconds=1.02),
                       pb.ActionSpan(action="B0.0", kind="backward", start_seconds=1.1, end_seconds=1.15)])])
    assert [o["kind"] for o in plan_profile.observe(trace, config)] == ["forward_selective", "backward_selective"]


def test_tensor_parallel_shards_are_priced_at_their_measured_rate():
    """A tensor-parallel server's traced step, its computes' spans less its tensor
    group's calls, against the laws' price of their FLOPs: the factor layout_costs
    stretches a tp>1 layout's compute by, and only its."""
    laws = profile()
    f, b = 1e8, 1e8
    priced = laws.forward.seconds(f) + laws.backward.seconds(b)
    report = pb.StepReport(
        spans=[pb.ActionSpan(action="F0.0", kind="forward", start_seconds=0.0, end_seconds=0.5 * 1.5 * priced + 0.01),
               pb.ActionSpan(action="B0.0", kind="backward", start_seconds=1.0,
                             end_seconds=1.0 + 0.5 * 1.5 * priced + 0.01),
               pb.ActionSpan(action="U", kind="update", start_seconds=2.0, end_seconds=2.5)],
        comm=[pb.CommStat(op="all_reduce", group="tp", seconds=0.02, bytes=1 << 20, calls=4)])
    seen = plan_profile._tp_compute(report, [f])
    assert seen[0]["computes"] == [["forward", f], ["backward", b]]
    assert seen[0]["seconds"] == pytest.approx(1.5 * priced)
    assert plan_profile._tp_compute(pb.StepReport(spans=report.spans), [f]) == []  # unmetered: no calls to subtract
    # a step whose backward started its bucket reductions (data parallel, overlapped): that
    # backward's calls are among the step's and cannot leave with its span, so no measure
    # (taking the span alone out, a tiny model's shard computed in negative time)
    assert plan_profile._tp_compute(report, [f], {"B0.0"}) == []
    # nor is a compute of no time or less, whatever made it
    negative = dict(seen[0], seconds=-0.01)
    assert fitting.fit([negative, {"kind": "forward", "amount": 1e9, "seconds": 0.01},
                        {"kind": "backward", "amount": 1e9, "seconds": 0.02}], "cpu", laws.links,
                       "synthetic").tp_compute_factor is None
    fitted = fitting.fit(seen + [{"kind": "forward", "amount": 1e9, "seconds": laws.forward.seconds(1e9)},
                                 {"kind": "forward", "amount": 2e9, "seconds": laws.forward.seconds(2e9)},
                                 {"kind": "backward", "amount": 1e9, "seconds": laws.backward.seconds(1e9)},
                                 {"kind": "backward", "amount": 2e9, "seconds": laws.backward.seconds(2e9)}],
                         "cpu", laws.links, "synthetic")
    assert fitted.tp_compute_factor == pytest.approx(1.5)
    base = load_config("", SMALL + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                    "parallel.microbatches=2"])
    for tp in (1, 2):
        config = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tp=tp))
        plain = layout_costs(config, dataclasses.replace(fitted, tp_compute_factor=None))
        stretched = layout_costs(config, fitted)
        compute = [x - plain.tp_collective_s for x in plain.forward_s]
        expected = [c * (1.5 if tp > 1 else 1.0) + plain.tp_collective_s for c in compute]
        assert stretched.forward_s == pytest.approx(expected)


def test_the_update_is_an_overhead_and_a_rate_fitted_without_its_wait_for_the_slowest_rank():
    """An update may cost more than its parameters' share (here 1.6M, 3.2M and 6.4M
    parameters take 7.5, 13 and 21 ms): a line through them, where one rate per
    parameter priced the smaller ones low, a ZeRO shard's or a pipeline rank's against a
    data-parallel replica's whole update. A rank's update span also holds its wait in the gradient norm's all-reduce for
    the slowest rank (the world group's calls): taken out where calls are timed, it
    prices no update; sequence parallelism's update, which sums gradients over the tensor
    group, is no observation."""
    updates = [{"kind": "update", "amount": n, "seconds": s}
               for n, s in ((1.6e6, 7.5e-3), (3.2e6, 13e-3), (6.4e6, 21e-3)) for _ in range(3)]
    computes = [{"kind": k, "amount": a, "seconds": a / 1e9} for k in ("forward", "backward") for a in (1e9, 2e9)]
    fitted = fitting.fit(computes + updates, "cpu", profile().links, "synthetic")
    line = fitting.fit_line([(o["amount"], o["seconds"]) for o in updates])
    assert fitted.update_overhead_s == pytest.approx(line.overhead_s) and fitted.update_overhead_s > 2e-3
    assert fitted.update_s_per_param == pytest.approx(1 / line.rate)
    whole = fitted.update_overhead_s + fitted.update_s_per_param * 6.4e6
    assert whole == pytest.approx(21e-3, rel=0.05)
    # one size measured (a single server's profile): a rate through the origin, as before
    single = fitting.fit(computes + updates[3:6], "cpu", profile().links, "synthetic")
    assert (single.update_overhead_s, single.update_s_per_param) == (0.0, pytest.approx(13e-3 / 3.2e6))
    assert fitting.fit(computes, "cpu", profile().links, "synthetic").update_s_per_param == 0.0
    # layout_costs prices each rank's update with it
    config = load_config("", SMALL + ["parallel.dp=2", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                      "parallel.microbatches=2"])
    held = sum(chunk_parameters(config, c) for c in partition(8, 1, 1, "1f1b"))
    assert layout_costs(config, fitted).update_s == pytest.approx(
        [fitted.update_overhead_s + fitted.update_s_per_param * held])
    # a ZeRO shard steps half the parameters, its overhead whole; ZeRO-1 adds its gather
    zero3 = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, zero=3))
    assert layout_costs(zero3, fitted).update_s == pytest.approx(
        [fitted.update_overhead_s + fitted.update_s_per_param * held / 2])
    # updates of no time (a --profile file's) are no observation: no division by a zero slope
    assert fitting.fit(computes + [dict(o, seconds=0.0) for o in updates], "cpu", profile().links,
                       "synthetic").update_s_per_param == 0.0
    # the traced update less its world calls
    pipelined = load_config("", SMALL + ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
                                         "parallel.microbatches=2"])
    trace = pb.StepTrace(
        ranks=[pb.RankInfo(rank=r, coordinates=pb.Coordinates(pp=r)) for r in (0, 1)],
        reports=[pb.StepReport(rank=r, spans=[pb.ActionSpan(action="OPT", kind="update", start_seconds=1.0,
                                                            end_seconds=1.0 + 0.01 + wait)],
                               comm=[pb.CommStat(op="all_reduce", group="world", seconds=wait, bytes=8, calls=1)])
                 for r, wait in ((0, 0.001), (1, 0.09))])
    seen = [o for o in plan_profile.observe(trace, pipelined) if o["kind"] == "update"]
    assert [o["seconds"] for o in seen] == [pytest.approx(0.01), pytest.approx(0.01)]
    untimed = [o for o in plan_profile.observe(trace, pipelined, calls_timed=False) if o["kind"] == "update"]
    assert [o["seconds"] for o in untimed] == [pytest.approx(0.011), pytest.approx(0.1)]  # a GPU's: as spanned
    sp = load_config("", SMALL + ["parallel.tp=2", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                  "parallel.microbatches=2", "parallel.sequence_parallel=true"])
    one = pb.StepTrace(ranks=[pb.RankInfo(rank=0, coordinates=pb.Coordinates(pp=0))], reports=trace.reports[:1])
    assert [o for o in plan_profile.observe(one, sp) if o["kind"] == "update"] == []
    assert [o for o in plan_profile.observe(one, dataclasses.replace(
        sp, parallel=dataclasses.replace(sp.parallel, sequence_parallel=False))) if o["kind"] == "update"] != []


def test_shape_jobs_worked_example():
    need = plan_profile.ChunkNeed
    needs = [need(3, True, False, 1, False), need(2, False, False, 1, False),
             need(3, False, True, 1, False), need(8, True, True, 1, False)]
    jobs = plan_profile.shape_jobs(needs, 2)
    assert [(pp, job.dp, job.schedule, job.vpp, job.layers) for pp, job in jobs] == [
        (1, 2, "1f1b", 1, (8,)), (2, 1, "interleaved-1f1b", 2, (3, 2, 1, 3))]
    # one server runs only the shape that holds both ends; four replicate each job
    assert [(job.dp, job.layers) for _, job in plan_profile.shape_jobs(needs, 1)] == [(1, (8,))]
    assert [job.dp for _, job in plan_profile.shape_jobs(needs, 4)] == [4, 2]
    # split backwards run under the zero-bubble schedules, and never with recompute
    split = plan_profile.shape_jobs([need(3, True, False, 2, True), need(4, False, True, 2, True)], 2)
    assert [(pp, job.schedule, job.layers, job.recompute, job.rows) for pp, job in split] == [
        (2, "zb-h1", (3, 4), "none", 2)]


def test_every_shape_job_is_a_valid_config_holding_its_shapes():
    """Each job's chunks are the needed shapes (one-layer fillers beside them), and its
    settings pass the config's rules."""
    config = load_config("", SMALL)
    setup = plan_profile.profile_setup(config, "cpu", None)
    needs = plan_profile.untimed_shapes([cfg for _, cfg in valid_configs(config, 4, 4)[0]], profile())
    assert {n.tp for n in needs} == {1, 2, 4}
    wanted = {(costs_module.chunk_shape(cfg, chunk, rows_of(cfg)), cfg.parallel.schedule in ("zb-h1", "zbv"))
              for _, cfg in valid_configs(config, 4, 4)[0] for chunk in chunks_of(cfg)}
    covered = set()
    for pp, job in plan_profile.shape_jobs(needs, 4):
        cfg = load_config("", plan_profile._job_overrides(setup, pp, job))
        assert cfg.train.recompute == "none" and cfg.parallel.world_size == 4
        # the shapes the job's spans are recorded under (observe), as the plans ask for them
        covered |= {(costs_module.chunk_shape(cfg, chunk, rows_of(cfg)), cfg.parallel.schedule in ("zb-h1", "zbv"))
                    for chunk in chunks_of(cfg)}
    assert wanted <= covered
    # two servers run no tensor group of four, nor a pipeline of tensor pairs
    assert all(job.tp * pp <= 2 for pp, job in plan_profile.shape_jobs(needs, 2))


def test_a_timed_shape_is_priced_at_what_it_took():
    """Shape observations fit DeviceProfile.shapes (the lower quartile, once timed often
    enough); a chunk of that shape is then priced at it, slowdown included, any rerun on
    top, and the laws price the rest: the halves it was not timed in, other shapes,
    tensor shards."""
    config = load_config("", SMALL + ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
                                      "parallel.microbatches=2", "parallel.dp=1", "parallel.tp=1"])
    chunks = partition(8, 2, 1, "1f1b")
    key = costs_module.chunk_shape(config, chunks[0], 8)
    assert key == f"4 layers + embedding, 8 rows, {chunk_forward_flops(config, chunks[0], 8):.6g} FLOPs"
    base = profile()
    seen = [{"kind": "shape:forward", "shape": key, "amount": 1.0, "seconds": s} for s in (0.5, 0.1, 0.2, 0.3)]
    seen += [{"kind": "shape:backward", "shape": key, "amount": 1.0, "seconds": s} for s in (0.4, 0.4)]
    fitted = fitting.fit(base_observations() + seen, "cpu", base.links, "test")
    assert fitted.shapes == {key: {"forward": pytest.approx(0.125)}}  # two backwards: not enough
    laws = layout_costs(config, dataclasses.replace(fitted, shapes={}), slowdown=2.0)
    timed = layout_costs(config, fitted, slowdown=2.0)
    assert timed.forward_s[0] == pytest.approx(0.25)
    assert timed.backward_s[0] == laws.backward_s[0] and timed.forward_s[1] == laws.forward_s[1]
    # recompute reruns on top of what the shape took, its forward's arithmetic again
    full = dataclasses.replace(config, train=dataclasses.replace(config.train, recompute="full"))
    rerun = layout_costs(full, fitted, slowdown=2.0)
    assert costs_module.chunk_shape(full, chunks[0], 8) == key and rerun.forward_s[0] == timed.forward_s[0]
    arithmetic = chunk_forward_flops(config, chunks[0], 8) / fitted.forward.rate
    assert rerun.backward_s[0] == pytest.approx(timed.backward_s[0] + 2 * arithmetic)
    # a tensor pair's chunk is its own shape: its spans hold the group's calls
    pair = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tp=2))
    assert costs_module.chunk_shape(pair, chunks[0], 8).endswith(", tp2")
    # the plan's other shapes are still untimed; this one only for its backward
    needs = plan_profile.untimed_shapes([config], fitted)
    assert [(n.layers, n.embedding, n.head, n.rows) for n in needs] == [(4, True, False, 8), (4, False, True, 8)]
    # On a GPU, 1F1B's blocks run compiled (train.compile=auto) and zb-h1's eager: a shape
    # timed one way is not the other's, and a CPU's shapes are never compiled
    gpu = dataclasses.replace(fitted, device="cuda (NVIDIA H100 80GB HBM3)")
    zb = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, schedule="zb-h1"))
    assert costs_module.compiled_on(config, gpu.device) and not costs_module.compiled_on(zb, gpu.device)
    assert not costs_module.compiled_on(config, "cpu")
    assert layout_costs(config, gpu, slowdown=2.0).forward_s[0] == laws.forward_s[0]  # the eager timing is not used
    compiled_key = costs_module.chunk_shape(config, chunks[0], 8, compiled=True)
    assert compiled_key == key + ", compiled"
    gpu_timed = dataclasses.replace(gpu, shapes={compiled_key: {"forward": 0.125}})
    assert layout_costs(config, gpu_timed, slowdown=2.0).forward_s[0] == pytest.approx(0.25)
    # A GPU profile written before shape keys told compiled from eager is read without its
    # shape timings (they may mix the two); a CPU's, or a current one, keeps them
    old_gpu = {k: v for k, v in gpu.to_json().items() if k != "shape_keys"}
    assert DeviceProfile.from_json(old_gpu).shapes == {} and not any(
        o["kind"].startswith("shape:") for o in DeviceProfile.from_json(old_gpu).observations)
    assert DeviceProfile.from_json(gpu.to_json()).shapes == gpu.shapes != {}
    old_cpu = {k: v for k, v in fitted.to_json().items() if k != "shape_keys"}
    assert DeviceProfile.from_json(old_cpu).shapes == fitted.shapes
    # zb-h1's eager blocks take the eager timing, and the laws where only the compiled one exists
    assert layout_costs(zb, gpu, slowdown=2.0).forward_s[0] == pytest.approx(0.25)
    assert layout_costs(zb, gpu_timed, slowdown=2.0).forward_s[0] == laws.forward_s[0]


def base_observations() -> list[dict]:
    """Forwards and backwards at two sizes: enough for the laws."""
    return [{"kind": kind, "amount": amount, "seconds": scale * (1e-3 + amount / 1e9)}
            for kind, scale in (("forward", 1), ("backward", 2)) for amount in (1e6, 4e6)]


def test_a_layout_invalid_as_given_is_planned_anew(tmp_path, capsys):
    """`interleaf plan` sets the config's layout aside (here pp*vpp=4 chunks of a 3-layer
    model, which no job could run): the plans are of the model and batch alone. A bad
    value beyond the layout is still refused, naming it."""
    from interleaf.clients.cli import main

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile().to_json()))
    args = ["plan", "--set", "model.n_layers=3", "--set", "parallel.pp=2", "--set", "parallel.vpp=2",
            "--servers", "2", "--profile", str(path), "--json"]
    assert main(args) == 0
    plans = json.loads(capsys.readouterr().out)
    for plan in plans:  # each a layout the model runs
        load_config("", ["model.n_layers=3"] + plan_command.overrides(plan))
    assert main(args[:-1] + ["--set", "train.global_batch=0", "--json"]) == 2
    assert "train.global_batch=0" in capsys.readouterr().err
    # a valid layout is kept while planning, so settings that need it still hold
    elastic = ["--set", "parallel.elastic=true", "--set", "parallel.dp=2", "--set", "parallel.pp=1",
               "--set", "parallel.vpp=1", "--set", "parallel.schedule=1f1b"]
    assert main(["plan", *elastic, "--servers", "2", "--profile", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
    # run --plan auto cannot count local servers from a layout set aside
    assert main(["run", "--plan", "auto", "--set", "model.n_layers=3"]) == 2
    assert "give --local N" in capsys.readouterr().err


def rows_of(config) -> int:
    return config.train.global_batch // (config.parallel.dp * config.parallel.microbatches)


def chunks_of(config) -> list:
    p = config.parallel
    return partition(config.model.n_layers, p.pp, p.vpp, p.schedule, p.layers)


def test_too_little_memory_for_few_microbatches_plans_more_of_them():
    """Only microbatches of one sample fit: the search goes past 8*pp*vpp of them rather
    than report that nothing fits (plan_command.run_search), and says why at pp=1."""
    config = load_config("", SMALL + ["model.d_model=256", "model.seq_len=256", "train.global_batch=64"])

    def need(microbatches: int) -> int:
        job = apply(config, Layout(1, 1, 1, 1, "1f1b", microbatches, 0, "full"))
        return max(needed_bytes(job, programs_for(job)))

    assert need(64) < need(8)
    cluster = Cluster(1, (need(64) + need(32)) // 2, 1)
    assert not search(config, cluster, profile(), top=3).plans
    report = plan_command.run_search(config, cluster, profile(), 3)
    assert report.plans and all(p.layout.microbatches > 8 for p in report.plans)  # past 8*pp*vpp
    assert all(p.admission_bytes <= cluster.memory_bytes for p in report.plans)
    best = report.plans[0]
    why = "\n".join(explain(best))
    assert f"{best.layout.microbatches} microbatches, no pipeline" in why and "fill and drain" not in why


def test_a_search_cut_by_its_time_budget_says_what_it_left_unweighed():
    config = load_config("", SMALL)
    report = search(config, Cluster(4, 2_000_000_000, 4), profile(), top=3, budget_s=0.0)
    assert report.stopped_by_time and report.unvisited == report.candidates - report.refused_by_rules
    assert report.bounded_out == 0
    text = plan_command.report_text(dataclasses.replace(report, plans=search(config, Cluster(4, 2 * GIB, 4),
                                                                               profile(), top=1).plans),
                                    Cluster(4, 2 * GIB, 4), profile(), config)
    assert f"{report.unvisited} not weighed: the search stopped at its time budget" in text


def test_what_users_tripped_on_is_planned_or_refused_clearly(tmp_path, capsys):
    """Each case a user met: evaluation rows tied to the microbatch; a server count no
    layout uses; layout settings given and replaced (said); a GPU's profile planned on
    a machine without a GPU; --local 0; --servers-per-host without --servers (a
    coordinator's servers have hosts); settings valid as given that one server cannot
    hold (uneven layers, sequence parallelism, elastic); float8 on CPU servers refused before anything
    starts, by `run --plan auto` and by `plan`."""
    from interleaf.clients.cli import main

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile().to_json()))
    plan = ["plan", "--servers", "4", "--profile", str(path), "--json"]
    evaluated = ["--set", "eval.every=10", "--set", "eval.samples=4"]
    assert main(plan + evaluated) == 0
    for chosen in json.loads(capsys.readouterr().out):  # rows of a microbatch divide eval.samples
        load_config("", ["eval.every=10", "eval.samples=4"] + plan_command.overrides(chosen))

    assert main(["plan", "--servers", "5", "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no layout uses all 5 servers" in err and "train.global_batch=16" in err and "GiB" not in err

    assert main(plan + ["--set", "parallel.schedule=zbv", "--set", "parallel.zero=3", "--set", "parallel.dp=4"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)[0]["parallel"]["schedule"] != "zbv"
    assert "of the settings given it replaced: parallel.schedule zbv -> " in captured.err
    # a layout is chosen afresh, but a value no layout takes is a mistake, refused as
    # everywhere else (it was replaced silently: parallel.dp=abc -> 4)
    for given, message in (("parallel.dp=abc", "parallel.dp='abc' must be int"),
                           ("parallel.dp=1.5", "parallel.dp=1.5 must be int"),
                           ("parallel.tp=-3", "parallel.tp=-3 must be at least 1"),
                           ("parallel.zero=7", "parallel.zero=7 must be 0, 1, 2 or 3"),
                           ("parallel.schedule=zb-v", "parallel.schedule='zb-v' must be one of gpipe, 1f1b"),
                           ("parallel.sequence_parallel=maybe", "parallel.sequence_parallel='maybe' must be true or"),
                           ("parallel.layers=a,b", "parallel.layers='a,b' must be a list of whole numbers"),
                           ("parallel.layers=3,0", "parallel.layers=[3, 0] must give every chunk at least 1 layer"),
                           ("parallel.vpp=100", "parallel.vpp=100 must be at most 64")):
        assert main(plan + ["--set", given]) == 2, given
        captured = capsys.readouterr()
        assert message in captured.err and not captured.out, (given, captured.err)
    config = tmp_path / "zbv.toml"
    config.write_text('[parallel]\nschedule = "zb-v"\n')
    assert main(["plan", str(config)] + plan[1:]) == 2
    assert "parallel.schedule='zb-v' must be one of" in capsys.readouterr().err
    # run --plan auto names the value to mend, not a rule of the layout it sets aside
    assert main(["run", "--local", "2", "--plan", "auto", "--set", "parallel.schedule=zbv", "--set",
                 "parallel.vpp=1", "--set", "parallel.zero=7"]) == 2
    assert "parallel.zero=7 must be 0, 1, 2 or 3" in capsys.readouterr().err
    config.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")  # too deep for tomllib: one line, no traceback
    assert main(["plan", str(config)] + plan[1:]) == 2
    err = capsys.readouterr().err
    assert "nests arrays or inline tables too deeply" in err and "Traceback" not in err

    gpu = dataclasses.replace(profile(), device="cuda (NVIDIA H100 80GB HBM3)")
    gpu_path = tmp_path / "gpu.json"
    gpu_path.write_text(json.dumps(gpu.to_json()))
    assert main(["plan", "--servers", "8", "--device", "cuda", "--profile", str(gpu_path), "--server-memory",
                 str(80 * GIB), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)

    assert main(["run", "--local", "0", "--plan", "auto"]) == 2
    assert "--local 0 must be at least 1" in capsys.readouterr().err
    assert main(["plan", "--servers-per-host", "4", "--coordinator", "127.0.0.1:1"]) == 2
    assert "--servers-per-host 4 describes a cluster given by --servers" in capsys.readouterr().err
    # Only microbatches past 8·pp·vpp meet eval.samples=4 at 64 samples a step on one server:
    # the search's second pass finds them, where memory refused nothing
    assert main(["plan", "--servers", "1", "--profile", str(path), "--json", "--set", "eval.every=1", "--set",
                 "eval.samples=4", "--set", "train.global_batch=64", "--set", "model.n_layers=2"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["parallel"]["microbatches"] >= 16
    assert main(plan + ["--server-memory", str(2**50 + 1)]) == 2
    assert f"--server-memory {2**50 + 1} must be at most {2**50} bytes (1 PiB) a server" in capsys.readouterr().err
    assert main(["plan", "--device", "cuda", "--coordinator", "127.0.0.1:1"]) == 2
    assert "--device cuda picks where a cluster given by --servers is profiled" in capsys.readouterr().err
    # Every layout refused by a rule: that rule, not memory, named (the float8 widths on GPUs)
    assert main(["plan", "--servers", "4", "--profile", str(gpu_path), "--server-memory", str(80 * GIB),
                 "--set", "train.precision=fp8", "--set", "model.d_model=120"]) == 2
    err = capsys.readouterr().err
    assert "layouts of 4 servers breaks a rule; the first: train.precision='fp8'" in err, err
    assert "model.d_model=120 is not" in err and "fits" not in err
    # Memory below a GiB in bytes or MiB, and admission's reserve named where it alone is more
    assert main(plan[:-1] + ["--server-memory", "1000"]) == 2
    err = capsys.readouterr().err
    assert "fits 1,000 bytes each" in err and "MiB" in err and "runtime reserve alone is 512.0 MiB" in err, err
    # A global batch of 9 sets elastic's placeholder replicas to 3, not to 2, which does not divide it
    assert main(plan + ["--set", "parallel.elastic=true", "--set", "train.global_batch=9"]) == 2
    assert "breaks a rule; the first: parallel.elastic=true needs parallel.dp>=2" in capsys.readouterr().err  # dp=1
    assert main(["plan", "--servers", "3", "--profile", str(path), "--json", "--set", "parallel.elastic=true",
                 "--set", "train.global_batch=9"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["parallel"]["dp"] == 3
    # Valid settings that need more than one server (an uneven split, sequence
    # parallelism, elastic replicas), and blocks rerun whole, which the plan's recompute
    # may not keep: planned, not a traceback from the proxy's one-server config.
    for given in (["parallel.layers=1,1,1,1"], ["parallel.tp=2", "parallel.pp=1", "parallel.vpp=1",
                                                 "parallel.schedule=1f1b", "parallel.sequence_parallel=true"],
                  ["parallel.elastic=true"], ["parallel.elastic=true", "parallel.dp=2", "parallel.pp=2",
                                               "parallel.vpp=1", "parallel.schedule=1f1b"],
                  ["train.recompute_layers=2"]):
        sets = [arg for setting in given for arg in ("--set", setting)]
        assert main(plan + sets) == 0, given
        chosen = json.loads(capsys.readouterr().out)
        for plan_json in chosen:
            planned = load_config("", given + plan_command.overrides(plan_json))
            assert planned.parallel.elastic == ("parallel.elastic=true" in given)
            assert planned.parallel.world_size == 4
    for refused in (["run", "--local", "2", "--device", "cpu", "--plan", "auto", "--set", "train.precision=fp8"],
                    ["plan", "--servers", "2", "--device", "cpu", "--set", "train.precision=fp8"]):
        assert main(refused) == 2
        err = capsys.readouterr().err
        assert "train.precision='fp8' needs stage servers on GPUs" in err and "starting a coordinator" not in err


def test_float8_plans_for_gpus_multiply_multiples_of_sixteen():
    """Float8 tensor cores multiply multiples of 16 only (plan.check_fp8): a GPU
    cluster's plans keep every microbatch's tokens such a multiple (a 24-token sequence:
    one sample a microbatch is refused), which the check before planning leaves to them;
    the profile's proxy of a 7B Llama keeps its widths such multiples, and GPT-2 XL's
    proxy (25 heads) is a model the config takes."""
    from interleaf.coordinator.plan import check_fp8

    fp8 = SMALL + ["model.seq_len=24", "model.d_model=64", "train.precision=fp8", "train.global_batch=8"]
    config = load_config("", fp8 + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                    "parallel.microbatches=8"])
    check_fp8(config, ["cuda:0"], tokens=False)  # the layout is the plan's to choose
    with pytest.raises(ConfigError, match="a microbatch's tokens\\)=24 is not"):
        check_fp8(config, ["cuda:0"])
    gpu = Cluster(1, 64 * GIB, 1, device_type="cuda")
    report = search(config, gpu, profile(), top=20)
    assert report.plans and report.refused_by_rules >= 1
    assert all(rows_of(p.config) * 24 % 16 == 0 for p in report.plans)
    assert 8 not in {p.layout.microbatches for p in report.plans}

    llama = load_config("", ["model.arch=llama", "model.n_layers=32", "model.d_model=4096", "model.n_heads=32",
                             "model.n_kv_heads=8", "model.ffn_hidden=11008", "model.seq_len=4096",
                             "model.vocab_size=32000", "train.precision=fp8", "parallel.pp=1", "parallel.vpp=1",
                             "parallel.schedule=1f1b"])
    proxy = load_config("", plan_profile._job_overrides(plan_profile.profile_setup(llama, "cuda (NVIDIA H100)", None), 1,
                                                         plan_profile.ProfileJob("1f1b", 1, plan_profile.SMALL_ROWS)))
    assert proxy.model.d_model < 4096
    check_fp8(proxy, ["cuda:0"])
    xl = load_config("", ["model.n_layers=48", "model.d_model=1600", "model.n_heads=25", "model.seq_len=1024"])
    assert plan_profile.profile_model(xl, "cpu", None)["d_model"] < 1600
    load_config("", [f"model.{k}={v}" for k, v in plan_profile.profile_model(xl, "cpu", None).items()
                     if k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len")])


def _traced_step(config, seconds: dict[str, float], step_seconds: float) -> pb.StepTrace:
    """A traced step of `config` (dp = tp = 1): every action of each pipeline rank's
    program spanned for `seconds` of its kind (CATEGORIES), each rank's step
    `step_seconds` long."""
    programs = programs_for(config)
    reports = []
    for rank, program in enumerate(programs):
        spans, clock = [], 0.0
        for action in program:
            kind = CATEGORIES.get(action.kind)
            if kind in seconds:
                spans.append(pb.ActionSpan(action=str(action), kind=kind, start_seconds=clock,
                                           end_seconds=clock + seconds[kind]))
                clock += seconds[kind]
        reports.append(pb.StepReport(rank=rank, step_seconds=step_seconds, spans=spans))
    return pb.StepTrace(ranks=[pb.RankInfo(rank=r, coordinates=pb.Coordinates(pp=r)) for r in range(len(programs))],
                        programs=[pb.PipelineProgram(pipeline_rank=r, actions=[pb.Action(text=str(a)) for a in program])
                                  for r, program in enumerate(programs)],
                        reports=reports)


def test_pipeline_messages_are_priced_as_the_servers_steps_show_them():
    """A message's latency is the one at which the simulator, replaying a pipeline's
    traced step (its computes, postings and updates as they took), takes what the step
    took; a rank's posting of each send, receive and exchange is a law of the bytes it
    posts, and the planner charges it on the rank: the bare probe priced a 262 KB
    message at about 0.12 ms, the servers' steps at about 1 ms, and the layouts of the most
    messages were predicted fast (bench/results/planner-*.json)."""
    config = load_config("", SMALL + ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved-1f1b",
                                      "parallel.microbatches=4"])
    seconds = {"forward": 0.010, "backward": 0.020, "update": 0.002, "send": 0.0004, "recv": 0.0002,
               "exchange": 0.0006}
    took = replay_by_latency(_traced_step(config, seconds, 0.0))(0.003).makespan_s
    assert took > replay_by_latency(_traced_step(config, seconds, 0.0))(0.0).makespan_s  # messages on the critical path
    trace = _traced_step(config, seconds, took)
    assert plan_profile.message_latency(trace, config) == pytest.approx(0.003, abs=1e-6)
    # a step the ranks' own work explains needs no latency; a stalled one, what explains it
    assert plan_profile.message_latency(_traced_step(config, seconds, 0.1), config) == 0.0
    stalled = _traced_step(config, seconds, 100.0)
    assert replay_by_latency(stalled)(plan_profile.message_latency(stalled, config)).makespan_s == pytest.approx(
        100.0)
    # only a pipeline of single servers: another group's calls would be taken for the messages'
    for other in ("parallel.dp=2", "parallel.tp=2"):
        assert plan_profile.message_latency(trace, load_config("", [*SMALL, *_parallel_sets(config), other])) is None

    size = message_bytes(config)
    seen = plan_profile.observe_messages(trace, config)
    postings = [o for o in seen if o["kind"] == fitting.POSTING_OBSERVED]
    spans = [s for r in trace.reports for s in r.spans if s.kind in ("send", "recv", "exchange")]
    assert len(postings) == len(spans) > 0
    assert {o["amount"] for o in postings} >= {size, 2 * size}  # a lone message, an exchange of two
    assert [o for o in seen if o["kind"] == fitting.MESSAGE_OBSERVED] == [
        {"kind": "message", "amount": size, "seconds": pytest.approx(0.003, abs=1e-6)}]
    # a GPU's calls are not timed: neither its postings nor its messages are observed
    assert not [o for o in plan_profile.observations(trace, config, "cuda")
                if o["kind"] in (fitting.POSTING_OBSERVED, fitting.MESSAGE_OBSERVED)]

    # the fit: the probe's bandwidth, the steps' median latency beyond it; posting a line
    computes = [{"kind": k, "amount": a, "seconds": 0.001 + a / 1e9} for k in ("forward", "backward")
                for a in (1e6, 4e6)]
    probe = profile(latency_s=1e-4, link_rate=1e9).links
    fitted = fitting.fit(computes + seen, "cpu", probe, "synthetic")
    assert fitted.links["p2p"] == Law(pytest.approx(0.003 - size / 1e9), 1e9)
    # lone sends (0.4 ms) and receives (0.2 ms) move messages of one size: priced at their
    # mean, what a step's postings of that size cost the rank together, and an exchange
    # of two at its own
    assert {size, 2 * size} <= {o["amount"] for o in postings}
    two_sizes = fitting.fit(computes + [o for o in postings if o["amount"] <= 2 * size], "cpu", probe, "synthetic")
    lone = [o["seconds"] for o in postings if o["amount"] == size]
    assert two_sizes.posting.seconds(size) == pytest.approx(sum(lone) / len(lone))
    assert 2e-4 < sum(lone) / len(lone) < 4e-4
    assert two_sizes.posting.seconds(2 * size) == pytest.approx(6e-4)
    # postings of no bytes or no time (a --profile file's) are no observation: no division by zero
    assert fitting.fit(computes + [dict(o, amount=0) for o in postings], "cpu", probe, "synthetic").posting is None
    assert fitting.fit(computes, "cpu", probe, "synthetic").posting is None  # nothing posted: free
    # charged on the rank: the same profile without its posting predicts a shorter step
    programs = programs_for(config)
    posted = simulate_layout(config, programs, layout_costs(config, fitted)).makespan_s
    free = simulate_layout(config, programs, layout_costs(config, dataclasses.replace(fitted, posting=None)))
    assert posted > free.makespan_s
    costs = layout_costs(config, fitted)
    assert costs.posting_s(2) == pytest.approx(fitted.posting.seconds(2 * size))
    # servers sharing cores computed and posted slower; the messages' latency is a wait, kept
    slowed = plan_profile.unslowed(computes[:1] + seen, 2.0)
    assert [o["seconds"] for o in slowed] == [computes[0]["seconds"] / 2] + [
        o["seconds"] if o["kind"] == fitting.MESSAGE_OBSERVED else o["seconds"] / 2 for o in seen]
    # a profile file keeps it; one written before it reads as none
    assert DeviceProfile.from_json(json.loads(json.dumps(fitted.to_json()))).posting == fitted.posting
    older = {k: v for k, v in fitted.to_json().items() if k != "posting"}
    assert DeviceProfile.from_json(older).posting is None
    with pytest.raises(ValueError, match="posting.rate=0 must be a finite number > 0"):
        DeviceProfile.from_json(dict(older, posting={"overhead_s": 0.0, "rate": 0}))


def test_a_messages_latency_is_found_without_the_updates_wait_for_the_slowest_rank():
    """Untied, the last stage finishes its backwards first and its update waits in the
    gradient norm's all-reduce for the first stage, whose 4 ms of the executor's work
    between actions no span holds. Replayed with that wait, the last stage's update
    would end the step at the latency its own path needs (3 ms); less it, the latency
    is the one the first stage's path needs, as it is where no wait was recorded."""
    config = load_config("", SMALL + ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved-1f1b",
                                      "parallel.microbatches=4", "model.tie_embeddings=false"])
    seconds = {"forward": 0.010, "backward": 0.020, "update": 0.002, "send": 0.0004, "recv": 0.0002,
               "exchange": 0.0006}
    exact = replay_by_latency(_traced_step(config, seconds, 0.0))(0.003).timeline
    first, last = exact[0][-1].end, exact[1][-1].end
    assert first > last  # the last stage's update is done first
    took = first + 0.004
    unrecorded = _traced_step(config, seconds, took)
    waited = _traced_step(config, seconds, took)
    wait = took - last
    update = next(span for span in waited.reports[1].spans if span.kind == "update")
    update.end_seconds += wait
    waited.reports[1].comm.append(pb.CommStat(op="all_reduce", group="world", seconds=wait, bytes=8, calls=1))
    found = plan_profile.message_latency(unrecorded, config)
    assert found == pytest.approx(0.003 + 0.004 / 10, abs=1e-6)  # ten messages on the first stage's path
    assert plan_profile.message_latency(waited, config) == pytest.approx(found, abs=1e-6)


def _parallel_sets(config) -> list[str]:
    """The pipeline settings of `config` as --set overrides."""
    p = config.parallel
    return [f"parallel.pp={p.pp}", f"parallel.vpp={p.vpp}", f"parallel.schedule={p.schedule}",
            f"parallel.microbatches={p.microbatches}"]
