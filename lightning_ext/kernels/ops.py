"""``torch.library`` custom ops ``torch.ops.lightning_ext.<op>``, which
:meth:`~lightning_ext.kernels.KernelBackend.run` calls while ``torch.compile`` traces: one graph node
per call, whose fake implementation gives output shapes, dtypes and strides. Each op takes the public
method's arguments plus ``backend``, the key of the backend instance that runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.library import CustomOpDef

from lightning_ext.kernels.backend import _LIVE, _stat_dtype

__all__: list[str] = []  # registers the ops; callers use torch.ops.lightning_ext.<op>


def _define(
    name: str, schema: str, fake: Callable[..., Any], mutates: tuple[str, ...] = (), clone: bool = False
) -> CustomOpDef:
    """Register ``lightning_ext::<name>(<schema args>, str backend)``, which runs ``_<name>`` of the
    backend. ``clone``: return copies (a backend's outputs may alias each other or its own state)."""

    def run(*args: Any) -> Any:
        *args, key = args
        backend = _LIVE.get(key)
        if backend is None:  # e.g. a graph deserialized in a fresh process
            from lightning_ext.kernels.registry import get_backend

            where = next(a for a in args if isinstance(a, Tensor | torch.device))  # x, payload, inv_scale...
            backend = get_backend(key, where if isinstance(where, torch.device) else where.device)
        if name in ("accumulate_moments_", "accumulate_histogram_") and not args[1].numel():
            return None  # backends take non-empty `x` only
        out = getattr(backend, "_" + name)(*args)
        if clone:
            return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        return out

    schema = schema.replace(") ->", ", str backend) ->")
    op = torch.library.custom_op(f"lightning_ext::{name}", run, mutates_args=mutates, schema=schema)
    op.register_fake(fake)
    return op


_batch_norm_moments = _define(
    "batch_norm_moments",
    "(Tensor x, Tensor shift) -> Tensor",
    lambda x, *_: x.new_empty((2 * x.shape[1] + 1,), dtype=torch.float64),
)
_batch_norm_gather_stats = _define(
    "batch_norm_gather_stats",
    "(Tensor payload, Tensor shift, Tensor(a2!)? running_mean, Tensor(a3!)? running_var, Tensor momentum, "
    "float eps) -> (Tensor, Tensor)",
    lambda payload, shift, *_: (torch.empty_like(shift), torch.empty_like(shift)),
    mutates=("running_mean", "running_var"),
    clone=True,
)
_batch_norm_elemt = _define(
    "batch_norm_elemt",
    "(Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias) -> Tensor",
    lambda x, *_: torch.empty_like(x),
)
_batch_norm_backward_reduce = _define(
    "batch_norm_backward_reduce",
    "(Tensor dy, Tensor x, Tensor mean) -> Tensor",
    lambda dy, x, *_: x.new_empty((2 * x.shape[1],), dtype=_stat_dtype(x)),
)
_batch_norm_backward_elemt = _define(
    "batch_norm_backward_elemt",
    "(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor sums, Tensor count) -> Tensor",
    lambda dy, x, *_: torch.empty_like(x),
)
_unscale_and_check_ = _define(
    "unscale_and_check_",
    "(Tensor(a0!)[] tensors, Tensor inv_scale) -> Tensor",
    lambda tensors, inv_scale, _: inv_scale.new_empty((), dtype=torch.float32),
    mutates=("tensors",),
    clone=True,
)
_check_finite = _define(
    "check_finite",
    "(Tensor[] tensors, Device device) -> Tensor",
    lambda tensors, device, _: torch.empty((), dtype=torch.float32, device=device),
    clone=True,
)
_accumulate_moments_ = _define(
    "accumulate_moments_",
    "(Tensor(a0!) acc, Tensor x, Tensor shift) -> ()",
    lambda *_: None,
    mutates=("acc",),
)
_moments_payload_ = _define(
    "moments_payload_",
    "(Tensor(a0!) max_payload, Tensor(a1!) sum_payload, Tensor sums, Tensor shifts, Tensor center, "
    "float fingerprint) -> ()",
    lambda *_: None,
    mutates=("max_payload", "sum_payload"),
)
_moments_finish_ = _define(
    "moments_finish_",
    "(Tensor(a0!) published, Tensor(a1!) next_shift, Tensor max_payload, Tensor sum_payload, Tensor center, "
    "bool keep_previous) -> Tensor",
    lambda published, *_: published.new_empty((), dtype=torch.bool),
    mutates=("published", "next_shift"),
    clone=True,
)
_accumulate_histogram_ = _define(
    "accumulate_histogram_",
    "(Tensor(a0!) hist, Tensor x, Tensor edges) -> ()",
    lambda *_: None,
    mutates=("hist",),
)
