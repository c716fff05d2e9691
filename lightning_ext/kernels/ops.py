"""The ops, by name: every :class:`~lightning_ext.kernels.KernelOp` at the top level of an op family
module. Each is also the custom op ``torch.ops.lightning_ext.<name>`` that ``torch.compile`` traces;
its reference implementation documents its arguments (:func:`~lightning_ext.kernels.define_op`).

- :mod:`~lightning_ext.kernels.batch_norm`: ``batch_norm_moments``, ``batch_norm_gather_stats``,
  ``batch_norm_elemt``, ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``;
- :mod:`~lightning_ext.kernels.unscale`: ``unscale_and_check_``, ``check_finite``;
- :mod:`~lightning_ext.kernels.moments`: ``accumulate_moments_``, ``moments_payload_``,
  ``moments_finish_``;
- :mod:`~lightning_ext.kernels.histogram`: ``accumulate_histogram_``.
"""

from __future__ import annotations

from lightning_ext.kernels import batch_norm, histogram, moments, unscale
from lightning_ext.kernels.backend import KernelOp

__all__ = ["OPS"]

OPS: dict[str, KernelOp] = {
    op.name: op
    for family in (batch_norm, unscale, moments, histogram)
    for op in vars(family).values()
    if isinstance(op, KernelOp)
}
