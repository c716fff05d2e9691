"""Tile-size sweep of the Triton kernels on a GPU (diagnosis; the figures of record come from
``bench_kernels.py``). Prints, per variant of the launch constants, each op's time and its fraction
of copy bandwidth at two ResNet-50 shapes in float16, NCHW and channels_last, then the host cost of
one eager launch. The multi-tensor unscale has its own script, ``tune_unscale_gpu.py``.

Usage (GPU only): ``python benchmarks/tune_kernels_gpu.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton.testing
from bench_kernels import _n_sets, gpu_device_time

from lightning_ext.kernels import batch_norm as bn
from lightning_ext.kernels import unscale as us


def t(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e-3


def main() -> None:
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / t(lambda: dst.copy_(src))
    print(f"copy {copy / 1e9:.0f} GB/s")
    cases = []
    for shape in ((64, 64, 56, 56), (64, 256, 14, 14)):
        for fmt in (torch.contiguous_format, torch.channels_last):
            c = shape[1]
            sets = []
            for _ in range(_n_sets(4 * torch.Size(shape).numel())):
                x = torch.randn(shape, device="cuda").half().contiguous(memory_format=fmt)
                dy = torch.randn(shape, device="cuda").half().contiguous(memory_format=fmt)
                mean, invstd = torch.randn(c, device="cuda"), torch.rand(c, device="cuda") + 0.5
                w, b = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
                cnt = torch.full((c,), float(x.numel() // c), device="cuda")
                sets.append((x, dy, mean, invstd, w, b, cnt))
            cases.append((f"{shape} {'CL' if fmt == torch.channels_last else 'NCHW'}", sets))
    ops = {
        "stats": (lambda a: bn.batch_norm_stats_triton(a[0]), 1),
        "elemt": (lambda a: bn.batch_norm_elemt_triton(*a[:1], *a[2:6]), 2),
        "bwd_reduce": (lambda a: bn.batch_norm_backward_reduce_triton(a[1], a[0], a[2], a[3]), 2),
        "bwd_elemt": (
            lambda a: bn.batch_norm_backward_elemt_triton(a[1], a[0], a[2], a[3], a[4], a[2], a[3], a[6]),
            3,
        ),
    }
    for tile, warps, per_sm in (
        (2048, 4, 8),
        (2048, 8, 8),
        (4096, 8, 4),
        (1024, 4, 16),
        (4096, 4, 8),
        (8192, 8, 4),
    ):
        bn._TILE, bn._NUM_WARPS, bn._PROGRAMS_PER_SM = tile, warps, per_sm
        for name, sets in cases:
            nb = sets[0][0].numel() * 2
            row = "  ".join(
                f"{op} {1e6 * (s := gpu_device_time(fn, sets)):6.1f}us {k * nb / s / copy:4.2f}"
                for op, (fn, k) in ops.items()
            )
            print(f"tile {tile} warps {warps} per_sm {per_sm:2d} {name:24s} {row}", flush=True)
    shapes_g = [(2048, 1024)] * 5 + [(512,)] * 40
    nb = 2 * sum(torch.Size(sh).numel() * 4 for sh in shapes_g)
    gsets = [[torch.randn(sh, device="cuda") * 1e-3 for sh in shapes_g] for _ in range(_n_sets(nb))]
    inv = torch.tensor(1.0, device="cuda")
    flag = torch.zeros((), device="cuda")
    # Host cost of one eager call (what a small layer pays when the GPU waits for the launch).
    x = torch.randn(64, 16, 32, 32, device="cuda")
    mean16, inv16 = torch.zeros(16, device="cuda"), torch.ones(16, device="cuda")
    calls = {
        "batch_norm_stats": lambda: bn.batch_norm_stats_triton(x),
        "batch_norm_elemt": lambda: bn.batch_norm_elemt_triton(x, mean16, inv16, None, None),
        "unscale_and_check (45 tensors)": lambda: us.unscale_and_check_triton(gsets[0], inv),
        "ATen batch_norm_stats": lambda: torch.batch_norm_stats(x, 1e-5),
        "ATen unscale (45 tensors)": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            gsets[0], flag, inv
        ),
    }
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200
        torch.cuda.synchronize()
        print(f"host time per call, {name}: {host * 1e6:.1f} us", flush=True)


if __name__ == "__main__":
    main()
