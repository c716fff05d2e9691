import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext._compat import at_least
from lightning_ext.callbacks import PreciseBN
from tests.nn.test_precise_bn import assert_population, make_batches


class BNModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1)
        self.bn = nn.BatchNorm2d(3)

    @override
    def forward(self, x):
        return self.bn(self.conv(x))

    @override
    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).square().mean()

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(hook, max_steps=-1, max_epochs=None, progress_bar=False):
    data = torch.cat(make_batches([6] * 5, seed=2))
    module = BNModule()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=[hook],
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=6))
    return module, data


def test_short_loader_warning_is_printed_on_its_own_line_above_the_progress_bar(capsys, recwarn):
    hook = PreciseBN(num_iter=8)  # the loader has 5 batches
    fit(hook, max_epochs=1, progress_bar=True)
    out = capsys.readouterr().out
    line = "UserWarning: PreciseBN: only 5 of num_iter=8 batches were available on every rank"
    # A line of its own, not in the bar's: after a newline (RichProgressBar, the default with rich on newer
    # Lightning) or after the carriage return with which tqdm clears its bar (TQDMProgressBar, 2.4's).
    assert re.search(rf"(^|[\r\n]){re.escape(line)}\n", out), out
    assert not [w for w in recwarn if "PreciseBN" in str(w.message)]  # printed once, not also warned


def test_hook_every_epoch_on_the_training_loader():
    hook = PreciseBN(num_iter=5)
    module, data = fit(hook, max_epochs=2)
    assert hook.batches_used == [5, 5]  # after the last batch of each epoch; nothing left at train end
    assert_population(module.bn, module.conv, list(data.split(6)))
    assert module.bn.momentum == 0.1 and module.training


def test_hook_every_n_train_steps_with_a_callable_loader():
    batches = make_batches([4, 8, 5], seed=3)
    hook = PreciseBN(every_n_train_steps=3, num_iter=2, data_loader=lambda: [(b,) for b in batches])
    module, _ = fit(hook, max_steps=7)
    assert hook.batches_used == [2, 2, 2]  # after iterations 2 and 5, and at train end (step 7)
    assert hook.state_dict() == {"last_update_step": 7}
    assert_population(module.bn, module.conv, batches[:2])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"every_n_train_steps": 0},
            ValueError,
            r"^PreciseBN: `every_n_train_steps` must be an int >= 1 or None, got 0\. "
            r"HINT: None updates after every epoch\.$",
        ),
        (
            {"every_n_train_steps": 2.5},
            TypeError,
            r"`every_n_train_steps` must be an int >= 1 or None, got 2\.5 \(float\)\. HINT",
        ),
        ({"num_iter": -2}, ValueError, r"^PreciseBN: `num_iter` must be an int >= 1, got -2$"),
        ({"num_iter": "8"}, TypeError, r"^PreciseBN: `num_iter` must be an int >= 1, got '8' \(str\)$"),
        (
            {"data_loader": 5},
            TypeError,
            r"PreciseBN: `data_loader` must be an iterable of batches, .* got 5$",
        ),
        (
            {"forward_fn": "model"},
            TypeError,
            r"`forward_fn` must be callable or None, got 'model'",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        PreciseBN(**kwargs)


def test_callable_loader_returning_non_iterable():
    with pytest.raises(
        TypeError, match=r"PreciseBN: `data_loader\(\)` must return an iterable of batches, got 3"
    ):
        fit(PreciseBN(every_n_train_steps=2, data_loader=lambda: 3), max_steps=2)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_the_update_forwards_the_batches_in_the_dtype_of_training(precision):
    # Lightning converts the batches of a "-true" precision: the update did not, and crashed on a
    # float32 batch into a float64 (bfloat16) model
    hook, data = PreciseBN(num_iter=5), torch.cat(make_batches([6] * 5, seed=2))
    module = BNModule()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, precision=precision, callbacks=[hook], enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=6))
    assert hook.batches_used == [5] and module.bn.running_mean.dtype == module.conv.weight.dtype
    if precision == "64-true":  # (float64 meets the float32 bounds)
        assert_population(module.bn, module.conv, list(data.split(6)))


class _Updates(PreciseBN):
    """Records the step of each update."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at: list[int] = []

    def update_stats(self) -> int:
        self.at.append(self.trainer.global_step)
        return super().update_stats()


def _fit_with_checkpoints(hook, tmp_path, max_steps, ckpt_path=None):
    data = torch.cat(make_batches([6] * 5, seed=2))  # 5 batches an epoch
    module = BNModule()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=max_steps, enable_progress_bar=False, enable_model_summary=False,
        logger=False, callbacks=[hook, ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=1,
                                                       save_top_k=-1, save_last=True)],
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=6), ckpt_path=ckpt_path)
    return module


@pytest.mark.skipif(
    not at_least(L.__version__, "2.5"),
    reason="Lightning 2.4 restores its count of the batches that stepped (its log step) one lower after a "
    "mid-epoch resume, for the whole run; from 2.5 its epoch loop corrects it",
)
def test_a_mid_epoch_resume_keeps_the_period(tmp_path):
    # Lightning's count of the iterations done is one lower at on_train_start after a mid-epoch resume:
    # every period was one iteration late (ResourceStats' and LossMonitor's too)
    whole = _Updates(every_n_train_steps=2, num_iter=2)
    _fit_with_checkpoints(whole, tmp_path, max_steps=8)
    resumed = _Updates(every_n_train_steps=2, num_iter=2)
    _fit_with_checkpoints(resumed, tmp_path / "resumed", max_steps=8, ckpt_path=tmp_path / "step=3.ckpt")
    assert whole.at == [2, 4, 6, 8] and resumed.at == [4, 6, 8] and resumed.start_iter == 3


def test_the_last_iterations_update_is_in_its_checkpoint(tmp_path):
    # as detectron2's final update: before the last iteration's checkpoint (and validation), not after
    hook = _Updates(every_n_train_steps=3, num_iter=2)
    module = _fit_with_checkpoints(hook, tmp_path, max_steps=7)
    assert hook.at == [3, 6, 7]
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert torch.equal(last["state_dict"]["bn.running_mean"], module.bn.running_mean)
