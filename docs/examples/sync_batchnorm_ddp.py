"""SyncBatchNorm on two CPU processes: `torchrun --standalone --nproc_per_node=2 sync_batchnorm_ddp.py`.

Rank 0 holds the 5 samples of the global batch and rank 1 none; the synchronized layer must give what
one process computes with torch's BatchNorm on the whole batch.
"""

import torch
import torch.distributed as dist
from torch import nn

import lightning_ext
from lightning_ext.nn import convert_sync_batchnorm


def main(rank: int) -> None:
    torch.manual_seed(0)  # the same model and global batch on every rank
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
    reference = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
    reference.load_state_dict(model.state_dict())
    model = convert_sync_batchnorm(model)  # BatchNorm2d -> lightning_ext.nn.SyncBatchNorm
    batch = torch.randn(5, 3, 6, 6)
    mine = slice(0, 5) if rank == 0 else slice(5, 5)  # uneven: 5 samples and none

    x = batch[mine].clone().requires_grad_()
    y = model(x)  # training mode: ONE all_reduce of 2C + 1 float64 numbers
    y.square().sum().backward()  # ONE all_reduce of 2C numbers

    expected_x = batch.clone().requires_grad_()
    expected_y = reference(expected_x)  # one process, the whole batch
    expected_y.square().sum().backward()
    bn, expected_bn = model[1], reference[1]
    checks = {
        "output": torch.allclose(y, expected_y[mine], atol=1e-5),
        "input grad": torch.allclose(x.grad, expected_x.grad[mine], atol=1e-5),
        "running stats": torch.allclose(bn.running_mean, expected_bn.running_mean, atol=1e-6)
        and torch.allclose(bn.running_var, expected_bn.running_var, atol=1e-6),
    }
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, checks)

    if rank == 0:  # eval mode calls no collective: one rank may run inference alone
        model.eval()
        model(batch)
        for r, result in enumerate(results):
            print(f"rank {r}: {5 if r == 0 else 0} samples,", result)
        print(type(bn).__name__, "synchronized", int(bn.num_batches_tracked), "batch")


if __name__ == "__main__":
    dist.init_process_group("gloo")  # torchrun sets the rank, world size and rendezvous address
    main(dist.get_rank())
    lightning_ext.reset()  # drop the package's references to the process group, then tear it down
    dist.barrier()
    dist.destroy_process_group()
