"""Which transport and device a job uses: the coordinator's choice from the servers'
devices, the stage server's own checks, `--device`, the NCCL dtype map, and a job that
forces a transport its servers cannot use (on the shared CPU cluster)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from interleaf.clients.launcher import local_devices
from interleaf.coordinator.config import ConfigError
from interleaf.coordinator.plan import choose_transport
from interleaf.stageserver.device import resolve_device
from interleaf.stageserver.job import JobRejected, _check_transport
from interleaf.stageserver.transport.nccl_dtypes import NCCL_TYPES, nccl_type
from tests.conftest import TINY, run_job

GPU = torch.cuda.is_available()


@pytest.mark.parametrize("setting,devices,chosen", [
    ("auto", ["cpu", "cpu"], "gloo"),
    ("auto", ["cuda:0", "cuda:1"], "nccl"),
    ("gloo", ["cpu"], "gloo"),
    ("nccl", ["cuda:3"], "nccl"),
])
def test_transport_follows_the_devices(setting, devices, chosen):
    assert choose_transport(setting, devices) == chosen


@pytest.mark.parametrize("setting,devices,message", [
    ("auto", ["cpu", "cuda:0"], "the job's servers mix devices (cpu, cuda:0): every rank of a job must compute "
                                "on the same kind of device"),
    ("nccl", ["cpu", "cpu"], "parallel.transport='nccl' cannot move tensors on cpu servers (they need 'gloo')"),
    ("gloo", ["cuda:0"], "parallel.transport='gloo' cannot move tensors on cuda servers (they need 'nccl')"),
])
def test_a_transport_the_devices_cannot_use_is_refused_by_name(setting, devices, message):
    with pytest.raises(ConfigError) as caught:
        choose_transport(setting, devices)
    assert str(caught.value) == message


@pytest.mark.parametrize("transport,device,message", [
    ("nccl", "cpu", "parallel.transport='nccl' moves CUDA tensors; this server computes on cpu"),
    ("gloo", "cuda:0", "parallel.transport='gloo' moves CPU tensors; this server computes on cuda:0 "
                       "(use nccl, or start the server with --device cpu)"),
    ("mpi", "cpu", "parallel.transport='mpi' must be one of gloo, nccl"),
])
def test_a_stage_server_refuses_a_transport_its_device_cannot_use(transport, device, message):
    with pytest.raises(JobRejected) as caught:
        _check_transport(transport, torch.device(device))
    assert str(caught.value) == message


def test_device_auto_is_the_cpu_without_a_gpu_and_bad_devices_are_named():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if GPU else "cpu", 0 if GPU else None)
    with pytest.raises(ValueError, match=r"--device='tpu' must be auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    if not GPU:
        with pytest.raises(ValueError, match=r"--device='cuda:1': torch sees no CUDA device on this machine"):
            resolve_device("cuda:1")


@pytest.mark.skipif(GPU, reason="checks the answer on a machine without a GPU (CI's)")
def test_local_servers_take_the_cpu_unless_told_cuda_which_needs_a_gpu_each():
    assert local_devices("auto", 3) == ["cpu"] * 3
    with pytest.raises(ValueError, match=r"device='cuda' needs one GPU per local server: 2 servers, 0 GPUs"):
        local_devices("cuda", 2)
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "run", "--device", "cuda"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == ("error: --device: device='cuda' needs one GPU per local server: "
                             "2 servers, 0 GPUs\n")


def test_nccl_types_are_nccl_h_values_and_an_unmovable_dtype_is_named():
    # ncclDataType_t in nccl.h; bench/gpu/check_nccl.py holds them against CuPy's constants.
    assert {str(d): v for d, v in NCCL_TYPES.items()} == {
        "torch.int8": ("NCCL_INT8", 0), "torch.uint8": ("NCCL_UINT8", 1), "torch.int32": ("NCCL_INT32", 2),
        "torch.int64": ("NCCL_INT64", 4), "torch.float16": ("NCCL_FLOAT16", 6),
        "torch.float32": ("NCCL_FLOAT32", 7), "torch.float64": ("NCCL_FLOAT64", 8),
        "torch.bfloat16": ("NCCL_BFLOAT16", 9)}
    assert nccl_type(torch.bfloat16) == 9
    with pytest.raises(TypeError, match=r"tensor dtype torch.complex64 has no NCCL type \(supported: int8, "):
        nccl_type(torch.complex64)


def test_a_job_forcing_nccl_on_cpu_servers_fails_naming_the_setting_and_frees_them(client):
    final, steps = run_job(client, TINY + ["parallel.transport=nccl"])
    assert final.state == "FAILED"
    assert final.error == "parallel.transport='nccl' cannot move tensors on cpu servers (they need 'gloo')"
    assert steps == []
    assert all(s.state == "IDLE" for s in client.servers())


def test_two_ranks_on_one_gpu_are_refused_before_any_server_is_set_up():
    from interleaf.coordinator.config import load_config
    from interleaf.coordinator.plan import ServerSlot, plan_job

    config = load_config("", ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"])
    shared = [ServerSlot("a", "10.0.0.1:1", "gpu-host", device="cuda:0"),
              ServerSlot("b", "10.0.0.1:2", "gpu-host", device="cuda:0")]
    with pytest.raises(ConfigError) as caught:
        plan_job(config, shared)
    assert str(caught.value) == ("ranks 0 and 1 would share cuda:0 on host gpu-host (servers 10.0.0.1:1 and "
                                 "10.0.0.1:2): NCCL refuses two ranks on one GPU; start each stage server "
                                 "with its own --device")
    apart = [ServerSlot("a", "10.0.0.1:1", "gpu-host", device="cuda:0"),
             ServerSlot("b", "10.0.0.2:1", "other-host", device="cuda:0")]
    assert plan_job(config, apart).transport == "nccl"


def test_stage_server_refuses_a_device_it_lacks_before_it_serves(capsys):
    """`interleaf stage-server --device cuda:99` on a machine without that GPU: an error
    line naming it and exit 2, not a traceback, and no port bound."""
    from interleaf.clients.cli import main

    assert main(["stage-server", "--coordinator", "127.0.0.1:1", "--device", "cuda:99"]) == 2
    assert "error: --device='cuda:99'" in capsys.readouterr().err
