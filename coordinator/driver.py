"""Drives one job: claim servers, plan, set up (prepare, then connect), run steps with
one RunSteps call per server per block of steps, save, tear down.

Anything that fails tears the job down on every server it touched, so a failed or
cancelled job leaves no server holding state. A failure after which some of the job's
servers no longer answer is a lost server: the job goes to RECOVERING, forgets them,
and runs again on registered servers from its newest checkpoint (recovery.max_restarts).
An elastic job that went on with fewer replicas grows back to its submitted layout at a
checkpoint boundary once enough servers are free (coordinator/elastic.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import grpc

from interleaf.common.model.compile_modes import DEVICE_TYPES
from interleaf.coordinator.job_logs import start_job_logs
from interleaf.coordinator.jobs import JobRecord
from interleaf.coordinator.admission import needed_bytes
from interleaf.coordinator.checkpointing import Checkpointing
from interleaf.coordinator.config import JobConfig
from interleaf.coordinator.elastic import describe_change, describe_growth, grows_back, smaller_layouts
from interleaf.coordinator.evaluations import eval_allowance, eval_event, evaluated_in_block
from interleaf.coordinator.plan import JobPlan, ServerSlot, place_servers, plan_job, plan_programs, setup_requests
from interleaf.coordinator.registry import DEAD_AFTER_S, HEARTBEAT_INTERVAL_S, Registry
from interleaf.coordinator.traces import trace_plan, traced_in_block
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.protos.actions import Action
from interleaf.common import wire

log = logging.getLogger("interleaf.coordinator")

SETUP_TIMEOUT_S = 120.0
COMM_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 600.0
LOST_AFTER_S = 10.0  # a server that answers no Teardown in this long after a failure is lost


@dataclass
class _Recovery:
    attempt: int
    failure: str
    lost: list[str]
    detected_unix: float
    started: float  # perf_counter at detection


@dataclass
class _Growth:
    """An elastic job's way back to its submitted layout, claimed at a checkpoint
    boundary (parallel.elastic): the servers placed for it and the layout it leaves."""
    slots: list[ServerSlot]  # by rank of the submitted layout, already the job's in the registry
    step: int  # the boundary, whose checkpoint the grown layout resumes from
    before: JobConfig  # the smaller layout it ran with
    added: list[str]  # the servers it did not hold (address)
    reason: str
    started: float  # perf_counter at the boundary


class JobFailed(RuntimeError):
    pass


def _fan_out(fn, items):
    """Runs fn on every item at once (collective setup blocks until all arrive);
    returns results in order, raising the first failure."""
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        futures = [pool.submit(fn, i, item) for i, item in enumerate(items)]
        return [f.result() for f in futures]


def _needs_by_device(config, programs: list[list[Action]]) -> dict[str, int]:
    """The most bytes any rank of `config` needs on a server of each device type
    (admission.needed_bytes): placement holds each idle server to its own type's, since
    each server decides for itself whether it compiles its blocks."""
    return {device_type: max(needed_bytes(config, programs, device_type)) for device_type in DEVICE_TYPES}


class JobDriver(threading.Thread):
    def __init__(self, job: JobRecord, registry: Registry, store: tuple[str, int], steps_per_call: int = 8):
        super().__init__(name=f"driver-{job.job_id}", daemon=True)
        self.steps_per_call = steps_per_call
        self.job = job
        self.registry = registry
        self.store = store
        self.stubs: list[rpc.StageServerStub] = []
        self.plan: JobPlan | None = None
        self.channels: list = []
        self.silent: dict[int, str] = {}  # rank -> why its server was declared dead by heartbeat
        self.slowest_step_s = 0.0  # the longest any rank took for a step so far (warm-ups aside)
        self.slowest_eval_s = 0.0  # the longest any rank took for an evaluation so far
        self.first_step = 0  # of the current attempt: its warm-up
        self.addresses: list[str] = []
        self.checkpoints = Checkpointing(job, _fan_out, self._rpc_error)
        self.config = job.config  # the layout it runs under: the submitted one, or a smaller (elastic)
        self.resized = ""  # why self.config is not the submitted one (parallel.elastic)
        self.restarted: _Recovery | None = None  # set when resumed after a coordinator restart
        self._submitted_planned = None  # plan_programs(job.config), made once: each claim offers it
        self._submitted_need: dict[str, int] = {}  # the most bytes a rank of it needs by device type, once known
        self._connected = threading.Event()  # the attempt's servers set up and connected: a teardown strands no peer

    def run(self) -> None:
        job = self.job
        state, error = "SUCCEEDED", ""
        try:
            start_job_logs(job, self.registry)  # metrics.tensorboard_dir; ends with the job
            self._run_with_recovery()
        except Exception as err:
            log.exception("job %s failed", job.job_id)
            state, error = "FAILED", str(err)
        if job.cancel_requested.is_set():
            state = "CANCELLED"
            self._finish_save_quietly()  # nothing of the job's after its final state
        # Servers are freed before the final state is published: whoever sees it may
        # submit the next job at once. The state is published whatever the cleanup meets.
        try:
            self._teardown()
            self.checkpoints.close()
        finally:
            self.registry.release(job.job_id)
            job.set_state(state, error)

    def _run_with_recovery(self) -> None:
        """Runs the job; when it fails and some of its servers no longer answer, sets it
        up again on registered servers from its newest checkpoint (the data order and
        learning rate being functions of the step, the result is the uninterrupted
        run's), up to recovery.max_restarts times."""
        job, recovery, grown = self.job, self.restarted, None
        attempts = recovery.attempt if recovery else 0  # recoveries so far (a growth is none)
        while True:
            try:
                grown = self._attempt(recovery, grown)
                if grown is None:
                    return
                recovery = None  # announced by the attempt that ran
                self._leave_for_growth(grown)
            except Exception as caught:
                grown = None
                err = caught
                if self.silent:  # the cause, rather than what it broke
                    err = JobFailed("; ".join(self.silent[r] for r in sorted(self.silent)))
                detected, started = time.time(), time.perf_counter()
                lost = self._lost_servers()
                if job.cancel_requested.is_set():
                    raise err
                self.registry.forget([slot.server_id for slot in lost])  # whether or not the job goes on
                attempt = attempts + 1
                if not lost or attempt > job.config.recovery.max_restarts:
                    raise err
                attempts = attempt
                addresses = [slot.address for slot in lost]
                log.warning("job %s lost %s: %s; recovering (attempt %d)", job.job_id, addresses, err, attempt)
                job.set_state("RECOVERING", reason=f"lost {', '.join(addresses)}: {err}")
                self.registry.release(job.job_id)
                self._forget_attempt()
                self.checkpoints.recover()
                recovery = _Recovery(attempt, str(err), addresses, detected, started)

    def _attempt(self, recovery: "_Recovery | None", grown: "_Growth | None" = None) -> "_Growth | None":
        """One attempt: set up, resume, train. Returns how it grows back when it ended at
        a checkpoint boundary to do so (parallel.elastic), else None: the job is done."""
        job = self.job
        probes = self.checkpoints.probes()
        # Only a loss shrinks: after a coordinator restart (nothing lost) the servers
        # register again one by one, and the first few must not fix a smaller layout
        # for the rest of the job's life.
        plan = self._claim_and_plan(shrink=bool(recovery and recovery.lost) and job.config.parallel.elastic,
                                    grown=grown)
        if plan is None:
            return None  # cancelled while waiting for servers
        watch = threading.Event()
        threading.Thread(target=self._watch_heartbeats, args=(plan, watch), daemon=True,
                         name=f"heartbeats-{job.job_id}").start()
        try:
            return self._run_attempt(plan, probes, recovery, grown)
        except Exception:
            # Before any teardown (which empties the servers' spools), and while the
            # heartbeat watch still ends calls to a silent server.
            self._finish_save_quietly()
            raise
        finally:
            watch.set()

    def _watch_heartbeats(self, plan: JobPlan, done: threading.Event) -> None:
        """A server of the job that misses its heartbeats (dead, stopped, or cut off from
        us) is declared dead at once: closing its channel fails every call in flight to
        it, wherever the driver waits, instead of at that call's deadline."""
        while not done.wait(HEARTBEAT_INTERVAL_S / 2):
            for rank, slot in enumerate(plan.servers):
                silence = self.registry.silence(slot.server_id)
                if silence is not None and silence < DEAD_AFTER_S:
                    continue
                self.silent[rank] = (f"rank {rank} ({slot.address}) stopped heartbeating: none for "
                                     f"{DEAD_AFTER_S:.0f} s" if silence is not None else
                                     f"rank {rank} ({slot.address}) is no longer registered")
                log.warning("job %s: %s", self.job.job_id, self.silent[rank])
                self.channels[rank].close()
            if self.silent:
                return

    def _run_attempt(self, plan: JobPlan, probes: list[pb.FileRef], recovery: "_Recovery | None",
                     grown: "_Growth | None") -> "_Growth | None":
        job = self.job
        self._setup(plan, probes)
        # Connected (or stopped short of it by a cancel): from here a cancel tears down at once,
        # a checkpoint's load included, which holds no collective. Set before the flag is read.
        self._connected.set()
        if job.cancel_requested.is_set():
            return None  # cancelled while setting up: run() tears down what was set up
        first = self.checkpoints.resume(self.stubs) if self.checkpoints.resume_from else 0
        job.step = self.first_step = first
        job.set_state("RUNNING", reason=self.resized or (grown.reason if grown else ""))
        if recovery is not None:
            grid = pb.Coordinates(dp=plan.grid.dp, pp=plan.grid.pp, tp=plan.grid.tp)
            job.add_recovery(pb.RecoveryEvent(
                attempt=recovery.attempt, failure=recovery.failure, lost=recovery.lost, restart_step=first,
                detected_unix=recovery.detected_unix, recover_seconds=time.perf_counter() - recovery.started,
                grid=grid, microbatches=self.config.parallel.microbatches, resized=self.resized))
        if grown is not None:
            b = grown.before.parallel
            job.add_grow(pb.GrowEvent(
                step=first, grid=pb.Coordinates(dp=plan.grid.dp, pp=plan.grid.pp, tp=plan.grid.tp),
                microbatches=self.config.parallel.microbatches, before=pb.Coordinates(dp=b.dp, pp=b.pp, tp=b.tp),
                before_microbatches=b.microbatches, added=grown.added,
                seconds=time.perf_counter() - grown.started, reason=grown.reason))
        growth = self._train(plan, first)
        if growth is not None:
            self.checkpoints.finish()  # its manifest is what the grown layout resumes from
            return growth
        if job.config.checkpoint.dir and not job.cancel_requested.is_set():
            if self.checkpoints.saved_step != job.step:
                self._save(plan)  # the end, unless a periodic save just took it
            self.checkpoints.finish()
        return None

    def _leave_for_growth(self, grown: _Growth) -> None:
        """Ends the smaller attempt on its servers (the grown one loads the checkpoint of
        the boundary into every rank anew, resharded) and frees those the grown layout
        did not choose."""
        self._teardown()
        self._forget_attempt()
        self.silent = {}  # the smaller attempt's ranks: the grown one watches its own
        self.registry.release(self.job.job_id, keep=frozenset(s.server_id for s in grown.slots))
        self.checkpoints.recover()

    def _forget_attempt(self) -> None:
        self._connected.clear()
        for channel in self.channels:
            channel.close()
        self.plan, self.addresses, self.stubs, self.channels = None, [], [], []

    def _finish_save_quietly(self) -> None:
        try:  # a save already under way still completes, if the servers allow
            self.checkpoints.finish(timeout_s=self.job.config.recovery.progress_timeout_s)
        except Exception as late:
            log.warning("job %s: the save under way failed too: %s", self.job.job_id, late)

    def _lost_servers(self) -> list:
        """Tears the failed attempt down on every server; those declared dead by their
        heartbeats, and those that do not answer, are lost."""
        def teardown(rank, address):
            if rank in self.silent:
                return True
            channel = wire.channel(address)  # its own: the job's may have been closed
            try:
                rpc.StageServerStub(channel).Teardown(pb.JobRef(job_id=self.job.job_id), timeout=LOST_AFTER_S)
            except grpc.RpcError as err:
                return err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            finally:
                channel.close()
            return False

        if self.plan is None:
            return []
        lost = _fan_out(teardown, self.addresses)
        self.silent = {}
        return [slot for slot, gone in zip(self.plan.servers, lost) if gone]

    def _rpc_error(self, rank: int, err: grpc.RpcError) -> JobFailed:
        address = self.addresses[rank] if rank < len(self.addresses) else "?"
        return JobFailed(f"rank {rank} ({address}) {err.code().name}: {err.details()}")

    def resume_after_restart(self, detected_unix: float, started: float) -> None:
        """A job the previous coordinator left unfinished: its first attempt is a
        recovery's, from its newest checkpoint (attempt 0: a coordinator restart counts
        against no recovery.max_restarts, and loses no server)."""
        self.checkpoints.recover()
        self.restarted = _Recovery(0, "the coordinator restarted", [], detected_unix, started)

    def cancel(self) -> None:
        """Stops the job: once its servers are connected, now, tearing them down, which
        ends their RunSteps streams (or a checkpoint's load); one waiting for servers or
        setting up where that phase ends (_claim_and_plan within a second, _setup,
        _run_attempt), without a teardown meanwhile: a server torn down while its peers
        connect leaves them waiting out the communication timeout (120 s) for it,
        holding the job's servers all the while. The flag is set before `_connected` is
        read, and the driver sets `_connected` before it reads the flag, so that one of
        the two sees the other."""
        self.job.request_cancel()
        if self._connected.is_set():
            threading.Thread(target=self._teardown, name=f"cancel-{self.job.job_id}", daemon=True).start()

    # -- phases ------------------------------------------------------------------

    def _claim_and_plan(self, shrink: bool = False, grown: "_Growth | None" = None) -> JobPlan | None:
        """Waits for idle servers that can hold the submitted layout or, when `shrink`
        (an elastic job that lost servers), the largest smaller one they can (coordinator/
        elastic.py): it goes on at once rather than wait for replacements, and waits as
        any job does while none fits. Each time, the submitted layout is tried first; the
        smaller ones are planned only once it cannot be claimed. `grown`: the submitted
        layout's servers, claimed already at a checkpoint boundary (_claim_growth)."""
        job = self.job
        if grown is not None:
            if job.cancel_requested.is_set():
                return None  # run() frees what was claimed
            self.config, self.resized = job.config, ""
            return self._plan(grown.slots, self._submitted_programs(), reason=grown.reason)
        options, planned, choices = [], [], []
        chosen = {}

        def offer(config, programs=None) -> None:
            planned.append(programs or plan_programs(config))
            options.append(config)
            programs = planned[-1][0]
            choices.append(partial(place_servers, config, need_bytes=_needs_by_device(config, programs)))

        def choose(idle):
            for index, place in enumerate(choices):
                if (slots := place(idle)) is not None:
                    chosen.update(index=index, idle=len(idle))
                    return slots
            return None

        offer(job.config, self._submitted_programs())
        # A job cancelled before its driver started (CancelJob during SubmitJob) claims nothing.
        slots = None if job.cancel_requested.is_set() else self.registry.claim(job.job_id, choose, timeout_s=0.0)
        if slots is None and shrink:  # planned outside the registry's lock: it may take a while
            for config in smaller_layouts(job.config):
                offer(config)
        while slots is None and not job.cancel_requested.is_set():
            slots = self.registry.claim(job.job_id, choose, timeout_s=1.0)
        if slots is None:
            return None
        index = chosen["index"]
        self.config = options[index]
        self.resized = describe_change(job.config, self.config, chosen["idle"]) if index else ""
        if self.resized:
            log.warning("job %s: %s", job.job_id, self.resized)
        return self._plan(slots, planned[index])

    def _plan(self, slots: list[ServerSlot], planned, reason: str = "") -> JobPlan:
        """Plans self.config on the claimed `slots` (by rank) and opens their channels."""
        job = self.job
        plan = plan_job(self.config, slots, planned)
        self.plan = plan
        job.layout, job.ranks, job.groups = plan.layout(), plan.rank_infos(), plan.groups()
        self.addresses = [s.address for s in plan.servers]
        self.channels = [wire.channel(a) for a in self.addresses]
        self.stubs = [rpc.StageServerStub(c) for c in self.channels]
        job.set_state("SETTING_UP", reason=reason)
        return plan

    def _submitted_programs(self):
        """plan_programs of the submitted layout, made once for the job's life."""
        if self._submitted_planned is None:
            self._submitted_planned = plan_programs(self.job.config)
        return self._submitted_planned

    def _claim_growth(self, step: int) -> _Growth | None:
        """At a checkpoint boundary of an elastic job that shrank: the servers for its
        submitted layout, when the idle ones with its own can hold it now, placed and
        admitted as at submit (admission.needed_bytes) and claimed at once, under the
        registry's lock, so no other job takes them meanwhile and none of another job's
        is offered. None, without waiting, otherwise, and while any job waits for servers
        (a running job's growth never keeps a queued one waiting): the job goes on as it
        is, and asks again at its next boundary. A server that registered during the steps before is
        simply idle here; one that has since stopped heartbeating is not offered."""
        job = self.job
        if job.cancel_requested.is_set() or not grows_back(job.config, self.config, step):
            return None
        if not self._submitted_need:  # predicted once: a shrunk job asks at every boundary
            self._submitted_need = _needs_by_device(job.config, self._submitted_programs()[0])
        choose = partial(place_servers, job.config, need_bytes=self._submitted_need)
        slots = self.registry.claim(job.job_id, choose, timeout_s=0.0, own=True)
        if slots is None:
            return None
        held = set(self.addresses)
        added = [s.address for s in slots if s.address not in held]
        reason = describe_growth(job.config, self.config, step, len(added))
        log.warning("job %s: %s", job.job_id, reason)
        return _Growth(slots, step, self.config, added, reason, time.perf_counter())

    def _setup(self, plan: JobPlan, probes: list[pb.FileRef]) -> None:
        job = self.job
        if job.cancel_requested.is_set():
            return  # cancelled as its servers were claimed: nothing set up yet
        prefix = f"{job.job_id}/{time.monotonic_ns()}"
        requests = setup_requests(job.job_id, self.config, plan, (*self.store, prefix), COMM_TIMEOUT_S,
                                  data_start=self.checkpoints.data_start,
                                  held_out=self.checkpoints.split["held_out_fraction"],
                                  # A resumed checkpoint replaces every weight: nothing to read before it.
                                  init_from="" if self.checkpoints.resume_from else self.config.checkpoint.init)
        for request in requests:
            request.probes.extend(probes)

        def prepare(rank, request):
            try:
                return self.stubs[rank].Setup(request, timeout=SETUP_TIMEOUT_S)
            except grpc.RpcError as err:
                raise self._rpc_error(rank, err) from None

        replies = _fan_out(prepare, requests)
        if job.cancel_requested.is_set():
            return  # no Connect: run() tears down what Setup made
        digests = {r.data_sha256 for r in replies}
        if len(digests) != 1:
            raise JobFailed(
                f"data.source={job.config.data.source!r} differs between servers "
                f"(SHA-256 {sorted(d[:12] for d in digests)}): every server must read the same tokens"
            )

        self.checkpoints.set_up(replies)
        # Each group's member 0 made its id during Setup; every member gets its groups' ids.
        ids = {g.name: g.id for reply in replies for g in reply.group_ids}

        def connect(rank, stub):
            mine = [pb.GroupId(name=g.name, id=ids.get(g.name, b"")) for g in requests[rank].groups]
            try:
                stub.Connect(pb.ConnectRequest(job_id=job.job_id, group_ids=mine), timeout=COMM_TIMEOUT_S + 10)
            except grpc.RpcError as err:
                raise self._rpc_error(rank, err) from None

        _fan_out(connect, self.stubs)

    def _train(self, plan: JobPlan, first: int = 0) -> _Growth | None:
        """Blocks of up to steps_per_call steps, cut so that one ends at every
        checkpoint.every-th step, where a checkpoint is saved; there an elastic job that
        shrank stops to grow back when it can (returned), its save under way."""
        job, steps, every = self.job, self.job.config.train.steps, self.job.config.checkpoint.every
        step = first
        while step < steps and not job.cancel_requested.is_set():
            count = min(self.steps_per_call, steps - step)
            if every:
                count = min(count, every - step % every)
            self._run_block(plan, step, count)
            step += count
            if every and step % every == 0 and not job.cancel_requested.is_set():
                self._save(plan)
                # Claimed while the save completes in the background: the servers are
                # the job's from here, whatever the wait.
                if (grown := self._claim_growth(step)) is not None:
                    return grown
        return None

    def _run_block(self, plan: JobPlan, first: int, count: int) -> None:
        """One RunSteps call per server; step events are published as soon as every
        rank has reported that step, the last one with the block's control time: the
        wall time from issuing the calls until every stream ended, beyond the slowest
        rank's total time inside its steps and evaluations. An evaluation comes as each
        rank's second report of its step, and its event follows the step's."""
        job, world = self.job, plan.grid.world_size
        reports: queue.Queue = queue.Queue()
        traced = traced_in_block(self.config, first, count)
        evaluated = evaluated_in_block(self.config, first, count)
        request = pb.RunStepsRequest(job_id=job.job_id, first_step=first, num_steps=count, trace_steps=traced,
                                     eval_after=evaluated)
        traced_plan = trace_plan(job.job_id, self.config, plan) if traced else None

        def stream(rank, stub):
            try:
                for report in stub.RunSteps(request, timeout=STEP_TIMEOUT_S * count):
                    reports.put(report)
            except grpc.RpcError as err:
                reports.put(self._rpc_error(rank, err))
            except ValueError as err:  # its channel was closed: the server was declared dead
                reports.put(JobFailed(f"rank {rank} ({self.addresses[rank]}): {err}"))
            reports.put(None)

        threads = [threading.Thread(target=stream, args=(r, s), daemon=True) for r, s in enumerate(self.stubs)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        pending: dict[int, list[pb.StepReport]] = {}
        scoring: dict[int, list[pb.StepReport]] = {}  # per step: its evaluation's reports so far
        inside = [0.0] * world  # per rank, seconds inside its steps and evaluations
        finished, last_time, held, next_step, longest = 0, started, None, first, 0.0
        while finished < world:
            # An evaluation sends nothing until it ends, and may take many steps' time:
            # while one is under way on some rank, it has its own allowance.
            due = sorted(s for s in scoring if len(scoring[s]) < world)
            patience = (eval_allowance(self.config, max(self.slowest_step_s, longest), self.slowest_eval_s)
                        if due else self._progress_deadline(min(pending, default=next_step)))
            try:
                item = reports.get(timeout=patience)
            except queue.Empty:
                if due:
                    silent = sorted(set(range(world)) - {r.rank for r in scoring[due[0]]})
                    raise JobFailed(f"no progress: the evaluation after step {due[0]} did not end within "
                                    f"{patience:.1f} s on ranks {silent}") from None
                stuck = min(pending, default=next_step)
                silent = sorted(set(range(world)) - {r.rank for r in pending.get(stuck, [])})
                raise JobFailed(f"no progress: no rank finished a step within {patience:.1f} s (step "
                                f"{stuck} not reported by ranks {silent})") from None
            if item is None:
                finished += 1
                continue
            if isinstance(item, JobFailed):
                if held is not None:  # a step every rank finished is reported all the same
                    self._publish_step(*held)
                raise item
            if item.HasField("evaluation"):  # sent after the step's own report
                inside[item.rank] += item.evaluation.seconds
                self.slowest_eval_s = max(self.slowest_eval_s, item.evaluation.seconds)
                scoring.setdefault(item.step, []).append(item)
                if len(scoring[item.step]) == world:
                    held = (held[0], eval_event(self.config, scoring.pop(item.step)))
                    last_time = time.perf_counter()  # the next step's wall time starts after it
                continue
            inside[item.rank] += item.step_seconds
            longest = max(longest, item.step_seconds)
            if item.step != self.first_step:
                self.slowest_step_s = max(self.slowest_step_s, item.step_seconds)
            if item.step in evaluated:
                scoring.setdefault(item.step, [])  # this rank evaluates next
            pending.setdefault(item.step, []).append(item)
            if len(pending[item.step]) == world:
                now = time.perf_counter()
                if item.step in traced:
                    job.traces.add(traced_plan, pending[item.step])
                done = pending.pop(item.step)
                event = self._step_event(done, now - last_time)
                next_step = item.step + 1
                last_time = now
                if held is not None:
                    self._publish_step(*held)
                held = (event, None)  # the block's last event waits for the streams to end
        for t in threads:
            t.join()
        held[0].block_control_seconds = (time.perf_counter() - started) - max(inside)
        held[0].block_steps = count
        self._publish_step(*held)
        log.info("steps %d-%d: control %.4fs beyond the slowest rank", first, first + count - 1,
                 held[0].block_control_seconds)

    def _publish_step(self, event: pb.StepEvent, evaluation: pb.EvalEvent | None) -> None:
        """A step's event, then the evaluation run after it, if any."""
        self.job.add_step(event)
        if evaluation is not None:
            self.job.add_eval(evaluation)

    def _progress_deadline(self, step: int) -> float:
        """How long a block may go without any rank finishing `step` before the job is
        declared stuck: recovery.progress_timeout_s, or ten times the slowest step seen
        when that is longer (an attempt's first step, which warms up, does not count);
        plus recovery.compile_timeout_s for that first step where a server compiles its
        blocks in it (train.compile)."""
        recovery = self.job.config.recovery
        deadline = max(recovery.progress_timeout_s, 10 * self.slowest_step_s)
        if step == self.first_step and self._compiles():
            deadline += recovery.compile_timeout_s
        return deadline

    def _compiles(self) -> bool:
        """Whether any server of the current plan compiles its blocks (as it decides:
        common/model/compile_modes.py)."""
        if self.plan is None:
            return False
        return any(self.config.compiles_on(s.device.split(":")[0]) for s in self.plan.servers)

    def _step_event(self, reports: list[pb.StepReport], wall_s: float) -> pb.StepEvent:
        config = self.job.config
        losses = [r.loss for r in reports if r.has_loss]
        slowest = max(r.step_seconds for r in reports)
        tokens = config.train.global_batch * config.model.seq_len
        return pb.StepEvent(
            step=reports[0].step,
            loss=sum(losses) / len(losses),
            tokens=tokens,
            step_seconds=slowest,
            tokens_per_second=tokens / wall_s if wall_s > 0 else 0.0,
            grad_norm=reports[0].grad_norm,
            lr=reports[0].lr,
            ranks=sorted((r.memory for r in reports), key=lambda m: m.rank),
            bubble_seconds=sum(r.comm_wait_seconds for r in reports) / len(reports),
            idle_seconds=sum(r.idle_seconds for r in reports) / len(reports),
        )

    def _save(self, plan: JobPlan) -> None:
        layout = {"dp": plan.grid.dp, "pp": plan.grid.pp, "tp": plan.grid.tp,
                  "vpp": self.job.config.parallel.vpp, "zero": self.job.config.parallel.zero}
        self.checkpoints.save(self.stubs, layout)

    def _teardown(self) -> None:
        def teardown(rank, stub):
            try:
                stub.Teardown(pb.JobRef(job_id=self.job.job_id), timeout=30)
            except grpc.RpcError as err:  # a dead server holds nothing to free
                log.warning("teardown of rank %d: %s", rank, err.details())
            except ValueError:  # its channel was closed: it was declared dead
                pass

        if self.stubs:
            _fan_out(teardown, self.stubs)
