"""train.compile's settings and what each means on a server: whether its chunks'
blocks run through `torch.compile`.

Worked example: "auto" on a CUDA server running 1f1b compiles; the same server running
zb-h1 does not (its backwards are split into I and W by hand-written autograd
Functions, stageserver/model/weight_grads.py, which a compiled graph would replace);
"auto" on a CPU server never compiles; "on" compiles wherever the config rules let it
(they refuse "on" with a zero-bubble schedule).
"""

from __future__ import annotations

COMPILE = ("auto", "on", "off")
DEVICE_TYPES = ("cpu", "cuda")
"""What a server computes on, as far as compiling goes."""


def compiles(setting: str, device_type: str, splits_backward: bool) -> bool:
    """Whether a server on `device_type` ("cuda", "cpu") compiles its blocks for a
    program that does (I and W actions) or does not split its backwards."""
    if setting not in COMPILE:
        raise ValueError(f"train.compile={setting!r} must be one of {', '.join(COMPILE)}")
    if setting == "off" or splits_backward:
        return False
    return setting == "on" or device_type == "cuda"


def device_type_of(devices: list[str]) -> str:
    """The device type servers on `devices` ("cuda:0", "cpu", or a profile's device kind,
    "cuda (NVIDIA H100 80GB HBM3)") share, for what
    train.compile="auto" does on them: "cuda" where every one is a GPU, else "cpu", on
    which nothing compiles by default and the memory model predicts the eager blocks'
    larger bytes: for servers that differ, the larger prediction."""
    return "cuda" if devices and all(d.startswith("cuda") for d in devices) else "cpu"
