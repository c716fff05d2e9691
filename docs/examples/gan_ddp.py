"""A GAN in manual optimization on two CPU processes.

`torchrun --standalone --nproc_per_node=2 gan_ddp.py`. The shape of Lightning's GAN
template (a discriminator step, then a generator step, each with its own optimizer) in
small, with one fp16 loss scale per optimizer and `LossMonitor`.
"""

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ext.amp import DynamicLossScaler
from lightning_ext.callbacks import LossMonitor
from lightning_ext.plugins import LossScalingPrecision


class TinyGAN(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        # G: noise (N, 4) -> samples (N, 8); D: samples (N, 8) -> logits (N, 1)
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(len(real), 4, device=self.device)

        self.toggle_optimizer(opt_d)  # only D's parameters require grad: D's scale
        fake = self.G(z).detach()
        logits_fake, logits_real = self.D(fake).float(), self.D(real).float()
        loss_d = F.softplus(logits_fake).mean() + F.softplus(-logits_real).mean()
        opt_d.zero_grad()
        self.manual_backward(loss_d)  # scaled by D's scale; DDP averages the gradients
        opt_d.step()  # unscale, check, step or skip, move D's scale
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)  # only G's parameters require grad: G's scale
        loss_g = F.softplus(-self.D(self.G(z)).float()).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # LossMonitor reads what training_step returns: "loss" and other "loss..." keys
        loss_d, loss_g = loss_d.detach(), loss_g.detach()
        return {"loss": loss_d + loss_g, "loss_D": loss_d, "loss_G": loss_g}

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.G.parameters(), lr=1e-3)
        opt_d = torch.optim.Adam(self.D.parameters(), lr=1e-3)
        return opt_g, opt_d


def main():
    torch.manual_seed(0)  # the same data and initial weights on every rank
    real = 1.0 + 0.5 * torch.randn(64, 8)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, per_optimizer=True)
    plugin = LossScalingPrecision("16-mixed", scaler=scaler, optimizer_names=["G", "D"])
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=1,
        # each backward reaches the parameters of G or of D, never both:
        strategy=DDPStrategy(find_unused_parameters=True),
        plugins=[plugin],
        callbacks=[LossMonitor(every_n_train_steps=2)],
        logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = TinyGAN()
    data = DataLoader(TensorDataset(real), batch_size=8)  # 4 batches of 8 per rank
    trainer.fit(model, data)

    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(trainer.world_size)]
    dist.all_gather(gathered, weights)  # every rank calls it; rank 0 prints
    if trainer.global_rank == 0:
        for name, optimizer in zip("GD", trainer.optimizers):
            own = scaler.optimizer_scaler(optimizer)
            scale, steps, skipped = own.get_scale(), own.steps, own.skipped_steps
            print(f"{name}: scale {scale}, {steps} steps, {skipped} skipped")
        print("global_step:", trainer.global_step)  # every optimizer step counts
        metrics = trainer.callback_metrics
        print("LossMonitor:", sorted(k for k in metrics if k.startswith("LossMonitor/")))
        same = all(torch.equal(gathered[0], w) for w in gathered[1:])
        print("the same weights on both ranks:", same)


if __name__ == "__main__":
    main()
