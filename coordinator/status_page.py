"""The coordinator's status page, `/` on its HTTP port (like torchft's lighthouse page):
its stage servers and their state, its jobs with their progress, the newest job's loss
curve and its last executed timeline. `/status.json` is the same content as data.

The page reloads itself every few seconds. It is read-only and shows what any watcher of
a job sees; the port is unauthenticated like /metrics (docs/monitoring.md). Its two
figures are drawn once for what they show and kept (`_Figures`): a reload, by however
many viewers, redraws nothing until the job publishes an event or traces a step.
"""

from __future__ import annotations

import html
import io
import json
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable

from interleaf.coordinator.jobs import JobRecord
from interleaf.coordinator.registry import Registry
from interleaf.common.http import Request, Response, Route

REFRESH_S = 5
MAX_JOBS = 20  # the newest ones; older jobs stay reachable by id (`interleaf status`)
KEPT_FIGURES = 8  # of each kind: the page shows one, a few more keep other viewers' pages warm


def _server_rows(servers: Registry) -> list[dict]:
    return [{"server_id": s.server_id, "address": s.address, "device": s.device, "state": s.state,
             "job_id": s.job_id, "memory_gib": round(s.memory_bytes / 2**30, 1),
             "heartbeat_age_s": round(s.heartbeat_age, 1)}
            for s in sorted(servers.servers(), key=lambda s: s.address)]


def _losses(job: JobRecord) -> list[tuple[int, float]]:
    """(step from 1, loss) of the events the job keeps; a step run again after a recovery
    replaces its first run."""
    by_step = {}
    for event in list(job.events):
        if event.HasField("step"):
            by_step[event.step.step + 1] = event.step.loss
    return sorted(by_step.items())


def _eval_losses(job: JobRecord) -> list[tuple[int, float]]:
    """(steps completed, held-out loss) of the evaluations the job keeps ([eval]); one run
    again after a recovery replaces its first run."""
    by_step = {event.eval.step: event.eval.loss for event in list(job.events) if event.HasField("eval")}
    return sorted(by_step.items())


def _job_rows(jobs: Iterable[JobRecord]) -> list[dict]:
    rows = []
    for job in jobs:
        last = job.last
        rows.append({"job_id": job.job_id, "state": job.state, "step": job.step, "steps": job.config.train.steps,
                     "loss": round(last.loss, 4) if last is not None else None,
                     "tokens_per_second": round(last.tokens_per_second) if last is not None else None,
                     "reason": job.reason or job.error,
                     "layout": f"dp{job.config.parallel.dp}·tp{job.config.parallel.tp}·pp{job.config.parallel.pp}"
                               f"·vpp{job.config.parallel.vpp} {job.config.parallel.schedule} "
                               f"ZeRO-{job.config.parallel.zero}"})
    return rows


def _svg(figure) -> str:
    out = io.StringIO()
    figure.savefig(out, format="svg", bbox_inches="tight")
    text = out.getvalue()
    return text[text.index("<svg"):]  # inline: without the XML prolog and doctype


class _Figures:
    """SVGs by what they show, the newest KEPT_FIGURES: drawing one (matplotlib, and a
    simulation for a timeline) takes far longer than a GET should."""

    def __init__(self):
        self._lock = threading.Lock()
        self._svgs: OrderedDict[tuple, str] = OrderedDict()

    def get(self, key: tuple, draw: Callable[[], str]) -> str:
        with self._lock:
            if key in self._svgs:
                self._svgs.move_to_end(key)
                return self._svgs[key]
        svg = draw()  # outside the lock: two first viewers may both draw, neither waits on the other
        with self._lock:
            self._svgs[key] = svg
            while len(self._svgs) > KEPT_FIGURES:
                self._svgs.popitem(last=False)
        return svg


def _published(job: JobRecord) -> int:
    """Events the job has published, dropped ones included: its loss curve changes only with them."""
    with job._changed:
        return job.events_dropped + len(job.events)


def loss_curve_svg(job: JobRecord) -> str:
    losses = _losses(job)
    if not losses:
        return ""
    from matplotlib.figure import Figure  # imported on first draw: a coordinator without a page needs none

    figure = Figure(figsize=(6.4, 2.8), dpi=100)
    axes = figure.add_subplot()
    axes.plot([s for s, _ in losses], [loss for _, loss in losses], color="#1f77b4", linewidth=1.5,
              label="training loss")
    evaluated = _eval_losses(job)
    if evaluated:  # the held-out loss at the points it was scored, over the training curve
        axes.plot([s for s, _ in evaluated], [loss for _, loss in evaluated], color="#d62728", marker="o",
                  markersize=4, linewidth=1.0, label="held-out loss")
        axes.legend(loc="upper right", fontsize="small")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(f"{job.job_id}: loss, {job.step}/{job.config.train.steps} steps")
    axes.grid(alpha=0.3)
    return _svg(figure)


def timeline_svg(job: JobRecord, draw: Callable | None, figures: _Figures) -> str:
    """The job's newest traced step as executed, drawn by `draw(trace) -> Figure`. A
    traced step is kept as it ran; one run again after a recovery replaces it, with
    other start times, so (job, step, rank 0's start) names what is drawn."""
    trace = job.traces.get() if draw is not None else None
    if trace is None:
        return ""
    key = (job.job_id, trace.step, trace.reports[0].started_unix if trace.reports else 0.0)
    return figures.get(key, lambda: _svg(draw(trace)))


def _table(rows: list[dict], columns: list[str], state_column: str = "state") -> str:
    head = "".join(f"<th>{html.escape(c.replace('_', ' '))}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for c in columns:
            value = "" if row.get(c) is None else str(row[c])
            css = f' class="state {html.escape(value)}"' if c == state_column else ""
            cells.append(f"<td{css}>{html.escape(value)}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body) or f'<tr><td colspan={len(columns)}>none</td></tr>'}</table>"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
table { border-collapse: collapse; } td, th { padding: 0.25em 0.8em; border-bottom: 1px solid #ddd; text-align: left; }
th { background: #f3f3f3; } .state.IDLE, .state.SUCCEEDED { color: #2a7; } .state.BUSY, .state.RUNNING { color: #27c; }
.state.DEAD, .state.FAILED { color: #c33; font-weight: bold; } .state.RECOVERING { color: #d80; font-weight: bold; }
.muted { color: #777; font-size: 0.9em; }
svg { max-width: 100%; height: auto; }
"""


def render(servers: list[dict], jobs: list[dict], curve: str, timeline: str, address: str) -> str:
    newest = jobs[0]["job_id"] if jobs else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>Interleaf coordinator {html.escape(address)}</title><style>{STYLE}</style></head>
<body>
<h1>Interleaf coordinator <code>{html.escape(address)}</code></h1>
<p class="muted">{time.strftime('%Y-%m-%d %H:%M:%S')} · reloads every {REFRESH_S} s ·
<a href="/metrics">metrics</a> · <a href="/sd">service discovery</a> · <a href="/status.json">as JSON</a></p>
<h2>Stage servers ({len(servers)})</h2>
{_table(servers, ["server_id", "address", "device", "state", "job_id", "memory_gib", "heartbeat_age_s"])}
<h2>Jobs</h2>
{_table(jobs, ["job_id", "state", "step", "steps", "loss", "tokens_per_second", "layout", "reason"])}
<h2>Loss curve{f" of {html.escape(newest)}" if newest else ""}</h2>
{curve or '<p class="muted">no steps yet</p>'}
<h2>Last executed timeline</h2>
{timeline or '<p class="muted">no traced step yet</p>'}
</body></html>
"""


def routes(servers: Registry, jobs: Callable[[], Iterable[JobRecord]], address: str,
           draw_trace: Callable | None = None) -> dict[str, Route]:
    """`jobs()`: the jobs to show, any order (the newest MAX_JOBS are shown, newest first)."""

    curves, timelines = _Figures(), _Figures()

    def newest() -> list[JobRecord]:
        return sorted(jobs(), key=lambda j: int(j.job_id.split("-")[1]), reverse=True)[:MAX_JOBS]

    def page(request: Request) -> Response:
        shown = newest()
        curve = ""
        if shown:
            curve = curves.get((shown[0].job_id, _published(shown[0])), lambda: loss_curve_svg(shown[0]))
        timeline = next((svg for job in shown if (svg := timeline_svg(job, draw_trace, timelines))), "")
        body = render(_server_rows(servers), _job_rows(shown), curve, timeline, address)
        return Response(body.encode(), "text/html; charset=utf-8")

    def data(request: Request) -> Response:
        shown = newest()
        body = {"servers": _server_rows(servers), "jobs": _job_rows(shown),
                "losses": {job.job_id: _losses(job) for job in shown},
                "eval_losses": {job.job_id: _eval_losses(job) for job in shown}}
        return Response(json.dumps(body).encode(), "application/json")

    return {"/": page, "/status.json": data}
