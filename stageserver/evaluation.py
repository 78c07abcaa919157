"""Scoring the held-out set: one rank's forward-only program (coordinator/schedule/
forward_only.py) run by the executor's own dispatch loop, in an evaluation mode.

What differs from a training step: forwards run under `torch.no_grad()` and keep
nothing for a backward (no graph, no activations on the ledger: a chunk's output lives
only until it is sent or handed to the next chunk), their samples are the fixed
evaluation set's (stageserver/data/holdout.py) rather than the step's, and the program
has no backward, reduction or optimizer step, so gradients are never touched. Sends,
receives, exchanges and ZeRO-3's gathers and releases are the training handlers.

The loss: each microbatch's mean next-token loss (all microbatches have the same rows
and seq_len, so their mean is the mean over every scored token of this replica); the
driver weights replicas by their tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from interleaf.protos.actions import Action, Kind
from interleaf.stageserver.data.holdout import EvalSet
from interleaf.stageserver.executor import (
    Executor,
    StepCancelled,
    StepError,
    _StepState,
)

_EVAL_KINDS = (Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.EXCHANGE, Kind.GATHER_PARAMS, Kind.RELEASE_PARAMS)


@dataclass
class EvalStats:
    loss: float | None  # this replica's mean over its scored tokens (None: it holds no head)
    tokens: int
    seconds: float


class Evaluator(Executor):
    def __init__(self, model, program: list[Action], rank: int, eval_set: EvalSet | None, microbatches: int,
                 cancelled=None):
        """`eval_set`: None on a rank with neither the embedding nor the loss, which reads
        no tokens (its chunks take and send activations only)."""
        super().__init__(model, program, rank, cancelled)
        unknown = sorted({a.kind.name for a in program if a.kind not in _EVAL_KINDS})
        if unknown:
            raise ValueError(f"an evaluation program runs forwards only; it holds {', '.join(unknown)}")
        self.eval_set = eval_set
        self.microbatches = microbatches
        # A send takes its tensor from `outputs`, as under full recompute: nothing else
        # keeps a forward's output here.
        self.recompute = True
        self.handlers = {kind: self.handlers[kind] for kind in _EVAL_KINDS}
        self.handlers[Kind.FORWARD] = self._forward_only

    def evaluate(self) -> EvalStats:
        state = _StepState(-1)
        started = time.perf_counter()
        self.clock.start_step()
        for index, action in enumerate(self.program):
            if self.cancelled.is_set():
                raise StepCancelled(f"rank {self.rank} evaluation: cancelled before action {index} ({action})")
            try:
                self.handlers[action.kind](action, state)
                self._reap_sends(state, block=False)
            except Exception as err:
                raise StepError(f"rank {self.rank} evaluation action {index} ({action}): {err}") from err
        self._reap_sends(state, block=True)
        for chunk in list(state.gathers):
            self._wait(state.gathers, chunk, state)
        for group in self.model.groups.values():
            group.check()
        # One host synchronization, as a step's.
        losses = torch.stack(state.losses).double().tolist() if state.losses else []
        rows = self.model.train.rows
        tokens = len(losses) * rows * self.model.config.seq_len
        return EvalStats(sum(losses) / len(losses) if losses else None, tokens, time.perf_counter() - started)

    def _samples(self, microbatch: int):
        rows = self.model.train.rows * self.model.dp.size  # the whole microbatch, every replica's rows
        inputs, targets = self.eval_set.microbatch(microbatch, rows, self.model.dp.rank, self.model.dp.size)
        device = self.model.device
        if device.type == "cpu":
            return inputs, targets
        return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    def _forward_only(self, a: Action, state: _StepState) -> None:
        chunk = self.model.chunks[a.chunk]
        self._ready(a.chunk, state)
        tokens = self._samples(a.microbatch) if chunk.has_embedding or chunk.has_head else None
        x = tokens[0] if chunk.has_embedding else self._take(state.activations, (a.chunk, a.microbatch))
        targets = tokens[1] if chunk.has_head else None
        with torch.no_grad(), self.clock.measure():
            out = chunk(x) if targets is None else chunk(x, targets)
        if chunk.has_head:
            state.losses.append(out)
        elif self.model.holds(a.chunk + 1):  # the next chunk is this rank's (pp=1)
            self._deliver(state.activations, (a.chunk + 1, a.microbatch), out)
        else:
            state.outputs[(a.chunk, a.microbatch)] = out  # for the send that follows
