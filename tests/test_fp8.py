"""train.precision = "fp8": the blocks' linears multiply in float8 through torchao
(emulated on this CPU: the same casts and scales, the products in high precision).

Held to: torchao's own Float8Linear, to the bit, on the same operands; bf16, which fp8
must track (its e4m3 operands keep 3 bits of mantissa: a product's relative error is a
few percent per element, far less on a loss); and, as a job, its own single-process
reference (`interleaf reference` converts the same blocks) at bf16's tolerances, through
pipelining, ZeRO-3 and selective recompute (compiled blocks: single-process). The config
refuses what torchao's whole linears cannot do: tensor parallelism and split backwards."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from interleaf.common.model.config import ModelShape
from interleaf.coordinator.config import ConfigError, load_config
from interleaf.stageserver.model.chunk import full_model
from interleaf.stageserver.model.compiled import compile_blocks
from interleaf.stageserver.model.fp8 import Float8Matmul, convert_blocks_to_fp8
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tests.conftest import TINY, layout_free, reference, run_job
from tests.test_equivalence import layout


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_product_is_torchaos_float8_linear_to_the_bit(recipe):
    from torchao.float8.float8_linear import Float8Linear

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator, dtype=torch.bfloat16)
    bias = torch.randn(96, generator=generator, dtype=torch.bfloat16)
    x = torch.randn(4, 16, 64, generator=generator, dtype=torch.bfloat16)
    ours = Float8Matmul(recipe, emulate=True)
    linear = nn.Linear(64, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    theirs = Float8Linear.from_float(linear, config=dataclasses.replace(ours.config, emulate=True))
    assert torch.equal(ours(x, weight, bias), theirs(x))
    plain = torch.nn.functional.linear(x, weight, bias)
    assert not torch.equal(ours(x, weight, bias), plain)  # really float8: e4m3 rounds what bf16 keeps


def _loss_and_grad(model: nn.Module):
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (4, 32), generator=generator) for _ in range(2))
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch,recipe,compiled", [
    ("gpt2", "tensorwise", False), ("gpt2", "rowwise", False), ("llama", "tensorwise", False),
    ("llama", "rowwise", False), ("gpt2", "tensorwise", True),  # inductor traces torchao's float8 casts
    ("llama", "rowwise", "selective"),  # compiled with their selective checkpoints
])
def test_fp8_blocks_track_bf16(arch, recipe, compiled):
    shape = ModelShape(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=256, arch=arch,
                       n_kv_heads=2 if arch == "llama" else 4, ffn_hidden=128 if arch == "llama" else 256)
    bf16 = full_model(shape, seed=1).to(torch.bfloat16)
    fp8 = full_model(shape, seed=1).to(torch.bfloat16)
    convert_blocks_to_fp8(fp8, recipe, torch.device("cpu"))
    if compiled == "selective":
        fp8.recompute = BlockRecompute("selective")
    if compiled:
        compile_blocks(fp8)
        assert len(fp8.recompute.compiled_selective) == (shape.n_layers if compiled == "selective" else 0)
    converted = [m for m in fp8.h.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    per_block = 7 if arch == "llama" else 4  # q, k, v, proj, gate, up, down; or qkv, proj, up, down
    assert len(converted) == per_block * shape.n_layers and all(m.float8 is not None for m in converted)
    loss, grads = _loss_and_grad(bf16)
    loss8, grads8 = _loss_and_grad(fp8)
    assert loss8 != loss and abs(loss8 - loss) <= 1e-3 * loss
    for name, grad in grads.items():
        assert ((grads8[name] - grad).norm() / grad.norm()).item() <= 0.2, name


def test_config_refuses_tensor_parallel_split_backwards_and_a_stray_recipe():
    with pytest.raises(ConfigError, match="train.precision='fp8' needs parallel.tp=1, not 2"):
        load_config("", ["train.precision=fp8", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="train.precision='fp8' cannot run parallel.schedule='zbv'"):
        load_config("", ["train.precision=fp8", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zbv"])
    with pytest.raises(ConfigError, match="train.fp8_recipe='rowwise' needs train.precision='fp8', not 'bf16'"):
        load_config("", ["train.precision=bf16", "train.fp8_recipe=rowwise"])
    with pytest.raises(ConfigError, match="train.fp8_recipe='blockwise' must be one of tensorwise, rowwise"):
        load_config("", ["train.precision=fp8", "train.fp8_recipe=blockwise"])
    with pytest.raises(ConfigError, match="train.fp8_emulate=true needs train.precision='fp8', not 'fp32'"):
        load_config("", ["train.fp8_emulate=true"])


def test_float8_tensor_cores_need_dimensions_of_sixteen():
    """On GPUs a float8 product's every dimension is a multiple of 16 (torch's
    _scaled_mm): a job whose linears or microbatch tokens are not is refused, naming
    which; the emulation (tests, CPU servers) takes any."""
    from interleaf.coordinator.plan import check_fp8

    good = ["train.precision=fp8", "model.d_model=64", "model.n_heads=4", "model.seq_len=32",
            "train.global_batch=16", "parallel.microbatches=4", "parallel.pp=1", "parallel.vpp=1",
            "parallel.schedule=1f1b"]
    check_fp8(load_config("", good), ["cuda:0"])
    for bad, message in ((["model.d_model=72"], "model.d_model=72 is not"),
                         (["model.ffn_hidden=200"], "model.ffn_hidden=200 is not"),
                         (["model.arch=llama", "model.n_heads=8", "model.n_kv_heads=1"],
                          "(the key and value width)=8 is not"),
                         (["model.seq_len=34"], "(a microbatch's tokens)=136 is not")):
        config = load_config("", good + bad)
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_fp8(config, ["cuda:0"])
        check_fp8(load_config("", good + bad + ["train.fp8_emulate=true"]), ["cuda:0", "cuda:1"])


def test_fp8_on_cpu_servers_is_refused_unless_emulation_is_asked_for(client):
    final, steps = run_job(client, TINY + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                           "train.precision=fp8"], timeout_s=60)
    assert final.state == "FAILED" and not steps
    assert ("train.precision='fp8' needs stage servers on GPUs with float8 tensor cores (compute capability 8.9 "
            "or newer: Ada, Hopper), and the job's servers compute on cpu") in final.error
    overrides = [a for o in TINY + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                    "train.precision=fp8"] for a in ("--set", o)]
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "run", "--local", "1", "--device", "cpu",
                             *overrides], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "train.fp8_emulate=true runs torchao's emulation" in result.stderr
    assert "starting a coordinator" not in result.stderr


FP8_LONG = ["train.steps=25", "train.warmup_steps=5", "train.lr=0.003"]


def test_an_fp8_job_tracks_its_reference(client):
    """bf16's bounds (test_zero_equivalence.test_bf16_tracks_its_reference_and_fp32), over
    25 steps of dp2·pp2·vpp2 with ZeRO-3, selective recompute and rowwise scaling: the
    layout rounds other partial sums than the reference does, and float8 rounds the
    operands of both alike."""
    common = TINY + FP8_LONG + ["train.precision=fp8", "train.fp8_recipe=rowwise", "train.fp8_emulate=true",
                                "train.recompute=selective"]
    final, steps = run_job(client, common + layout(dp=2, pp=2, vpp=2) + ["parallel.zero=3"])
    assert final.state == "SUCCEEDED", final.error
    expected, _ = reference(layout_free(common))
    bf16, _ = reference(layout_free(TINY + FP8_LONG + ["train.precision=bf16"]))
    differences = [abs(a.loss - b.loss) / b.loss for a, b in zip(steps, expected, strict=True)]
    assert sum(differences) / len(differences) <= 1e-2 and max(differences) <= 5e-2, differences
    assert any(a.loss != b.loss for a, b in zip(expected, bf16))  # the reference multiplied in float8 too
    assert steps[-1].loss < 0.8 * steps[0].loss
