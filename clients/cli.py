"""The `interleaf` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import signal
import sys

from interleaf.clients.data_commands import add_data_commands
from interleaf.clients.follow import ROW_KINDS, MetricsOut, eval_line, eval_row, follow
from interleaf.clients.parent_death import die_with_parent_if_asked
from interleaf.clients.usage import Parser, UsageError
from interleaf.clients.weights_commands import add_weights_commands
from interleaf.common import limits
from interleaf.coordinator.job_store import DEFAULT_KEEP_JOBS
from interleaf.coordinator.run_logs import RunLogs, check_wandb

DEFAULT_COORDINATOR = os.environ.get("INTERLEAF_COORDINATOR", "127.0.0.1:50051")


class Stopped(BaseException):
    """`interleaf run` (or `plan`) got SIGINT, SIGTERM or SIGHUP. A BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on the way (gRPC's, ours) takes it for an error."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopSignals:
    """SIGINT, SIGTERM and SIGHUP end `interleaf run` alike: the first raises Stopped in
    the main thread, which unwinds through the local cluster's stop. Once `holding` (the
    stop under way), a signal is only noted, so it cannot cut that stop short."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, note: str):
        self.note = note
        self.received: int | None = None
        self.holding = False

    def __enter__(self) -> "_StopSignals":
        self.previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        first = self.received is None
        self.received = self.received or signum
        if first and not self.holding:
            try:
                print(f"\n{signal.Signals(signum).name}: {self.note}", file=sys.stderr)
            except OSError:  # SIGHUP: the terminal may be gone
                pass
            raise Stopped(signum)


def _config_text(path: str | None) -> str:
    if not path:
        return ""
    file = pathlib.Path(path)
    if not file.is_file():
        raise UsageError(f"config file {path!r} {'is a folder' if file.is_dir() else 'does not exist'}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"config file {path!r} is not UTF-8 text, as TOML must be (byte {err.start}: "
                         f"{err.object[err.start:err.start + 1]!r})") from None
    except OSError as err:
        raise UsageError(f"config file {path!r} cannot be read ({err.strerror})") from None


def _security(args):
    """The token and TLS files of --token-file and --tls-* (the token, without
    --token-file, from $INTERLEAF_TOKEN)."""
    from interleaf.common.security import Security, SecurityError

    try:
        return Security.from_options(args.token_file, args.tls_cert, args.tls_key, args.tls_ca,
                                     getattr(args, "tls_client_ca", None))
    except SecurityError as err:
        raise UsageError(str(err)) from None


def _client(args):
    from interleaf.clients.client import Client

    if not (args.coordinator or "").strip():
        raise UsageError(f"--coordinator {args.coordinator!r} must be HOST:PORT")
    return Client(args.coordinator, _security(args))


def _load(args, remote: bool = False, planning: bool = False):
    """(the config's text, the JobConfig). For a `remote` coordinator, a checkpoint.init
    this machine does not see leaves the config to it (None): the path is the cluster's.
    A layout about to be planned (`planning`: `interleaf plan`; or parallel.plan=auto)
    need not be valid as given: the config is then read with it set aside
    (candidates.load_unplanned), the planner choosing it anew."""
    from interleaf.coordinator.config import ConfigError, InitNotFound, load_config
    from interleaf.coordinator.planner.candidates import load_unplanned

    if getattr(args, "resume", None):  # --resume DIR is checkpoint.resume, made absolute
        args.set.append(f"checkpoint.resume={os.path.abspath(args.resume)}")
    text = _config_text(args.config)
    try:
        return text, load_config(text, args.set)
    except InitNotFound as err:
        if remote:
            return text, None
        raise UsageError(str(err)) from None
    except ConfigError as err:
        try:
            unplanned = load_unplanned(text, args.set)
        except ConfigError as beyond:  # wrong beyond its layout: that is what to mend
            raise UsageError(str(beyond if planning or _asks_for_a_plan(text, args.set) else err)) from None
        if planning or unplanned.parallel.plan == "auto":
            return text, unplanned
        raise UsageError(str(err)) from None


def _asks_for_a_plan(text: str, sets: list[str]) -> bool:
    """Whether the config sets parallel.plan="auto": its layout is then chosen afresh, and
    what to mend is what load_unplanned refuses, not a rule the layout breaks."""
    from interleaf.coordinator.config import ConfigError
    from interleaf.coordinator.config.loading import given_settings

    try:
        return given_settings(text, sets, "parallel").get("plan") == "auto"
    except ConfigError:
        return False


def _valid_as_given(text: str, sets: list[str]) -> bool:
    from interleaf.coordinator.config import ConfigError, load_config

    try:
        load_config(text, sets)
    except ConfigError:
        return False
    return True


def cmd_run(args) -> int:
    from interleaf.clients.launcher import LocalCluster

    remote = args.coordinator and args.local is None
    if args.plan:
        args.set.append(f"parallel.plan={args.plan}")
    text, config = _load(args, remote)  # None: the remote coordinator alone reads checkpoint.init
    if config is None:
        _unplannable(args)
    planned = config is not None and config.parallel.plan == "auto"
    world = None if remote else config.parallel.world_size
    if planned and not remote and args.local is None and not _valid_as_given(text, args.set):
        raise UsageError("parallel.plan=auto: the layout given is set aside (it breaks the rules), so it cannot say "
                         "how many local servers to plan for: give --local N")
    servers = args.local if args.local is not None else world
    if args.local is not None and args.local < 1:
        raise UsageError(f"--local {args.local} must be at least 1")
    if not remote and servers != world and not planned:
        raise UsageError(f"--local {servers} must equal parallel.dp*parallel.tp*parallel.pp={world}")
    given = [f for f in ("token_file", "tls_cert", "tls_key", "tls_ca") if getattr(args, f)]
    if not remote and given:
        raise UsageError(f"--{given[0].replace('_', '-')} goes with --coordinator: a local cluster talks "
                         "over loopback, guarded by a random token of its own")
    client = _client(args) if remote else None  # a bad --token-file or --tls-* stops it here
    if not remote:
        assert servers is not None  # --local's, or the config's world
        _check_vocab_locally(config)
        _check_resume_locally(config)
        _check_devices_locally(config, servers, args.device, layout_given=not planned)
        if not planned:  # a planned layout is admitted by the planner
            _admit_locally(config, servers, args.device)
    _check_run_outputs(args)
    metrics = MetricsOut(args.metrics_out)
    logs = RunLogs()  # opened once the job has an id: W&B names its run after it
    note = "the job goes on at the coordinator" if remote else "stopping the local servers"
    try:
        # while a remote plan is made no job exists yet; a profile job it waits on is cancelled
        with _StopSignals("planning stopped" if remote and planned else note) as signals:
            if remote:
                planned_run = _plan(client, config, args, text=text) if planned else None
                signals.note = note
                job = client.submit(text, args.set + (planned_run.overrides if planned_run else []))
                print(f"submitted {job.job_id}", file=sys.stderr)
                logs = _run_logs(args, job.job_id, planned_run.config if planned_run else config, client)
                status = follow(client, job.job_id, job.steps, metrics, logs)
                if planned_run and status == 0:
                    planned_run.refine(job.job_id)
                return status
            print(f"starting a coordinator and {servers} stage servers", file=sys.stderr)
            cluster = LocalCluster(servers, log_dir=args.log_dir, device=args.device)
            try:
                cluster.start()  # stops what it started should it fail or be stopped
                client = cluster.client()
                planned_run = _plan(client, config, args, servers, text=text) if planned else None
                job = client.submit(text, args.set + (planned_run.overrides if planned_run else []))
                logs = _run_logs(args, job.job_id, planned_run.config if planned_run else config, client)
                status = follow(client, job.job_id, config.train.steps, metrics, logs)
                if planned_run and status == 0:
                    planned_run.refine(job.job_id)
            finally:
                signals.holding = True
                cluster.stop()
            return status  # a signal that came during the stop changed nothing: the job had ended
    except Stopped as stopped:
        return 128 + stopped.signum
    finally:
        metrics.close()
        logs.close()


def _plan(client, config, args, local_servers: int | None = None, text: str = ""):
    """parallel.plan=auto: the layout chosen for `local_servers` local servers, or for
    the coordinator's idle ones (plan_command.PlannedRun)."""
    from interleaf.clients import plan_command as planning

    try:
        if local_servers:
            cluster, device = planning.local_cluster(local_servers, args.device)
        else:
            cluster, device = planning.remote_cluster(client.servers())
        planned = planning.plan_for_run(client, config, cluster, device, _stderr)
    except planning.PlanError as err:
        raise UsageError(f"parallel.plan=auto: {err}") from None
    _say_replaced(planning.replaced_settings(text, args.set, planned.plan))
    return planned


def _say_replaced(replaced: list[str]) -> None:
    if replaced:
        _stderr("the plan chooses the layout afresh; of the settings given it replaced: " + ", ".join(replaced))


def _unplannable(args) -> None:
    """A remote job whose checkpoint.init this machine does not see has no config here
    to plan; asked to plan it, say so rather than submit it unplanned."""
    if getattr(args, "plan", None) or "parallel.plan=auto" in args.set:  # `submit` has no --plan
        raise UsageError("parallel.plan=auto plans here, before submitting, and this machine cannot read the "
                         "config's checkpoint.init; plan with `interleaf plan` where it can, and submit that layout")


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)


def cmd_plan(args) -> int:
    from interleaf.clients import plan_command as planning

    text, config = _load(args, planning=True)
    for flag, value in (("--top", args.top), ("--servers", args.servers), ("--servers-per-host", args.servers_per_host),
                        ("--server-memory", args.server_memory)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value} must be at least 1")
    if args.server_memory is not None and args.server_memory > limits.MAX_SERVER_MEMORY_BYTES:
        raise UsageError(f"--server-memory {args.server_memory} must be at most {limits.MAX_SERVER_MEMORY_BYTES} "
                         f"bytes (1 PiB) a server")
    if args.servers_per_host is not None and args.servers is None:
        raise UsageError(f"--servers-per-host {args.servers_per_host} describes a cluster given by --servers; "
                         f"a coordinator's servers report their own hosts")
    if args.device is not None and args.servers is None:
        raise UsageError(f"--device {args.device} picks where a cluster given by --servers is profiled here; a "
                         f"coordinator's servers are profiled on their own devices")
    try:
        # A signal unwinds through what planning started (the profile's local servers, or
        # the coordinator's profile job, cancelled), as it does through `run`'s cluster.
        with _StopSignals("stopping what the plan started"):
            if args.servers is not None:
                report, cluster, profile = planning.plan_described(
                    config, args.servers, args.server_memory, args.servers_per_host, args.device or "auto", args.top,
                    args.profile, _stderr)
            else:
                client = _client(args)
                servers, device = planning.remote_cluster(_servers_or_hint(client, args))
                # --server-memory plans for servers of that size; the profile's jobs run on these
                cluster = dataclasses.replace(servers, memory_bytes=args.server_memory or servers.memory_bytes)
                report, profile = planning.plan_on(client, config, cluster, device, args.top, args.profile,
                                                   _stderr, servers_memory_bytes=servers.memory_bytes)
    except planning.PlanError as err:
        raise UsageError(str(err)) from None
    except Stopped as stopped:
        return 128 + stopped.signum
    _say_replaced(planning.replaced_settings(text, args.set, report.plans[0].as_json()))
    if args.json:
        planning.print_json(report)
    else:
        print(planning.report_text(report, cluster, profile, config))
    return 0


def _servers_or_hint(client, args):
    """The coordinator's servers; where none answers, the error says how to plan without one."""
    import grpc

    try:
        return client.servers()
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        raise UsageError(f"no coordinator answers at {args.coordinator} ({err.details()}): start one, name it with "
                         "--coordinator, or plan for a described cluster with --servers N") from None


def _check_run_outputs(args) -> None:
    """--wandb without the wandb package, a --tensorboard folder or --metrics-out file
    that cannot be written, and a --log-dir that is a file, are refused before anything
    starts: a job submitted first would go on at a
    coordinator (or hold a local cluster) that nothing records."""
    if getattr(args, "wandb", None):
        try:
            check_wandb()
        except RuntimeError as err:
            raise UsageError(str(err)) from None
    folder = getattr(args, "tensorboard", None)
    if folder and "://" not in folder:  # a local folder (TensorBoard's writer also takes gs://, s3://)
        try:
            os.makedirs(folder, exist_ok=True)
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError("not writable")
        except (OSError, ValueError) as err:  # ValueError: a NUL in the path
            raise UsageError(f"--tensorboard {folder!r}: the event files' folder cannot be written ({err})") from None
    if path := getattr(args, "metrics_out", None):
        if os.path.isdir(path):
            raise UsageError(f"--metrics-out {path!r} is a folder; it must name the JSON-lines file to write")
        _check_writable_folder("--metrics-out", path)
    if (logs := getattr(args, "log_dir", None)) and os.path.exists(logs) and not os.path.isdir(logs):
        raise UsageError(f"--log-dir {logs!r} is a file; it must name a folder for the servers' logs")


def _run_logs(args, name: str, config=None, client=None) -> RunLogs:
    """The --tensorboard and --wandb sinks of a run named `name` (a job id, or the
    reference's); `config` (None: unknown here) gives MFU its model FLOPs and W&B its settings."""
    import dataclasses

    return RunLogs.open(tensorboard=args.tensorboard, wandb=args.wandb, name=name,
                        config=dataclasses.asdict(config) if config is not None else None,
                        model=config.model if config is not None else None,
                        peak_flops=client.peak_flops if client is not None else None)


def _check_vocab_locally(config) -> None:
    """The coordinator's vocabulary check, made before any local process starts; here,
    where the job runs, data.tokenizer must load."""
    from interleaf.common.data.vocab_check import check_eval_source, check_vocab
    from interleaf.stageserver.data.tokenfile import TokenFile

    try:
        check_vocab(config.model.vocab_size, config.data.source, config.data.tokenizer, tokenizer_needed=True)
        if config.eval.enabled and config.eval.source:  # here, where the job runs, it must be there
            TokenFile(config.eval.source, field="eval.source")
            check_eval_source(config.model.vocab_size, config.eval.source, config.data.source)
    except (OSError, ValueError) as err:  # VocabError, TokenizerError, a blend that does not parse, no eval.source
        raise UsageError(str(err)) from None


def _check_resume_locally(config) -> None:
    """checkpoint.resume (--resume) found here, where a local cluster's coordinator will
    look for it, before any process starts."""
    from interleaf.coordinator.checkpoints import CheckpointError, find

    if config.checkpoint.resume:
        try:
            find(config.checkpoint.resume)
        except CheckpointError as err:
            raise UsageError(f"checkpoint.resume: {err}") from None


def _check_devices_locally(config, servers: int, device: str, layout_given: bool = True) -> None:
    """The coordinator's checks of the servers' devices (float8 tensor cores, CUDA for a
    memory snapshot), made before any local process starts or any layout is planned
    (then without what the layout decides: the planner holds its candidates to that)."""
    from interleaf.clients.launcher import local_devices
    from interleaf.coordinator.config import ConfigError
    from interleaf.coordinator.plan import check_devices

    try:
        devices = local_devices(device, servers)
    except ValueError as err:
        raise UsageError(f"--device: {err}") from None
    try:
        check_devices(config, devices, tokens=layout_given)
    except ConfigError as err:
        raise UsageError(str(err)) from None


def _admit_locally(config, servers: int, device: str) -> None:
    """The coordinator's admission check, made before any local process starts: each
    local server would offer its GPU's memory, or its share of this machine's."""
    from interleaf.clients.launcher import local_devices, memory_per_local_server
    from interleaf.common.model.compile_modes import device_type_of
    from interleaf.coordinator.admission import AdmissionError, check_fits, needed_bytes
    from interleaf.coordinator.plan import plan_programs

    devices = local_devices(device, servers)  # _check_devices_locally has held them
    programs, _ = plan_programs(config)
    share = memory_per_local_server(devices)
    try:
        check_fits(needed_bytes(config, programs, device_type_of(devices)),
                   [(f"local-{i}", share) for i in range(servers)])
    except AdmissionError as err:
        raise UsageError(str(err)) from None


def cmd_reference(args) -> int:
    from interleaf.clients.progress import Progress
    from interleaf.clients.reference import train
    from interleaf.coordinator.run_logs import eval_scalars, reference_scalars

    _, config = _load(args)
    _check_run_outputs(args)
    metrics, progress = MetricsOut(args.metrics_out), Progress(config.train.steps)
    logs = _run_logs(args, "reference", config)

    def on_step(r):
        metrics.write("step", step=r.step, loss=r.loss, tokens=r.tokens, step_seconds=r.step_seconds,
                      tokens_per_second=r.tokens / r.step_seconds, grad_norm=r.grad_norm, lr=r.lr)
        logs.log(r.step + 1, reference_scalars(r))
        progress.update(r.step, r.loss, r.tokens / r.step_seconds)

    def on_eval(e):
        metrics.write(**eval_row(e))
        logs.log(e.step, eval_scalars(e.loss, e.perplexity, e.seconds))
        progress.evaluation(e.loss, e.perplexity)
        progress.note(eval_line(e))

    try:
        train(config, on_step, on_eval)
    finally:  # what was written stays readable, whatever stopped the run
        logs.close()
        progress.close()
        metrics.close()
    return 0


def cmd_schedule(args) -> int:
    from interleaf.coordinator.grid import RankGrid
    from interleaf.coordinator.memory_model import predict
    from interleaf.coordinator.memory_table import memory_table
    from interleaf.coordinator.partition import describe, partition
    from interleaf.coordinator.plan import describe_state, plan_programs
    from interleaf.coordinator.schedule import CostModel, DeadlockError, simulate, timeline_table, write_png
    from interleaf.coordinator.schedule.placement import chunk_ranks, tie_ranks
    from interleaf.coordinator.schedule.zero import max_gathered
    from interleaf.protos.actions import format_program

    _check_png(args.png)
    _, config = _load(args)
    _say_layout_is_planned(config, "scheduled here")

    p = config.parallel
    try:
        # Planning validates the programs, which includes running them under rendezvous
        # semantics: a program that deadlocks there is never shipped.
        programs, _ = plan_programs(config)
        result = simulate(programs, CostModel(), links=args.links)
    except DeadlockError as err:
        print(f"{_LINKS[args.links]}: deadlock")
        for blocked in err.blocked:
            print(f"  {blocked}")
        return 1
    print(describe(partition(config.model.n_layers, p.pp, p.vpp, p.schedule, p.layers), p.pp))
    print(RankGrid(p.dp, p.pp, p.tp, tie_ranks(chunk_ranks(p.schedule, p.pp, p.vpp))).describe())
    print(describe_state(config))
    print(timeline_table(programs, result))
    print("programs (every action, in order):")
    for rank, program in enumerate(programs):
        print(f"rank {rank:<2} {format_program(program)}")
    print(memory_table(config, predict(config, programs, args.device)))
    if p.zero == 3:
        print(f"ZeRO-3: at most {max(max_gathered(program) for program in programs)} chunks gathered "
              f"at once on a rank (parallel.zero_prefetch={p.zero_prefetch})")
    if args.png:
        write_png(args.png, programs, result, title=f"{p.schedule}: dp={p.dp} pp={p.pp} tp={p.tp} vpp={p.vpp}, "
                                                     f"{p.microbatches} microbatches, ZeRO stage {p.zero}")
        print(f"timeline written to {args.png}")
    print(f"{_LINKS[args.links]}: deadlock-free")
    return 0


_LINKS = {
    "rendezvous": "links rendezvous (a send completes only when its peer reaches the matching receive)",
    "eager": "links eager (sends buffered without limit; programs are checked under rendezvous too)",
}


def cmd_config(args) -> int:
    if args.markdown:
        from interleaf.coordinator.config.markdown import config_markdown

        sys.stdout.write(config_markdown())
        return 0
    from interleaf.clients.api import config_text

    config = _load(args)[1]
    _say_layout_is_planned(config, "below")
    sys.stdout.write(config_text(config))
    return 0


def _say_layout_is_planned(config, where: str) -> None:
    """parallel.plan=auto: the layout shown is not the one a job will run (the config's,
    or where that breaks the rules a placeholder of one server), so say so on stderr."""
    if config is not None and config.parallel.plan == "auto":
        _stderr(f"parallel.plan=auto: the layout {where} is not what a job runs; the planner chooses dp, tp, pp, "
                f"vpp, schedule, microbatches, zero, sequence parallelism, layers and recompute when it is "
                f"submitted (`interleaf plan` shows its choice)")


def cmd_coordinator(args) -> int:
    from interleaf.coordinator.job_store import JobStoreError
    from interleaf.coordinator.main import serve

    try:
        serve(args.host, args.port, args.bind, args.store_port, args.steps_per_call, _security(args),
              state_db=args.state_db, http_port=args.http_port, keep_jobs=args.keep_jobs)
    except JobStoreError as err:
        raise UsageError(str(err)) from None
    return 0


def cmd_stage_server(args) -> int:
    from interleaf.stageserver.main import serve

    if not args.orphan_timeout > 0:
        raise UsageError(f"--orphan-timeout={args.orphan_timeout:g} must be a positive number of seconds")
    if args.peak_flops < 0:
        raise UsageError(f"--peak-flops={args.peak_flops:g} must be a FLOP/s figure (0: the default)")
    if args.metrics_port < -1:
        raise UsageError(f"--metrics-port={args.metrics_port} must be a port, 0 (any free one) or -1 (no metrics)")
    from interleaf.stageserver.device import resolve_device

    try:
        resolve_device(args.device)  # before anything binds a port: serve resolves it again
    except ValueError as err:
        raise UsageError(str(err)) from None
    serve(args.coordinator, args.host, args.port, args.bind, args.threads, args.memory_bytes, args.device,
          args.spool_dir, args.orphan_timeout, _security(args), args.metrics_port, args.peak_flops)
    return 0


def cmd_submit(args) -> int:
    text, config = _load(args, remote=True)
    if config is None:
        _unplannable(args)
    client = _client(args)
    planned = config is not None and config.parallel.plan == "auto"
    print(client.submit(text, args.set + (_plan(client, config, args).overrides if planned else [])).job_id)
    return 0


def cmd_status(args) -> int:
    from google.protobuf import json_format

    status = _client(args).status(args.job)
    print(json_format.MessageToJson(status, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True))
    return 0


def cmd_watch(args) -> int:
    _check_run_outputs(args)
    client = _client(args)
    steps = client.status(args.job).steps
    metrics, logs = MetricsOut(args.metrics_out), _run_logs(args, args.job, client=client)
    try:
        return follow(client, args.job, steps, metrics, logs)
    finally:
        logs.close()
        metrics.close()


def _check_png(path: str | None) -> None:
    """--png names a PNG file to write, in a folder that exists (matplotlib would append
    .png to a name without it, or refuse another suffix, after the work was done)."""
    if path is None:
        return
    if not path.lower().endswith(".png") or os.path.isdir(path):
        raise UsageError(f"--png {path!r} must name a .png file")
    _check_writable_folder("--png", path)


def _check_writable_folder(flag: str, path: str) -> None:
    """The folder `flag`'s file `path` is to be written in exists and is writable."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path!r}: its folder {parent!r} "
                         f"{'is not writable' if os.path.isdir(parent) else 'does not exist'}")


def _check_trace_out(path: str | None) -> None:
    """--out names the Chrome trace's JSON file, in a folder that exists: checked before
    the step is fetched, as the summary would otherwise print and the write then fail."""
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"--out {path!r} is a folder; it must name the trace's JSON file to write")
    _check_writable_folder("--out", path)


def cmd_trace(args) -> int:
    from interleaf.coordinator import executed_step as trace

    # TraceRequest.step is a uint32: outside its range the request could not even be encoded.
    if args.step is not None and not 0 <= args.step < 2**32:
        raise UsageError(f"--step {args.step} must be a step number, 0 to {2**32 - 1} (left out: the newest "
                         f"traced step)")
    _check_trace_out(args.out)
    _check_png(args.png)
    client = _client(args)
    step = client.trace(args.job, args.step)
    print(trace.summary(step))
    for note in step.profile_notes:
        print(f"note: {note}", file=sys.stderr)
    if args.out:
        from interleaf.coordinator.step_profiles import write_profiles

        trace.write_chrome_trace(args.out, step)
        print(f"trace written to {args.out} (open it in https://ui.perfetto.dev or chrome://tracing)")
        # trace.torch_profiler, trace.memory_snapshot: a rank's at a time, each its own reply
        profiled = (client.trace_profile(args.job, step.step, rank) for rank in step.profiled_ranks)
        for path in write_profiles(args.out, profiled):
            viewer = "https://pytorch.org/memory_viz" if path.suffix == ".pickle" else "https://ui.perfetto.dev"
            print(f"{path} written (open it in {viewer})")
    if args.png:
        trace.write_picture(args.png, step)
        print(f"timeline written to {args.png}")
    return 0


def cmd_cancel(args) -> int:
    print(_client(args).cancel(args.job).state)
    return 0


def cmd_servers(args) -> int:
    for s in _client(args).servers():
        print(f"{s.server_id}  {s.address:<22} {s.host:<16} {s.device:<6} {s.state:<5} {s.job_id}")
    return 0


def cmd_health(args) -> int:
    """Asks a server's standard gRPC health service, as a Kubernetes probe does (no token
    needed); with --wait, until it answers SERVING."""
    import time

    import grpc

    from interleaf.common import wire
    from interleaf.common.health import check

    channel = wire.channel(args.address, _security(args))
    deadline = time.monotonic() + args.wait
    try:
        while True:
            try:
                status = check(channel, args.service)
            except grpc.RpcError as err:
                status = f"{err.code().name}: {err.details()}"
            if status == "SERVING" or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
    finally:
        channel.close()
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


def _checkpoint(path: str):
    from interleaf.clients.checkpoint import CheckpointError, find

    try:
        return find(path)
    except CheckpointError as err:
        raise UsageError(str(err)) from None


def cmd_generate(args) -> int:
    from interleaf.clients.checkpoint import CheckpointError, model_config
    from interleaf.clients.generate import check_sampling, check_tokenizer, generate, load_model
    from interleaf.common.data.text_tokenizer import load_tokenizer

    try:
        check_sampling(args.tokens, args.temperature, args.top_k)
        checkpoint = _checkpoint(args.checkpoint)
        spec = args.tokenizer or checkpoint.manifest.get("tokenizer", "bytes")
        field = "--tokenizer" if args.tokenizer else "the checkpoint's data.tokenizer"
        tokenizer = load_tokenizer(spec, field)
        check_tokenizer(tokenizer, model_config(checkpoint).vocab_size, f"{field}={spec!r}")  # before the weights
        model = load_model(checkpoint)
        text = generate(model, args.prompt, args.tokens, args.temperature, args.top_k, args.seed, tokenizer)
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    print(args.prompt + text)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="interleaf", description="Train GPTs with data, tensor and interleaved pipeline parallelism.")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("config", nargs="?", help="TOML config (defaults apply without one)")
        p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config value")

    def with_resume(p):
        p.add_argument("--resume", metavar="CKPT", help="continue from a checkpoint (a manifest, a step folder "
                                                        "or checkpoint.dir), saved under any layout")

    def with_run_logs(p):
        p.add_argument("--tensorboard", metavar="DIR",
                       help="write TensorBoard event files here: loss, lr, grad norm, tokens/s, MFU, bubble, "
                            "memory by kind per step, eval loss (tensorboard --logdir DIR)")
        p.add_argument("--wandb", metavar="PROJECT",
                       help="log the same scalars to this Weights & Biases project (needs the optional extra: "
                            "pip install 'interleaf[wandb]'; WANDB_MODE=offline works as wandb documents)")

    def with_metrics_out(p):
        p.add_argument("--metrics-out", metavar="FILE.jsonl",
                       help=f"write a JSON object a line, each with a \"kind\" ({', '.join(ROW_KINDS)}; "
                            "clients/follow.py MetricsOut says which keys each has)")

    def with_coordinator(p, required=False):
        p.add_argument("--coordinator", default=None if required else DEFAULT_COORDINATOR, metavar="HOST:PORT",
                       help=f"coordinator address (default {DEFAULT_COORDINATOR}, or $INTERLEAF_COORDINATOR)")
        with_security(p)

    def with_security(p, serves=False):
        p.add_argument("--token-file", metavar="PATH",
                       help="file holding the shared token every RPC carries and every server requires "
                            "(default: $INTERLEAF_TOKEN; neither: no token, for trusted networks only)")
        p.add_argument("--tls-ca", metavar="PEM", help="CA certificates that verify the servers called; "
                                                       "calls then go over TLS")
        p.add_argument("--tls-cert", metavar="PEM",
                       help="this server's certificate chain (it then serves TLS), also presented to servers "
                            "that require client certificates" if serves
                       else "client certificate, for a coordinator that requires one (mutual TLS)")
        p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
        if serves:
            p.add_argument("--tls-client-ca", metavar="PEM",
                           help="require every caller to present a certificate these CAs signed (mutual TLS)")

    p = sub.add_parser("run", help="run a job (local servers unless --coordinator is given)")
    with_config(p)
    with_resume(p)
    p.add_argument("--local", type=int, metavar="N", help="start a coordinator and N stage servers here (default: as many as the layout needs)")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="submit to a running coordinator instead")
    with_security(p)
    with_metrics_out(p)
    with_run_logs(p)
    p.add_argument("--log-dir", help="write the local processes' logs here")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="local servers compute on: one GPU each (cuda), the CPU, or auto (GPUs when "
                        "there is one per server)")
    p.set_defaults(fn=cmd_run)

    p.add_argument("--plan", choices=("auto",), help="choose the layout for the servers (parallel.plan=auto): "
                                                    "plans as `interleaf plan` does, prints the choice, runs it")

    p = sub.add_parser("plan", help="rank the layouts (dp, tp, pp, vpp, schedule, microbatches, zero, recompute) "
                                    "that fit the servers by predicted step time (docs/planning.md)")
    with_config(p)
    p.add_argument("--servers", type=int, metavar="N",
                   help="plan for N servers described here instead of a coordinator's idle ones")
    p.add_argument("--server-memory", type=int, metavar="BYTES",
                   help="memory each server offers (default: the coordinator's servers', or with --servers "
                        "this machine's device's)")
    p.add_argument("--servers-per-host", type=int, metavar="N",
                   help="with --servers: servers per host, which bounds tp (default min(N, 8))")
    p.add_argument("--top", type=int, default=5, metavar="K", help="how many plans to print (default 5)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list, best first: parallel, train (the --set values), "
                        "predicted_step_seconds, predicted_peak_bytes, ...")
    p.add_argument("--profile", metavar="FILE",
                   help="device profile JSON to cost with (default: the cache's, else measured)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help="with --servers: the device the profile is measured on here (default auto)")
    p.add_argument("--coordinator", default=DEFAULT_COORDINATOR, metavar="HOST:PORT",
                   help=f"plan for this coordinator's idle servers (default {DEFAULT_COORDINATOR})")
    with_security(p)
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("reference", help="the single-process reference run of a config")
    with_config(p)
    with_metrics_out(p)
    with_run_logs(p)
    p.set_defaults(fn=cmd_reference)

    p = sub.add_parser("schedule", help="print every rank's program as a timeline and the simulated bubble")
    with_config(p)
    p.add_argument("--png", metavar="FILE", help="also draw the timeline")
    p.add_argument("--links", choices=("rendezvous", "eager"), default="rendezvous",
                   help="point-to-point semantics to simulate: rendezvous (NCCL's: a send waits for "
                        "its receiver; default) or eager (sends never wait); says 'deadlock-free' "
                        "or names the blocked ranks and actions and exits 1")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="the servers' device type the memory table predicts for: on cuda, "
                        "train.compile=\"auto\" compiles the blocks, which keep less for the backward "
                        "(default: cpu)")
    p.set_defaults(fn=cmd_schedule)

    p = sub.add_parser("config", help="print the complete config a job would run with, as TOML; or, with "
                                      "--markdown, the reference of every key (docs/configuration.md)")
    with_config(p)
    p.add_argument("--markdown", action="store_true",
                   help="print every section and key with its type, default, bound and meaning, as Markdown")
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("coordinator", help="serve a coordinator")
    p.add_argument("--host", default="127.0.0.1", help="address stage servers and clients reach it by")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--bind", default="0.0.0.0")
    p.add_argument("--store-port", type=int, default=0, help="gloo rendezvous store port (0: any free port)")
    p.add_argument("--http-port", type=int, default=50052,
                   help="HTTP port of /metrics (Prometheus) and /sd (Prometheus service discovery of the stage "
                        "servers); 0: any free port")
    p.add_argument("--steps-per-call", type=int, default=8,
                   help="steps per RunSteps call to each server (control traffic is per call)")
    p.add_argument("--state-db", default="", metavar="PATH",
                   help="SQLite file of job state, kept across restarts: started again on it, the coordinator "
                        "resumes unfinished jobs (default $XDG_STATE_HOME/interleaf/coordinator.db, i.e. "
                        "~/.local/state/interleaf/coordinator.db; one coordinator per file)")
    p.add_argument("--keep-jobs", type=int, default=DEFAULT_KEEP_JOBS, metavar="N",
                   help=f"finished jobs kept in --state-db, the newest N to finish (default {DEFAULT_KEEP_JOBS}, at "
                        "least 1); older ones are removed with their events and traces as jobs finish, and "
                        "`interleaf status` then answers that they are not found. Unfinished jobs always stay")
    with_security(p, serves=True)
    p.set_defaults(fn=cmd_coordinator)

    p = sub.add_parser("stage-server", help="serve a stage server")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address peers reach this server by")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--bind", default="0.0.0.0")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--memory-bytes", type=int, default=0,
                   help="memory this server offers to jobs (0: its GPU's memory, or the machine's "
                        "physical memory on a CPU); the coordinator refuses jobs predicted to need more")
    p.add_argument("--device", default="auto",
                   help="where this server computes: cpu, cuda, cuda:N or auto (the GPU if torch sees one)")
    p.add_argument("--spool-dir", default=None, metavar="DIR",
                   help="where checkpoint files wait when this server does not share the coordinator's "
                        "checkpoint.dir (default: interleaf-spool in the system's temporary folder)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="HTTP port of this server's /metrics (0: any free port; the coordinator's /sd tells "
                        "Prometheus which; -1: no metrics at all, and the server is left out of /sd)")
    p.add_argument("--peak-flops", type=float, default=0.0, metavar="FLOP/S",
                   help="this device's peak FLOP/s, for model FLOPs utilization (0: 1e11 per torch thread on a "
                        "CPU; the datasheet bf16 peak of an H100, H200 or A100)")
    p.add_argument("--orphan-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="drop the job held (freeing its memory) once the coordinator has been unreachable "
                        "this long (default 30)")
    with_security(p, serves=True)
    p.set_defaults(fn=cmd_stage_server)

    p = sub.add_parser("submit", help="submit a job, print its id")
    with_config(p)
    with_resume(p)
    with_coordinator(p)
    p.set_defaults(fn=cmd_submit)

    for name, fn, text in (("status", cmd_status, "show a job's status"), ("cancel", cmd_cancel, "cancel a job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("job")
        with_coordinator(p)
        p.set_defaults(fn=fn)

    p = sub.add_parser("watch", help="follow a job's steps")
    p.add_argument("job")
    with_coordinator(p)
    with_metrics_out(p)
    with_run_logs(p)
    p.set_defaults(fn=cmd_watch)

    p = sub.add_parser("trace", help="what each rank did in a traced step, beside the simulator's prediction")
    p.add_argument("job")
    p.add_argument("--step", type=int, default=None, help="the traced step (default: the newest; trace.steps "
                                                          "in the job's config says which are traced)")
    p.add_argument("--out", metavar="TRACE.json", help="write a Chrome/Perfetto trace: a track per rank; with "
                                                       "trace.torch_profiler (trace.memory_snapshot) also each "
                                                       "rank's torch profiler trace TRACE.rankN.torch.json (CUDA "
                                                       "memory snapshot TRACE.rankN.memory_snapshot.pickle)")
    p.add_argument("--png", metavar="FILE", help="draw the executed timeline above the predicted one")
    with_coordinator(p)
    p.set_defaults(fn=cmd_trace)

    p = sub.add_parser("servers", help="list registered stage servers")
    with_coordinator(p)
    p.set_defaults(fn=cmd_servers)

    p = sub.add_parser("health", help="ask a coordinator's or stage server's gRPC health service; exit 0 when "
                                      "SERVING")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("--service", default="", help="the name to ask about: '' (the default) is the server as a "
                                                 "whole, SERVING until it stops; interleaf.Coordinator or "
                                                 "interleaf.StageServer is SERVING once it can work (a stage "
                                                 "server: once registered)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="ask again until SERVING, for at most this long")
    with_security(p)
    p.set_defaults(fn=cmd_health)

    add_data_commands(sub)

    add_weights_commands(sub)  # export, eval

    p = sub.add_parser("generate", help="sample text from a checkpoint on the CPU")
    p.add_argument("checkpoint", metavar="CKPT", help="as for export")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--tokenizer", default="", help="'bytes', a tokenizer.json or a model folder (default: the "
                                                   "job's data.tokenizer, as its checkpoint records it)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; more: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    p.set_defaults(fn=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.fn(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C where no command stops on its own (each stops what it started first)
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        import grpc

        if isinstance(err, grpc.RpcError):
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            # A refused config or job is the caller's to fix, as locally (exit 2).
            return 2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
        raise


if __name__ == "__main__":
    sys.exit(main())
