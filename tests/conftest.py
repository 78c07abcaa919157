"""Shared fixtures: one real local cluster (a coordinator and 8 stage servers as
processes, real gRPC on loopback, real gloo) for every end-to-end test, and the
single-process reference, computed once per distinct training setup."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shutil
import tempfile

import pytest
import torch

from interleaf.clients import checkpoint
from interleaf.clients.client import Client
from interleaf.clients.launcher import LocalCluster
from interleaf.clients.reference import train
from interleaf.coordinator.config import load_config

SERVERS = 8

# A coordinator a test starts without --state-db keeps its job state under
# $XDG_STATE_HOME: here a folder of this test run's own, never the user's ~/.local/state,
# where a later coordinator would resume the tests' unfinished jobs.
_STATE_HOME = tempfile.mkdtemp(prefix="interleaf-test-state-")
os.environ["XDG_STATE_HOME"] = _STATE_HOME
atexit.register(shutil.rmtree, _STATE_HOME, ignore_errors=True)

# A model small enough for 2 CPU cores yet with every part present: 8 layers so that
# pp=4 with vpp=2 gives each chunk one layer, 4 heads and a 256 vocabulary so tp=4
# splits both. The learning rate is a realistic 1e-3: Adam's early updates are about
# lr*g/(|g|+eps), so where a gradient element is near eps=1e-8 the last-bit rounding
# that tensor parallelism's different matmul shapes introduce is amplified in
# proportion to lr (measured on tp=2: max parameter difference 1.5e-4 at lr=1e-2,
# 1.5e-5 at lr=1e-3). Pipeline and data-parallel layouts compute the same bits.
TINY = [
    "model.n_layers=8", "model.d_model=32", "model.n_heads=4", "model.seq_len=16",
    "model.vocab_size=256", "train.steps=3", "train.global_batch=8", "train.warmup_steps=1",
    "train.lr=0.001", "parallel.microbatches=4",
]

# The same run as a Llama: grouped-query attention (two query heads per key/value head),
# an untied head, and a vocabulary of 259 (the bytes' 256 and three more) that only
# padding splits (to 384 at tp=1, 512 at tp 2 and 4). tp=4 needs four key/value heads:
# see `arch_setup`.
LLAMA = ["model.arch=llama", "model.n_kv_heads=2", "model.ffn_hidden=64", "model.vocab_size=259"]
ARCHS = {"gpt2": [], "llama": LLAMA}


def arch_setup(arch: str, layout: list[str]) -> list[str]:
    """The model overrides of `arch` for `layout`: key/value heads split over tp, so a
    Llama at tp=4 keeps one per rank."""
    if arch == "llama" and "parallel.tp=4" in layout:
        return LLAMA + ["model.n_kv_heads=4"]
    return ARCHS[arch]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster-logs")
    with LocalCluster(SERVERS, threads_per_server=1, log_dir=str(logs)) as running:
        yield running


@pytest.fixture(scope="session")
def client(cluster):
    c = cluster.client()
    yield c
    c.close()


@contextlib.contextmanager
def servers_by_address(logs, servers: int = 4):
    """A cluster of `servers` stage servers driven one step per call, for tests that kill
    or stop servers: (cluster, client, {address: the server's process})."""
    with LocalCluster(servers, threads_per_server=1, log_dir=str(logs), steps_per_call=1) as cluster:
        client = cluster.client()
        # Each server logs the address it serves on; the coordinator is process 0.
        by_address = {re.search(r"stage server on (\S+) ", (logs / f"stage-server-{i}.log").read_text())[1]:
                      cluster.processes[1 + i] for i in range(servers)}
        try:
            yield cluster, client, by_address
        finally:
            client.close()


@functools.lru_cache(maxsize=None)
def reference(overrides: tuple[str, ...]):
    """Reference losses and final parameters; the layout keys do not change them."""
    return train(load_config("", list(overrides)))


def layout_free(overrides: list[str]) -> tuple[str, ...]:
    """The overrides that matter to the reference (layout keys dropped), so layouts of
    one training setup share one reference run. The microbatch count stays: it changes
    no sample, but the reference accumulates its gradients in that many parts, as the
    layouts do, which keeps reduced-precision rounding alike."""
    kept = [o for o in overrides if not o.startswith("parallel.") or o.startswith("parallel.microbatches")]
    # The reference needs a layout that is valid on one process.
    return tuple(kept + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"])


def run_job(client: Client, overrides: list[str], timeout_s: float = 300):
    status = client.submit("", overrides)
    final, steps = client.wait(status.job_id, timeout_s=timeout_s)
    return final, steps


def load_parameters(manifest_path: str) -> dict[str, torch.Tensor]:
    """Every parameter a job saved, as full tensors (clients/checkpoint.py)."""
    return checkpoint.load_parameters(checkpoint.find(manifest_path))
