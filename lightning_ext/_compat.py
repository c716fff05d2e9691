"""The one place that knows which torch and Lightning it runs on, and touches their internals.

Supported: torch 2.5–2.14.1 and Lightning 2.4–2.6.6 (``pyproject.toml``; every corner tested by
``make test-matrix``). Where an API differs between supported versions, this module holds the version
test and both spellings; every private attribute of torch or Lightning the package uses is reached
through this module (or, for GradScaler's members that its subclass ``DynamicLossScaler`` uses by name,
listed here), each with its reason in one line and a test in ``tests/test_compat.py`` that names the
upstream change when a release breaks it. Nothing else in the package tests versions.

Lightning is never imported here: the core below the adapters (``stats``, ``amp``, ``nn``,
``distributed``, ``kernels``) knows nothing of it; its objects arrive as arguments.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version
from torch import Tensor, nn

__all__: list[str] = []  # private helpers for the package's own modules

# -------------------------------------------------------------------------------------------- versions
# The floors of pyproject.toml's ``dependencies`` that an import checks (``pip install --no-deps`` or a
# later downgrade can leave older releases installed). torch 2.5, not 2.4: torch 2.4 cannot compile a
# custom op that mutates a list of tensors (``auto_functionalize`` takes ``Tensor[]`` from 2.5), which
# ``unscale_and_check_`` is, and the package keeps one implementation of each op.
MIN_VERSIONS = {"torch": "2.5", "lightning": "2.4"}


def at_least(version: str, floor: str) -> bool:
    """Whether ``version`` is at least ``floor`` (``packaging.version``), a pre-release or local build
    counting as its release: ``"2.5.0a0+git1"`` is at least ``"2.5"``.

    Raises:
        packaging.version.InvalidVersion (a ValueError): ``version`` or ``floor`` is not a PEP 440 version.
    """
    return Version(Version(version).base_version) >= Version(floor)


def check_versions(installed: dict[str, str | None] | None = None) -> None:
    """Raise ``ImportError`` when an installed torch or Lightning is older than ``MIN_VERSIONS``.

    Args:
        installed: ``{distribution: version or None (not installed)}``; default: the imported torch's
            ``torch.__version__`` and Lightning's installed distribution (not imported: the core of the
            package runs without it).

    Raises:
        ImportError: naming each distribution below its floor, its installed and its required version.
    """
    if installed is None:
        installed = {"torch": torch.__version__, "lightning": _distribution_version("lightning")}
    old = [
        f"{name} {version} is installed, lightning_ext needs {name}>={MIN_VERSIONS[name]}"
        for name, version in installed.items()
        if version is not None and not at_least(version, MIN_VERSIONS[name])
    ]
    if old:
        raise ImportError(
            "; ".join(old) + ". HINT: `pip install -U lightning-ext` upgrades them (an install with "
            "--no-deps keeps what was there)."
        )


def _distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name``, ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# At import, before the internals below, which an older torch may lack: its error would not say why.
check_versions()

from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state  # noqa: E402
from torch.nn.modules.batchnorm import _BatchNorm  # noqa: E402

# -------------------------------------------------------------------------------------- differing APIs
# torch.utils.cpp_extension.load's build lock, this file in the build directory: up to torch 2.13 a FileBaton,
# which exists exactly while a process builds (a killed build leaves it behind, and every later load waits
# for it forever); from torch 2.14 filelock's advisory lock on a file that stays. The cpu backend removes it
# while it holds its own lock (kernels/cpu.py).
BUILD_LOCK_FILE = "lock"


@contextlib.contextmanager
def owner_writable() -> Iterator[None]:
    """Files and directories created inside are writable by their owner only: umask 022 added (a group's
    member must not write what a build compiles or links: ``lightning_ext.kernels.cpu``)."""
    umask = os.umask(0o022)
    os.umask(umask | 0o022)
    try:
        yield
    finally:
        os.umask(umask)


def extension_build_directory(name: str) -> Path:
    """Where ``torch.utils.cpp_extension.load`` builds and caches the extension ``name``: torch's private
    ``_get_build_directory`` (``$TORCH_EXTENSIONS_DIR/<name>`` or its default), which creates the
    directories that are missing, here writable by their owner only (:func:`owner_writable`).

    Raises:
        OSError: a missing directory cannot be created (e.g. a read-only file system).
    """
    from torch.utils.cpp_extension import _get_build_directory

    with owner_writable():
        return Path(_get_build_directory(name, verbose=False))


def group_timeout(group: Any, device: torch.device) -> float:
    """Seconds the collectives of process group ``group`` wait (the ``timeout`` it was created with):
    its backend's private options on ``device``; torch's default when a backend has none."""
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return torch.distributed.distributed_c10d.default_pg_timeout.total_seconds()


def triton_interpreter_limit() -> str | None:
    """Why Triton's interpreter (``TRITON_INTERPRET=1``: the ``triton`` backend on CPU tensors) cannot run
    this package's kernels with the installed Triton, or ``None`` when it can (or Triton is absent).

    Triton before 3.4 (torch 2.5-2.7 pin 3.1-3.3) interprets a kernel whose ``tl.constexpr``
    annotations are strings (``from __future__ import annotations``) as if they were not constexpr;
    compiled Triton (CUDA) reads them in every release.
    """
    version = _distribution_version("triton")
    if version is None or at_least(version, "3.4"):
        return None
    return (
        f"Triton {version}'s interpreter does not read the string annotations `tl.constexpr` of the "
        "kernels (modules with `from __future__ import annotations`); Triton >= 3.4 does"
    )


# ------------------------------------------------------------------------------------- torch internals
def assume_constant_result(fn: Any) -> Any:
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (about 2 s, which an
    eager process never needs): the decorator only sets the private marker ``_dynamo_marked_constant``
    that dynamo reads when it traces a call of ``fn`` (it then calls ``fn`` outside the graph and keeps
    the value)."""
    fn._dynamo_marked_constant = True
    return fn


# The base class of BatchNorm1d/2d/3d, torch.nn.SyncBatchNorm and users' own batch norms (no public name);
# its forward checks the input with the hook ``_check_input_dim`` that each subclass defines.
BatchNormBase = _BatchNorm

# DynamicLossScaler subclasses torch.amp.GradScaler and keeps its per-optimizer records (stage and
# found_inf per device), so that GradScaler's own unscale_/step/update read them; these make them.
GradScalerStage = OptState
new_optimizer_state = _refresh_per_optimizer_state

# GradScaler's private members DynamicLossScaler reads, writes or overrides (tested to exist with these
# meanings, by tests/test_compat.py): its device state, its constructor's settings and its hooks.
GRAD_SCALER_STATE = ("_scale", "_growth_tracker", "_per_optimizer_states", "_enabled", "_device")
GRAD_SCALER_SETTINGS = ("_init_scale", "_growth_factor", "_backoff_factor", "_growth_interval",
                        "_init_growth_tracker")  # fmt: skip
GRAD_SCALER_HOOKS = {  # method -> its parameters after self
    "_lazy_init_scale_growth_tracker": ("dev",),
    "_unscale_grads_": ("optimizer", "inv_scale", "found_inf", "allow_fp16"),
    "_check_inf_per_device": ("optimizer",),
}


def amp_update_scale_(scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, growth_factor: float,
                      backoff_factor: float, growth_interval: int) -> Tensor:  # fmt: skip
    """GradScaler's own in-place scale update (``torch._amp_update_scale_``; no public name), so that an
    exponential schedule agrees with GradScaler's bit for bit. Tensors: float32 ``scale``, int32
    ``growth_tracker``, float32 ``found_inf``, all 0-dim on one device. No host sync."""
    return torch._amp_update_scale_(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
    )


def optimizer_handles_unscaling(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` unscales and skips by itself given ``grad_scale``/``found_inf`` (fused
    optimizers): torch's private ``_step_supports_amp_scaling`` flag, which GradScaler reads too."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` (what ``self.optimizers()`` returns) or
    Fabric's optimizer wrapper (both keep it in ``_optimizer``, private); any other object as it is (an
    optimizer that wraps another one, such as Lookahead, is an optimizer of its own)."""
    inner = getattr(optimizer, "_optimizer", None)
    while isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        optimizer, inner = inner, getattr(inner, "_optimizer", None)
    return optimizer


def sparse_values(grad: Tensor) -> Tensor:
    """The values of a sparse COO ``grad``, coalesced or not, as a view to unscale in place (GradScaler's
    ``_values()``: the public ``values()`` refuses an uncoalesced tensor)."""
    return grad._values()


def in_backward() -> bool:
    """True while autograd runs a backward pass in this thread (a forward recomputed by
    ``torch.utils.checkpoint`` included): ``torch._C._current_graph_task_id``, which torch's checkpoint
    reads for the same question; no public API. Call it outside ``torch.compile`` tracing."""
    return torch._C._current_graph_task_id() != -1


# nn.Module's own tables of parameters, buffers and children: convert/revert swap them whole so that two
# layers share the same tensor objects, ``None`` entries and buffer persistence included, which the
# public ``register_parameter``/``register_buffer`` cannot restore for an existing layer.
def module_tables(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """Copies of ``module``'s own ``(parameters, buffers, names of non-persistent buffers)`` tables
    (same tensor objects; ``None`` entries kept)."""
    return dict(module._parameters), dict(module._buffers), set(module._non_persistent_buffers_set)


def set_module_tables(
    module: nn.Module,
    parameters: dict[str, Any],
    buffers: dict[str, Any],
    non_persistent: set[str],
    children: dict[str, nn.Module] | None = None,
) -> None:
    """Replace ``module``'s own tables by copies of these (``children``: its submodules, kept when
    ``None``). No tensor is copied."""
    module._parameters = dict(parameters)
    module._buffers = dict(buffers)
    module._non_persistent_buffers_set = set(non_persistent)
    if children is not None:
        module._modules = dict(children)


# DistributedDataParallel skips the parameters and buffers a model names in this attribute (set before
# wrapping) in its initial sync and its per-forward buffer broadcast; the only setter,
# ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``, is private too.
DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def ddp_ignored(model: nn.Module) -> Collection[str] | None:
    """The names ``model`` itself asks DDP to ignore, ``None`` when it asks none."""
    return model.__dict__.get(DDP_IGNORE_ATTR)


def set_ddp_ignored(model: nn.Module, names: Collection[str] | None) -> None:
    """Make DDP ignore ``names`` (parameter and buffer names, as ``named_parameters`` gives them) of
    ``model`` when it wraps it; ``None``: remove the attribute."""
    if names is None:
        model.__dict__.pop(DDP_IGNORE_ATTR, None)
    else:
        setattr(model, DDP_IGNORE_ATTR, names)


# --------------------------------------------------------------------------------- Lightning internals
def batches_that_stepped(trainer: Any) -> int:
    """Training batches that stepped the optimizers, restored on resume: the step at which Lightning's
    logger connector writes ``self.log`` values (``fit_loop.epoch_loop._batches_that_stepped``, private).
    ``trainer.global_step`` differs (it counts optimizer steps: several per batch with several
    optimizers)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


# Lightning's training epoch loop steps an ``interval="step"`` LR scheduler only when
# ``(batch_idx + 1) % config.frequency == 0``, reading ``frequency`` at every batch: a frequency that no
# batch index reaches holds the scheduler for that batch, with Lightning's public objects only.
UNREACHABLE_FREQUENCY = 2**62


# ------------------------------------------------------------------- DDP communication hooks (timer)
# DistributedDataParallel's list of the (hook, state) pairs registered with ``register_comm_hook``: DDP
# takes one hook and raises on a second (after recording it), so DDPSyncTimer.install reads the list
# to find its own hook or another before it registers one.
def ddp_comm_hooks(model: Any) -> list[tuple[Any, Any]]:
    """The ``(hook, state)`` pairs registered on the ``DistributedDataParallel`` ``model``."""
    return list(model._comm_hooks)
