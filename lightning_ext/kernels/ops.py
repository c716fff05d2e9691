"""The ops, by name (:data:`~lightning_ext.kernels.OPS`): the :class:`~lightning_ext.kernels.KernelOp`
each op family module registers when this module imports it. Each is also the custom op
``torch.ops.lightning_ext.<name>`` that ``torch.compile`` traces; its reference implementation
documents its arguments (:func:`~lightning_ext.kernels.define_op`).

- :mod:`~lightning_ext.kernels.batch_norm`: ``batch_norm_moments``, ``batch_norm_gather_stats``,
  ``batch_norm_elemt``, ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``;
- :mod:`~lightning_ext.kernels.unscale`: ``unscale_and_check_``, ``check_finite``;
- :mod:`~lightning_ext.kernels.moments`: ``accumulate_moments_``, ``moments_payload_``,
  ``moments_finish_``;
- :mod:`~lightning_ext.kernels.histogram`: ``accumulate_histogram_``, ``pack_windows_``.
"""

from __future__ import annotations

from lightning_ext.kernels import batch_norm, histogram, moments, unscale  # noqa: F401  (register their ops)
from lightning_ext.kernels.backend import OPS

__all__ = ["OPS"]
