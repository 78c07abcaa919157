"""Predicts, per rank, the bytes a stage server's ledger (stageserver/memory.py) reports:
state held at the end of a step by kind, and peaks during it.

State follows the ZeRO paper's accounting (Rajbhandari et al. 2020, section 5) on this
system's buffers (stageserver/sharded_bucket.py), with Ψ a bucket's parameters padded to
a multiple of dp, S = Ψ/dp, a the compute dtype's bytes and m the master dtype's (4 for
fp32 and bf16, 8 for fp64):

    stage  parameters        gradients              optimizer
    0      aΨ                aΨ                     2mΨ  (+ mΨ master, bf16 only)
    1      aΨ                aΨ + mS                2mS  (+ mS)
    2      aΨ                mS (aΨ while reducing) 2mS  (+ mS)
    3      aS (aΨ gathered)  mS (aΨ while reducing) 2mS  (+ mS)

(in mixed precision, a = 2 and m = 4: the paper's (2+2+K)Ψ with K = 12, plus the
master-dtype gradient shard that the optimizer reads). Peaks come from walking the
rank's program in the order the executor runs it: activations per (chunk, microbatch)
from `activation_bytes`, received tensors until consumed, full-size gradients from a
chunk's first backward to its reduction, gathered parameters from AG to RP, and the
staging buffers of reductions and gathers until they are waited.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.activation_bytes import chunk_activation_bytes, chunk_input_bytes
from coordinator.config import JobConfig
from coordinator.partition import Chunk, chunks_of, partition
from protos.actions import Action, Kind
from protos.memory import KINDS, memory_report

BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}
MASTER_BYTES = {"fp32": 4, "bf16": 4, "fp64": 8}


def bucket_sizes(config: JobConfig, chunk: Chunk) -> list[int]:
    """Parameters per bucket of a chunk on one tp rank: [tied embedding,] the rest
    (the same split as stageserver/model_state.py makes)."""
    m, t = config.model, config.parallel.tp
    d = m.d_model
    block = (2 * d) + (3 * d // t * d + 3 * d // t) + (d * d // t + d) + (2 * d) \
        + (4 * d // t * d + 4 * d // t) + (d * 4 * d // t + d)
    rest = len(chunk.layers) * block
    rest += m.seq_len * d if chunk.has_embedding else 0  # learned positions
    rest += 2 * d if chunk.has_head else 0  # final LayerNorm
    tied = [m.vocab_size // t * d] if chunk.has_embedding or chunk.has_head else []
    return tied + [rest]


@dataclass
class _Ledger:
    current: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    total_peak: int = 0

    def add(self, kind: str, n: int) -> None:
        self.current[kind] += n
        self.peak[kind] = max(self.peak[kind], self.current[kind])
        self.total_peak = max(self.total_peak, sum(self.current.values()))

    def reset_peaks(self) -> None:
        self.peak, self.total_peak = dict(self.current), sum(self.current.values())


def predict_rank(config: JobConfig, program: list[Action], pipeline_rank: int) -> dict[str, int]:
    """The ledger figures of any rank at this pipeline rank (dp and tp replicas hold
    equal shards), for a step after the first."""
    p, t, m = config.parallel, config.train, config.model
    a, mb, dp, zero = BYTES[t.precision], MASTER_BYTES[t.precision], p.dp, p.zero
    separate = a != mb
    chunks = {c.index: c for c in chunks_of(partition(m.n_layers, p.pp, p.vpp), pipeline_rank)}
    padded = {c: [-(-n // dp) * dp for n in bucket_sizes(config, chunk)] for c, chunk in chunks.items()}
    full = {c: sum(sizes) for c, sizes in padded.items()}  # elements over the chunk's buckets
    shard = {c: n // dp for c, n in full.items()}
    ledger = _Ledger()
    for c in chunks:  # what the step starts with
        ledger.add("parameters", a * (shard[c] if zero == 3 else full[c]))
        ledger.add("gradients", (a * full[c] if zero < 2 else 0) + (mb * shard[c] if zero else 0))
        owned = full[c] if zero == 0 else shard[c]
        ledger.add("optimizer", 2 * mb * owned + (mb * owned if separate else 0))
    ledger.reset_peaks()

    rows = t.global_batch // (dp * p.microbatches)
    hidden = rows * m.seq_len * m.d_model * a
    local = {c for c in chunks if c - 1 in chunks}  # input handed over on this rank
    recompute = t.recompute == "full"

    def kept(c: int) -> int:
        ch = chunks[c]
        full_acts = chunk_activation_bytes(m.d_model, m.n_heads, m.seq_len, m.vocab_size, len(ch.layers),
                                           ch.has_embedding, ch.has_head, rows, p.tp, t.precision)
        inputs = chunk_input_bytes(m.d_model, m.seq_len, ch.has_embedding, rows, t.precision)
        if c in local and not recompute:
            full_acts -= hidden  # counted as the previous chunk's output
        return (inputs, full_acts) if recompute else (full_acts, full_acts)

    grads_held = {c: zero < 2 for c in chunks}
    pending: dict[int, list[tuple[str, int, str, int]]] = {}  # chunk -> frees on completion
    gathers: dict[int, int] = {}
    inbox = 0

    def finish(c: int) -> None:
        for kind, n, then_kind, then_n in pending.pop(c, []):
            ledger.add(kind, -n)
            ledger.add(then_kind, then_n)
            if then_kind == "gradients" and then_n < 0:
                grads_held[c] = False

    for action in program:
        c = action.chunk
        if action.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            ledger.add("communication", hidden)
            inbox += 1
        elif action.kind is Kind.FORWARD:
            gathers.pop(c, None)
            if not chunks[c].has_embedding and c not in local:
                ledger.add("communication", -hidden)
            ledger.add("activations", kept(c)[0])
        elif action.kind is Kind.BACKWARD:
            gathers.pop(c, None)
            finish(c)
            if not grads_held[c]:
                ledger.add("gradients", a * full[c])
                grads_held[c] = True
            held, rerun = kept(c)
            ledger.add("activations", rerun - held)
            if not chunks[c].has_head and c + 1 not in chunks:
                ledger.add("communication", -hidden)
            ledger.add("activations", -rerun)
        elif action.kind is Kind.SEND_GRAD:
            # Sent as soon as written: on the ledger for a moment only (see _send).
            ledger.add("communication", hidden)
            ledger.add("communication", -hidden)
        elif action.kind is Kind.SEND_ACT and recompute:
            ledger.add("communication", hidden)
            ledger.add("communication", -hidden)
        elif action.kind in (Kind.REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS):
            staged = mb * full[c] if separate else 0
            if zero == 0:
                ledger.add("communication", staged)
                pending.setdefault(c, []).append(("communication", staged, "gradients", staged))
            else:
                ledger.add("communication", staged + mb * shard[c])
                release = -a * full[c] if zero >= 2 else 0
                pending.setdefault(c, []).append(("communication", staged + mb * shard[c],
                                                   "gradients", release))
        elif action.kind is Kind.GATHER_PARAMS:
            if zero == 3:
                ledger.add("parameters", a * full[c])
                gathers[c] = 1
            else:
                ledger.add("communication", a * shard[c])
        elif action.kind is Kind.RELEASE_PARAMS:
            ledger.add("parameters", -a * full[c])
        elif action.kind in (Kind.REDUCE_TIED_GRADS, Kind.OPTIMIZER_STEP):
            for chunk in list(pending):
                finish(chunk)
            if action.kind is Kind.OPTIMIZER_STEP and zero == 0 and separate:
                copies = sum(full[ch] for ch in chunks if p.dp == 1)  # cast at the step
                ledger.add("gradients", mb * copies)
                ledger.add("gradients", -mb * sum(full.values()))
    if zero in (1, 2):
        ledger.add("communication", -a * sum(shard.values()))
    return memory_report(ledger.current, ledger.peak, ledger.total_peak)


def predict(config: JobConfig, programs: list[list[Action]]) -> list[dict[str, int]]:
    """One prediction per pipeline rank (index = pipeline rank)."""
    return [predict_rank(config, program, rank) for rank, program in enumerate(programs)]


def memory_table(config: JobConfig, predictions: list[dict[str, int]]) -> str:
    """The prediction per pipeline rank as a table (its dp and tp replicas hold the same)."""
    p, t = config.parallel, config.train
    columns = [("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"),
               ("optimizer", "optimizer_bytes"), ("params peak", "parameters_peak_bytes"),
               ("grads peak", "gradients_peak_bytes"), ("activations peak", "activations_peak_bytes"),
               ("comm peak", "communication_peak_bytes"), ("peak", "peak_bytes")]
    header = ["pipeline rank"] + [name for name, _ in columns]
    rows = [[str(rank)] + [_mib(pred[key]) for _, key in columns] for rank, pred in enumerate(predictions)]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = [f"predicted memory per rank, MiB (ZeRO stage {p.zero}, {t.precision}, "
             f"recompute {t.recompute}; state at the end of a step, peaks during it):"]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *rows]]
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}"
