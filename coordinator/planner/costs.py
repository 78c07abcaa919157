"""What a layout's actions cost, from a device profile measured on real servers.

A `DeviceProfile` holds the fitted laws of one device kind running one model family
(clients/plan_profile.py measures them; traces of real jobs refine them):

    compute seconds of one chunk's forward  = forward_overhead_s  + forward FLOPs / forward_flops_per_s
    ... of its backward B                    = backward_overhead_s + forward FLOPs / backward_flops_per_s
    ... of the halves I and W                = the same law with their own constants
    a message of n bytes                     = latency_s + n / bytes_per_s
    posting a send, receive or exchange      = posting_overhead_s + its messages' bytes / bytes_per_s   (on its rank)
    a collective of n bytes over 2 members   = latency_s + n / bytes_per_s   (per group kind and op)
    the weight update                        = update_overhead_s + update_s_per_param * parameters the rank steps

The overheads are what a compute costs beyond its arithmetic (the executor's work, kernel
launches); on small models they dominate, which is why the law is affine and not FLOPs
alone. Forward FLOPs count every matrix product of the chunk on one tensor rank (1/tp of
each block's weights, the attention scores, the head's vocabulary slice). A chunk shape
the servers ran (`chunk_shape`: a chunk of so many layers, with or without the
embedding and the head, at so many rows, over a tensor group of so many) is priced at
what it took instead, its group's calls inside, in `DeviceProfile.shapes`; the laws
price the shapes never run.

`layout_costs` turns a job config into the simulator's inputs: per chunk its F, B, I and
W seconds (recompute's rerun and the tensor group's collectives included), the
pipeline message's seconds and its posting's on the rank, and one data-parallel
reduction's, parameter gather's and update's.

Worked example: a chunk of 2 GPT-2 layers (d_model 64, seq_len 32) at 4 rows, tp=1,
does 2 layers * 128 tokens * (2 * 12 * 64^2 + 4 * 64 * 32) = 27,262,976 FLOPs forward;
with a forward law of 2 ms + 1 GFLOP/s, its forward costs 2 + 27.26 = 29.26 ms.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from interleaf.common.model.architectures import architecture
from interleaf.common.model.config import shape_of
from interleaf.common.model.shapes import chunk_param_specs, local_numel
from interleaf.common.pipeline_message_modes import message_mode
from interleaf.coordinator.config import PRECISION_BYTES, JobConfig
from interleaf.coordinator.memory_model import message_bytes
from interleaf.coordinator.partition import Chunk, partition

@dataclass(frozen=True)
class Law:
    """seconds = overhead_s + amount / rate: the affine cost of one action."""
    overhead_s: float
    rate: float
    """Amount per second (FLOP/s for compute, bytes/s for links)."""

    def seconds(self, amount: float) -> float:
        return self.overhead_s + amount / self.rate


def _finite(field: str, value, minimum: float, above: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum or (above and value == minimum):
        raise ValueError(f"{field}={value!r} must be a finite number {'>' if above else '>='} {minimum:g}")
    return float(value)


def _law(field: str, value) -> Law:
    """A profile file's law, checked: seconds are never negative and rates positive."""
    if not isinstance(value, dict) or set(value) != {"overhead_s", "rate"}:
        raise ValueError(f"{field}={value!r} must be an object of overhead_s and rate")
    return Law(_finite(f"{field}.overhead_s", value["overhead_s"], 0.0),
               _finite(f"{field}.rate", value["rate"], 0.0, above=True))


LINK_GROUP = {"tp": "tp", "tp_reduce_scatter": "tp", "tp_all_gather": "tp",
              "dp": "dp", "dp_reduce_scatter": "dp", "dp_all_gather": "dp"}
"""Each collective link kind, and the group whose all-reduce law stands in for it where it
was not measured."""


@dataclass(frozen=True)
class DeviceProfile:
    device: str
    """The device kind measured: cpu, or the CUDA device's name."""
    forward: Law
    backward: Law
    input_grad: Law
    weight_grad: Law
    links: dict[str, Law]
    """Per link kind, the seconds of one call of n bytes between two
    members: "p2p" a pipeline message, "allreduce" the probe's all-reduce (what a kind
    not measured on the servers falls back to), and as measured inside jobs on the
    servers "tp" the tensor group's all-reduce, "dp" the data-parallel all-reduce,
    "dp_reduce_scatter" and "dp_all_gather" ZeRO's, "tp_reduce_scatter" and
    "tp_all_gather" the tensor group's under sequence parallelism."""
    update_s_per_param: float
    update_overhead_s: float = 0.0
    """What a rank's update costs beyond its parameters' share; 0 in profiles fitted before
    it was (format 3), which priced every parameter alike."""
    selective_share: float | None = None
    """Selective recompute's rerun as a share of the forward's arithmetic, measured;
    None: estimated from the FLOPs it reruns."""
    selective_forward_factor: float | None = None
    """A forward under selective recompute against the same chunk's plain forward,
    measured (the checkpoint's policy decides, op by op, what to keep: 7-18% on the
    planner bench's CPU chunks); None: as fast (profiles before format 6)."""
    posting: Law | None = None
    """The seconds a rank spends posting a send, a receive or an exchange (the executor's
    own work, before its messages travel: stageserver spans of kinds send, recv and
    exchange), by the bytes of the messages it posts; None where nothing was measured (a
    GPU's posting only queues work on a stream, and profiles before format 5): free."""
    tp_compute_factor: float | None = None
    """A tensor-parallel shard's compute against the laws' price for its FLOPs, measured
    (its spans less its group's calls); None: priced at the laws' rate."""
    measured_on: str = ""
    """What was run to measure it (the profile jobs' shapes), for the plan's report."""
    observations: list[dict] = field(default_factory=list)
    """Every (kind, FLOPs, seconds) fitted, profile jobs' and traces' alike."""
    shapes: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per chunk shape run on the servers (chunk_shape: its key), the undisturbed seconds
    of each compute kind timed ("forward", "backward", "input_grad", "weight_grad"):
    what a chunk of that shape is priced at in place of the laws."""

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "shape_keys": SHAPE_KEYS}

    def link(self, kind: str) -> Law:
        """The law of `kind`; where it was not measured, its group's all-reduce's (the
        profile's, else the probe's), a reduce-scatter or all-gather taken to move half
        an all-reduce's bytes in half its steps."""
        if kind in self.links:
            return self.links[kind]
        group = LINK_GROUP[kind]
        law = self.links.get(group, self.links["allreduce"])
        return law if kind == group else Law(law.overhead_s / 2, law.rate * 2)

    @classmethod
    def from_json(cls, data: dict) -> "DeviceProfile":
        """ValueError naming the field, its value and the rule where `data` (a file the
        user may have written or edited: --profile) is not a profile the costs can use."""
        if not isinstance(data, dict):
            raise ValueError(f"a device profile is a JSON object, not {type(data).__name__}")
        missing = [k for k in ("device", "forward", "backward", "input_grad", "weight_grad", "links",
                               "update_s_per_param") if k not in data]
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)}")
        device = data["device"]
        if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
            raise ValueError(f"device={device!r} must be \"cpu\" or a GPU's kind, \"cuda\" or \"cuda (its name)\": "
                             "the kinds of server a profile is measured on")
        laws = {k: _law(k, data[k]) for k in ("forward", "backward", "input_grad", "weight_grad")}
        if not isinstance(data["links"], dict) or not {"p2p", "allreduce"} <= set(data["links"]):
            raise ValueError(f"links={data['links']!r} must be an object with at least p2p and allreduce laws")
        _finite("update_s_per_param", data["update_s_per_param"], minimum=0.0)
        _finite("update_overhead_s", data.get("update_overhead_s", 0.0), minimum=0.0)
        posting = data.get("posting")
        observations, shapes = _shape_timings(data)
        return cls(device=data["device"], links={k: _law(f"links.{k}", v) for k, v in data["links"].items()},
                   posting=None if posting is None else _law("posting", posting),
                   update_s_per_param=data["update_s_per_param"],
                   update_overhead_s=data.get("update_overhead_s", 0.0), measured_on=data.get("measured_on", ""),
                   selective_share=data.get("selective_share"),
                   selective_forward_factor=data.get("selective_forward_factor"),
                   tp_compute_factor=data.get("tp_compute_factor"),
                   observations=observations, shapes=shapes, **laws)


SHAPE_KEYS = 2
"""Of a profile's chunk shape keys (chunk_shape): 2 tell a shape timed with compiled blocks
from one timed eager. A GPU profile of older keys may have timed both under one key (on a
GPU, 1F1B's blocks compile and zb-h1's do not), so its shape timings are set aside when it
is read (_shape_timings); a CPU's never compiled by default, and keep theirs."""


def _shape_timings(data: dict) -> tuple[list[dict], dict[str, dict[str, float]]]:
    """A profile file's observations and shapes, the GPU shape timings of older keys left
    out (SHAPE_KEYS): the laws are fitted to its other observations, and the shapes the
    plans need are timed again."""
    from .fitting import SHAPE_OBSERVED

    observations, shapes = list(data.get("observations", [])), dict(data.get("shapes", {}))
    if data.get("shape_keys", 1) < SHAPE_KEYS and str(data["device"]).startswith("cuda"):
        observations = [o for o in observations if not str(o.get("kind", "")).startswith(SHAPE_OBSERVED)]
        shapes = {}
    return observations, shapes


@dataclass(frozen=True)
class LayoutCosts:
    forward_s: list[float]
    """Per chunk (global index), one microbatch's forward."""
    backward_s: list[float]
    input_s: list[float]
    weight_s: list[float]
    message_s: float
    reduce_s: float
    """One chunk's data-parallel gradient reduction (all-reduce, or reduce-scatter under
    ZeRO 1-3), the largest chunk's."""
    gather_s: float
    """ZeRO-3: one chunk's parameter all-gather."""
    update_s: list[float]
    """Per pipeline rank, its weight update, with ZeRO's all-gather of the stepped shard."""
    tp_collective_s: float
    """Of the forward of the chunk that calls the most, the tensor group's collectives
    (for the report)."""
    posting_overhead_s: float = 0.0
    """What posting a send, receive or exchange occupies its rank beyond its messages'
    share (DeviceProfile.posting's overhead); 0 where posting is free."""
    posting_s_per_message: float = 0.0
    """Posting's seconds for each message it posts, by the layout's message bytes:
    posting n messages costs posting_overhead_s + n * posting_s_per_message."""

    def posting_s(self, messages: int) -> float:
        return self.posting_overhead_s + messages * self.posting_s_per_message


def chunk_forward_flops(config: JobConfig, chunk: Chunk, rows: int) -> float:
    """Matrix FLOPs of one chunk's forward on one microbatch of `rows`, on one tensor rank."""
    tp = config.parallel.tp
    block_matrix, attention, head = _per_token(config.model, tp)
    tokens = rows * config.model.seq_len
    flops = len(chunk.layers) * tokens * (2 * block_matrix + attention) / tp
    if chunk.has_head:
        flops += tokens * head / tp
    return flops


def chunk_shape(config: JobConfig, chunk: Chunk, rows: int, compiled: bool = False) -> str:
    """What a chunk's compute on its server depends on beside the model and precision, as
    the key of DeviceProfile.shapes: its layers, whether it holds the embedding and the
    head, the microbatch's rows, its forward FLOPs on one tensor rank (which tell a
    proxy's chunks from the model's), over a tensor group its size and whether its
    calls are sequence parallelism's, and whether its blocks are `compiled` (compiled_on:
    on a GPU 1F1B's are and zb-h1's are not, and take other times). Recompute is not part
    of it: a shape is timed without, and a rerun is priced on top of what its forward took."""
    p = config.parallel
    parts = [f"{len(chunk.layers)} layers"] + ["embedding"] * chunk.has_embedding + ["head"] * chunk.has_head
    key = " + ".join(parts) + f", {rows} rows, {chunk_forward_flops(config, chunk, rows):.6g} FLOPs"
    if p.tp > 1:
        key += f", tp{p.tp}" + (" sp" if p.sequence_parallel else "")
    return key + (", compiled" if compiled else "")


def compiled_on(config: JobConfig, device: str) -> bool:
    """Whether `config`'s blocks run compiled on servers of `device` (cpu, cuda, or a
    profile's device kind): JobConfig.compiles_on, the answer the memory model and the
    driver share ("auto" compiles on GPUs, never under a schedule that splits its
    backwards)."""
    from interleaf.common.model.compile_modes import device_type_of

    return config.compiles_on(device_type_of([device]))


def head_layers(config: JobConfig) -> float:
    """The head's forward FLOPs in layers' worth: what the chunk holding it does beyond
    its layers."""
    block_matrix, attention, head = _per_token(config.model, 1)
    return head / (2 * block_matrix + attention)


@functools.lru_cache(maxsize=256)
def _per_token(model, tp: int) -> tuple[int, int, int]:
    """A block's matrix weights, its attention FLOPs per token (the scores and their
    weighted sum), and the head's FLOPs per token on the vocabulary padded for tp."""
    shape = shape_of(model)
    block = architecture(shape.arch).block_parameters(shape)
    block_matrix = sum(math.prod(full) for full, _ in block.values() if len(full) == 2)
    return block_matrix, 4 * shape.d_model * shape.seq_len, 2 * shape.padded_vocab(tp) * shape.d_model


def chunk_parameters(config: JobConfig, chunk: Chunk) -> int:
    """Parameters one tensor rank holds of the chunk."""
    return _parameters(config.model, chunk.layers.start, chunk.layers.stop, chunk.has_embedding, chunk.has_head,
                       config.parallel.tp)


@functools.lru_cache(maxsize=4096)
def _parameters(model, start: int, stop: int, has_embedding: bool, has_head: bool, tp: int) -> int:
    """(Cached: the planner asks it of every chunk of thousands of layouts.)"""
    specs = chunk_param_specs(shape_of(model), range(start, stop), has_embedding, has_head, tp)
    return sum(local_numel(spec, tp) for spec in specs.values())


def collective_s(law: Law, members: int, total_bytes: float) -> float:
    """One collective call among `members` on a buffer of `total_bytes`, from the law
    of the same call between two: a ring takes members-1 steps where two take one, and
    each member moves (members-1)/members of the buffer where two move half of it (an
    all-reduce twice over, a reduce-scatter or all-gather once: the law between two
    already holds that). `normalized` is the inverse."""
    if members <= 1:
        return 0.0
    return (members - 1) * law.overhead_s + 2 * (members - 1) / members * total_bytes / law.rate


def normalized(members: int, total_bytes: float, seconds: float) -> tuple[float, float]:
    """(bytes, seconds) of the two-member call that costs what a call among `members` of
    `total_bytes` took in `seconds`, by collective_s's scaling."""
    return 2 * total_bytes / members, seconds / (members - 1)


def layout_costs(config: JobConfig, profile: DeviceProfile, slowdown: float = 1.0) -> LayoutCosts:
    """The simulator's inputs for `config` on devices `profile` describes. `slowdown`
    stretches compute where servers share cores (search.Cluster.compute_slowdown)."""
    p, t, m = config.parallel, config.train, config.model
    rows = t.global_batch // (p.dp * p.microbatches)
    act_bytes = PRECISION_BYTES[t.precision]
    chunks = partition(m.n_layers, p.pp, p.vpp, p.schedule, p.layers)
    hidden = rows * m.seq_len * m.d_model * act_bytes
    tp_forward, tp_backward = _tp_block_seconds(config, profile, hidden)
    # a shard's smaller products may not run at the whole layer's rate
    stretch = slowdown * ((profile.tp_compute_factor or 1.0) if p.tp > 1 else 1.0)
    forward, backward, inputs, weights, tp_share = [], [], [], [], []
    # a block rerun whole (full recompute, or selective's every K-th) calls its forward's
    # collectives again; selective's rerun replays them (collective_replay.py)
    whole_reruns = t.recompute == "full" or (t.recompute == "selective" and t.recompute_layers > 0)
    compiled = compiled_on(config, profile.device)
    for chunk in chunks:
        flops = chunk_forward_flops(config, chunk, rows)
        ends_f, ends_b = _tp_chunk_seconds(config, profile, chunk, hidden)
        gather_f, gather_b = _message_gathers(config, profile, chunk, len(chunks), hidden)
        blocks_f = len(chunk.layers) * tp_forward
        tp_f = blocks_f + ends_f
        tp_b = len(chunk.layers) * tp_backward + ends_b
        # a shape run on the servers is priced at what its computes took (the group's calls
        # inside them), the laws price the rest
        shape = chunk_shape(config, chunk, rows, compiled)
        timed = {kind: seconds * slowdown for kind, seconds in profile.shapes.get(shape, {}).items()}
        share = _recompute_share(config, chunk, profile.selective_share)
        # the rerun's arithmetic at the law's rate (what selective_share was measured against)
        rerun = share * (flops / profile.forward.rate * stretch + (blocks_f if whole_reruns else 0.0))
        forward_s = timed.get("forward", profile.forward.seconds(flops) * stretch + tp_f)
        forward.append(forward_s * _selective_forward_factor(config, profile) + gather_f)
        backward.append(timed.get("backward", profile.backward.seconds(flops) * stretch + tp_b) + gather_b + rerun)
        inputs.append(timed.get("input_grad", profile.input_grad.seconds(flops) * stretch + tp_b) + gather_b + rerun)
        # W keeps what it needs: no calls
        weights.append(timed.get("weight_grad", profile.weight_grad.seconds(flops) * stretch))
        tp_share.append(tp_f + gather_f)
    params = [chunk_parameters(config, c) for c in chunks]
    grad_bytes = max(params) * _master_bytes(t.precision)
    param_bytes = max(params) * act_bytes
    # ZeRO 1-3 reduce-scatter the gradient (each replica steps its shard), ZeRO 0 all-reduces it
    reduce_s = collective_s(profile.link("dp_reduce_scatter" if p.zero >= 1 else "dp"), p.dp, grad_bytes)
    gather = profile.link("dp_all_gather")
    gather_s = collective_s(gather, p.dp, param_bytes) if p.zero == 3 else 0.0
    update_s = []
    for rank in range(p.pp):
        held = sum(n for n, c in zip(params, chunks) if c.pipeline_rank == rank)
        seconds = (profile.update_overhead_s + profile.update_s_per_param * held / (p.dp if p.zero else 1)) * slowdown
        if p.zero in (1, 2):  # the stepped shards are gathered back into every replica
            seconds += collective_s(gather, p.dp, held * act_bytes)
        update_s.append(seconds)
    p2p = profile.links["p2p"]
    posting = profile.posting or Law(0.0, math.inf)
    return LayoutCosts(forward, backward, inputs, weights, p2p.seconds(message_bytes(config)),
                       reduce_s, gather_s, update_s, max(tp_share),
                       posting_overhead_s=posting.overhead_s * slowdown,
                       posting_s_per_message=message_bytes(config) / posting.rate * slowdown)


def _tp_block_seconds(config: JobConfig, profile: DeviceProfile, hidden: float) -> tuple[float, float]:
    """One block's tensor-group calls in its forward and in its backward (or input-
    gradient half), each on a microbatch's `hidden` bytes (stageserver/model/
    tensor_parallel.py, sequence_parallel.py):
    - without sequence parallelism, each row-parallel linear's output is all-reduced in
      the forward, and each column-parallel linear's input gradient in the backward
      (gpt2: 2 and 2; llama, with q, k, v, gate and up apart: 2 and 5);
    - with it, each group of column-parallel linears reading one input all-gathers it
      and each row-parallel output is reduce-scattered in the forward; the backward
      gathers each input again and each output gradient, and reduce-scatters each
      input's gradient (gpt2 and llama: 2 + 2 forward, 4 + 2 backward)."""
    p = config.parallel
    if p.tp <= 1:
        return 0.0, 0.0
    columns, column_inputs, rows = _tp_linears(config.model)
    if p.sequence_parallel:
        gather = collective_s(profile.link("tp_all_gather"), p.tp, hidden)
        scatter = collective_s(profile.link("tp_reduce_scatter"), p.tp, hidden)
        return column_inputs * gather + rows * scatter, (column_inputs + rows) * gather + column_inputs * scatter
    reduce = collective_s(profile.link("tp"), p.tp, hidden)
    return rows * reduce, columns * reduce


def _tp_chunk_seconds(config: JobConfig, profile: DeviceProfile, chunk: Chunk, hidden: float) -> tuple[float, float]:
    """What a chunk calls over the tensor group beyond its blocks, forward and backward:
    the vocabulary-parallel embedding's sum (a reduce-scatter under sequence
    parallelism, its gradient gathered back) and the head's input gradient summed (under
    sequence parallelism its input gathered, its gradient reduce-scattered), inside its
    computes. The loss's own calls are a few numbers per token: left out."""
    p = config.parallel
    if p.tp <= 1:
        return 0.0, 0.0
    if p.sequence_parallel:
        gather = collective_s(profile.link("tp_all_gather"), p.tp, hidden)
        scatter = collective_s(profile.link("tp_reduce_scatter"), p.tp, hidden)
        return (chunk.has_embedding * scatter + chunk.has_head * gather,
                chunk.has_embedding * gather + chunk.has_head * scatter)
    reduce = collective_s(profile.link("tp"), p.tp, hidden)
    return chunk.has_embedding * reduce, chunk.has_head * reduce


def _message_gathers(config: JobConfig, profile: DeviceProfile, chunk: Chunk, chunks: int,
                     hidden: float) -> tuple[float, float]:
    """With scatter/gather pipeline messages (stageserver/pipeline_messages.py), the
    tensor group's all-gather of each received message, before the compute that takes
    it (the executor's wait, not its span): a forward's input from the chunk before, a
    backward's gradient from the one after."""
    p = config.parallel
    if message_mode(p.tp, p.sequence_parallel, p.scatter_gather) != "scatter_gather":
        return 0.0, 0.0
    gather = collective_s(profile.link("tp_all_gather"), p.tp, hidden)
    return (chunk.index > 0) * gather, (chunk.index < chunks - 1) * gather


@functools.lru_cache(maxsize=64)
def _tp_linears(model) -> tuple[int, int, int]:
    """A block's column-parallel linears (weights split along their outputs), the
    distinct inputs they read (their modules: attention's and the MLP's), and its
    row-parallel linears (split along their inputs)."""
    shape = shape_of(model)
    block = architecture(shape.arch).block_parameters(shape)
    matrices = [(name, dim) for name, (full, dim) in block.items() if len(full) == 2]
    columns = [name for name, dim in matrices if dim == 0]
    return len(columns), len({name.split(".")[0] for name in columns}), sum(1 for _, dim in matrices if dim == 1)


def _master_bytes(precision: str) -> int:
    """Bytes of a reduced gradient: fp32 under bf16 and fp8 (the reduction's accumulator),
    the compute dtype otherwise."""
    return 8 if precision == "fp64" else 4


def _selective_forward_factor(config: JobConfig, profile: DeviceProfile) -> float:
    """What selective recompute's forward (every block under the checkpoint's policy)
    takes against a plain one: the profile's measurement, where it made one; 1 without
    selective recompute, or with recompute_layers (whose other blocks run plain)."""
    t = config.train
    if t.recompute != "selective" or t.recompute_layers:
        return 1.0
    return profile.selective_forward_factor or 1.0


def _recompute_share(config: JobConfig, chunk: Chunk, selective: float | None) -> float:
    """Share of the chunk's forward its backward reruns: all of it under full recompute;
    under selective the attention core and pointwise work, about the attention scores'
    share of the block's FLOPs (Korthikanti et al. 2022), or the share the profile
    measured; every K-th block whole with recompute_layers=K."""
    t, m = config.train, config.model
    if t.recompute == "full":
        return 1.0
    if t.recompute != "selective":
        return 0.0
    if t.recompute_layers:
        whole = sum(1 for i in chunk.layers if (i + 1) % t.recompute_layers == 0)
        return whole / max(1, len(chunk.layers))
    if selective is not None:
        return selective
    block_matrix, attention, _ = _per_token(m, 1)
    return attention / (2 * block_matrix + attention)
