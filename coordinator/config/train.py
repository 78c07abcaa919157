"""[train]: steps, batch, optimizer, schedule, precision and recompute."""

from __future__ import annotations

from dataclasses import dataclass

from interleaf.common.limits import shown
from interleaf.common.lr_schedule import DECAY_FRACTION, DECAYS, MIN_LR_RATIO
from interleaf.common.model.compile_modes import COMPILE
from interleaf.common.model.fp8_recipes import FP8_RECIPES
from interleaf.common.model.recompute_modes import MODES
from interleaf.coordinator.config.rules import ConfigError, _bounded, _positive

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8, "fp8": 2}
"""Bytes per element of the compute dtype of each train.precision (fp8's is bf16: only
the products' operands are float8, cast as they are multiplied)."""
MASTER_BYTES = {"fp32": 4, "bf16": 4, "fp64": 8, "fp8": 4}
"""Bytes per element of the master weights, Adam moments and gradient reductions."""
PRECISIONS = tuple(PRECISION_BYTES)
RECOMPUTE = MODES


@dataclass(frozen=True)
class TrainConfig:
    """[train]: steps, batch, AdamW and its learning-rate schedule, precision and
    activation recomputation."""

    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Samples per step over all replicas; divisible by parallel.dp * parallel.microbatches."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 20
    """Linear warmup steps; then lr_decay's decay to lr*min_lr_ratio at the last step
    (when warmup_steps <= steps - 2; a longer warmup is allowed, and what it does is
    stated exactly in common/lr_schedule.py)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's (beta1, beta2): the decay rates of the gradient's running mean and of its
    square's; each at least 0 and less than 1. A TOML array, or `--set
    train.betas=0.9,0.99`."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the root of the squared-gradient average; more than 0."""
    lr_decay: str = "cosine"
    """After the warmup: cosine (to the floor at the last step), linear (likewise), wsd
    (warmup-stable-decay: the peak held, then the last decay_fraction of the steps fall
    linearly to the floor) or constant (the peak to the end). The rate of every step is
    a function of the step alone (common/lr_schedule.py, worked example there): the
    same on every rank and in `interleaf reference`, in each step's `lr`, and continued
    exactly by a resumed run."""
    min_lr_ratio: float = MIN_LR_RATIO
    """The floor the decay reaches at the last step, as a fraction of lr (0 to 1); not
    for constant."""
    decay_fraction: float = DECAY_FRACTION
    """wsd only: the fraction of all steps, at the end, over which the rate decays (more
    than 0, at most 1; decay_fraction*steps rounded half up, at least the last step; 1 is
    linear decay right after the warmup)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on weights and embeddings (not biases or norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all ranks) to this; 0 turns clipping off."""
    seed: int = 1234
    """Seeds the initial weights and the sample order."""
    precision: str = "fp32"
    """fp32; bf16 (bf16 parameters, activations and gradients for compute, fp32 master
    weights, Adam moments and gradient reductions, softmax and loss in fp32); fp8 (bf16,
    with the blocks' linears multiplying in float8 through torchao: `pip install
    interleaf[fp8]`, a GPU of compute capability 8.9 or newer, or CPUs with
    train.fp8_emulate; parallel.tp=1, and no zero-bubble schedule); or fp64 (everything float64:
    the verification mode, with no rounding noise to hide a bug)."""
    fp8_recipe: str = "tensorwise"
    """fp8 only: tensorwise (one float8 scale per tensor, the fastest) or rowwise (one per
    row of each operand, kinder to outliers): torchao's recipes of those names."""
    fp8_emulate: bool = False
    """fp8 only: lets servers on CPUs run the job through torchao's emulation (the same
    float8 casts and scales, the products in high precision): for tests, never speed.
    Without it an fp8 job on CPU servers is refused."""
    recompute: str = "none"
    """none; selective: each block keeps the outputs of its matrix multiplications,
    attention and collectives, and recomputes norms, activation functions, rotary
    embeddings and elementwise operations in the backward (torch's selective activation
    checkpointing; the rerun replays the kept collective outputs and communicates
    nothing); or full: a chunk keeps only its input after a forward and recomputes
    its activations in the backward (less activation memory for a second forward)."""
    recompute_layers: int = 0
    """selective only: K > 0 recomputes every K-th block in full (blocks whose global
    index i has (i + 1) % K == 0, torchtitan's layer-wise selective checkpointing) and
    keeps everything of the others; 0 (the default) is op-level selective in every block."""
    compile: bool | str = "auto"
    """true: each transformer block of every chunk runs through `torch.compile` (inductor
    fuses its norms, activation functions and residual adds; torchtitan's per-block
    compile), and so does the head loss's softmax arithmetic; recompute, tensor-parallel
    collectives, ZeRO and every schedule without a split backward unchanged; false: eager; "auto" (the default): true for servers on
    CUDA, false on CPUs ("on" and "off" are taken for true and false). The zero-bubble schedules (zb-h1, zbv) split each backward in
    hand-written autograd Functions that compiled graphs replace, so they run eager (true
    is refused)."""

    def __post_init__(self):
        _positive("train", self, "steps", "global_batch")
        self._check_optimizer()
        _bounded("train", self)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"train.recompute={self.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"train.fp8_recipe={shown(self.fp8_recipe)} must be one of {', '.join(FP8_RECIPES)}")
        if self.fp8_emulate and self.precision != "fp8":
            raise ConfigError(f"train.fp8_emulate=true needs train.precision='fp8', not {self.precision!r}")
        if self.fp8_recipe != "tensorwise" and self.precision != "fp8":
            raise ConfigError(f"train.fp8_recipe={self.fp8_recipe!r} needs train.precision='fp8', "
                              f"not {self.precision!r}")
        # Held as the setting servers take (common/model/compile_modes.py): on, off or auto.
        switch = {True: "on", False: "off", "true": "on", "false": "off"}
        given = self.compile.lower() if isinstance(self.compile, str) else self.compile
        setting = switch.get(given, given) if isinstance(given, (bool, str)) else given
        if setting not in COMPILE:
            raise ConfigError(f"train.compile={shown(self.compile)} must be true, false or \"auto\" "
                              f"(\"on\" and \"off\" are taken for true and false)")
        object.__setattr__(self, "compile", setting)
        if self.recompute_layers < 0:
            raise ConfigError(f"train.recompute_layers={self.recompute_layers} must be 0 (off) or more")
        if self.recompute_layers and self.recompute != "selective":
            raise ConfigError(f"train.recompute_layers={self.recompute_layers} needs train.recompute='selective' "
                              f"(it picks the blocks selective recompute reruns in full), "
                              f"not {self.recompute!r}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr} must be greater than 0")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must not be negative")

    def _check_optimizer(self) -> None:
        betas = self.betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
            raise ConfigError(f"train.betas={shown(betas)} must be a pair of numbers, e.g. [0.9, 0.95]")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))  # frozen; a list given
        if not all(0 <= b < 1 for b in self.betas):  # NaN fails too
            raise ConfigError(f"train.betas={list(self.betas)} must each be at least 0 and less than 1")
        if not self.eps > 0:
            raise ConfigError(f"train.eps={self.eps} must be greater than 0")
        if self.lr_decay not in DECAYS:
            raise ConfigError(f"train.lr_decay={shown(self.lr_decay)} must be one of {', '.join(DECAYS)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be between 0 and 1 "
                              f"(a fraction of train.lr)")
        if self.lr_decay == "constant" and self.min_lr_ratio != MIN_LR_RATIO:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be left out for "
                              f"train.lr_decay='constant': the rate never decays to a floor")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"train.decay_fraction={self.decay_fraction} must be more than 0 and at most 1 "
                              f"(a fraction of train.steps)")
        if self.lr_decay != "wsd" and self.decay_fraction != DECAY_FRACTION:
            raise ConfigError(f"train.decay_fraction={self.decay_fraction} must be left out unless "
                              f"train.lr_decay='wsd' (it sizes wsd's decay phase), not {self.lr_decay!r}")
