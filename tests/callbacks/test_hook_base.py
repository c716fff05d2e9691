import weakref

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from typing_extensions import override

from lightning_ext.callbacks import HookBase


class TinyModule(L.LightningModule):
    """A linear regression whose training_step returns the loss tensor."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.lr = lr

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def tiny_loader(n: int = 32, batch_size: int = 2) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def make_trainer(callbacks, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    defaults.update(kwargs)
    return L.Trainer(callbacks=callbacks, **defaults)


class Recorder(HookBase):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []
        self.after_train_exceptions: list[BaseException | None] = []

    def before_train(self):
        assert isinstance(self.trainer, weakref.ProxyType)
        assert isinstance(self.pl_module, TinyModule)
        self.events.append(("before_train", self.iter))

    def before_step(self):
        assert self.trainer.global_step == self.iter
        self.events.append(("before_step", self.iter))

    def after_backward(self):
        self.events.append(("after_backward", self.iter))

    def after_step(self):
        assert self.trainer.global_step == self.iter + 1  # the optimizer stepped
        self.events.append(("after_step", self.iter))

    def after_train(self):
        self.events.append(("after_train", self.iter))
        self.after_train_exceptions.append(self.exception)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_call_order_and_counts(accumulate):
    hook = Recorder()
    make_trainer([hook], max_steps=3, accumulate_grad_batches=accumulate).fit(TinyModule(), tiny_loader())
    expected = [("before_train", 0)]
    for it in range(3):
        expected += [("before_step", it)] + [("after_backward", it)] * accumulate + [("after_step", it)]
    expected += [("after_train", 3)]  # detectron2's: the iteration after the last one
    assert hook.events == expected
    assert hook.after_train_exceptions == [None]
    assert hook.start_iter == 0


class FailInAfterStep(HookBase):
    def after_step(self):
        if self.iter == 1:
            raise RuntimeError("boom in after_step")


class TwoOptimizerModule(TinyModule):
    """Manual optimization stepping two optimizers per training_step (global_step advances by 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = nn.Linear(4, 1)

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        for optimizer, net in zip(self.optimizers(), (self.net, self.other)):
            optimizer.zero_grad()
            self.manual_backward(nn.functional.mse_loss(net(x), y))
            optimizer.step()

    @override
    def configure_optimizers(self):
        return [torch.optim.SGD(net.parameters(), lr=0.1) for net in (self.net, self.other)]


class IterRecorder(HookBase):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, int]] = []

    def before_step(self):
        self.events.append(("before_step", self.iter, self.trainer.global_step))

    def after_step(self):
        self.events.append(("after_step", self.iter, self.trainer.global_step))

    def after_train(self):
        self.events.append(("after_train", self.iter, self.trainer.global_step))


def test_an_iteration_of_manual_optimization_is_one_training_step():
    hook = IterRecorder()
    make_trainer([hook], max_steps=-1, max_epochs=1, limit_train_batches=3).fit(
        TwoOptimizerModule(), tiny_loader()
    )
    expected = []
    for it in range(3):
        expected += [("before_step", it, 2 * it), ("after_step", it, 2 * it + 2)]
    assert hook.events == [*expected, ("after_train", 3, 6)]


class FailInAfterTrain(Recorder):
    def after_train(self):
        super().after_train()
        raise ValueError("after_train failed too")


def test_after_train_runs_once_per_hook_on_exception():
    first, failing_after_train, last = Recorder(), FailInAfterTrain(), Recorder()
    trainer = make_trainer([first, FailInAfterStep(), failing_after_train, last], max_steps=5)
    with pytest.raises(RuntimeError, match="boom in after_step") as info:
        trainer.fit(TinyModule(), tiny_loader())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "FailInAfterStep.after_step() at iteration=1" in notes
    assert "FailInAfterTrain.after_train() also raised ValueError('after_train failed too')" in notes
    for hook in (first, failing_after_train, last):
        assert [e for e in hook.events if e[0] == "after_train"] == [("after_train", 1)]
        assert hook.after_train_exceptions == [info.value]
    # the failing iteration's after_step of later hooks never ran
    assert ("after_step", 1) in first.events and ("after_step", 1) not in last.events


def test_after_train_raising_on_success_still_runs_the_others():
    failing, other = FailInAfterTrain(), Recorder()
    with pytest.raises(ValueError, match="after_train failed too") as info:
        make_trainer([failing, other], max_steps=2).fit(TinyModule(), tiny_loader())
    assert "FailInAfterTrain.after_train() at iteration=2" in "\n".join(info.value.__notes__)
    assert failing.after_train_exceptions == [None]  # ran once, on the success path
    assert other.after_train_exceptions == [info.value]  # ran once, through on_exception


class FailInBeforeStepAt3(HookBase):
    def before_step(self):
        if self.iter == 3:
            raise ValueError("boom in before_step")


class FailingDataset(Dataset):
    """``tiny_loader``'s samples; reading a sample of the ``fail_batch``-th batch of 2 raises."""

    def __init__(self, fail_batch: int) -> None:
        self.data = tiny_loader().dataset
        self.fail_batch = fail_batch

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        if index // 2 == self.fail_batch:
            raise OSError(f"cannot read the batch of iteration {self.fail_batch}")
        return self.data[index]


class FailingIterable(IterableDataset):
    """The same samples without ``__len__``: Lightning fetches one batch ahead."""

    def __init__(self, fail_batch: int) -> None:
        self.dataset = FailingDataset(fail_batch)

    def __iter__(self):
        return (self.dataset[i] for i in range(len(self.dataset)))


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ("before_step", 3),  # a hook raises in before_step at iteration 3
        ("loader", 4),  # the loader raises when Lightning fetches the batch of iteration 4
        ("after_train", 5),  # after 5 iterations, the first hook's after_train raises
        # Without __len__ Lightning fetches batch 4 in iteration 3's loop body, before its
        # before_step: iteration 3 never started, 3 iterations completed (see HookBase).
        ("loader_ahead", 3),
    ],
)
def test_every_hook_sees_the_trainer_iteration_in_after_train(failure, expected):
    first = FailInAfterTrain() if failure == "after_train" else Recorder()
    last = Recorder()
    hooks = [first, FailInBeforeStepAt3(), last] if failure == "before_step" else [first, last]
    data = {"loader": FailingDataset(4), "loader_ahead": FailingIterable(4)}.get(failure)
    data = tiny_loader().dataset if data is None else data
    error = OSError if failure.startswith("loader") else ValueError
    with pytest.raises(error):
        make_trainer(hooks, max_steps=5 if failure == "after_train" else 10).fit(
            TinyModule(), DataLoader(data, batch_size=2)
        )
    for hook in (first, last):
        assert [e for e in hook.events if e[0] == "after_train"] == [("after_train", expected)]


class Counter(HookBase):
    def __init__(self, increment: int) -> None:
        super().__init__()
        self.increment = increment
        self.count = 0

    def after_step(self):
        self.count += self.increment

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state_dict):
        self.count = state_dict["count"]


def test_state_round_trip_with_two_instances(tmp_path):
    a, b = Counter(1), Counter(10)
    assert a.state_key != b.state_key  # distinct before attachment (Trainer validates this)
    trainer = make_trainer([a, b], max_steps=3)
    trainer.fit(TinyModule(), tiny_loader())
    assert (a.count, b.count) == (3, 30)
    assert (a.state_key, b.state_key) == ("Counter{'index': 0}", "Counter{'index': 1}")
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"]
    assert saved["Counter{'index': 0}"] == {"count": 3} and saved["Counter{'index': 1}"] == {"count": 30}

    c, d = Counter(1), Counter(10)
    make_trainer([c, d], max_steps=5).fit(TinyModule(), tiny_loader(), ckpt_path=path)
    assert (c.count, d.count) == (5, 50)
    assert (c.start_iter, d.start_iter) == (3, 3)


def test_trainer_before_attachment_raises():
    with pytest.raises(RuntimeError, match=r"Recorder.trainer is only available once the hook is attached"):
        Recorder().trainer


class CancelsTheFourthBatch(TinyModule):
    """Returns -1 from ``on_train_batch_start`` at batch 3: Lightning ends the epoch there, after the
    callbacks' ``on_train_batch_start`` ran."""

    @override
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 3 else None


@pytest.mark.parametrize("accumulate", [1, 3])  # (with 2, batch 2's gradients wait for the next epoch's)
def test_an_iteration_the_module_cancelled_is_not_merged_into_the_next_epochs_first(accumulate):
    # The cancelled batch's before_step left the hook inside an iteration: the next epoch's first
    # batch was taken for a later micro-batch of it (no before_step), so that iteration ran from the
    # cancelled batch, across the epoch's end and validation, to the next epoch's first step.
    hook = Recorder()
    make_trainer([hook], max_steps=-1, max_epochs=2, accumulate_grad_batches=accumulate).fit(
        CancelsTheFourthBatch(), tiny_loader(n=16)
    )
    steps = [event for event in hook.events if event[0] in ("before_step", "after_step")]
    per_epoch = 3 // accumulate  # batches 0-2 run
    expected = []
    for it in range(2 * per_epoch):
        expected += [("before_step", it), ("after_step", it)]
        if it % per_epoch == per_epoch - 1:
            expected += [("before_step", it + 1)]  # the cancelled batch's (callbacks run first)
    assert steps == expected


class StepsEveryOtherBatch(TinyModule):
    """Manual optimization stepping on the even batches, with a batch norm, the loss NaN from batch
    ``nan_from`` on."""

    def __init__(self, nan_from: int | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.bn, self.nan_from, self.batches = nn.BatchNorm1d(4), nan_from, 0

    @override
    def forward(self, x):
        return self.net(self.bn(x))

    @override
    def training_step(self, batch, batch_idx):
        self.batches += 1
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.nan_from is not None and batch_idx >= self.nan_from:
            loss = loss * float("nan")
        self.manual_backward(loss)
        if batch_idx % 2 == 0:
            self.optimizers().step()
            self.optimizers().zero_grad()
        return loss


def test_periodic_hooks_count_iterations_under_manual_optimization():
    # Their period read Lightning's count, which counts every batch in manual optimization; after_step
    # saw only the batches that stepped (0, 2, 4, ...), so (iter + 1) % 2 was never 0: LossMonitor
    # checked the loss only at the end of training (the NaN trained 16 batches), PreciseBN and
    # ResourceStats never ran during training.
    from lightning_ext.callbacks import LossMonitor, PreciseBN, ResourceStats
    from lightning_ext.stats import Collector

    collector = Collector(regex="Resources/.*")
    precise, resources = PreciseBN(every_n_train_steps=2, num_iter=1), ResourceStats(every_n_train_steps=2)
    make_trainer([precise, resources], max_steps=-1, max_epochs=1).fit(StepsEveryOtherBatch(), tiny_loader())
    collector.update()
    assert precise.batches_used == [1] * 4  # 8 iterations in 16 batches: one update every 2
    assert collector.num("Resources/cpu_mem_gb") == 4
    module = StepsEveryOtherBatch(nan_from=3)
    with pytest.raises(FloatingPointError, match=r"iteration=3 .*\n.*\n.*after_step\(\) at iteration=6"):
        trainer = make_trainer([LossMonitor(every_n_train_steps=2)], max_steps=-1, max_epochs=1)
        trainer.fit(module, tiny_loader())
    assert module.batches == 7  # checked after iterations 2 and 4 (batches 2 and 6; Lightning's steps)
