"""``lightning_ext._compat``: the supported versions, and every upstream internal the package relies on.

Each test of an internal fails with a message naming the upstream change and the package feature it
breaks, so a new torch or Lightning release that moves one says what to update and where.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import os
import re
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import lightning
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from packaging.version import Version
from torch import nn
from torch.amp import GradScaler
from torch.nn.parallel import DistributedDataParallel
from torch.utils import cpp_extension

from lightning_ext import _compat

ROOT = Path(__file__).resolve().parents[1]
TORCH, LIGHTNING = f"torch {torch.__version__}", f"Lightning {lightning.__version__}"


# -------------------------------------------------------------------------------------------- versions
@pytest.mark.parametrize(
    ("version", "floor", "expected"),
    [
        ("2.5.0", "2.5", True),
        ("2.4.1+cu121", "2.5", False),
        ("2.13.0+cpu", "2.5", True),
        ("2.5.0a0+git1", "2.5", True),  # a pre-release or local build counts as its release
        ("2.4.99", "2.5", False),
    ],
)
def test_at_least_compares_the_releases(version, floor, expected):
    assert _compat.at_least(version, floor) is expected


def test_at_least_rejects_a_version_that_is_not_pep_440():
    with pytest.raises(ValueError, match=r"Invalid version: 'dev'"):  # packaging's InvalidVersion
        _compat.at_least("dev", "2.5")


def test_versions_at_the_floor_or_missing_pass():
    _compat.check_versions({"torch": "2.5.0", "lightning": "2.4.0"})
    _compat.check_versions({"torch": "2.14.1+cu130", "lightning": None})


def test_versions_below_the_floor_name_installed_and_required():
    with pytest.raises(ImportError, match=(
        r"^torch 2\.3\.1\+cu121 is installed, lightning_ext needs torch>=2\.5; lightning 2\.3\.3 is "
        r"installed, lightning_ext needs lightning>=2\.4\. HINT: `pip install -U lightning-ext`"
    )):  # fmt: skip
        _compat.check_versions({"torch": "2.3.1+cu121", "lightning": "2.3.3"})


def test_the_floors_are_those_of_pyproject():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name, floor in _compat.MIN_VERSIONS.items():
        assert f"{name}>={floor}" in dependencies, f"pyproject.toml: {dependencies}, _compat: {name}>={floor}"


def _pins(path: Path) -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return dict(line.split("==") for line in lines if "==" in line)


def test_the_corners_and_the_documents_state_one_range():
    oldest, newest = _pins(ROOT / "constraints-oldest.txt"), _pins(ROOT / "constraints-newest.txt")
    for name, floor in _compat.MIN_VERSIONS.items():
        assert Version(oldest[name]).release[:2] == Version(floor).release, f"oldest corner: {oldest[name]}"
    for path in ("README.md", "docs/getting_started.md", "pyproject.toml"):
        text = " ".join((ROOT / path).read_text().split())
        for name, label in (("torch", "torch"), ("lightning", "Lightning")):
            low, high = _compat.MIN_VERSIONS[name], newest[name]
            stated = rf"{label} {re.escape(low)}( to |–|-){re.escape(high)}\b"
            assert re.search(stated, text), f"{path} does not state the range {label} {low}–{high}"


OLD_RELEASES = [  # a patch that makes an old release look installed; the error importing then names it
    ("import torch; torch.__version__ = '2.3.1+cu121'",
     "ImportError: torch 2.3.1+cu121 is installed, lightning_ext needs torch>=2.5"),
    ("import importlib.metadata as m; v = m.version; "
     "m.version = lambda name: '2.2.5' if name == 'lightning' else v(name)",
     "ImportError: lightning 2.2.5 is installed, lightning_ext needs lightning>=2.4"),
]  # fmt: skip


@pytest.fixture(scope="module")
def imports_with_old_releases() -> dict[str, tuple[int, str]]:
    """Per patch of ``OLD_RELEASES``: the exit status and stderr of ``import lightning_ext`` after it,
    in new interpreters that run side by side."""
    processes = {
        patch: subprocess.Popen(
            [sys.executable, "-c", f"{patch}; import lightning_ext"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for patch, _ in OLD_RELEASES
    }
    stderrs = {patch: p.communicate(timeout=120)[1] for patch, p in processes.items()}
    return {patch: (processes[patch].returncode, stderr) for patch, stderr in stderrs.items()}


@pytest.mark.slow  # its fixture starts processes
@pytest.mark.parametrize(("patch", "message"), OLD_RELEASES)
def test_importing_with_an_old_release_installed_raises_importerror(
    patch, message, imports_with_old_releases
):
    returncode, stderr = imports_with_old_releases[patch]
    assert returncode == 1 and message in stderr, stderr


# -------------------------------------------------------------------------------------- differing APIs
def test_the_build_lock_file_is_the_one_cpp_extension_takes():
    source = inspect.getsource(cpp_extension._jit_compile)
    assert re.search(rf"join\(build_directory, ['\"]{_compat.BUILD_LOCK_FILE}['\"]\)", source), (
        f"{TORCH}: torch.utils.cpp_extension.load no longer locks <build directory>/"
        f"{_compat.BUILD_LOCK_FILE}: update _compat.BUILD_LOCK_FILE (the cpu backend removes the lock a "
        "killed build left, or torch waits for it forever)"
    )


@pytest.mark.parametrize(
    ("version", "limited"), [("3.1.0", True), ("3.3.1", True), ("3.4.0", False), (None, False)]
)
def test_triton_interpreter_limit_names_the_triton_release(monkeypatch, version, limited):
    monkeypatch.setattr(_compat, "_distribution_version", lambda name: version)
    reason = _compat.triton_interpreter_limit()
    assert (reason is not None) == limited
    assert reason is None or reason.startswith(f"Triton {version}'s interpreter does not read")


# ------------------------------------------------------------------------------------- torch internals
def test_batch_norm_base_is_the_base_of_torch_batch_norms_with_its_input_check_hook():
    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    assert all(issubclass(c, _compat.BatchNormBase) for c in norms), (
        f"{TORCH}: torch.nn.modules.batchnorm._BatchNorm is no longer the base of the batch norms: "
        "PreciseBN would miss layers and revert_sync_batchnorm's _BatchNormXd needs another base"
    )

    class Checked(_compat.BatchNormBase):
        def _check_input_dim(self, input):
            raise LookupError("checked")

    with pytest.raises(LookupError, match="checked"):  # else: _BatchNormXd's input check is not called
        Checked(3)(torch.zeros(2, 3))


def test_grad_scaler_has_the_private_state_and_hooks_dynamic_loss_scaler_uses():
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    names = (*_compat.GRAD_SCALER_STATE, *_compat.GRAD_SCALER_SETTINGS)
    missing = [name for name in names if not hasattr(scaler, name)]
    assert not missing, f"{TORCH}: torch.amp.GradScaler lost {missing}, which DynamicLossScaler uses"
    assert scaler._scale.dtype == torch.float32 and scaler._growth_tracker.dtype == torch.int32
    for hook, params in _compat.GRAD_SCALER_HOOKS.items():
        got = tuple(inspect.signature(getattr(GradScaler, hook)).parameters)[1:]
        assert got == params, f"{TORCH}: GradScaler.{hook}{got}, was {params}: DynamicLossScaler overrides it"
    state = _compat.new_optimizer_state()
    ready = _compat.GradScalerStage.READY
    assert set(state) == {"stage", "found_inf_per_device"} and state["stage"] is ready, (
        f"{TORCH}: GradScaler's per-optimizer record is now {state}: DynamicLossScaler writes it"
    )
    assert {s.name for s in _compat.GradScalerStage} == {"READY", "UNSCALED", "STEPPED"}


def test_amp_update_scale_is_grad_scalers_update():
    scale, tracker = torch.tensor(8.0), torch.tensor(1, dtype=torch.int32)
    _compat.amp_update_scale_(scale, tracker, torch.tensor(0.0), 2.0, 0.5, 2)  # second clean step: grow
    assert (scale.item(), tracker.item()) == (16.0, 0), f"{TORCH}: torch._amp_update_scale_ changed"
    _compat.amp_update_scale_(scale, tracker, torch.tensor(1.0), 2.0, 0.5, 2)  # overflow: back off
    assert (scale.item(), tracker.item()) == (8.0, 0), f"{TORCH}: torch._amp_update_scale_ changed"


def test_fused_optimizers_say_they_handle_unscaling():
    param = nn.Parameter(torch.ones(3))
    assert not _compat.optimizer_handles_unscaling(torch.optim.SGD([param], lr=0.1))
    assert _compat.optimizer_handles_unscaling(torch.optim.Adam([param], fused=True)), (
        f"{TORCH}: a fused Adam no longer sets _step_supports_amp_scaling: DynamicLossScaler would unscale "
        "its gradients itself and the fused step would unscale them again"
    )


def test_sparse_values_are_an_in_place_view_of_an_uncoalesced_gradient():
    indices = [[0, 0, 2]]  # index 0 twice: uncoalesced
    grad = torch.sparse_coo_tensor(indices, [1.0, 2.0, 4.0], (3,), check_invariants=True)
    _compat.sparse_values(grad).mul_(0.5)
    assert torch.equal(grad.to_dense(), torch.tensor([1.5, 0.0, 2.0])), f"{TORCH}: Tensor._values() changed"


class _RecordInBackward(torch.autograd.Function):
    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx, x):
        _RecordInBackward.seen.append(_compat.in_backward())
        ctx.save_for_backward(x)  # unpacked in backward: checkpoint recomputes this forward then
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        _RecordInBackward.seen.append(_compat.in_backward())
        return grad * torch.ones_like(x)


def test_in_backward_tells_a_checkpoint_recomputation_from_the_forward():
    _RecordInBackward.seen = []
    x = torch.ones(2, requires_grad=True)
    torch.utils.checkpoint.checkpoint(_RecordInBackward.apply, x, use_reentrant=False).sum().backward()
    assert _RecordInBackward.seen == [False, True, True], (
        f"{TORCH}: torch._C._current_graph_task_id() no longer tells a backward pass (forward, recomputed "
        f"forward, backward saw {_RecordInBackward.seen}): SyncBatchNorm would count recomputed batches"
    )


def test_module_tables_move_parameters_buffers_and_persistence_whole():
    source = nn.BatchNorm1d(3, affine=False)
    source.register_buffer("scratch", torch.zeros(1), persistent=False)
    parameters, buffers, non_persistent = _compat.module_tables(source)
    assert parameters == {"weight": None, "bias": None} and non_persistent == {"scratch"}, (
        f"{TORCH}: nn.Module's _parameters/_buffers/_non_persistent_buffers_set changed meaning"
    )
    target = nn.Module()
    _compat.set_module_tables(target, parameters, buffers, non_persistent, children={})
    assert target.running_mean is source.running_mean
    assert list(target.state_dict()) == list(source.state_dict())
    assert "scratch" not in target.state_dict() and target.scratch is source.scratch


@contextlib.contextmanager
def _one_rank_group(tmp_path: Path, timeout: float = 60.0) -> Iterator[None]:
    """A gloo process group of this process alone (what DistributedDataParallel needs), created with
    ``timeout`` seconds and destroyed after the block (its gloo threads end once nothing holds it)."""
    import torch._dynamo  # noqa: F401  (imported while a group exists, it would keep that group alive)

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()
        gc.collect()  # a DDP model's cycles hold the group and its gloo threads


def test_ddp_ignores_the_names_a_model_lists(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    _compat.set_ddp_ignored(model, ["1.running_mean"])
    assert _compat.ddp_ignored(model) == ["1.running_mean"]
    with _one_rank_group(tmp_path):
        ignored = sorted(DistributedDataParallel(model).parameters_to_ignore)
    _compat.set_ddp_ignored(model, None)
    assert _compat.ddp_ignored(model) is None and _compat.DDP_IGNORE_ATTR not in model.__dict__
    assert ignored == ["1.running_mean"], (
        f"{TORCH}: DistributedDataParallel no longer reads {_compat.DDP_IGNORE_ATTR} (ignored {ignored}): "
        "SyncBatchNormPlugin's buffers would be broadcast by DDP at every forward"
    )


# --------------------------------------------------------------------------------- Lightning internals
def _fit(model: BoringModel, callback: Callback | None = None) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=4, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback] if callback else None,
    )  # fmt: skip
    trainer.fit(model)
    return trainer


class _Steps(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((_compat.batches_that_stepped(trainer), trainer.global_step))


def test_batches_that_stepped_counts_the_batches_before_this_one():
    callback = _Steps()
    try:
        trainer = _fit(BoringModel(), callback)
    except AttributeError as exc:
        raise AssertionError(
            f"{LIGHTNING}: fit_loop.epoch_loop._batches_that_stepped is gone ({exc}): the hooks' iteration "
            "count and every row TrainingStats logs need Lightning's logging step"
        ) from exc
    assert callback.seen == [(i, i) for i in range(4)], f"{LIGHTNING}: _batches_that_stepped changed meaning"
    assert _compat.batches_that_stepped(trainer) == 4


class _StepScheduled(BoringModel):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _Hold(Callback):
    def on_train_start(self, trainer, pl_module):
        (config,) = trainer.strategy.lr_scheduler_configs
        config.frequency = _compat.UNREACHABLE_FREQUENCY


def test_an_unreachable_frequency_holds_a_step_scheduler():
    stepped = _fit(_StepScheduled()).lr_scheduler_configs[0].scheduler.last_epoch
    held = _fit(_StepScheduled(), _Hold()).lr_scheduler_configs[0].scheduler.last_epoch
    assert (stepped, held) == (4, 0), (
        f"{LIGHTNING}: an interval='step' scheduler with frequency {_compat.UNREACHABLE_FREQUENCY} stepped "
        f"{held} times in 4 batches (4 with frequency 1: {stepped}): the training epoch loop no longer tests "
        "(batch_idx + 1) % frequency, and LossScalingPrecision cannot hold schedulers on skipped steps"
    )


def test_extension_build_directory_is_where_cpp_extension_builds(tmp_path, monkeypatch):
    """torch's private ``_get_build_directory`` (``torch.utils.cpp_extension``) names, and creates, the
    directory ``load`` builds in: ``$TORCH_EXTENSIONS_DIR/<name>``; created writable by their owner
    only whatever the umask, which is restored."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    umask = os.umask(0o002)  # group-writable by default, as on many distributions
    try:
        directory = _compat.extension_build_directory("lightning_ext_probe")
        assert os.umask(0o002) == 0o002
    finally:
        os.umask(umask)
    assert directory == tmp_path / "cache" / "lightning_ext_probe" and directory.is_dir(), (
        f"{TORCH}: torch.utils.cpp_extension._get_build_directory moved or changed: update "
        "_compat.extension_build_directory (where the cpu backend looks for its build)"
    )
    for path in (directory, directory.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, oct(path.stat().st_mode)


def test_assume_constant_result_marks_a_function_as_torch_compiler_does():
    def mine():
        return "cpu"

    def torchs():
        return "cpu"

    assert _compat.assume_constant_result(mine) is mine
    torch.compiler.assume_constant_result(torchs)
    marks = dict(vars(torchs))
    assert marks == vars(mine) == {"_dynamo_marked_constant": True}, (
        f"{TORCH}: torch.compiler.assume_constant_result now sets {marks}: update "
        "_compat.assume_constant_result (get_backend's selection under torch.compile)"
    )


def test_group_timeout_reads_the_timeout_a_gloo_group_was_created_with(tmp_path):
    """A process group backend's private ``options._timeout`` (``ProcessGroupGloo.Options``) holds the
    ``timeout`` given to ``init_process_group``/``new_group``."""
    with _one_rank_group(tmp_path, timeout=7.0):
        assert _compat.group_timeout(dist.group.WORLD, torch.device("cpu")) == 7.0
        assert _compat.group_timeout(object(), torch.device("cpu")) == 1800.0  # torch's default


# ------------------------------------------------------------------- DDP communication hooks (timer)
def _comm_hook(state, bucket):  # no annotations: DDP refuses them as strings (future annotations)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(state, bucket)


def test_ddp_comm_hooks_lists_the_registered_hook(tmp_path):
    with _one_rank_group(tmp_path):
        model = DistributedDataParallel(nn.Linear(2, 2))
        before = len(_compat.ddp_comm_hooks(model))
        model.register_comm_hook(None, _comm_hook)
        found = _compat.ddp_comm_hooks(model) == [(_comm_hook, None)]
        del model
    assert (before, found) == (0, True), (
        f"{TORCH}: DistributedDataParallel no longer lists its communication hook in `_comm_hooks` "
        f"(before registering: {before} hooks; found after: {found}): IterationTimer cannot tell its "
        "DDPSyncTimer from a user's hook and would register a second one (DDP raises)"
    )
