"""One process as a rank of a group whose other ranks add nothing: ``SyncBatchNorm``'s distributed path
(its kernels and autograd Function, one all_reduce per direction) on this process's data alone, whose
statistics it then gives. A layer outside distributed training is ATen's batch norm, as torch's."""

from __future__ import annotations

import pytest

from lightning_ext.nn import sync_batch_norm


def simulate_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``SyncBatchNorm`` take its distributed path in this process (the all_reduces: no-ops)."""
    monkeypatch.setattr(sync_batch_norm, "is_distributed", lambda: True)
    monkeypatch.setattr(sync_batch_norm, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(sync_batch_norm, "all_reduce_", lambda tensor, group=None: None)
