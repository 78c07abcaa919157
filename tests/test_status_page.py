"""The coordinator's status page, rendered by a real headless Chromium: its servers, its
jobs, the newest job's loss curve and its last executed timeline; and, with no cluster,
its figures drawn once for what they show."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import urllib.request

import pytest

from tests.conftest import TINY, run_job
from interleaf.coordinator import status_page
from interleaf.coordinator.config import load_config
from interleaf.coordinator.jobs import JobRecord
from interleaf.coordinator.registry import Registry
from interleaf.protos import interleaf_pb2 as pb
from interleaf.common.http import Request

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LAYOUT = ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b", "train.steps=4"]


def chromium(*args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM, "Debian's chromium is needed (.ci/run installs it)"
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--hide-scrollbars", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def finished_job(client):
    return run_job(client, TINY + LAYOUT)


def test_status_json_lists_servers_and_the_job(cluster, client, finished_job):
    status, steps = finished_job
    with urllib.request.urlopen(f"http://{cluster.http_address}/status.json", timeout=10) as reply:
        data = json.load(reply)
    assert len(data["servers"]) == cluster.count
    assert {s["address"] for s in data["servers"]} == {s.address for s in client.servers()}
    newest = data["jobs"][0]
    assert (newest["job_id"], newest["state"], newest["step"]) == (status.job_id, "SUCCEEDED", 4)
    assert data["losses"][status.job_id] == [[s.step + 1, s.loss] for s in steps]


def test_page_renders_in_chromium(cluster, client, finished_job, tmp_path):
    status, steps = finished_job
    url = f"http://{cluster.http_address}/"
    dom = chromium("--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    text = dom.stdout
    assert f"Interleaf coordinator <code>{cluster.address}</code>" in text
    assert f"Stage servers ({cluster.count})" in text
    for server in client.servers():
        assert f"<td>{server.address}</td>" in text
    row = re.search(rf"<tr><td>{status.job_id}</td><td class=\"state SUCCEEDED\">SUCCEEDED</td><td>4</td>"
                    rf"<td>4</td><td>{round(steps[-1].loss, 4)}</td>", text)
    assert row, "the job's row (id, state, steps, loss) is missing"
    curve = text[text.index("<h2>Loss curve"):text.index("<h2>Last executed timeline")]
    assert f"Loss curve of {status.job_id}" in curve and "<svg" in curve
    timeline = text[text.index("<h2>Last executed timeline"):]
    assert "<svg" in timeline, "the job's traced step is not drawn"

    shot = tmp_path / "status.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1280,1800", url)
    assert taken.returncode == 0 and shot.stat().st_size > 20_000, taken.stderr[-2000:]


def test_figures_are_drawn_once_for_what_they_show(monkeypatch):
    """Reloads redraw nothing; a new step redraws the loss curve, a step traced anew (a
    re-run after a recovery: other start times) the timeline."""
    from matplotlib.figure import Figure

    drawn = {"curve": 0, "timeline": 0}
    curve = status_page.loss_curve_svg

    def count_curve(job):
        drawn["curve"] += 1
        return curve(job)

    def draw(trace):
        drawn["timeline"] += 1
        return Figure()

    def trace(step: int, started: float):
        record.traces.add(pb.StepTrace(job_id=record.job_id),
                          [pb.StepReport(step=step, rank=0, started_unix=started)])

    monkeypatch.setattr(status_page, "loss_curve_svg", count_curve)
    record = JobRecord("job-1-00001", load_config("", TINY))
    page = status_page.routes(Registry(), lambda: [record], "127.0.0.1:1", draw)["/"]

    def reload(n: int = 3) -> None:
        for _ in range(n):
            assert page(Request("/", {}, {})).status == 200

    record.add_step(pb.StepEvent(step=0, loss=5.0))
    trace(0, 100.0)
    reload()
    assert drawn == {"curve": 1, "timeline": 1}
    record.add_step(pb.StepEvent(step=1, loss=4.0))
    reload()
    assert drawn == {"curve": 2, "timeline": 1}
    trace(0, 200.0)
    reload()
    assert drawn == {"curve": 2, "timeline": 2}


def test_the_loss_chart_and_status_json_carry_the_held_out_evaluations():
    """[eval]: the held-out loss is drawn over the training curve at the points it was
    scored, and /status.json lists it per job (an evaluation run again after a recovery
    replaces the first)."""
    record = JobRecord("job-1-00001", load_config("", TINY))
    routes = status_page.routes(Registry(), lambda: [record], "127.0.0.1:1")
    for step, loss in enumerate([5.0, 4.0, 3.5, 3.0]):
        record.add_step(pb.StepEvent(step=step, loss=loss))
        if step % 2:
            record.add_eval(pb.EvalEvent(step=step + 1, loss=loss + 0.5, perplexity=math.exp(loss + 0.5)))
    record.add_eval(pb.EvalEvent(step=4, loss=3.25))  # step 4 scored again after a recovery
    data = json.loads(routes["/status.json"](Request("/status.json", {}, {})).body)
    assert data["eval_losses"] == {"job-1-00001": [[2, 4.5], [4, 3.25]]}
    page = routes["/"](Request("/", {}, {})).body.decode()
    assert "held-out loss" in page and "training loss" in page
