"""Percentiles and the slowest rank over three processes:
`torchrun --standalone --nproc_per_node=3 stats_percentiles.py`."""

import numpy as np
import torch.distributed as dist

import lightning_ext
from lightning_ext.stats import Collector, report


def step_times(rank: int) -> np.ndarray:
    """200 step times of `rank` (seconds): log-normal around 12 ms; rank 1 is 50 ms slower."""
    times = np.random.default_rng(rank).lognormal(np.log(0.012), 0.3, size=200)
    return times + (0.05 if rank == 1 else 0.0)


def main(rank: int, world_size: int) -> None:
    timing = Collector(regex="Timing/.*", quantiles="Timing/.*", stragglers="Timing/step_sec")
    for value in step_times(rank):
        report("Timing/step_sec", value)
    timing.update()  # every rank: one MAX and one SUM all-reduce, sketches and slowest rank included
    if rank == 0:
        every = np.concatenate([step_times(r) for r in range(world_size)])  # what no rank holds
        for q in (0.5, 0.99):
            exact = np.quantile(every, q, method="inverted_cdf")
            print(f"p{q * 100:g}: {timing.quantile('Timing/step_sec', q):.5f} s (exact {exact:.5f} s)")
        print(f"max: {timing.max('Timing/step_sec'):.5f} s (exact {every.max():.5f} s)")
        slowest = timing.straggler("Timing/step_sec")
        print(f"slowest: rank {slowest.rank}, {slowest.ratio:.2f}x the median rank")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(dist.get_rank(), dist.get_world_size())
    lightning_ext.reset()
    dist.barrier()
    dist.destroy_process_group()
