"""train.precision = "fp8": bf16 training whose blocks' linears multiply in float8, through
torchao's float8 training (the matmul its Float8Linear runs: each operand scaled to
float8 e4m3 by its current absolute maximum, per tensor or per row, the product
accumulated in higher precision, the output in bf16; the backward's products likewise).

The weights, their gradients, the master copy and the optimizer stay as bf16 runs keep
them; only the products' operands are cast, dynamically, so there is no scale history
to checkpoint or shard, and ZeRO, pipelining and recompute see bf16 tensors. Eager, a
linear saves its bf16 input and weight for its backward, as under bf16 (the memory
model's bytes); compiled (train.compile), inductor keeps fewer of them and recomputes the
rest, casts included (coordinator/activation_bytes.py, compiled_block_bytes). The
embedding, the final norm and the head stay bf16, as torchtitan leaves the output
projection out of float8.

Recipes (train.fp8_recipe): tensorwise, one scale per tensor (fastest); rowwise, one
per row of each operand (more accurate for outliers). On a GPU the products need float8
tensor cores (compute capability 8.9: Ada, Hopper and newer). On a CPU torchao's
emulation runs the same casts and scales with the products in high precision: the
tests' path, for correctness, never speed.

Worked example: a gpt2 block's qkv at tp=1 with x [8, 2048, 2048] bf16 and weight
[6144, 2048] bf16: x and weight are each scaled by 448/amax and cast to e4m3, their
product taken by torch._scaled_mm with the inverse scales, giving [8, 2048, 6144] bf16;
the bias is added after, in bf16.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from interleaf.common.model.fp8_recipes import FP8_RECIPES
from interleaf.stageserver.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear

MIN_CAPABILITY = (8, 9)


class Float8Matmul:
    """x @ weight.T (+ bias) in float8, as torchao's Float8Linear computes it."""

    def __init__(self, recipe: str, emulate: bool):
        from torchao.float8 import Float8LinearConfig  # imported here: only fp8 jobs need torchao
        from torchao.float8.float8_linear import Float8Linear

        self.config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        # torchao builds the products' configuration from the recipe in its module's
        # constructor: one on the meta device yields it without allocating anything.
        template = Float8Linear.from_float(nn.Linear(16, 16, bias=False, device="meta"), config=self.config)
        self.mm_config = template.linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        out = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return out if bias is None else out + bias.to(out.dtype)


def check_ready(device: torch.device) -> None:
    """Refuses (ValueError naming what and the rule) a GPU without float8 tensor cores,
    or a server without torchao."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ValueError(f"train.precision='fp8' needs torchao on the stage server (pip install "
                         f"'interleaf[fp8]'): {err}") from None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise ValueError(
                f"train.precision='fp8' needs float8 tensor cores (compute capability "
                f"{'.'.join(map(str, MIN_CAPABILITY))} or newer: Ada, Hopper); {device} "
                f"({torch.cuda.get_device_name(device)}) is {'.'.join(map(str, capability))}")


def convert_blocks_to_fp8(chunk: nn.Module, recipe: str, device: torch.device) -> None:
    """Every tensor-parallel linear of the chunk's blocks (chunk.h) multiplies in float8
    (emulated on a CPU); the embedding and the head are left as they are."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8_recipe={recipe!r} must be one of {', '.join(FP8_RECIPES)}")
    check_ready(device)
    blocks = chunk.get_submodule("h")
    linears = [m for m in blocks.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    split = sorted({m.tp.size for m in linears} - {1})
    if split:
        raise ValueError(f"train.precision='fp8' runs whole linears only (parallel.tp=1), not tp={split[0]}")
    matmul = Float8Matmul(recipe, emulate=device.type != "cuda")
    for module in linears:
        module.float8 = matmul
