"""Runs one rank's step program: one dispatch loop, one handler per action kind.

The program comes from the coordinator (coordinator/schedule) and is the same every
step. Receives and exchanges (one tick's sends and receives as one batch) are posted
where the program puts them, often ahead of their consumer, and waited by the compute
that needs what they receive; sends are reaped as the network takes them (an
exchange's once its receives have been waited too). The
coordinator accepts only programs that run to the end even if every send and receive
were waited where posted, until its partner is there (rendezvous semantics, NCCL's),
so waiting later cannot deadlock either. Reductions and
parameter gathers start asynchronously and are waited where their result is needed: a
chunk's gather before its first compute that reads parameters (F, B, I; never W), its
reduction before its gradient is touched again (B, W; never I). Under
parallel.overlap_grad_reduce a chunk's last B starts each gradient bucket's reduction
as soon as it has written the bucket (bucket_readiness.py); the program's reduction
then starts only what that backward left.
A backward is B, or I then W (model/weight_grads.py): I computes the input gradient
and leaves the parameter gradients queued, W computes them.
Every tensor the step allocates or frees is entered in the model's memory ledger. A
failing action raises `StepError` naming the rank, the step and the action.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from dataclasses import dataclass, field

import torch

from interleaf.common.overlapped_reductions import overlapped_reductions
from interleaf.protos.actions import CATEGORIES, RECVS, REDUCTION, SENDS, Action, Kind
from interleaf.stageserver.activation_meter import ChunkActivations, parameter_storages
from interleaf.stageserver.compute_clock import ComputeClock
from interleaf.stageserver.deferred_grads import DeferredGrads
from interleaf.stageserver.memory import device_peak_bytes, nbytes, reset_peaks, rss_peak_bytes
from interleaf.stageserver.model.weight_grads import WeightGrads
from interleaf.stageserver.model_state import ModelState


def _check_finite(step: int, rank: int, losses: list[float], grad_norm: float) -> None:
    """A non-finite loss or gradient norm ends the job at that step: the parameters it
    updated are not to be trained on, or saved. The norm is global (every rank sees the
    same), so every rank stops at the same step and none waits on another."""
    bad_losses = [x for x in losses if not math.isfinite(x)]
    bad = [f"loss {bad_losses[0]} in {len(bad_losses)} of {len(losses)} microbatches"] if bad_losses else []
    if not math.isfinite(grad_norm):
        bad.append(f"gradient norm {grad_norm}")
    if bad:
        raise NonFiniteError(f"step {step}: non-finite {', '.join(bad)} on rank {rank}; the job stops here, and "
                             f"nothing after its last checkpoint is kept")


class NonFiniteError(ArithmeticError):
    """Training diverged: a loss or the gradient norm is NaN or infinite."""


_COMPUTES = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT,
                       Kind.OPTIMIZER_STEP})
"""The actions that compute (each runs one `ComputeClock.measure`); the rest of a step's
time is its idle time."""


class StepError(RuntimeError):
    pass


class StepCancelled(StepError):
    """The job was closed (a teardown, a dropped job, a signal) while this step ran."""


@dataclass
class StepStats:
    loss: float | None
    step_seconds: float
    compute_seconds: float
    comm_wait_seconds: float
    grad_norm: float
    lr: float
    memory: dict = field(default_factory=dict)
    # The part of step_seconds in which no compute (forward, backward, weight update)
    # ran: the executed timeline's bubble on this rank.
    idle_seconds: float = 0.0
    started_unix: float = 0.0
    # A traced step's executed timeline: (action, kind, start, end) in seconds from the
    # step's start (`_spans`); empty for other steps.
    spans: list = field(default_factory=list)
    # (op, group, seconds, bytes, calls) per pair: the job's CommMeter (transport/metered.py).
    comm: list = field(default_factory=list)
    # A traced step's torch.profiler Chrome trace and CUDA memory snapshot, gzip-compressed
    # (stageserver/profiling.py); empty unless trace.torch_profiler / memory_snapshot.
    torch_profile: bytes = b""
    memory_snapshot: bytes = b""


@dataclass
class _StepState:
    step: int
    # (chunk, microbatch) -> the chunk's input (requires grad unless tokens) and output.
    saved: dict = field(default_factory=dict)
    # (chunk, microbatch) -> (input activation that arrived for that chunk, the bytes it
    # holds on the ledger's communication account until used: 0 for a local hand-over,
    # which the previous chunk counts as its output).
    activations: dict = field(default_factory=dict)
    # (chunk, microbatch) -> (gradient of that chunk's output, its ledger bytes).
    output_grads: dict = field(default_factory=dict)
    # (chunk, microbatch) -> gradient of that chunk's input, waiting to be sent.
    input_grads: dict = field(default_factory=dict)
    # (chunk, microbatch) -> activation bytes its forward left for its backward.
    kept: dict = field(default_factory=dict)
    # (chunk, microbatch) -> its forward's WeightGrads, which an I fills for its W.
    weight_grads: dict = field(default_factory=dict)
    # What the I's left for their W's.
    deferred: DeferredGrads = field(default_factory=DeferredGrads)
    # (chunk, microbatch) -> output kept only for its send (recompute keeps no graph).
    outputs: dict = field(default_factory=dict)
    # Sends in flight, (work, tensor or an exchange's tensors, ledger bytes): what is
    # sent must stay alive until the network has it.
    sends: list = field(default_factory=list)
    # chunk -> started reductions / parameter gathers, waited when next needed.
    reductions: dict = field(default_factory=dict)
    gathers: dict = field(default_factory=dict)
    # chunk -> the buckets its last backward started reducing (overlap_grad_reduce).
    started_buckets: dict = field(default_factory=dict)
    # A traced step's bucket reductions: [reduction action text, start mark, landed mark
    # (None until seen done), its Pending].
    in_flight: list | None = None
    losses: list = field(default_factory=list)
    wait_s: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0


class _Posted:
    """Point-to-point work posted ahead of its use: waited once, by the first compute
    that needs what it receives or when reaped, the wait counted as communication."""

    def __init__(self, work, state: _StepState):
        self.work, self.state, self.done = work, state, False

    def wait(self) -> None:
        if not self.done:
            t0 = time.perf_counter()
            self.work.wait()
            self.state.wait_s += time.perf_counter() - t0
            self.done = True

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()


class Executor:
    def __init__(self, model: ModelState, program: list[Action], rank: int,
                 cancelled: threading.Event | None = None):
        self.model = model
        # Set when the job is closed: the step stops before its next action instead of
        # running to its end (a wait already posted still ends only when its peer
        # answers or goes away; see stageserver/main.py for how a server exits anyway).
        self.cancelled = cancelled or threading.Event()
        self.ledger = model.ledger
        self.program = program
        self.rank = rank
        self.recompute = model.train.recompute == "full"
        self.activations = ChunkActivations()
        self.clock = ComputeClock(model.device)
        self.handlers = {
            Kind.FORWARD: self._forward,
            Kind.BACKWARD: self._backward,
            Kind.BACKWARD_INPUT: self._backward_input,
            Kind.BACKWARD_WEIGHT: self._backward_weight,
            Kind.SEND_ACT: self._send,
            Kind.RECV_ACT: self._recv,
            Kind.SEND_GRAD: self._send,
            Kind.RECV_GRAD: self._recv,
            Kind.EXCHANGE: self._exchange,
            Kind.REDUCE_GRADS: self._reduce_grads,
            Kind.REDUCE_SCATTER_GRADS: self._reduce_grads,
            Kind.GATHER_PARAMS: self._gather,
            Kind.RELEASE_PARAMS: self._release,
            Kind.REDUCE_TIED_GRADS: self._reduce_tied_grads,
            Kind.OPTIMIZER_STEP: self._optimizer_step,
        }
        # chunk -> the microbatch of the backward that starts its buckets' reductions,
        # and the program's reduction action it stands in for (common/overlapped_reductions.py).
        self.overlapped, self.reductions = overlapped_reductions(program)
        if not model.overlap_grad_reduce:
            self.overlapped = {}

    def run_step(self, step: int, trace: bool = False) -> StepStats:
        """Runs the program once. `trace`: also time every action (two clock marks each;
        on a GPU, events on the compute stream, read at the step's end)."""
        state = _StepState(step, in_flight=[] if trace else None)
        reset_peaks(self.model.device)
        self.ledger.reset_peaks()
        marks = [] if trace else None
        started_unix, start = time.time(), time.perf_counter()
        self.clock.start_step()
        self.model.zero_grad()
        for index, action in enumerate(self.program):
            if self.cancelled.is_set():
                raise StepCancelled(f"rank {self.rank} step {step}: cancelled before action {index} ({action})")
            try:
                if marks is not None:
                    marks.append(self.clock.mark())
                self.handlers[action.kind](action, state)
                self._reap_sends(state, block=False)
                if state.in_flight:
                    self._note_landed(state.in_flight)
                if marks is not None:
                    marks.append(self.clock.mark())
            except Exception as err:
                raise StepError(
                    f"rank {self.rank} step {step} action {index} ({action}): {err}"
                ) from err
        self._reap_sends(state, block=True)
        if state.deferred.left():
            raise StepError(f"rank {self.rank} step {step}: no weight-gradient pass after "
                            f"{', '.join(f'I{c}.{m}' for c, m in state.deferred.left())}: the program lacks their W")
        for chunk in list(state.gathers):
            self._wait(state.gathers, chunk, state)
        if state.in_flight:
            self._note_landed(state.in_flight, every=True)
        # The step's one host synchronization: its losses and gradient norm. Each loss
        # stays on the device until here (a GPU would otherwise idle at every microbatch).
        losses = torch.stack(state.losses).double().tolist() if state.losses else []
        grad_norm = float(state.grad_norm)
        for group in self.model.groups.values():
            group.check()  # a watchdog's abort surfaces here
        _check_finite(step, self.rank, losses, grad_norm)
        step_seconds = time.perf_counter() - start
        computes = self.clock.computes()
        compute_seconds = sum(end - begin for begin, end in computes)
        return StepStats(
            loss=sum(losses) / len(losses) if losses else None,
            step_seconds=step_seconds,
            compute_seconds=compute_seconds,
            comm_wait_seconds=state.wait_s,
            grad_norm=grad_norm,
            lr=state.lr,
            memory=self._memory_report(),
            idle_seconds=max(0.0, step_seconds - compute_seconds),
            started_unix=started_unix,
            spans=self._spans(self.clock.seconds(marks), computes) + self._reduction_spans(state.in_flight or [])
            if marks is not None else [],
        )

    def _spans(self, marks: list[float], computes: list[tuple[float, float]]) -> list[tuple]:
        """Every action of the step as (text, kind, start, end). A compute action is its
        compute, preceded by a "wait" span for the time before it: waiting for its inputs
        (a receive, a gather, a reduction) and reading its samples. Each compute action
        measures exactly one compute, in program order."""
        spans, computed = [], iter(computes)
        for index, action in enumerate(self.program):
            begin, end, text = marks[2 * index], marks[2 * index + 1], str(action)
            if action.kind in _COMPUTES:
                compute_begin, compute_end = next(computed)
                if compute_begin > begin:
                    spans.append((text, "wait", begin, compute_begin))
                spans.append((text, CATEGORIES[action.kind], compute_begin, compute_end))
            else:
                spans.append((text, CATEGORIES[action.kind], begin, end))
        return spans

    def _reduction_spans(self, in_flight: list) -> list[tuple]:
        """A traced step's bucket reductions as (reduction action, REDUCTION, start, end):
        from when it started (inside a backward, under overlap_grad_reduce) until the
        executor saw it done: when it waited for it, when it started the next bucket, or
        at the end of an action (so at most that late)."""
        starts = self.clock.seconds([entry[1] for entry in in_flight])
        ends = self.clock.seconds([entry[2] for entry in in_flight])
        return [(entry[0], REDUCTION, start, end) for entry, start, end in zip(in_flight, starts, ends)]

    def _note_landed(self, in_flight: list, every: bool = False) -> None:
        """Marks the traced reductions done since the last look (`every`: all of them,
        at the step's end, when every one has been waited)."""
        for entry in in_flight:
            if entry[2] is None and (every or entry[3].done or entry[3].work.is_completed()):
                entry[2] = self.clock.mark()

    def _memory_report(self) -> dict:
        return dict(self.ledger.report(), rss_peak_bytes=rss_peak_bytes(),
                    device_peak_bytes=device_peak_bytes(self.model.device))

    def _wait(self, started: dict, chunk: int, state: _StepState) -> None:
        """Waits for the chunk's started collectives and runs what follows each."""
        pending = started.pop(chunk, [])
        if pending:
            t0 = time.perf_counter()
            for p in pending:
                p.wait()
            state.wait_s += time.perf_counter() - t0
            if state.in_flight:
                self._note_landed(state.in_flight)

    # -- compute ---------------------------------------------------------------

    def _ready(self, chunk: int, state: _StepState) -> None:
        """Waits for the chunk's gather; refuses to compute on released parameters (their
        storage holds no bytes: touching it would read freed memory)."""
        self._wait(state.gathers, chunk, state)
        if not self.model.gathered(chunk):
            raise RuntimeError(f"chunk {chunk}'s parameters are not gathered: the program "
                               f"lacks AG{chunk} before this compute")

    def _forward(self, a: Action, state: _StepState) -> None:
        chunk = self.model.chunks[a.chunk]
        self._ready(a.chunk, state)
        # Token ids feed the first chunk, targets the last; one read serves a chunk with both.
        tokens = self.model.microbatch(state.step, a.microbatch) if chunk.has_embedding or chunk.has_head else None
        if chunk.has_embedding:
            x = tokens[0]
        else:
            x = self._take(state.activations, (a.chunk, a.microbatch)).requires_grad_()
        targets = tokens[1] if chunk.has_head else None
        weight_grads = state.weight_grads[(a.chunk, a.microbatch)] = WeightGrads()
        with self.clock.measure():
            out, kept = self._run_forward(chunk, a.chunk, x, targets, keep_graph=not self.recompute,
                                          weight_grads=weight_grads)
        self.ledger.add("activations", kept)
        state.kept[(a.chunk, a.microbatch)] = kept
        state.saved[(a.chunk, a.microbatch)] = (x, None if self.recompute else out)
        if chunk.has_head:
            state.losses.append(out.detach())
        elif self.model.holds(a.chunk + 1):
            # Next chunk on this rank (pp=1): hand over locally, cut the graph as the
            # network would so each chunk's backward stays its own action.
            self._deliver(state.activations, (a.chunk + 1, a.microbatch), out.detach(), counted=0)
        elif self.recompute:
            state.outputs[(a.chunk, a.microbatch)] = out  # for the send that follows

    def _local_input(self, chunk, index: int) -> bool:
        """An input handed over locally by the previous chunk is that chunk's output and
        counted there (recompute keeps no outputs, so there the input counts here)."""
        return not chunk.has_embedding and self.model.holds(index - 1) and not self.recompute

    def _run_forward(self, chunk, index: int, x: torch.Tensor, targets, keep_graph: bool,
                     weight_grads: WeightGrads):
        """(output, activation bytes kept for the backward). The forward runs under its
        WeightGrads, so that an I of it can leave the parameter gradients to a W."""
        with weight_grads.recording():
            return self.activations.forward(chunk, index, x, targets, keep_graph, self._local_input(chunk, index))

    def _backward(self, a: Action, state: _StepState) -> None:
        """B: the input gradient and every parameter gradient in one backward. The
        chunk's last B of the step, under overlap_grad_reduce, starts each gradient
        bucket's reduction as soon as it has written that bucket."""
        if self.overlapped.get(a.chunk) != a.microbatch:
            self._input_grads(a, state, defer=False)
            return
        start = functools.partial(self._start_bucket, a.chunk, state, True)
        with self.model.readiness[a.chunk].armed(start) as started:
            self._input_grads(a, state, defer=False)
        state.started_buckets[a.chunk] = started

    def _backward_input(self, a: Action, state: _StepState) -> None:
        """I: B's backward, its parameter gradients left queued for W
        (model/weight_grads.py). What the queue holds (each parameter operation's input
        and output gradient) stays on the activation account until W; the rest of the
        chunk's activations go, as after B."""
        chunk = self.model.chunks[a.chunk]
        x, weight_grads = self._input_grads(a, state, defer=True)
        self.ledger.add("activations", state.deferred.keep((a.chunk, a.microbatch), weight_grads,
                                                           parameter_storages(chunk),
                                                           x if self._local_input(chunk, a.chunk) else None))

    def _backward_weight(self, a: Action, state: _StepState) -> None:
        """W: the parameter gradients its I left, added into .grad. Reads no parameter
        (a ZeRO-3 chunk may be released since its I) and communicates nothing."""
        key = (a.chunk, a.microbatch)
        weight_grads = state.deferred.queue(key)
        # The gradient buffer may still be read by this chunk's last reduction.
        self._wait(state.reductions, a.chunk, state)
        self.model.hold_grads(a.chunk)
        with self.clock.measure():
            weight_grads.run()
        self.ledger.free("activations", state.deferred.done(key))

    def _input_grads(self, a: Action, state: _StepState, defer: bool) -> tuple[torch.Tensor, WeightGrads]:
        """B's or I's backward: the output gradient in, the input gradient delivered or
        left for its send, the forward's activations freed. I writes no gradient
        buffer (its parameter gradients wait for W), so it neither waits for the chunk's
        reduction nor holds its gradients: at ZeRO-2/3 those exist from the first W;
        but the head chunk's I writes the head's (weight_grads.at_once), so it holds
        them from its first I."""
        key = (a.chunk, a.microbatch)
        x, out = state.saved.pop(key)
        weight_grads = state.weight_grads.pop(key)
        chunk = self.model.chunks[a.chunk]
        self._ready(a.chunk, state)
        if not defer or chunk.has_head:
            # The gradient buffer may still be read by this chunk's last reduction.
            self._wait(state.reductions, a.chunk, state)
            self.model.hold_grads(a.chunk)
        # Taken (its receive waited) before the clock starts: waiting is not compute.
        grad = None if chunk.has_head else self._take(state.output_grads, key)
        with self.clock.measure(), weight_grads.deferred() if defer else contextlib.nullcontext():
            self._run_backward(a, state, chunk, x, out, grad, weight_grads)
        self.ledger.free("activations", state.kept.pop(key))
        # This chunk's output, if the next one's W still reads it, is that W's from now on.
        self.ledger.add("activations", state.deferred.previous_freed((a.chunk + 1, a.microbatch)))
        if not chunk.has_embedding:
            if self.model.holds(a.chunk - 1):
                self._deliver(state.output_grads, (a.chunk - 1, a.microbatch), x.grad)
            else:
                state.input_grads[(a.chunk, a.microbatch)] = x.grad
        return x, weight_grads

    def _run_backward(self, a: Action, state: _StepState, chunk, x: torch.Tensor, out,
                      grad: torch.Tensor | None, weight_grads: WeightGrads) -> None:
        if out is None:  # recompute: rerun the forward with the graph this time
            targets = self.model.microbatch(state.step, a.microbatch)[1] if chunk.has_head else None
            out, rerun = self._run_forward(chunk, a.chunk, x, targets, keep_graph=True, weight_grads=weight_grads)
            # The rerun's count includes the kept input: only the rest is new.
            self.ledger.add("activations", rerun - state.kept[(a.chunk, a.microbatch)])
            state.kept[(a.chunk, a.microbatch)] = rerun
        if chunk.has_head:
            # The step's loss is the mean over microbatches: scale each one's share.
            (out / self.model.microbatches).backward()
        else:
            out.backward(grad)

    # -- point to point ----------------------------------------------------------

    def _outgoing(self, a: Action, state: _StepState) -> tuple[torch.Tensor, int]:
        """What a send moves (under scatter/gather this rank's piece of the tensor:
        stageserver/pipeline_messages.py), and the bytes it holds on the communication
        account until the network has it."""
        messages = self.model.messages
        if a.kind is Kind.SEND_GRAD:
            tensor = messages.outgoing(state.input_grads.pop((a.chunk, a.microbatch)), keep_whole=False)
            return tensor, nbytes(tensor)
        if self.recompute:
            tensor = messages.outgoing(state.outputs.pop((a.chunk, a.microbatch)), keep_whole=False)
            return tensor, nbytes(tensor)  # kept by nothing else once the forward is done
        # The output is counted among the chunk's activations.
        return messages.outgoing(state.saved[(a.chunk, a.microbatch)][1].detach(), keep_whole=True), 0

    def _send(self, a: Action, state: _StepState) -> None:
        tensor, counted = self._outgoing(a, state)
        self.ledger.add("communication", counted)
        # Left in flight: the receiver posts the matching receive at this same tick
        # (coordinator/schedule/fuse.py), so waiting here would be as correct, only slower.
        state.sends.append((self.model.pp.send(tensor, a.peer, self.model.tag(a)), tensor, counted))

    def _exchange(self, a: Action, state: _StepState) -> None:
        """One tick's sends and receives, posted as one batch. Each neighbour posts its
        matching batch at the same tick, so under rendezvous semantics all of them can
        complete; posted one at a time they could not (each rank's first send would
        wait for a receive its peer posts only later). Like a lone receive, the batch is
        waited by the first compute that needs what it receives, and reaped with the
        sends."""
        sends = [(op, *self._outgoing(op, state)) for op in a.members if op.kind in SENDS]
        receives = [(op, self.model.activation_buffer()) for op in a.members if op.kind in RECVS]
        sent = sum(counted for _, _, counted in sends)
        self.ledger.add("communication", sent)
        tag = self.model.tag
        posted = _Posted(self.model.pp.exchange([(t, op.peer, tag(op)) for op, t, _ in sends],
                                                [(b, op.peer, tag(op)) for op, b in receives]), state)
        for op, buffer in receives:
            self._deliver(self._inbox(op, state), (op.chunk, op.microbatch), buffer, posted=posted)
        if sends:
            state.sends.append((posted, [t for _, t, _ in sends], sent))

    def _reap_sends(self, state: _StepState, block: bool) -> None:
        """Drops sends the network has taken (all of them, waiting, when `block`)."""
        while state.sends and (block or state.sends[0][0].is_completed()):
            work, _, counted = state.sends.pop(0)
            work.wait()
            self.ledger.free("communication", counted)

    def _deliver(self, store: dict, key: tuple[int, int], tensor: torch.Tensor,
                 counted: int | None = None, posted: _Posted | None = None) -> None:
        """Leaves an input for a compute, on the communication account until it is used;
        `posted` is the receive still filling it."""
        counted = nbytes(tensor) if counted is None else counted
        self.ledger.add("communication", counted)
        store[key] = (tensor, counted, posted)

    def _take(self, store: dict, key: tuple[int, int]) -> torch.Tensor:
        tensor, counted, posted = store.pop(key)
        if posted is not None:  # received: a message, gathered into the whole under scatter/gather
            posted.wait()
            tensor = self.model.messages.incoming(tensor)
        self.ledger.free("communication", counted)
        return tensor

    def _inbox(self, a: Action, state: _StepState) -> dict:
        """Where a received tensor waits for its compute: a forward's input activation, or
        a backward's output gradient."""
        return state.activations if a.kind is Kind.RECV_ACT else state.output_grads

    def _recv(self, a: Action, state: _StepState) -> None:
        # Posted here, which may be ahead of the consumer (coordinator/schedule/fuse.py),
        # and waited by it: the transfer overlaps the compute in between.
        buffer = self.model.activation_buffer()
        posted = _Posted(self.model.pp.recv(buffer, a.peer, self.model.tag(a)), state)
        self._deliver(self._inbox(a, state), (a.chunk, a.microbatch), buffer, posted=posted)

    # -- ZeRO: gradient reductions and parameter gathers ------------------------------

    def _reduce_grads(self, a: Action, state: _StepState) -> None:
        if (a.kind is Kind.REDUCE_GRADS) != (self.model.zero == 0):
            raise RuntimeError(f"{a} does not belong in a ZeRO stage {self.model.zero} program")
        # The other chunks' reductions have had the backwards since they started to
        # overlap with: waiting for them here, not at the step's end, frees their staging
        # buffers (and at stages 2/3 the full-size gradients) before this chunk's are taken.
        for chunk in [c for c in state.reductions if c != a.chunk]:
            self._wait(state.reductions, chunk, state)
        started = state.started_buckets.pop(a.chunk, set())
        for bucket in range(len(self.model.buckets[a.chunk])):
            if bucket not in started:
                self._start_bucket(a.chunk, state, False, bucket)

    def _start_bucket(self, chunk: int, state: _StepState, inside_backward: bool, bucket: int) -> None:
        """Starts one gradient bucket's data-parallel reduction, waited when the chunk's
        gradient is next needed. Inside the backward, the bucket the backward finished
        before it is waited first, as FSDP2 waits its previous reduce-scatter: it has had
        this bucket's computing to overlap with, and one bucket's staging at a time is
        all the backward then adds to what it holds. A GPU's wait only orders the
        streams; a CPU's blocks the backward, and stays in its span (the step's
        communication wait leaves it out, as it does a tensor group's calls)."""
        if inside_backward and state.reductions.get(chunk):
            state.reductions[chunk].pop().wait()
            if state.in_flight:
                self._note_landed(state.in_flight)
        pending = self.model.start_bucket_reduction(chunk, bucket, inside_backward)
        state.reductions.setdefault(chunk, []).append(pending)
        if state.in_flight is not None:
            state.in_flight.append([self.reductions[chunk], self.clock.mark(), None, pending])

    def _gather(self, a: Action, state: _StepState) -> None:
        if self.model.zero == 0:
            raise RuntimeError(f"{a} does not belong in a ZeRO stage 0 program")
        state.gathers.setdefault(a.chunk, []).extend(self.model.start_gather(a.chunk))

    def _release(self, a: Action, state: _StepState) -> None:
        self._wait(state.gathers, a.chunk, state)
        self.model.release(a.chunk)

    def _finish_reductions(self, state: _StepState) -> None:
        for chunk in list(state.reductions):
            self._wait(state.reductions, chunk, state)

    def _reduce_tied_grads(self, a: Action, state: _StepState) -> None:
        # The embedding's gradient is what the reductions write: let them land first.
        self._finish_reductions(state)
        t0 = time.perf_counter()
        self.model.reduce_tied_grads()
        state.wait_s += time.perf_counter() - t0

    def _optimizer_step(self, a: Action, state: _StepState) -> None:
        self._finish_reductions(state)
        with self.clock.measure():
            state.grad_norm, state.lr = self.model.optimizer_step(state.step)
