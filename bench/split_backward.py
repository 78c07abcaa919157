"""What splitting the backward costs: one chunk's fused backward B against its
input-gradient pass I plus its weight-gradient pass W (stageserver/model/weight_grads.py),
in one process, on the same forward each time.

The split computes the same products as B (the measured gradients are equal to the
bit), so what it adds is per parameter operation: a Python function queued in I and
called in W, the weight gradients' matrix products run apart from the input
gradients' (their operands no longer fresh in the caches), LayerNorm's kernel run
twice (input gradient, then weight and bias), and the memory of what W reads held
through I (on a CPU, I's own allocations then take fresh pages). Reported: the median
of B, I, W and I+W over the repeats; the overhead, the median over the repeats of
(I+W)/B - 1 (each repeat runs B and I+W back to back, so that a slow spell of a shared
machine hits both); and the activation bytes a forward keeps for its backward beside
those an I keeps for its W (activation_meter.py's counting).

Defaults: a middle gpt2 chunk of 4 layers, d_model 256, seq 128, batch 8, fp32, on the
CPU with torch's default threads. The script exits non-zero if the two ways' gradients
differ.

    python bench/split_backward.py [--arch gpt2|llama] [--chunk middle|whole] [--layers 4] [--d-model 256]
        [--seq 128] [--batch 8] [--vocab 50304] [--precision fp32|bf16|fp64] [--recompute none|selective]
        [--repeats 10] [--warmup 2] [--device cpu|cuda] [--threads N] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from interleaf.common.model.config import ModelShape
from interleaf.stageserver.activation_meter import ActivationMeter, parameter_storages, storage_bytes
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.model.weight_grads import WeightGrads
from interleaf.stageserver.transport import SoloTransport

# Siblings in bench/ (the script's own directory is first on sys.path).
from measure import machine, table, write_json

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="One chunk's backward fused (B) against split (I + W)")
    parser.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--chunk", choices=("middle", "whole"), default="middle",
                        help="blocks only, or with the embedding, head and loss")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50304, help="with --chunk whole")
    parser.add_argument("--precision", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--recompute", choices=("none", "selective"), default="none")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats of each way, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "split_backward.json"))
    return parser.parse_args()


class _Chunk:
    """The chunk, its input and output gradient, and one forward + backward either way."""

    def __init__(self, args: argparse.Namespace):
        self.device = torch.device(args.device)
        whole = args.chunk == "whole"
        llama = dict(arch="llama", n_kv_heads=args.d_model // 64, ffn_hidden=4 * args.d_model) \
            if args.arch == "llama" else {}
        config = ModelShape(n_layers=args.layers, d_model=args.d_model, n_heads=args.d_model // 64,
                            seq_len=args.seq, vocab_size=args.vocab, **llama)
        self.chunk = ModelChunk(config, range(args.layers), whole, whole, SoloTransport(), seed=0,
                                recompute=BlockRecompute(args.recompute)).to(self.device, DTYPES[args.precision])
        g = torch.Generator().manual_seed(1)
        shape, dtype = (args.batch, args.seq, args.d_model), DTYPES[args.precision]
        self.ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(self.device)
        self.targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(self.device)
        self.hidden = torch.randn(shape, generator=g).to(self.device, dtype)
        self.grad = torch.randn(shape, generator=g).to(self.device, dtype)
        self.whole = whole

    def _input(self) -> torch.Tensor:
        return self.ids if self.whole else self.hidden.clone().requires_grad_()

    def _forward(self, x: torch.Tensor, weight_grads: WeightGrads | None = None) -> torch.Tensor:
        with weight_grads.recording() if weight_grads else torch.enable_grad():
            return self.chunk(x, self.targets) if self.whole else self.chunk(x)

    def _backward(self, out: torch.Tensor) -> None:
        out.backward(None if self.whole else self.grad)

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def fused(self) -> float:
        """Seconds of B (the forward before it not counted)."""
        self.chunk.zero_grad(set_to_none=True)
        out = self._forward(self._input())
        start = self._sync()
        self._backward(out)
        return self._sync() - start

    def split(self) -> tuple[float, float]:
        """Seconds of I and of W."""
        self.chunk.zero_grad(set_to_none=True)
        weight_grads = WeightGrads()
        out = self._forward(self._input(), weight_grads)
        start = self._sync()
        with weight_grads.deferred():
            self._backward(out)
        middle = self._sync()
        weight_grads.run()
        return middle - start, self._sync() - middle

    def grads(self) -> dict[str, torch.Tensor]:
        return {name: p.grad.clone() for name, p in self.chunk.named_parameters() if p.grad is not None}

    def bytes_kept(self) -> tuple[int, int]:
        """(activation bytes a forward keeps for B or I, bytes an I keeps for W)."""
        exclude = parameter_storages(self.chunk)
        x = self._input()
        out, kept = ActivationMeter(exclude).forward(self.chunk, x, self.targets if self.whole else None)
        weight_grads = WeightGrads()
        out = self._forward(x, weight_grads)
        with weight_grads.deferred():
            self._backward(out)
        held = storage_bytes(weight_grads.tensors(), exclude)
        weight_grads.run()
        return kept, held


def main() -> None:
    args = _arguments()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    before = machine()
    chunk = _Chunk(args)
    chunk.fused()
    want = chunk.grads()
    chunk.split()
    got = chunk.grads()
    differ = [name for name, _ in chunk.chunk.named_parameters()
              if name not in got or name not in want or not torch.equal(got[name], want[name])]
    fused, inputs, weights = [], [], []
    for repeat in range(args.warmup + args.repeats):  # alternated, so that drift hits both alike
        b = chunk.fused()
        i, w = chunk.split()
        if repeat >= args.warmup:
            fused.append(b)
            inputs.append(i)
            weights.append(w)
    kept, held = chunk.bytes_kept()
    b, i, w = (statistics.median(v) for v in (fused, inputs, weights))
    split = statistics.median(x + y for x, y in zip(inputs, weights))
    overhead = statistics.median((x + y) / z - 1 for x, y, z in zip(inputs, weights, fused))
    result = dict(config=vars(args), machine=before, fused_seconds=fused, input_seconds=inputs,
                  weight_seconds=weights, median=dict(fused=b, input=i, weight=w, split=split),
                  overhead=overhead, forward_kept_bytes=kept, input_kept_bytes=held, grads_equal=not differ)
    write_json(args.out, result)
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    print(table(["B ms", "I ms", "W ms", "I+W ms", "overhead", "kept by F", "kept by I for W"],
                [[ms(b), ms(i), ms(w), ms(split), f"{100 * overhead:+.1f}%", f"{kept >> 10} KiB",
                  f"{held >> 10} KiB"]]))
    if differ:
        raise SystemExit(f"the split's gradients differ from B's: {', '.join(differ)}")


if __name__ == "__main__":
    main()
