"""Latency of a small all_reduce between CPU ranks of one host: gloo's own vs ours through shared memory
and ours through the process group.

Two spawned gloo ranks (1 thread each) all-reduce (SUM) float64 tensors of the sizes SyncBatchNorm
and the Collector send (2C + 1 for C = 64 and 256, a K = 100 collector's payload, one scalar) with
``torch.distributed.all_reduce`` (the anchor), with ``lightning_ext.distributed.all_reduce_`` over
the default group (which takes its shared-memory path for these tensors), and with ``all_reduce_``
over a second group of the same ranks created with ``LIGHTNING_EXT_SHM_COLLECTIVES=0`` (the
process-group path, with its agreement check: what a group spanning hosts pays), back to back, in
alternating blocks of 100 calls per transport (the first 5 of a block untimed). Median and 90th
percentile of the per-call time on rank 0; ratios = gloo / ours (> 1: ours is faster).

Usage: ``python benchmarks/bench_all_reduce.py [--quick] [--iters 2000]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import write_result  # noqa: E402

from lightning_ext.distributed import SHM_ENV_VAR, all_reduce_, shm_available  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

SIZES = {
    "scalar": 1,
    "SyncBN C=64 (129 floats)": 129,
    "SyncBN C=256 (513 floats)": 513,
    "Collector K=100": 404,
}
BLOCK = 100  # calls per transport before switching: a call right after the other transport's would
# absorb the rank skew that one left behind (gloo releases the ranks up to milliseconds apart)


def _worker(rank: int, world_size: int, iters: int) -> dict[str, dict[str, float]]:
    if not shm_available():
        raise RuntimeError("the shared-memory path of all_reduce_ is not available on this machine")
    os.environ[SHM_ENV_VAR] = "0"  # read at a group's first reduction: this group takes the process group
    process_group = dist.new_group(list(range(world_size)))
    if shm_available(process_group):
        raise RuntimeError(f"{SHM_ENV_VAR}=0 did not turn the shared-memory path off")
    transports = {
        "gloo": dist.all_reduce,
        "shm": all_reduce_,
        "pg": functools.partial(all_reduce_, group=process_group),
    }
    out = {}
    for label, n in SIZES.items():
        x = torch.randn(n, dtype=torch.float64)
        times: dict[str, list[float]] = {name: [] for name in transports}
        for _ in range(max(1, iters // BLOCK)):
            for name, fn in transports.items():
                for i in range(BLOCK + 5):
                    start = time.perf_counter()
                    fn(x)
                    elapsed = time.perf_counter() - start
                    x.mul_(0.5)  # keep the values bounded
                    if i >= 5:  # the first calls of a block absorb the skew left by the other transport
                        times[name].append(elapsed * 1e6)
        out[label] = {
            f"{name}_{stat}": fn(v)
            for name, v in times.items()
            for stat, fn in (("median", statistics.median), ("p90", lambda v: sorted(v)[int(0.9 * len(v))]))
        }
    del transports, process_group  # the harness destroys the group: nothing may hold it
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 calls per transport (smoke run)")
    parser.add_argument("--iters", type=int, default=2000, help="calls per transport and payload")
    args = parser.parse_args()
    if args.quick:
        args.iters = 200
    result = run_distributed(_worker, 2, args.iters, timeout=600)[0]
    lines = [
        "## Small all_reduce latency between 2 CPU ranks of one host (`bench_all_reduce.py`)",
        "",
        f"float64 SUM, {args.iters} calls per transport in alternating blocks of {BLOCK}, µs per call on "
        "rank 0: `torch.distributed.all_reduce` (gloo) vs `lightning_ext.distributed.all_reduce_` through "
        "shared memory, and through the process group (a group made with `LIGHTNING_EXT_SHM_COLLECTIVES=0`: "
        "gloo plus the agreement check, what a group spanning hosts pays). What one SyncBatchNorm layer pays "
        "per step and direction, and a Collector per flush.",
        "",
        "| payload | gloo median | gloo p90 | shared memory median | shared memory p90 | process group "
        "median | process group p90 | gloo / shared memory | gloo / process group |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in result.items():
        lines.append(
            f"| {label} | {r['gloo_median']:.0f} | {r['gloo_p90']:.0f} | {r['shm_median']:.0f} | "
            f"{r['shm_p90']:.0f} | {r['pg_median']:.0f} | {r['pg_p90']:.0f} | "
            f"{r['gloo_median'] / r['shm_median']:.1f}x | {r['gloo_median'] / r['pg_median']:.2f}x |"
        )
    markdown = "\n".join(lines)
    print(markdown)
    write_result("all_reduce", markdown, quick=args.quick)


if __name__ == "__main__":
    main()
