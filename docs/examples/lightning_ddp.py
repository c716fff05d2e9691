"""A Lightning job for any launcher: `torchrun ... lightning_ddp.py --devices D --num-nodes N`.

Lightning reads the ranks from the launcher's environment (torchrun's, or SLURM's under `srun`);
`--devices` is the number of processes per node.
"""

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ext.callbacks import LossMonitor, TrainingStats
from lightning_ext.distributed import shm_available
from lightning_ext.plugins import SyncBatchNormPlugin
from lightning_ext.stats import report


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return report("Loss/train", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self):
        shared_memory = shm_available()  # a collective the first time: every rank calls it
        if self.global_rank == 0:
            t = self.trainer
            print(f"{t.num_nodes} nodes, {t.num_devices} process(es) per node, world size {t.world_size}")
            print("synchronized layer:", type(self.net[1]).__name__, "| shared memory:", shared_memory)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=16)  # Lightning shards it
    stats = TrainingStats(every_n_train_steps=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy="ddp",
        plugins=[SyncBatchNormPlugin()], callbacks=[stats, LossMonitor(every_n_train_steps=4)], max_steps=8,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Classifier()
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        logged = "Loss/train" in stats.collector.names()
        print("after fit:", type(model.net[1]).__name__, "| Loss/train logged:", logged)


if __name__ == "__main__":
    main()
