"""Planning a job, pure: config and servers in, every rank's SetupRequest out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from interleaf.common.buckets import bucket_cap_bytes
from interleaf.common.model.compile_modes import device_type_of
from interleaf.coordinator import partition as partitioning
from interleaf.coordinator.config import ConfigError, JobConfig
from interleaf.coordinator.grid import RankGrid, place
from interleaf.coordinator.config.eval import eval_microbatches
from interleaf.coordinator.schedule import CostModel, build_programs, simulate, validate_programs
from interleaf.coordinator.schedule.forward_only import build_eval_programs
from interleaf.coordinator.schedule.placement import chunk_ranks, tie_ranks
from interleaf.protos.actions import Action
from interleaf.protos import interleaf_pb2 as pb


@dataclass(frozen=True)
class ServerSlot:
    server_id: str
    address: str
    host: str
    memory_bytes: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class JobPlan:
    grid: RankGrid
    chunks: list[partitioning.Chunk]
    programs: list[list[Action]]  # by pipeline rank
    servers: list[ServerSlot]  # by rank
    predicted_bubble: float
    state: str = ""  # how training state is held: ZeRO stage, precision, recompute
    transport: str = "gloo"  # how tensors move: gloo (CPU servers) or nccl (CUDA servers)
    eval_programs: list[list[Action]] = field(default_factory=list)  # by pipeline rank; [] without [eval]

    def layout(self) -> str:
        pp = self.grid.pp
        return "\n".join(
            [
                partitioning.describe(self.chunks, pp),
                self.grid.describe(),
                f"{self.state}; transport {self.transport}",
                f"simulated bubble fraction (a backward costing two forwards): {self.predicted_bubble:.3f}",
            ]
        )

    def rank_infos(self) -> list[pb.RankInfo]:
        infos = []
        for rank, slot in enumerate(self.servers):
            c = self.grid.coord(rank)
            infos.append(
                pb.RankInfo(
                    rank=rank,
                    coordinates=pb.Coordinates(dp=c.dp, pp=c.pp, tp=c.tp),
                    server_address=slot.address,
                    chunks=[ch.index for ch in partitioning.chunks_of(self.chunks, c.pp)],
                )
            )
        return infos

    def groups(self) -> list[pb.Group]:
        return [pb.Group(name=n, members=m) for n, m in self.grid.all_groups().items()]


def plan_programs(config: JobConfig) -> tuple[list[list[Action]], float]:
    """Lowers the schedule into one validated program per pipeline rank (deadlock-free
    under rendezvous semantics, or `DeadlockError`) and simulates it with the cost
    model's default costs: a backward twice a forward (its FLOPs), each of its halves
    one forward, free communication."""
    p = config.parallel
    programs = build_programs(p.schedule, p.pp, p.vpp, p.microbatches, p.dp, p.zero, p.zero_prefetch,
                              tied=config.model.tie_embeddings)
    validate_programs(programs, p.pp, p.vpp, p.microbatches, p.zero, placement=chunk_ranks(p.schedule, p.pp, p.vpp))
    result = simulate(programs, CostModel())
    return programs, result.bubble_fraction


def plan_eval_programs(config: JobConfig) -> list[list[Action]]:
    """The forward-only programs an evaluation runs (coordinator/schedule/forward_only.py),
    validated and simulated like the training programs; [] when the job does not evaluate."""
    p, e = config.parallel, config.eval
    if not e.enabled:
        return []
    count = eval_microbatches(e.samples, config.train.global_batch, p.microbatches)
    programs = build_eval_programs(p.schedule, p.pp, p.vpp, count, p.zero, p.zero_prefetch)
    validate_programs(programs, p.pp, p.vpp, count, p.zero, forward_only=True,
                      placement=chunk_ranks(p.schedule, p.pp, p.vpp))
    simulate(programs, CostModel())
    return programs


def place_servers(config: JobConfig, idle: list[ServerSlot],
                  need_bytes: int | Mapping[str, int] = 0) -> list[ServerSlot] | None:
    """The servers for each rank, TP groups kept on one host where possible, among
    those offering at least `need_bytes` (the most any rank needs; or, by device type,
    "cpu" and "cuda", what a server of its type needs: train.compile="auto" compiles
    the blocks on GPUs only, which then keep less); None while there are too few such
    idle servers."""
    p = config.parallel
    grid = RankGrid(p.dp, p.pp, p.tp)

    def need(server: ServerSlot) -> int:
        if not isinstance(need_bytes, Mapping):
            return need_bytes
        return need_bytes.get(device_type_of([server.device]), max(need_bytes.values()))

    idle = [s for s in idle if s.memory_bytes >= need(s)]
    if len(idle) < grid.world_size:
        return None
    by_id = {s.server_id: s for s in idle}
    return [by_id[sid] for sid in place([(s.server_id, s.host) for s in idle], grid)]


def plan_job(config: JobConfig, servers: list[ServerSlot],
             planned: tuple[list[list[Action]], float] | None = None) -> JobPlan:
    """`servers` are already placed: servers[r] runs rank r. `planned` is what
    plan_programs(config) returned, when the caller already has it."""
    p = config.parallel
    transport = choose_transport(p.transport, [s.device for s in servers])
    check_devices(config, [s.device for s in servers])
    if transport == "nccl":
        _check_one_rank_per_gpu(servers)
    programs, bubble = planned or plan_programs(config)
    return JobPlan(
        transport=transport,
        grid=RankGrid(p.dp, p.pp, p.tp, tie_ranks(chunk_ranks(p.schedule, p.pp, p.vpp))),
        chunks=partitioning.partition(config.model.n_layers, p.pp, p.vpp, p.schedule, p.layers),
        programs=programs,
        servers=list(servers),
        predicted_bubble=bubble,
        state=describe_state(config),
        eval_programs=plan_eval_programs(config),
    )


def describe_state(config: JobConfig) -> str:
    p, t = config.parallel, config.train
    zero = f"ZeRO stage {p.zero} over dp={p.dp}" + (f" (prefetch {p.zero_prefetch})" if p.zero == 3 else "")
    return f"{zero}, {t.precision}, recompute {t.recompute}{tensor_parallel_mode(p)}"


def tensor_parallel_mode(p) -> str:
    """How activations move between tensor ranks, where tp > 1: sequence parallelism, or
    the pipeline sends' scatter/gather (only with pp > 1, where there are sends)."""
    if p.tp == 1:
        return ""
    if p.sequence_parallel:
        return f", sequence parallel over tp={p.tp}"
    return f", scatter/gather {'on' if p.scatter_gather else 'off'}" if p.pp > 1 else ""


def setup_requests(
    job_id: str, config: JobConfig, plan: JobPlan, store: tuple[str, int, str], comm_timeout_s: float,
    data_start: tuple[int, int] = (0, 0), init_from: str = "", held_out: float | None = None,
) -> list[pb.SetupRequest]:
    """`data_start`: the data position (step, samples consumed before it) the job goes on
    from: a resumed checkpoint's (stageserver/data/sampler.py); (0, 0) for a new job.
    `init_from`: the weights each server reads its parameters from (checkpoint.init,
    resolved); "" starts from the seed, or from a checkpoint loaded after setup.
    `held_out`: the fraction of data.source training never reads, when a resumed
    checkpoint's split sets it (coordinator/data_split.py); else the job's."""
    m, p, t, e = config.model, config.parallel, config.train, config.eval
    held_out = e.held_out if held_out is None else held_out
    host, port, prefix = store
    requests = []
    for rank in range(plan.grid.world_size):
        c = plan.grid.coord(rank)
        groups = dict(plan.grid.groups(rank), world=list(range(plan.grid.world_size)))
        requests.append(
            pb.SetupRequest(
                job_id=job_id,
                rank=rank,
                world_size=plan.grid.world_size,
                coordinates=pb.Coordinates(dp=c.dp, pp=c.pp, tp=c.tp),
                grid=pb.Coordinates(dp=p.dp, pp=p.pp, tp=p.tp),
                vpp=p.vpp,
                model=pb.ModelSpec(
                    n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads,
                    seq_len=m.seq_len, vocab_size=m.vocab_size, arch=m.arch, n_kv_heads=m.n_kv_heads,
                    ffn_hidden=m.ffn_hidden, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                    tie_embeddings=m.tie_embeddings, pad_vocab_to=m.pad_vocab_to,
                    rope_scaling_factor=m.rope_scaling_factor, rope_low_freq_factor=m.rope_low_freq_factor,
                    rope_high_freq_factor=m.rope_high_freq_factor, rope_original_positions=m.rope_original_positions,
                ),
                train=pb.TrainSpec(
                    steps=t.steps, global_batch=t.global_batch, lr=t.lr,
                    warmup_steps=t.warmup_steps, weight_decay=t.weight_decay,
                    grad_clip=t.grad_clip, seed=t.seed, microbatches=p.microbatches,
                    precision=t.precision, recompute=t.recompute,
                    data_start_step=data_start[0], data_start_samples=data_start[1],
                    beta1=t.betas[0], beta2=t.betas[1], eps=t.eps, lr_decay=t.lr_decay,
                    min_lr_ratio=t.min_lr_ratio, decay_fraction=t.decay_fraction,
                    recompute_layers=t.recompute_layers, compile=str(t.compile), fp8_recipe=t.fp8_recipe,
                ),
                data_source=config.data.source,
                init_from=init_from,
                chunks=[
                    pb.ChunkSpec(
                        index=ch.index, first_layer=ch.layers.start, end_layer=ch.layers.stop,
                        has_embedding=ch.has_embedding, has_head=ch.has_head,
                    )
                    for ch in partitioning.chunks_of(plan.chunks, c.pp)
                ],
                program=[pb.Action(text=str(a)) for a in plan.programs[c.pp]],
                groups=[pb.Group(name=n, members=ms) for n, ms in sorted(groups.items())],
                store_host=host,
                store_port=port,
                store_prefix=prefix,
                comm_timeout_s=comm_timeout_s,
                zero=p.zero,
                transport=plan.transport,
                sequence_parallel=p.sequence_parallel,
                scatter_gather=p.scatter_gather,
                bucket_bytes=bucket_cap_bytes(p.bucket_mb),
                overlap_grad_reduce=p.overlap_grad_reduce,
                torch_profiler=config.trace.torch_profiler,
                memory_snapshot=config.trace.memory_snapshot,
                eval_program=[pb.Action(text=str(a)) for a in plan.eval_programs[c.pp]] if plan.eval_programs else [],
                eval_microbatches=eval_microbatches(e.samples, t.global_batch, p.microbatches) if e.enabled else 0,
                eval_samples=e.samples if e.enabled else 0,
                eval_source=e.source if e.enabled else "",
                eval_fraction=e.fraction if e.enabled else 0.0,
                held_out_fraction=held_out,
            )
        )
    return requests


def _check_one_rank_per_gpu(servers: list[ServerSlot]) -> None:
    """NCCL refuses two ranks on one GPU; say so before any server is set up."""
    seen: dict[tuple[str, str], int] = {}
    for rank, slot in enumerate(servers):
        where = (slot.host, slot.device)
        if where in seen:
            raise ConfigError(f"ranks {seen[where]} and {rank} would share {slot.device} on host {slot.host} "
                              f"(servers {servers[seen[where]].address} and {slot.address}): NCCL refuses "
                              f"two ranks on one GPU; start each stage server with its own --device")
        seen[where] = rank


def check_memory_snapshot(config: JobConfig, devices: list[str]) -> None:
    """trace.memory_snapshot records the CUDA caching allocator's history: a job whose
    servers compute on the CPU has none to record."""
    cpu = sorted({d for d in devices if not d.startswith("cuda")})
    if config.trace.memory_snapshot and cpu:
        raise ConfigError(f"trace.memory_snapshot=true records CUDA memory history, and the job's servers "
                          f"compute on {', '.join(cpu)}: it needs CUDA servers (trace.torch_profiler works on both)")


FLOAT8_MULTIPLE = 16
"""What every dimension of a float8 tensor-core product must be a multiple of (torch's
_scaled_mm): each linear's in and out features, and the tokens its weight gradient sums."""


def check_fp8(config: JobConfig, devices: list[str], tokens: bool = True) -> None:
    """train.precision=fp8 multiplies in float8 on GPUs (whose servers check their compute
    capability at setup), whose products take dimensions that are multiples of
    FLOAT8_MULTIPLE only; CPU servers only emulate it (any dimension), which
    train.fp8_emulate asks for. `tokens`: the microbatch's tokens too, which the layout
    sets (False before a plan has chosen it; the planner holds each candidate to it)."""
    cpu = sorted({d for d in devices if not d.startswith("cuda")})
    t = config.train
    if t.precision != "fp8" or t.fp8_emulate:
        return
    if cpu:
        raise ConfigError(f"train.precision='fp8' needs stage servers on GPUs with float8 tensor cores (compute "
                          f"capability 8.9 or newer: Ada, Hopper), and the job's servers compute on "
                          f"{', '.join(cpu)}; train.fp8_emulate=true runs torchao's emulation there, for tests")
    m, p = config.model, config.parallel
    dims = [("model.d_model", m.d_model), ("model.ffn_hidden", m.ffn_hidden),
            ("model.n_kv_heads*d_model/n_heads (the key and value width)", m.n_kv_heads * (m.d_model // m.n_heads))]
    if tokens:
        dims.append(("train.global_batch/(parallel.dp*parallel.microbatches)*model.seq_len (a microbatch's tokens)",
                     config.train.global_batch // (p.dp * p.microbatches) * m.seq_len))
    for name, value in dims:
        if value % FLOAT8_MULTIPLE:
            raise ConfigError(f"train.precision='fp8' multiplies on float8 tensor cores, whose products need every "
                              f"dimension a multiple of {FLOAT8_MULTIPLE}: {name}={value} is not")


def check_devices(config: JobConfig, devices: list[str], tokens: bool = True) -> None:
    """What the job asks of its servers' devices: a transport they can use, CUDA for a memory snapshot, float8
    tensor cores and their dimensions for fp8 (`tokens`: check_fp8's). Made by the
    coordinator as it places a job, and by clients before they start servers or plan."""
    choose_transport(config.parallel.transport, devices)
    check_memory_snapshot(config, devices)
    check_fp8(config, devices, tokens)


def choose_transport(setting: str, devices: list[str]) -> str:
    """parallel.transport for these servers: auto picks nccl when every server computes
    on a GPU and gloo when every one is on a CPU; a mix, or a forced transport the
    devices cannot use, is refused naming the setting and the devices."""
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) > 1:
        raise ConfigError(f"the job's servers mix devices ({', '.join(sorted(set(devices)))}): "
                          f"every rank of a job must compute on the same kind of device")
    kind = kinds.pop() if kinds else "cpu"
    wanted = {"cuda": "nccl", "cpu": "gloo"}.get(kind)
    if wanted is None:
        raise ConfigError(f"server device {devices[0]!r} is neither cpu nor cuda")
    if setting not in ("auto", wanted):
        raise ConfigError(f"parallel.transport={setting!r} cannot move tensors on {kind} servers "
                          f"(they need {wanted!r})")
    return wanted
