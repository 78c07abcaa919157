"""Predicts, per rank, the bytes a stage server's ledger (stageserver/memory.py) reports:
state held at the end of a step by kind, and peaks during it.

State follows the ZeRO paper's accounting (Rajbhandari et al. 2020, section 5) on this
system's buffers (stageserver/sharded_bucket.py), with Ψ a bucket's parameters padded to
a multiple of dp, S = Ψ/dp, a the compute dtype's bytes and m the master dtype's (4 for
fp32 and bf16, 8 for fp64):

    stage  parameters        gradients              optimizer
    0      aΨ                aΨ                     2mΨ  (+ mΨ master, bf16 only)
    1      aΨ                aΨ (+ mS, bf16)        2mS  (+ mS)
    2      aΨ                mS (aΨ while reducing) 2mS  (+ mS)
    3      aS (aΨ gathered)  mS (aΨ while reducing) 2mS  (+ mS)

(in mixed precision, a = 2 and m = 4: the paper's (2+2+K)Ψ with K = 12, plus the
fp32 gradient shard that the optimizer reads; in fp32 stage 1 writes that shard back
into its slice of the full gradient). Peaks come from walking the
rank's program in the order the executor runs it: activations per (chunk, microbatch)
from `activation_bytes` (from the forward to its backward B, or to its input-gradient
half I, after which what the weight-gradient half W reads is held until W), received
tensors until consumed, full-size gradients from a chunk's first B or W (I writes none)
to its reduction, gathered parameters from AG to RP, and the staging buffers of reductions and
gathers until they are waited.

Pipeline messages (stageserver/pipeline_messages.py): with tp > 1 and scatter/gather or
sequence parallelism, what a send holds and a receive buffer takes is 1/tp of the
hidden states; under sequence parallelism the hidden states themselves are (the
residual stream's s/tp tokens), so a local hand-over between chunks shrinks too, while
under scatter/gather a received message is gathered back to the whole tensor, which
the chunk keeps as its input (activation_bytes counts it). Sequence parallelism's one
reduction of the replicated parameters' gradients over the tensor group stages them at
the optimizer step.
"""

from __future__ import annotations

from interleaf.common.buckets import BucketLayout, bucket_cap_bytes, chunk_buckets, clip_segments, starts_in_backward
from interleaf.common.overlapped_reductions import overlapped_reductions
from interleaf.common.memory import MemoryLedger
from interleaf.common.model.config import shape_of
from interleaf.common.model.params import TIED
from interleaf.common.model.recompute_modes import block_modes
from interleaf.common.model.shapes import chunk_param_specs, local_numel
from interleaf.common.pipeline_message_modes import message_mode
from interleaf.coordinator.activation_bytes import (
    chunk_activation_bytes,
    chunk_input_bytes,
    head_loss_temporaries_bytes,
    weight_grad_bytes,
    weight_grads_read_input,
)
from interleaf.coordinator.config import MASTER_BYTES, PRECISION_BYTES, JobConfig
from interleaf.coordinator.partition import Chunk, chunks_of, partition
from interleaf.protos.actions import RECVS, SENDS, Action, Kind


def bucket_names(config: JobConfig, chunk: Chunk) -> tuple[dict, dict[str, int], list[list[str]]]:
    """(specs, elements on one tp rank, names per bucket) of a chunk's parameters: [the
    tied embedding,] the rest cut by parallel.bucket_mb, in the order a backward finishes
    them (the same split as stageserver/model_state.py makes: common/buckets.py), from the
    parameters the chunk's ModelChunk would hold: the architecture's, with the
    vocabulary padded for tp."""
    p, t = config.parallel, config.parallel.tp
    specs = chunk_param_specs(shape_of(config.model), chunk.layers, chunk.has_embedding, chunk.has_head, t)
    sizes = {name: local_numel(spec, t) for name, spec in specs.items()}
    groups = chunk_buckets(list(sizes.items()), TIED, chunk.has_embedding, bucket_cap_bytes(p.bucket_mb),
                           PRECISION_BYTES[config.train.precision])
    return specs, sizes, groups


def bucket_sizes(config: JobConfig, chunk: Chunk) -> list[int]:
    """Parameters per bucket of a chunk on one tp rank (`bucket_names`)."""
    _, sizes, groups = bucket_names(config, chunk)
    return [sum(sizes[name] for name in group) for group in groups]


class _ProgramWalk:
    """One rank's program walked in the executor's order (stageserver/executor.py), with
    the allocations and releases it makes entered in a ledger: one handler per action
    kind, as the executor has."""

    def __init__(self, config: JobConfig, pipeline_rank: int, compiled: bool = False):
        p, t, m = config.parallel, config.train, config.model
        self.compiled, self.fp8_recipe = compiled, t.fp8_recipe
        self.a, self.m = PRECISION_BYTES[t.precision], MASTER_BYTES[t.precision]
        self.zero, self.dp, self.tp, self.model, self.precision = p.zero, p.dp, p.tp, m, t.precision
        self.recompute = t.recompute == "full"
        self.block_recompute = (t.recompute, t.recompute_layers)  # selective: inside the blocks
        self.sequence_parallel = p.sequence_parallel and p.tp > 1
        self.chunks = {c.index: c for c in chunks_of(partition(m.n_layers, p.pp, p.vpp, p.schedule, p.layers), pipeline_rank)}
        sizes = {c: bucket_sizes(config, chunk) for c, chunk in self.chunks.items()}
        # Padded elements per bucket, and of all of a chunk's.
        self.buckets = {c: [-(-n // p.dp) * p.dp for n in ns] for c, ns in sizes.items()}
        self.full = {c: sum(ns) for c, ns in self.buckets.items()}
        # The buckets the backward may start (common/buckets.py's starts_in_backward), and the rest.
        cap = bucket_cap_bytes(p.bucket_mb)
        self.early = {c: [b for b, n in enumerate(ns) if starts_in_backward(n, cap, self.a)] for c, ns in sizes.items()}
        self.late = {c: [b for b in range(len(ns)) if b not in self.early[c]] for c, ns in sizes.items()}
        self.overlap = p.overlap_grad_reduce
        self.overlapped: dict[int, int] = {}  # chunk -> microbatch of the B that starts its reductions
        self.shard = {c: n // p.dp for c, n in self.full.items()}
        self.rows = t.global_batch // (p.dp * p.microbatches)
        # The hidden states [rows, seq, d] a compute takes and gives (sequence parallel:
        # this rank's seq/tp), and what one pipeline message of them holds.
        tokens = m.seq_len // p.tp if self.sequence_parallel else m.seq_len
        self.hidden = self.rows * tokens * m.d_model * self.a
        self.message = message_bytes(config)
        # The most any data-parallel rank stages: ZeRO cuts the replicated elements
        # differently into each rank's shard.
        self.partial = self.m * max(partial_grad_elements(config, pipeline_rank, dp_rank)
                                    for dp_rank in range(config.parallel.dp)) if self.sequence_parallel else 0
        self.ledger = MemoryLedger()
        self.grads_held = {c: p.zero < 2 for c in self.chunks}
        self.pending: list[tuple[int, int, int]] = []  # (chunk, staged bytes, gradient bytes freed when done)
        # (chunk, microbatch) of each I whose W has not run -> [bytes counted for that W,
        # bytes of its input it reads that the previous chunk still counts].
        self.weights_owed: dict[tuple[int, int], list[int]] = {}
        self.handlers = {
            Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward,
            Kind.BACKWARD_INPUT: self._backward_input, Kind.BACKWARD_WEIGHT: self._backward_weight,
            Kind.RECV_ACT: self._receive, Kind.RECV_GRAD: self._receive,
            Kind.SEND_ACT: self._send, Kind.SEND_GRAD: self._send, Kind.EXCHANGE: self._exchange,
            Kind.REDUCE_GRADS: self._reduce, Kind.REDUCE_SCATTER_GRADS: self._reduce,
            Kind.GATHER_PARAMS: self._gather, Kind.RELEASE_PARAMS: self._release,
            Kind.REDUCE_TIED_GRADS: self._finish_all, Kind.OPTIMIZER_STEP: self._optimizer_step,
        }

    @property
    def separate(self) -> bool:
        return self.a != self.m  # bf16: master weights and reductions in fp32

    def run(self, program: list[Action]) -> dict[str, int]:
        a, m, zero = self.a, self.m, self.zero
        self.overlapped = overlapped_reductions(program)[0] if self.overlap else {}
        for c in self.chunks:  # what a step after the first starts with
            owned = self.full[c] if zero == 0 else self.shard[c]
            self.ledger.add("parameters", a * (self.shard[c] if zero == 3 else self.full[c]))
            shard_apart = zero >= 2 or zero == 1 and self.separate  # stage 1 fp32: in the full one
            self.ledger.add("gradients", (a * self.full[c] if zero < 2 else 0) + (m * self.shard[c] if shard_apart else 0))
            self.ledger.add("optimizer", 2 * m * owned + (m * owned if self.separate else 0))
        self.ledger.reset_peaks()
        for action in program:
            self.handlers[action.kind](action)
        heads = [c for c in self.chunks.values() if c.has_head]
        temporaries = head_loss_temporaries_bytes(self.model, self.rows, self.tp, self.precision,
                                                  self.sequence_parallel, self.compiled) if heads else 0
        return {**self.ledger.report(), "loss_temporaries_bytes": temporaries}

    def _activations(self, c: int) -> tuple[int, int]:
        """(kept from the forward to the backward, held during the backward)."""
        chunk = self.chunks[c]
        full = chunk_activation_bytes(self.model, len(chunk.layers), chunk.has_embedding, chunk.has_head,
                                      self.rows, self.tp, self.precision, self.sequence_parallel,
                                      block_modes(chunk.layers, *self.block_recompute), self.compiled,
                                      self.fp8_recipe)
        if self.recompute:
            return chunk_input_bytes(self.model, chunk.has_embedding, self.rows, self.precision, self.tp,
                                     self.sequence_parallel), full
        if c - 1 in self.chunks:
            full -= self.hidden  # the input is the previous chunk's output, counted there
        return full, full

    def _forward(self, action: Action) -> None:
        c = action.chunk
        if not self.chunks[c].has_embedding and c - 1 not in self.chunks:
            self.ledger.free("communication", self.message)  # the received input, now in use
        self.ledger.add("activations", self._activations(c)[0])

    def _weight_grad_bytes(self, c: int) -> tuple[int, int]:
        """What chunk c's I keeps of a microbatch for its W: (bytes counted for it, bytes
        of an input handed over locally that it reads). Such an input is the previous
        chunk's output, counted there as in the forward until that chunk's own B or I
        frees its activations; the input then moves to this W's account (the
        executor's stageserver/deferred_grads.py). Only gpt2's W reads it, in its first
        LayerNorm."""
        chunk = self.chunks[c]
        kept = weight_grad_bytes(self.model, len(chunk.layers), chunk.has_embedding, chunk.has_head,
                                 self.rows, self.tp, self.precision, self.sequence_parallel)
        if not self.recompute and c - 1 in self.chunks and weight_grads_read_input(self.model):
            return kept - self.hidden, self.hidden
        return kept, 0

    def _hold_grads(self, c: int) -> None:
        """B or W, which write c's full-size gradient: its reduction's last read of it
        is waited first, then it is held (again) until the next reduction. I writes
        none, so at ZeRO-2/3 a split backward holds it from the chunk's first W; but
        the head chunk's I writes the head's (stageserver/model/weight_grads.at_once),
        so that chunk holds it from its first I."""
        self._finish(c)
        if not self.grads_held[c]:
            self.ledger.add("gradients", self.a * self.full[c])
            self.grads_held[c] = True

    def _backward(self, action: Action) -> None:
        self._hold_grads(action.chunk)
        self._input_gradient(action)

    def _backward_input(self, action: Action) -> None:
        if self.chunks[action.chunk].has_head:
            self._hold_grads(action.chunk)
        self._input_gradient(action)
        counted, borrowed = self._weight_grad_bytes(action.chunk)
        self.ledger.add("activations", counted)
        self.weights_owed[(action.chunk, action.microbatch)] = [counted, borrowed]

    def _backward_weight(self, action: Action) -> None:
        owed = self.weights_owed.pop((action.chunk, action.microbatch), None)
        if owed is None:
            raise ValueError(f"{action} has no I before it: nothing is kept for it")
        self._hold_grads(action.chunk)
        self.ledger.free("activations", owed[0])

    def _input_gradient(self, action: Action) -> None:
        """B or I: the activations (rerun first under recompute) are freed, the
        output's gradient is consumed and the input's made. I then counts what it
        keeps for W: after the forward's are freed, as autograd frees each saved
        tensor as its backward passes it while the gradients W keeps are made one by
        one on the way, so the most held during I is about the larger of the two, not
        their sum."""
        c = action.chunk
        kept, held = self._activations(c)
        self.ledger.add("activations", held - kept)  # recompute's rerun
        if not self.chunks[c].has_head:  # the output's gradient, handed over or received
            self.ledger.free("communication", self.hidden if c + 1 in self.chunks else self.message)
        if action.kind is Kind.BACKWARD and self.overlapped.get(c) == action.microbatch:
            self._start_reductions(c, self.early[c], inside_backward=True)  # while its activations are held
        self.ledger.free("activations", held)
        owed = self.weights_owed.get((c + 1, action.microbatch))
        if owed and owed[1]:  # this chunk's output, which the next chunk's W still reads
            self.ledger.add("activations", owed[1])
            owed[0], owed[1] = owed[0] + owed[1], 0
        if not self.chunks[c].has_embedding and c - 1 in self.chunks:
            self.ledger.add("communication", self.hidden)  # the input's gradient, handed over

    def _receive(self, action: Action) -> None:
        self.ledger.add("communication", self.message)

    def _sent_bytes(self, action: Action) -> int:
        """What a send holds on the communication account until the network has it: an
        input gradient, or an output only recompute keeps (otherwise the output is
        counted among the activations)."""
        return self.message if action.kind is Kind.SEND_GRAD or self.recompute else 0

    def _send(self, action: Action) -> None:
        # Freed when the network has it: at once, as far as a model can know.
        self.ledger.add("communication", self._sent_bytes(action))
        self.ledger.free("communication", self._sent_bytes(action))

    def _exchange(self, action: Action) -> None:
        # As the executor posts the batch: the sends are held while the receive buffers
        # are counted; the sends are freed when the network has them, at once as far as
        # a model can know (the executor frees them when it reaps them).
        sent = sum(self._sent_bytes(op) for op in action.members if op.kind in SENDS)
        self.ledger.add("communication", sent)
        for op in action.members:
            if op.kind in RECVS:
                self._receive(op)
        self.ledger.free("communication", sent)

    def _reduce(self, action: Action) -> None:
        c = action.chunk
        for other in {e[0] for e in self.pending} - {c}:  # the executor waits the others' first
            self._finish(other)
        # Its last backward started all but the late ones, where it was armed.
        left = self.late[c] if self.overlapped.get(c) is not None else range(len(self.buckets[c]))
        self._start_reductions(c, left, inside_backward=False)

    def _start_reductions(self, c: int, buckets, inside_backward: bool) -> None:
        """Each bucket's reduction started (sharded_bucket.py's reduce): in bf16 its fp32
        copy staged, and under ZeRO the reduce-scatter's output; at stages 2/3 the
        bucket's full-size gradient goes, at once where its fp32 copy is what travels and
        the reduction starts after the backward, else when the reduction is done. Inside
        the backward each bucket's start first finishes the bucket before it (the
        executor's `_start_bucket`), in bucket order, the order the backward finishes them.
        `buckets`: the indices of those to start."""
        a, m = self.a, self.m
        for n in (self.buckets[c][b] for b in buckets):
            if inside_backward and self.pending and self.pending[-1][0] == c:
                self._finish_entry(self.pending.pop())
            staged = m * n if self.separate else 0
            if self.zero:
                staged += m * (n // self.dp)  # the reduce-scatter's output
            self.ledger.add("communication", staged)
            drops_now = self.separate and self.zero >= 2 and not inside_backward
            if drops_now:
                self.ledger.free("gradients", a * n)
            self.pending.append((c, staged, a * n if self.zero >= 2 and not drops_now else 0))
        if self.separate and self.zero >= 2 and not inside_backward and len(buckets) == len(self.buckets[c]):
            self.grads_held[c] = False  # every bucket's gradient dropped at its start

    def _finish(self, c: int) -> None:
        for entry in [e for e in self.pending if e[0] == c]:
            self.pending.remove(entry)
            self._finish_entry(entry)

    def _finish_entry(self, entry: tuple[int, int, int]) -> None:
        c, staged, freed = entry
        self.ledger.free("communication", staged)
        if self.zero == 0 and self.separate:
            self.ledger.add("gradients", staged)  # the fp32 sum, kept for the step
        if freed:
            self.ledger.free("gradients", freed)
            self.grads_held[c] = False

    def _finish_all(self, action: Action) -> None:
        for c in {e[0] for e in self.pending}:
            self._finish(c)

    def _gather(self, action: Action) -> None:
        if self.zero == 3:  # stages 1/2 gather into the parameters they hold
            self.ledger.add("parameters", self.a * self.full[action.chunk])

    def _release(self, action: Action) -> None:
        self.ledger.free("parameters", self.a * self.full[action.chunk])

    def _optimizer_step(self, action: Action) -> None:
        self._finish_all(action)
        if self.zero == 0 and self.separate:
            total = self.m * sum(self.full.values())
            if self.dp == 1:  # never reduced: the fp32 copy is made for the step
                self.ledger.add("gradients", total)
        self.ledger.add("communication", self.partial)  # sequence parallel: summed over tp
        self.ledger.free("communication", self.partial)
        if self.zero == 0 and self.separate:
            self.ledger.free("gradients", total)


def message_bytes(config: JobConfig) -> int:
    """What one pipeline message (an activation or its gradient) holds on one rank: the
    hidden states [rows, seq, d] of a microbatch, or 1/tp of them under scatter/gather
    or sequence parallelism (stageserver/pipeline_messages.py)."""
    p, t, m = config.parallel, config.train, config.model
    whole = t.global_batch // (p.dp * p.microbatches) * m.seq_len * m.d_model * PRECISION_BYTES[t.precision]
    return whole if message_mode(p.tp, p.sequence_parallel, p.scatter_gather) == "plain" else whole // p.tp


def sent_bytes_per_step(config: JobConfig, program: list[Action]) -> int:
    """Bytes one rank of a pipeline rank running `program` sends to its neighbours in a
    step: every activation and gradient message, lone or in an exchange."""
    sends = sum(1 for a in program if a.kind in SENDS)
    sends += sum(1 for a in program if a.kind is Kind.EXCHANGE for op in a.members if op.kind in SENDS)
    return sends * message_bytes(config)


def partial_grad_elements(config: JobConfig, pipeline_rank: int, dp_rank: int = 0) -> int:
    """Sequence parallel: the gradient elements of parameters replicated over tp (norms,
    row-parallel biases, wpe) in what the optimizer reads on this rank (its ZeRO shard
    at stages 1-3, which data-parallel ranks cut at different places), summed over the
    tensor group at the optimizer step (stageserver/model_state.py)."""
    p = config.parallel
    count = 0
    for chunk in chunks_of(partition(config.model.n_layers, p.pp, p.vpp, p.schedule, p.layers), pipeline_rank):
        specs = bucket_names(config, chunk)[0]
        for names in bucket_names(config, chunk)[2]:
            layout = BucketLayout.build([(n, local_numel(specs[n], p.tp)) for n in names], p.dp, dp_rank)
            window = (0, layout.padded) if p.zero == 0 else layout.shard
            replicated = layout.segments(n for n in names if specs[n].tp_dim is None)
            count += sum(end - start for start, end in clip_segments(replicated, window))
    return count


def predict_rank(config: JobConfig, program: list[Action], pipeline_rank: int, compiled: bool = False) -> dict[str, int]:
    """The ledger figures of any rank at this pipeline rank (dp and tp replicas hold
    equal shards), for a step after the first; `compiled`: its servers run the blocks
    through torch.compile (train.compile). Besides them, `loss_temporaries_bytes`: what
    the head chunk's forward holds for a moment beyond the ledger (0 on a rank without
    the head), which with_temporaries adds to the peak."""
    return _ProgramWalk(config, pipeline_rank, compiled).run(program)


def with_temporaries(prediction: dict[str, int]) -> int:
    """A rank's predicted peak with the loss's forward temporaries on top (what admission
    adds its reserve to): the head chunk's forward is at the step's peak or before it.
    The blocks' own forward temporaries are not counted, nor the allocator's rounding."""
    return prediction["peak_bytes"] + prediction["loss_temporaries_bytes"]


def predict(config: JobConfig, programs: list[list[Action]], device_type: str = "cpu") -> list[dict[str, int]]:
    """One prediction per pipeline rank (index = pipeline rank), for servers on
    `device_type` ("cpu", "cuda"), which decides whether train.compile="auto" compiles
    their blocks: compiled blocks keep less for their backward (activation_bytes.py)."""
    compiled = config.compiles_on(device_type)
    return [predict_rank(config, program, rank, compiled) for rank, program in enumerate(programs)]
