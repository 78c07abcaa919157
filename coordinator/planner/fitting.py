"""Fitting a device profile's laws (costs.py) to timed actions: the profile jobs' and
planned jobs' traced computes, each an observation {"kind", "amount" (forward FLOPs,
parameters stepped for an update, bytes for a link's call, a posting or a message),
"seconds"}.

Worked example (tests/test_planner.py): backwards of 50 ms at 1 GFLOP and 170 ms at 4
GFLOP fit 10 ms + 25 GFLOP/s; halves of 102 and 85 ms measured beside the 170 ms one
price every split backward at 187/170 of the whole, 102/187 of it the input half.
"""

from __future__ import annotations

import statistics

from .costs import DeviceProfile, Law

LINK_OBSERVED = "link:"
"""An observation of kind "link:<kind>" is one call of that link kind: its bytes and held
seconds, between two members (costs.normalized)."""
SHAPE_OBSERVED = "shape:"
"""An observation of kind "shape:<compute kind>" is one compute of the chunk shape its
"shape" names (costs.chunk_shape): what DeviceProfile.shapes is made of."""
SHAPE_TIMINGS = 3
"""A shape's compute kind is priced at what it took once it was timed this often."""
POSTING_OBSERVED = "posting"
"""An observation of kind "posting" is a send, receive or exchange a rank posted: the
bytes of its messages, and the seconds its span took (DeviceProfile.posting)."""
MESSAGE_OBSERVED = "message"
"""An observation of kind "message" is a pipeline's traced step: the bytes of one of its
messages, and the latency at which the simulator, replaying the step's own computes,
postings and updates, takes what the step took (plan_profile.message_latency): the p2p
link's latency beyond the probe's bandwidth is their median."""


def undisturbed(seconds: list[float]) -> float:
    """What a compute costs when nothing else gets in its way: the lower quartile of its
    timings (another process on the cores only ever adds time)."""
    return statistics.quantiles(seconds, n=4)[0] if len(seconds) >= 4 else min(seconds)


def fit_line(observed: list[tuple[float, float]], typical=undisturbed) -> Law:
    """Least squares seconds = overhead + amount / rate through each amount's `typical`
    seconds (by default the undisturbed), overhead kept >= 0."""
    by_amount: dict[float, list[float]] = {}
    for amount, seconds in observed:
        by_amount.setdefault(amount, []).append(seconds)
    points = [(amount, typical(seconds)) for amount, seconds in sorted(by_amount.items())]
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    intercept = mean_y - slope * mean_x
    if slope <= 0 or intercept < 0:  # through the origin instead
        slope, intercept = sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0
    return Law(intercept, 1.0 / slope)


def fit(observations: list[dict], device: str, links: dict[str, Law], measured_on: str) -> DeviceProfile:
    laws: dict[str, Law] = {}
    for law in ("forward", "backward"):
        points = [(o["amount"], o["seconds"]) for o in observations if o["kind"] == law]
        if points:
            laws[law] = fit_line(points)
    if "forward" not in laws or "backward" not in laws:
        raise ValueError("a device profile needs traced forwards and whole backwards")
    laws["input_grad"], laws["weight_grad"] = _split_laws(observations, laws["backward"])
    # a line as the other laws: an update may cost more than its parameters' share (the
    # gradient norm, work per bucket); its overhead came out 0.4 ms on the benchmark's CPU
    # (bench/results/planner-f67902a.json). A time of 0 or less (a --profile file's) is
    # no update's.
    updates = [(o["amount"], o["seconds"]) for o in observations
               if o["kind"] == "update" and o["amount"] and o["seconds"] > 0]
    update = fit_line(updates) if updates else Law(0.0, float("inf"))
    links = dict(links)
    for kind in sorted({o["kind"] for o in observations if o["kind"].startswith(LINK_OBSERVED)}):
        links[kind[len(LINK_OBSERVED):]] = fit_line([(o["amount"], o["seconds"]) for o in observations
                                                     if o["kind"] == kind])
    # a pipeline message as the servers' steps show it, where they were replayed: the
    # probe's bandwidth, and the latency beyond it the median step needed (a residual,
    # which noise moves either way)
    latencies = [o for o in observations if o["kind"] == MESSAGE_OBSERVED]
    if latencies:
        probe = links["p2p"]
        links["p2p"] = Law(max(0.0, statistics.median(o["seconds"] - o["amount"] / probe.rate for o in latencies)),
                           probe.rate)
    # the mean at each size: lone sends and lone receives move messages of one size and
    # post at different costs (a lower quartile would price both as the cheaper), and a
    # rank's postings over a step cost it their sum, rare long ones included
    postings = [(o["amount"], o["seconds"]) for o in observations
                if o["kind"] == POSTING_OBSERVED and o["amount"] > 0 and o["seconds"] > 0]
    return DeviceProfile(device=device, links=links, update_s_per_param=1.0 / update.rate,
                         posting=fit_line(postings, typical=statistics.mean) if postings else None,
                         update_overhead_s=update.overhead_s,
                         measured_on=measured_on, observations=observations, shapes=_shapes(observations),
                         selective_share=_selective_share(observations, laws["forward"], laws["backward"]),
                         selective_forward_factor=_selective_forward_factor(observations),
                         tp_compute_factor=_tp_compute_factor(observations, laws), **laws)


def _shapes(observations: list[dict]) -> dict[str, dict[str, float]]:
    """Per chunk shape, each compute kind timed at least SHAPE_TIMINGS times: its
    undisturbed seconds."""
    timings: dict[str, dict[str, list[float]]] = {}
    for o in observations:
        if o["kind"].startswith(SHAPE_OBSERVED):
            kind = o["kind"][len(SHAPE_OBSERVED):]
            timings.setdefault(o["shape"], {}).setdefault(kind, []).append(o["seconds"])
    shapes = {shape: {kind: undisturbed(seconds) for kind, seconds in kinds.items() if len(seconds) >= SHAPE_TIMINGS}
              for shape, kinds in timings.items()}
    return {shape: kinds for shape, kinds in shapes.items() if kinds}


def _split_laws(observations: list[dict], backward: Law) -> tuple[Law, Law]:
    """The halves' laws as shares of the whole backward's: at each chunk measured both
    whole and split, (I + W) / B and I / (I + W), medians over those chunks. Fitting I
    and W apart from B could price a split backward below a whole one, which it never is
    (the split only adds work); measured at the same chunks, the ratio is what it costs.
    Without a chunk measured both ways, each half is half a B."""
    timings: dict[tuple[str, float], list[float]] = {}
    for o in observations:
        timings.setdefault((o["kind"], o["amount"]), []).append(o["seconds"])
    both = [a for kind, a in timings if kind == "backward"
            and ("input_grad", a) in timings and ("weight_grad", a) in timings]
    if not both:
        return Law(backward.overhead_s / 2, backward.rate * 2), Law(backward.overhead_s / 2, backward.rate * 2)
    whole = {a: undisturbed(timings[("backward", a)]) for a in both}
    halves = {a: (undisturbed(timings[("input_grad", a)]), undisturbed(timings[("weight_grad", a)])) for a in both}
    factor = statistics.median((i + w) / whole[a] for a, (i, w) in halves.items())
    share = statistics.median(i / (i + w) for i, w in halves.values())
    return (Law(backward.overhead_s * factor * share, backward.rate / (factor * share)),
            Law(backward.overhead_s * factor * (1 - share), backward.rate / (factor * (1 - share))))


def _selective_share(observations: list[dict], forward: Law, backward: Law) -> float | None:
    """What selective recompute's rerun costs, as a share of the forward's arithmetic:
    the median over the sizes measured of (B with it - B) / (F - its overhead)."""
    by_amount: dict[float, list[float]] = {}
    for o in observations:
        if o["kind"] == "backward_selective":
            by_amount.setdefault(o["amount"], []).append(o["seconds"])
    shares = [(undisturbed(s) - backward.seconds(a)) / (forward.seconds(a) - forward.overhead_s)
              for a, s in by_amount.items()]
    return max(0.0, statistics.median(shares)) if shares else None


def _selective_forward_factor(observations: list[dict]) -> float | None:
    """What a forward under selective recompute took against a plain forward of the same
    FLOPs: the median over the sizes measured both ways of their undisturbed ratio (the
    profile's selective job runs the same chunks as its plain one)."""
    timings: dict[tuple[str, float], list[float]] = {}
    for o in observations:
        if o["kind"] in ("forward", "forward_selective"):
            timings.setdefault((o["kind"], o["amount"]), []).append(o["seconds"])
    ratios = [undisturbed(seconds) / undisturbed(timings[("forward", amount)])
              for (kind, amount), seconds in timings.items()
              if kind == "forward_selective" and ("forward", amount) in timings]
    return max(1.0, statistics.median(ratios)) if ratios else None


def _tp_compute_factor(observations: list[dict], laws: dict[str, Law]) -> float | None:
    """What a tensor-parallel shard's computes took against the laws' price for their
    FLOPs: over each "tp_compute" observation (a server's traced step: its computes'
    kinds and FLOPs, and their spans' seconds less its tensor group's calls), the
    undisturbed ratio."""
    ratios = [o["seconds"] / sum(laws[kind].seconds(flops) for kind, flops in o["computes"])
              for o in observations if o["kind"] == "tp_compute" and o["computes"] and o["seconds"] > 0]
    return undisturbed(ratios) if ratios else None  # none left: the laws' rate
