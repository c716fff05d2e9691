"""Training statistics over two processes: `torchrun --standalone --nproc_per_node=2 stats_ddp.py`."""

import torch
import torch.distributed as dist

import lightning_ext
from lightning_ext.stats import Collector, report, report0


def main(rank: int) -> None:
    collector = Collector(regex=".*")  # on every rank, before the values are reported
    for step in range(3):
        # Ranks report different numbers of values, and only rank 1 reports "Data/skipped".
        report("Loss/train", torch.full((rank + 1,), float(10 * rank + step)))
        if rank == 1:
            report("Data/skipped", 1)
        report0("Opt/lr", 0.1)  # identical on every rank: only rank 0's value counts

    collector.update()  # every rank, same order: the collectives run here
    stats = collector.as_dict()  # identical on every rank
    if rank == 0:
        for name, values in stats.items():
            print(name, {key: round(value, 4) for key, value in values.items()})


if __name__ == "__main__":
    dist.init_process_group("gloo")  # torchrun sets the rank, world size and rendezvous address
    main(dist.get_rank())
    lightning_ext.reset()  # drop the package's references to the process group, then tear it down
    dist.barrier()
    dist.destroy_process_group()
