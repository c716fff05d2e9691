"""SyncBatchNorm cost: ours (2 gloo ranks, CPU) vs local ATen ``nn.BatchNorm2d`` in the same run.

For per-rank shapes (32, 64, 32, 32) and (64, 256, 14, 14), fp32, NCHW and channels_last (and bf16,
fp16 and float64 input in both formats at (32, 64, 32, 32), and bf16 at the digits model's
(32, 64, 8, 8)), each of two spawned gloo ranks
times one training step of a single layer (forward + backward with a fixed upstream gradient):
:class:`lightning_ext.nn.SyncBatchNorm` (one float64 ``all_reduce`` of ``2C + 1`` numbers in forward,
one float32 ``all_reduce`` of ``2C`` in backward) with the kernel backend chosen automatically
(``cpu`` where it builds), the same layer with ``backend="reference"``, the layer's autograd Function
run with ``group=None`` (its maths without the collectives), and a local ``nn.BatchNorm2d`` (no
communication), interleaved with the local layer right before each of ours, median of the timed
steps. A counting pass (``_common.CollectiveCounter``, benchmark only) reports the collectives and
bytes per layer step, next to what ``torch.nn.SyncBatchNorm`` moves: an ``all_gather`` of
``W * (2C + 1)`` float32 (count, mean, invstd per rank) in forward plus an ``all_reduce`` of ``2C``
float32 in backward. Target: ours <= 1.5x local BatchNorm2d on CPU.

GPU section (only when CUDA is available): at world size 1, ours forced through the synchronized
path (its autograd Function with one all_reduce over a 1-rank NCCL group; ``triton`` and
``reference`` backends) vs ``torch.nn.SyncBatchNorm``'s own autograd function forced through its
synchronized path on the same group. Target: <= 1.0x.

Usage: ``python benchmarks/bench_syncbn.py [--quick] [--gpu-only]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _common import CollectiveCounter, align_ranks, anchored_pairs, write_result  # noqa: E402

from lightning_ext.distributed import shm_available  # noqa: E402
from lightning_ext.kernels import get_backend  # noqa: E402
from lightning_ext.nn import SyncBatchNorm  # noqa: E402
from lightning_ext.nn.sync_batch_norm import _SyncBatchNormFunction  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

SHAPES = [(32, 64, 32, 32), (64, 256, 14, 14)]
FORMATS = {"NCHW": torch.contiguous_format, "channels_last": torch.channels_last}
# (shape, format, dtype): fp32 at the target's shapes, then every other input dtype (bf16/fp16 as
# autocast gives them, float32 parameters; float64) in both formats at the first shape, and bf16 at a
# layer of the end-to-end digits model.
CASES = (
    [(shape, fmt, torch.float32) for shape in SHAPES for fmt in FORMATS]
    + [(SHAPES[0], fmt, dtype) for dtype in (torch.bfloat16, torch.float16, torch.float64) for fmt in FORMATS]
    + [((32, 64, 8, 8), "NCHW", torch.bfloat16)]
)


def _step(bn: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    y = bn(x)
    y.backward(dy)


def _function(bn: SyncBatchNorm, x: torch.Tensor, group, backend) -> torch.Tensor:
    """``bn``'s training forward through its autograd Function over ``group`` (``None``: no collective)."""
    bn.num_batches_tracked.add_(1)
    return _SyncBatchNormFunction.apply(
        x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked, bn.momentum,
        bn.eps, True, group, backend,
    )  # fmt: skip


class _WithoutCollectives(nn.Module):
    """Our layer's autograd Function with ``group=None``: its maths alone, without the two all_reduces."""

    def __init__(self, bn: SyncBatchNorm) -> None:
        super().__init__()
        self.bn = bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _function(self.bn, x, None, get_backend(self.bn.backend, x.device))


def _worker(rank: int, world_size: int, iters: int) -> list[dict]:
    rows = []
    shm_available()  # set the shared-memory segment up now, outside the counted step
    for shape, fmt_name, dtype in CASES:
        fmt = FORMATS[fmt_name]
        g = torch.Generator().manual_seed(rank)
        x = (1.0 + torch.randn(shape, generator=g)).to(dtype).contiguous(memory_format=fmt)
        x.requires_grad_(True)
        dy = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=fmt)
        # float64 input with float64 parameters (ATen's BatchNorm takes no float32 ones with it); half
        # precision input with float32 parameters, as autocast gives it.
        params = {"dtype": torch.float64} if dtype == torch.float64 else {}
        ours = SyncBatchNorm(shape[1], **params)
        with CollectiveCounter() as counter:
            _step(ours, x, dy)
        x.grad = None
        layers = {
            "local": nn.BatchNorm2d(shape[1], **params),
            "ours": ours,
            "without": _WithoutCollectives(SyncBatchNorm(shape[1], **params)),
            "reference": SyncBatchNorm(shape[1], backend="reference", **params),
        }
        times: dict[str, list[float]] = {name: [] for name in layers}
        paired: list[float] = []
        for i in range(iters + 3):
            # local right before each of ours (L O L W L R): no layer follows itself or a variant of it.
            for anchor, name in anchored_pairs(list(layers)):
                step_times = []
                for which in (anchor, name):
                    align_ranks()
                    start = time.perf_counter()
                    _step(layers[which], x, dy)
                    step_times.append(time.perf_counter() - start)
                    x.grad = None
                if i >= 3:
                    times[anchor].append(step_times[0])
                    times[name].append(step_times[1])
                    if name == "ours":
                        paired.append(step_times[1] / step_times[0])
        rows.append(
            {
                "shape": shape,
                "format": fmt_name,
                "dtype": str(dtype).replace("torch.", ""),
                **{f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()},
                # Steps of one iteration ran back to back: their ratio cancels slow machine drift.
                "paired": statistics.median(paired),
                "calls": counter.calls,
                "backend": get_backend(None, "cpu").name,
            }
        )
    return rows


def _ours_forced_step(bn: SyncBatchNorm, group, x: torch.Tensor, dy: torch.Tensor) -> None:
    _function(bn, x, group, get_backend(bn.backend, x.device)).backward(dy)


def _torch_forced_step(ref: nn.BatchNorm2d, group, x: torch.Tensor, dy: torch.Tensor) -> None:
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNormFunction

    TorchSyncBatchNormFunction.apply(
        x, ref.weight, ref.bias, ref.running_mean, ref.running_var, 1e-5, 0.1, group, 1
    ).backward(dy)


def gpu_section(iters: int) -> str:
    """World size 1 on CUDA: ours vs torch.nn.SyncBatchNorm's function, both forced to synchronize."""
    store = Path(tempfile.mkdtemp(prefix="bench_syncbn_")) / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    group = dist.group.WORLD
    lines = [
        "## SyncBatchNorm, GPU (`bench_syncbn.py`)",
        "",
        f"{torch.cuda.get_device_name()}, world size 1 (NCCL) forced through the synchronized path, fp32, "
        f"one layer's forward + backward, mean ms over {iters} steps (host clock around synchronized "
        "loops, so launch overhead counts), the three timed one after another per repeat, median of 3 "
        "repeats. Target: ours <= 1.0x torch's SyncBatchNorm function.",
        "",
        "| shape (N, C, H, W) | format | ours, triton backend | ours, reference backend "
        "| torch SyncBatchNorm function | triton / torch | reference / torch |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    try:
        for shape in SHAPES:
            for fmt_name, fmt in FORMATS.items():
                x = torch.randn(shape, device="cuda").contiguous(memory_format=fmt).requires_grad_(True)
                dy = torch.randn(shape, device="cuda").contiguous(memory_format=fmt)
                ref = nn.BatchNorm2d(shape[1], device="cuda")
                steps = {"torch": functools.partial(_torch_forced_step, ref, group, x, dy)}
                for be in ("triton", "reference"):
                    bn = SyncBatchNorm(shape[1], device="cuda", backend=be)
                    steps[be] = functools.partial(_ours_forced_step, bn, group, x, dy)
                samples: dict[str, list[float]] = {name: [] for name in steps}
                for fn in steps.values():  # warm-up: compilation, caches
                    for _ in range(5):
                        fn()
                for _ in range(3):
                    for name, fn in steps.items():
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        for _ in range(iters):
                            fn()
                        torch.cuda.synchronize()
                        samples[name].append(1e3 * (time.perf_counter() - start) / iters)
                result = {name: statistics.median(v) for name, v in samples.items()}
                line = (
                    f"| {shape} | {fmt_name} | {result['triton']:.3f} | {result['reference']:.3f} | "
                    f"{result['torch']:.3f} | {result['triton'] / result['torch']:.2f}x | "
                    f"{result['reference'] / result['torch']:.2f}x |"
                )
                print(line, flush=True)
                lines.append(line)
    finally:
        dist.destroy_process_group()
    return "\n".join(lines)


def cpu_section(iters: int, world_size: int = 2) -> str:
    results = run_distributed(_worker, world_size, iters, timeout=1800)
    backend = results[0][0]["backend"]
    lines = [
        "## SyncBatchNorm (`bench_syncbn.py`)",
        "",
        f"CPU, {world_size} gloo ranks (1 thread each), per-rank shape and input dtype as given (bf16: "
        "float32 parameters, as under autocast), one layer's training step (forward + backward), median "
        f"of {iters} interleaved steps on rank 0 (local BatchNorm2d right before each other layer: L O L "
        "W L R ...); paired ratio = median over steps of ours / the local step right before it. Ours "
        f"runs the automatically chosen kernel backend, `{backend}` in this run. "
        "Target: ours <= 1.5x local ATen BatchNorm2d.",
        "",
        f"| shape (N, C, H, W) | format | dtype | ours ({backend}) ms | local BatchNorm2d ms | ratio "
        "| paired ratio | ours without collectives ms | ours, reference backend ms | ours collectives/step "
        "| ours bytes/layer | torch all_gather scheme bytes/layer |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in results[0]:
        channels = row["shape"][1]
        ours_bytes = sum(b for _, b in row["calls"])
        # torch.nn.SyncBatchNorm: all_gather of W*(2C+1) float32 (fwd) + all_reduce of 2C float32 (bwd).
        torch_bytes = 4 * world_size * (2 * channels + 1) + 4 * 2 * channels
        names = ", ".join(f"{name} {b} B" for name, b in row["calls"])
        lines.append(
            f"| {row['shape']} | {row['format']} | {row['dtype']} | {row['ours_ms']:.2f} | "
            f"{row['local_ms']:.2f} | {row['ours_ms'] / row['local_ms']:.2f}x | {row['paired']:.2f}x | "
            f"{row['without_ms']:.2f} | {row['reference_ms']:.2f} | {names} | {ours_bytes} | {torch_bytes} |"
        )
    lines += [
        "",
        "'ours without collectives' runs the layer's autograd Function with `group=None`: the same",
        "kernel-backend maths with the two all_reduces left out; the difference to 'ours' is the cost of",
        "the two small all_reduces, which `lightning_ext.distributed.all_reduce_` sends through shared",
        "memory between ranks of one host (`all_reduce_ (shm)`; `bench_all_reduce.py` times it against",
        "gloo's). Each timed step starts after an all_reduce that aligns the ranks. 'ours, reference",
        'backend\' is the same layer with `backend="reference"` (ATen ops driven from Python; results',
        "agree to rounding). Figures from a loaded machine are noisy; compare within one run.",
        "",
        "Bytes are the buffers handed to the collectives per layer and step. Ours: 8(2C+1) forward (float64,",
        "for exactness with uneven shards) + 4·2C backward, independent of the world size W; torch's",
        "all_gather buffer is 4·W(2C+1) forward + 4·2C backward, so ours moves the same at W = 2 and less",
        "for every W > 2 (e.g. W = 8: 8(2C+1) vs 32(2C+1) forward).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps (smoke run)")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU section")
    args = parser.parse_args()
    iters = 5 if args.quick else 60
    if torch.cuda.is_available():
        markdown = gpu_section(iters * 5)
        print(markdown, flush=True)
        write_result("syncbn_gpu", markdown, quick=args.quick)
    elif args.gpu_only:
        print("bench_syncbn.py --gpu-only: no CUDA device, nothing to run")
    if args.gpu_only:
        return 0
    markdown = cpu_section(iters)
    print(markdown)
    write_result("syncbn", markdown, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
