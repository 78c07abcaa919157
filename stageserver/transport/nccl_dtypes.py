"""torch dtypes as NCCL data types.

NCCL names its types by an enum (nccl.h's ncclDataType_t); CuPy exposes them as
`cupy.cuda.nccl.NCCL_*` constants. The map is by name and value so that it can be
checked on a machine without CuPy (tests) and against CuPy's constants on a GPU
machine (bench/gpu/check_nccl.py). bf16 has no NumPy type, so CuPy cannot infer it
from an array: it must be named explicitly, which is why torch tensors are passed by
pointer with their NCCL type from this table.
"""

from __future__ import annotations

import torch

# torch dtype -> (CuPy constant name, ncclDataType_t value in nccl.h)
NCCL_TYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.int8: ("NCCL_INT8", 0),
    torch.uint8: ("NCCL_UINT8", 1),
    torch.int32: ("NCCL_INT32", 2),
    torch.int64: ("NCCL_INT64", 4),
    torch.float16: ("NCCL_FLOAT16", 6),
    torch.float32: ("NCCL_FLOAT32", 7),
    torch.float64: ("NCCL_FLOAT64", 8),
    torch.bfloat16: ("NCCL_BFLOAT16", 9),
}


def nccl_type(dtype: torch.dtype) -> int:
    """The ncclDataType_t value of `dtype`; a clear error for one NCCL cannot move."""
    try:
        return NCCL_TYPES[dtype][1]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in NCCL_TYPES)
        raise TypeError(f"tensor dtype {dtype} has no NCCL type (supported: {supported})") from None
