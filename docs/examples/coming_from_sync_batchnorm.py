"""torch.nn.SyncBatchNorm and ours, on two CPU processes (gloo).

Run with `torchrun --standalone --nproc_per_node=2 coming_from_sync_batchnorm.py`.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning_ext
from lightning_ext.nn import convert_sync_batchnorm, revert_sync_batchnorm


def before():
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
    )
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DistributedDataParallel(net)  # CPU
    x = torch.randn(4, 3, 8, 8)
    model(x).mean().backward()
    return model.module  # torch has no revert


def after():
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
    )
    net = convert_sync_batchnorm(net)
    model = DistributedDataParallel(net)  # CPU
    x = torch.randn(4, 3, 8, 8)
    model(x).mean().backward()
    return revert_sync_batchnorm(model.module)


def main(rank: int) -> None:
    for name, function in (("before", before), ("after", after)):
        try:
            result = type(function()[1]).__name__
        except Exception as err:  # raised on every rank alike: nobody waits in a collective
            result = f"{type(err).__name__}: {err}"
        if rank == 0:
            print(f"{name}: {result}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(dist.get_rank())
    lightning_ext.reset()
    dist.barrier()
    dist.destroy_process_group()
