from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelSpec(_message.Message):
    __slots__ = ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "arch", "n_kv_heads", "ffn_hidden", "norm_eps", "rope_theta", "tie_embeddings", "pad_vocab_to", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_positions")
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    FFN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    NORM_EPS_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    TIE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PAD_VOCAB_TO_FIELD_NUMBER: _ClassVar[int]
    ROPE_SCALING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ROPE_LOW_FREQ_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ROPE_HIGH_FREQ_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ROPE_ORIGINAL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    arch: str
    n_kv_heads: int
    ffn_hidden: int
    norm_eps: float
    rope_theta: float
    tie_embeddings: bool
    pad_vocab_to: int
    rope_scaling_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_positions: int
    def __init__(self, n_layers: _Optional[int] = ..., d_model: _Optional[int] = ..., n_heads: _Optional[int] = ..., seq_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., arch: _Optional[str] = ..., n_kv_heads: _Optional[int] = ..., ffn_hidden: _Optional[int] = ..., norm_eps: _Optional[float] = ..., rope_theta: _Optional[float] = ..., tie_embeddings: _Optional[bool] = ..., pad_vocab_to: _Optional[int] = ..., rope_scaling_factor: _Optional[float] = ..., rope_low_freq_factor: _Optional[float] = ..., rope_high_freq_factor: _Optional[float] = ..., rope_original_positions: _Optional[int] = ...) -> None: ...

class TrainSpec(_message.Message):
    __slots__ = ("steps", "global_batch", "lr", "warmup_steps", "weight_decay", "grad_clip", "seed", "microbatches", "precision", "recompute", "data_start_step", "data_start_samples", "beta1", "beta2", "eps", "lr_decay", "min_lr_ratio", "decay_fraction", "recompute_layers", "compile", "fp8_recipe")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    DATA_START_STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_START_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    LR_DECAY_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    DECAY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    FP8_RECIPE_FIELD_NUMBER: _ClassVar[int]
    steps: int
    global_batch: int
    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    seed: int
    microbatches: int
    precision: str
    recompute: str
    data_start_step: int
    data_start_samples: int
    beta1: float
    beta2: float
    eps: float
    lr_decay: str
    min_lr_ratio: float
    decay_fraction: float
    recompute_layers: int
    compile: str
    fp8_recipe: str
    def __init__(self, steps: _Optional[int] = ..., global_batch: _Optional[int] = ..., lr: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., weight_decay: _Optional[float] = ..., grad_clip: _Optional[float] = ..., seed: _Optional[int] = ..., microbatches: _Optional[int] = ..., precision: _Optional[str] = ..., recompute: _Optional[str] = ..., data_start_step: _Optional[int] = ..., data_start_samples: _Optional[int] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., lr_decay: _Optional[str] = ..., min_lr_ratio: _Optional[float] = ..., decay_fraction: _Optional[float] = ..., recompute_layers: _Optional[int] = ..., compile: _Optional[str] = ..., fp8_recipe: _Optional[str] = ...) -> None: ...

class Coordinates(_message.Message):
    __slots__ = ("dp", "pp", "tp")
    DP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    dp: int
    pp: int
    tp: int
    def __init__(self, dp: _Optional[int] = ..., pp: _Optional[int] = ..., tp: _Optional[int] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("name", "members")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    members: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., members: _Optional[_Iterable[int]] = ...) -> None: ...

class ChunkSpec(_message.Message):
    __slots__ = ("index", "first_layer", "end_layer", "has_embedding", "has_head")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    HAS_EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    HAS_HEAD_FIELD_NUMBER: _ClassVar[int]
    index: int
    first_layer: int
    end_layer: int
    has_embedding: bool
    has_head: bool
    def __init__(self, index: _Optional[int] = ..., first_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., has_embedding: _Optional[bool] = ..., has_head: _Optional[bool] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class SetupRequest(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "coordinates", "grid", "vpp", "model", "train", "data_source", "chunks", "program", "groups", "store_host", "store_port", "store_prefix", "comm_timeout_s", "zero", "transport", "probes", "init_from", "sequence_parallel", "scatter_gather", "eval_program", "eval_microbatches", "eval_samples", "eval_source", "eval_fraction", "held_out_fraction", "torch_profiler", "memory_snapshot", "bucket_bytes", "overlap_grad_reduce")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    VPP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    STORE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    COMM_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    SCATTER_GATHER_FIELD_NUMBER: _ClassVar[int]
    EVAL_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    EVAL_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    EVAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EVAL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    EVAL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    HELD_OUT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TORCH_PROFILER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_GRAD_REDUCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    coordinates: Coordinates
    grid: Coordinates
    vpp: int
    model: ModelSpec
    train: TrainSpec
    data_source: str
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkSpec]
    program: _containers.RepeatedCompositeFieldContainer[Action]
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    store_host: str
    store_port: int
    store_prefix: str
    comm_timeout_s: float
    zero: int
    transport: str
    probes: _containers.RepeatedCompositeFieldContainer[FileRef]
    init_from: str
    sequence_parallel: bool
    scatter_gather: bool
    eval_program: _containers.RepeatedCompositeFieldContainer[Action]
    eval_microbatches: int
    eval_samples: int
    eval_source: str
    eval_fraction: float
    held_out_fraction: float
    torch_profiler: bool
    memory_snapshot: bool
    bucket_bytes: int
    overlap_grad_reduce: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., coordinates: _Optional[_Union[Coordinates, _Mapping]] = ..., grid: _Optional[_Union[Coordinates, _Mapping]] = ..., vpp: _Optional[int] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., train: _Optional[_Union[TrainSpec, _Mapping]] = ..., data_source: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[ChunkSpec, _Mapping]]] = ..., program: _Optional[_Iterable[_Union[Action, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., store_prefix: _Optional[str] = ..., comm_timeout_s: _Optional[float] = ..., zero: _Optional[int] = ..., transport: _Optional[str] = ..., probes: _Optional[_Iterable[_Union[FileRef, _Mapping]]] = ..., init_from: _Optional[str] = ..., sequence_parallel: _Optional[bool] = ..., scatter_gather: _Optional[bool] = ..., eval_program: _Optional[_Iterable[_Union[Action, _Mapping]]] = ..., eval_microbatches: _Optional[int] = ..., eval_samples: _Optional[int] = ..., eval_source: _Optional[str] = ..., eval_fraction: _Optional[float] = ..., held_out_fraction: _Optional[float] = ..., torch_profiler: _Optional[bool] = ..., memory_snapshot: _Optional[bool] = ..., bucket_bytes: _Optional[int] = ..., overlap_grad_reduce: _Optional[bool] = ...) -> None: ...

class GroupId(_message.Message):
    __slots__ = ("name", "id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: bytes
    def __init__(self, name: _Optional[str] = ..., id: _Optional[bytes] = ...) -> None: ...

class SetupReply(_message.Message):
    __slots__ = ("data_tokens", "data_sha256", "group_ids", "device", "probes_seen")
    DATA_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_SHA256_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROBES_SEEN_FIELD_NUMBER: _ClassVar[int]
    data_tokens: int
    data_sha256: str
    group_ids: _containers.RepeatedCompositeFieldContainer[GroupId]
    device: str
    probes_seen: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, data_tokens: _Optional[int] = ..., data_sha256: _Optional[str] = ..., group_ids: _Optional[_Iterable[_Union[GroupId, _Mapping]]] = ..., device: _Optional[str] = ..., probes_seen: _Optional[_Iterable[bool]] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("job_id", "group_ids")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    group_ids: _containers.RepeatedCompositeFieldContainer[GroupId]
    def __init__(self, job_id: _Optional[str] = ..., group_ids: _Optional[_Iterable[_Union[GroupId, _Mapping]]] = ...) -> None: ...

class RunStepsRequest(_message.Message):
    __slots__ = ("job_id", "first_step", "num_steps", "trace_steps", "eval_after")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRACE_STEPS_FIELD_NUMBER: _ClassVar[int]
    EVAL_AFTER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    first_step: int
    num_steps: int
    trace_steps: _containers.RepeatedScalarFieldContainer[int]
    eval_after: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., first_step: _Optional[int] = ..., num_steps: _Optional[int] = ..., trace_steps: _Optional[_Iterable[int]] = ..., eval_after: _Optional[_Iterable[int]] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("job_id", "step", "rank", "has_loss", "loss", "tokens", "step_seconds", "compute_seconds", "comm_wait_seconds", "grad_norm", "lr", "memory", "idle_seconds", "comm", "spans", "started_unix", "evaluation", "torch_profile", "memory_snapshot")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMM_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    TORCH_PROFILE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    rank: int
    has_loss: bool
    loss: float
    tokens: int
    step_seconds: float
    compute_seconds: float
    comm_wait_seconds: float
    grad_norm: float
    lr: float
    memory: RankMemory
    idle_seconds: float
    comm: _containers.RepeatedCompositeFieldContainer[CommStat]
    spans: _containers.RepeatedCompositeFieldContainer[ActionSpan]
    started_unix: float
    evaluation: EvalReport
    torch_profile: bytes
    memory_snapshot: bytes
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., has_loss: _Optional[bool] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., comm_wait_seconds: _Optional[float] = ..., grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., memory: _Optional[_Union[RankMemory, _Mapping]] = ..., idle_seconds: _Optional[float] = ..., comm: _Optional[_Iterable[_Union[CommStat, _Mapping]]] = ..., spans: _Optional[_Iterable[_Union[ActionSpan, _Mapping]]] = ..., started_unix: _Optional[float] = ..., evaluation: _Optional[_Union[EvalReport, _Mapping]] = ..., torch_profile: _Optional[bytes] = ..., memory_snapshot: _Optional[bytes] = ...) -> None: ...

class EvalReport(_message.Message):
    __slots__ = ("loss", "tokens", "seconds")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    tokens: int
    seconds: float
    def __init__(self, loss: _Optional[float] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CommStat(_message.Message):
    __slots__ = ("op", "group", "seconds", "bytes", "calls")
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    op: str
    group: str
    seconds: float
    bytes: int
    calls: int
    def __init__(self, op: _Optional[str] = ..., group: _Optional[str] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., calls: _Optional[int] = ...) -> None: ...

class ActionSpan(_message.Message):
    __slots__ = ("action", "kind", "start_seconds", "end_seconds")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_SECONDS_FIELD_NUMBER: _ClassVar[int]
    END_SECONDS_FIELD_NUMBER: _ClassVar[int]
    action: str
    kind: str
    start_seconds: float
    end_seconds: float
    def __init__(self, action: _Optional[str] = ..., kind: _Optional[str] = ..., start_seconds: _Optional[float] = ..., end_seconds: _Optional[float] = ...) -> None: ...

class RankMemory(_message.Message):
    __slots__ = ("rank", "parameters_bytes", "gradients_bytes", "optimizer_bytes", "parameters_peak_bytes", "gradients_peak_bytes", "activations_peak_bytes", "communication_peak_bytes", "peak_bytes", "rss_peak_bytes", "device_peak_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    parameters_peak_bytes: int
    gradients_peak_bytes: int
    activations_peak_bytes: int
    communication_peak_bytes: int
    peak_bytes: int
    rss_peak_bytes: int
    device_peak_bytes: int
    def __init__(self, rank: _Optional[int] = ..., parameters_bytes: _Optional[int] = ..., gradients_bytes: _Optional[int] = ..., optimizer_bytes: _Optional[int] = ..., parameters_peak_bytes: _Optional[int] = ..., gradients_peak_bytes: _Optional[int] = ..., activations_peak_bytes: _Optional[int] = ..., communication_peak_bytes: _Optional[int] = ..., peak_bytes: _Optional[int] = ..., rss_peak_bytes: _Optional[int] = ..., device_peak_bytes: _Optional[int] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("job_id", "path", "background")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    path: str
    background: bool
    def __init__(self, job_id: _Optional[str] = ..., path: _Optional[str] = ..., background: _Optional[bool] = ...) -> None: ...

class SavedFile(_message.Message):
    __slots__ = ("path", "sha256", "bytes", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    sha256: str
    bytes: int
    seconds: float
    def __init__(self, path: _Optional[str] = ..., sha256: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SavedFiles(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[SavedFile]
    def __init__(self, files: _Optional[_Iterable[_Union[SavedFile, _Mapping]]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("job_id", "paths")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ...) -> None: ...

class FileRef(_message.Message):
    __slots__ = ("job_id", "path", "sha256")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    path: str
    sha256: str
    def __init__(self, job_id: _Optional[str] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("job_id", "path", "sha256", "data")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    path: str
    sha256: str
    data: bytes
    def __init__(self, job_id: _Optional[str] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("optimizer_steps",)
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    optimizer_steps: int
    def __init__(self, optimizer_steps: _Optional[int] = ...) -> None: ...

class SaveReply(_message.Message):
    __slots__ = ("sha256", "bytes")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    bytes: int
    def __init__(self, sha256: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("address", "host", "device", "memory_bytes", "metrics_port", "peak_flops")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    address: str
    host: str
    device: str
    memory_bytes: int
    metrics_port: int
    peak_flops: float
    def __init__(self, address: _Optional[str] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., metrics_port: _Optional[int] = ..., peak_flops: _Optional[float] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("server_id", "heartbeat_interval_s", "incarnation")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    heartbeat_interval_s: float
    incarnation: str
    def __init__(self, server_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("server_id",)
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    def __init__(self, server_id: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("config_toml", "overrides")
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    config_toml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, config_toml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "coordinates", "server_address", "chunks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    COORDINATES_FIELD_NUMBER: _ClassVar[int]
    SERVER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    coordinates: Coordinates
    server_address: str
    chunks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., coordinates: _Optional[_Union[Coordinates, _Mapping]] = ..., server_address: _Optional[str] = ..., chunks: _Optional[_Iterable[int]] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("step", "loss", "tokens", "step_seconds", "tokens_per_second", "grad_norm", "lr", "bubble_seconds", "ranks", "block_control_seconds", "block_steps", "idle_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CONTROL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STEPS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    tokens: int
    step_seconds: float
    tokens_per_second: float
    grad_norm: float
    lr: float
    bubble_seconds: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankMemory]
    block_control_seconds: float
    block_steps: int
    idle_seconds: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., bubble_seconds: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankMemory, _Mapping]]] = ..., block_control_seconds: _Optional[float] = ..., block_steps: _Optional[int] = ..., idle_seconds: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "step", "steps", "error", "ranks", "groups", "layout", "last", "checkpoint", "reason", "events_dropped")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    step: int
    steps: int
    error: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    layout: str
    last: StepEvent
    checkpoint: str
    reason: str
    events_dropped: int
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., error: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., layout: _Optional[str] = ..., last: _Optional[_Union[StepEvent, _Mapping]] = ..., checkpoint: _Optional[str] = ..., reason: _Optional[str] = ..., events_dropped: _Optional[int] = ...) -> None: ...

class CheckpointEvent(_message.Message):
    __slots__ = ("kind", "step", "manifest", "stall_seconds", "write_seconds", "bytes", "load_seconds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    step: int
    manifest: str
    stall_seconds: float
    write_seconds: float
    bytes: int
    load_seconds: float
    def __init__(self, kind: _Optional[str] = ..., step: _Optional[int] = ..., manifest: _Optional[str] = ..., stall_seconds: _Optional[float] = ..., write_seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class RecoveryEvent(_message.Message):
    __slots__ = ("attempt", "failure", "lost", "restart_step", "detected_unix", "recover_seconds", "grid", "microbatches", "resized")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    RESTART_STEP_FIELD_NUMBER: _ClassVar[int]
    DETECTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    RECOVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    RESIZED_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    failure: str
    lost: _containers.RepeatedScalarFieldContainer[str]
    restart_step: int
    detected_unix: float
    recover_seconds: float
    grid: Coordinates
    microbatches: int
    resized: str
    def __init__(self, attempt: _Optional[int] = ..., failure: _Optional[str] = ..., lost: _Optional[_Iterable[str]] = ..., restart_step: _Optional[int] = ..., detected_unix: _Optional[float] = ..., recover_seconds: _Optional[float] = ..., grid: _Optional[_Union[Coordinates, _Mapping]] = ..., microbatches: _Optional[int] = ..., resized: _Optional[str] = ...) -> None: ...

class EvalEvent(_message.Message):
    __slots__ = ("step", "loss", "perplexity", "samples", "tokens", "seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    perplexity: float
    samples: int
    tokens: int
    seconds: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., perplexity: _Optional[float] = ..., samples: _Optional[int] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GrowEvent(_message.Message):
    __slots__ = ("step", "grid", "microbatches", "before", "before_microbatches", "added", "seconds", "reason")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    BEFORE_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    grid: Coordinates
    microbatches: int
    before: Coordinates
    before_microbatches: int
    added: _containers.RepeatedScalarFieldContainer[str]
    seconds: float
    reason: str
    def __init__(self, step: _Optional[int] = ..., grid: _Optional[_Union[Coordinates, _Mapping]] = ..., microbatches: _Optional[int] = ..., before: _Optional[_Union[Coordinates, _Mapping]] = ..., before_microbatches: _Optional[int] = ..., added: _Optional[_Iterable[str]] = ..., seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("step", "status", "checkpoint", "recovery", "eval", "grow")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    GROW_FIELD_NUMBER: _ClassVar[int]
    step: StepEvent
    status: JobStatus
    checkpoint: CheckpointEvent
    recovery: RecoveryEvent
    eval: EvalEvent
    grow: GrowEvent
    def __init__(self, step: _Optional[_Union[StepEvent, _Mapping]] = ..., status: _Optional[_Union[JobStatus, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointEvent, _Mapping]] = ..., recovery: _Optional[_Union[RecoveryEvent, _Mapping]] = ..., eval: _Optional[_Union[EvalEvent, _Mapping]] = ..., grow: _Optional[_Union[GrowEvent, _Mapping]] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("server_id", "address", "host", "device", "state", "job_id", "memory_bytes", "metrics_port", "peak_flops", "heartbeat_age_s", "heartbeat_gap_max_s")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_GAP_MAX_S_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    host: str
    device: str
    state: str
    job_id: str
    memory_bytes: int
    metrics_port: int
    peak_flops: float
    heartbeat_age_s: float
    heartbeat_gap_max_s: float
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., state: _Optional[str] = ..., job_id: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., metrics_port: _Optional[int] = ..., peak_flops: _Optional[float] = ..., heartbeat_age_s: _Optional[float] = ..., heartbeat_gap_max_s: _Optional[float] = ...) -> None: ...

class ServerList(_message.Message):
    __slots__ = ("servers",)
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("job_id", "step", "profile_rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROFILE_RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    profile_rank: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., profile_rank: _Optional[int] = ...) -> None: ...

class PipelineProgram(_message.Message):
    __slots__ = ("pipeline_rank", "actions")
    PIPELINE_RANK_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    pipeline_rank: int
    actions: _containers.RepeatedCompositeFieldContainer[Action]
    def __init__(self, pipeline_rank: _Optional[int] = ..., actions: _Optional[_Iterable[_Union[Action, _Mapping]]] = ...) -> None: ...

class StepTrace(_message.Message):
    __slots__ = ("job_id", "step", "reports", "programs", "ranks", "grid", "schedule", "vpp", "microbatches", "zero", "traced_steps", "profiled_ranks", "profile_notes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    VPP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    TRACED_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROFILED_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_NOTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    reports: _containers.RepeatedCompositeFieldContainer[StepReport]
    programs: _containers.RepeatedCompositeFieldContainer[PipelineProgram]
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    grid: Coordinates
    schedule: str
    vpp: int
    microbatches: int
    zero: int
    traced_steps: _containers.RepeatedScalarFieldContainer[int]
    profiled_ranks: _containers.RepeatedScalarFieldContainer[int]
    profile_notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., reports: _Optional[_Iterable[_Union[StepReport, _Mapping]]] = ..., programs: _Optional[_Iterable[_Union[PipelineProgram, _Mapping]]] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., grid: _Optional[_Union[Coordinates, _Mapping]] = ..., schedule: _Optional[str] = ..., vpp: _Optional[int] = ..., microbatches: _Optional[int] = ..., zero: _Optional[int] = ..., traced_steps: _Optional[_Iterable[int]] = ..., profiled_ranks: _Optional[_Iterable[int]] = ..., profile_notes: _Optional[_Iterable[str]] = ...) -> None: ...
