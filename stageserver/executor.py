"""Runs one rank's step program: one dispatch loop, one handler per action kind.

The program comes from the coordinator (coordinator/schedule) and is the same every
step. Sends are non-blocking and receives block, exactly as the coordinator's simulator
assumes, so a program it accepted cannot deadlock here. A failing action raises
`StepError` naming the rank, the step and the action.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from protos.actions import Action, Kind
from stageserver.model_state import ModelState


class StepError(RuntimeError):
    pass


@dataclass
class StepStats:
    loss: float | None
    step_seconds: float
    compute_seconds: float
    comm_wait_seconds: float
    grad_norm: float
    lr: float


@dataclass
class _StepState:
    step: int
    # (chunk, microbatch) -> the chunk's input (requires grad unless tokens) and output.
    saved: dict = field(default_factory=dict)
    # (chunk, microbatch) -> input activation that arrived for that chunk.
    activations: dict = field(default_factory=dict)
    # (chunk, microbatch) -> gradient of that chunk's output.
    output_grads: dict = field(default_factory=dict)
    # (chunk, microbatch) -> gradient of that chunk's input, waiting to be sent.
    input_grads: dict = field(default_factory=dict)
    # Sends in flight: their tensors must stay alive until the network has them.
    sends: list = field(default_factory=list)
    reductions: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    compute_s: float = 0.0
    wait_s: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0


class Executor:
    def __init__(self, model: ModelState, program: list[Action], rank: int):
        self.model = model
        self.program = program
        self.rank = rank
        self.handlers = {
            Kind.FORWARD: self._forward,
            Kind.BACKWARD: self._backward,
            Kind.SEND_ACT: self._send_act,
            Kind.RECV_ACT: self._recv_act,
            Kind.SEND_GRAD: self._send_grad,
            Kind.RECV_GRAD: self._recv_grad,
            Kind.REDUCE_GRADS: self._reduce_grads,
            Kind.REDUCE_TIED_GRADS: self._reduce_tied_grads,
            Kind.OPTIMIZER_STEP: self._optimizer_step,
        }

    def run_step(self, step: int) -> StepStats:
        state = _StepState(step)
        start = time.perf_counter()
        self.model.zero_grad()
        for index, action in enumerate(self.program):
            try:
                self.handlers[action.kind](action, state)
            except Exception as err:
                raise StepError(
                    f"rank {self.rank} step {step} action {index} ({action}): {err}"
                ) from err
        for work, _ in state.sends:
            work.wait()
        return StepStats(
            loss=sum(state.losses) / len(state.losses) if state.losses else None,
            step_seconds=time.perf_counter() - start,
            compute_seconds=state.compute_s,
            comm_wait_seconds=state.wait_s,
            grad_norm=state.grad_norm,
            lr=state.lr,
        )

    # -- compute ---------------------------------------------------------------

    def _forward(self, a: Action, state: _StepState) -> None:
        chunk = self.model.chunks[a.chunk]
        # Token ids feed the first chunk, targets the last; one read serves a chunk with both.
        tokens = self.model.microbatch(state.step, a.microbatch) if chunk.has_embedding or chunk.has_head else None
        if chunk.has_embedding:
            x = tokens[0]
        else:
            x = state.activations.pop((a.chunk, a.microbatch)).requires_grad_()
        targets = tokens[1] if chunk.has_head else None
        t0 = time.perf_counter()
        out = chunk(x, targets) if chunk.has_head else chunk(x)
        state.compute_s += time.perf_counter() - t0
        state.saved[(a.chunk, a.microbatch)] = (x, out)
        if chunk.has_head:
            state.losses.append(out.item())
        elif self.model.holds(a.chunk + 1):
            # Next chunk on this rank (pp=1): hand over locally, cut the graph as the
            # network would so each chunk's backward stays its own action.
            state.activations[(a.chunk + 1, a.microbatch)] = out.detach()

    def _backward(self, a: Action, state: _StepState) -> None:
        x, out = state.saved.pop((a.chunk, a.microbatch))
        chunk = self.model.chunks[a.chunk]
        t0 = time.perf_counter()
        if chunk.has_head:
            # The step's loss is the mean over microbatches: scale each one's share.
            (out / self.model.microbatches).backward()
        else:
            out.backward(state.output_grads.pop((a.chunk, a.microbatch)))
        state.compute_s += time.perf_counter() - t0
        if not chunk.has_embedding:
            if self.model.holds(a.chunk - 1):
                state.output_grads[(a.chunk - 1, a.microbatch)] = x.grad
            else:
                state.input_grads[(a.chunk, a.microbatch)] = x.grad

    # -- point to point ----------------------------------------------------------

    def _send_act(self, a: Action, state: _StepState) -> None:
        _, out = state.saved[(a.chunk, a.microbatch)]
        tensor = out.detach()
        state.sends.append((self.model.pp.send(tensor, a.peer, self.model.tag(a)), tensor))

    def _send_grad(self, a: Action, state: _StepState) -> None:
        tensor = state.input_grads.pop((a.chunk, a.microbatch))
        state.sends.append((self.model.pp.send(tensor, a.peer, self.model.tag(a)), tensor))

    def _receive(self, a: Action, state: _StepState) -> torch.Tensor:
        buffer = self.model.activation_buffer()
        t0 = time.perf_counter()
        self.model.pp.recv(buffer, a.peer, self.model.tag(a)).wait()
        state.wait_s += time.perf_counter() - t0
        return buffer

    def _recv_act(self, a: Action, state: _StepState) -> None:
        state.activations[(a.chunk, a.microbatch)] = self._receive(a, state)

    def _recv_grad(self, a: Action, state: _StepState) -> None:
        state.output_grads[(a.chunk, a.microbatch)] = self._receive(a, state)

    # -- gradient synchronisation and update ---------------------------------------

    def _reduce_grads(self, a: Action, state: _StepState) -> None:
        # Started now, waited at the optimizer step: overlaps the remaining backwards.
        state.reductions.append(self.model.start_dp_reduce(a.chunk))

    def _finish_reductions(self, state: _StepState) -> None:
        t0 = time.perf_counter()
        for work in state.reductions:
            work.wait()
        state.reductions.clear()
        state.wait_s += time.perf_counter() - t0

    def _reduce_tied_grads(self, a: Action, state: _StepState) -> None:
        # The embedding's gradient lives in chunk 0's flat buffer, which a data-parallel
        # reduction may still be writing: let those land first.
        self._finish_reductions(state)
        t0 = time.perf_counter()
        self.model.reduce_tied_grads()
        state.wait_s += time.perf_counter() - t0

    def _optimizer_step(self, a: Action, state: _StepState) -> None:
        self._finish_reductions(state)
        t0 = time.perf_counter()
        state.grad_norm, state.lr = self.model.optimizer_step(state.step)
        state.compute_s += time.perf_counter() - t0
