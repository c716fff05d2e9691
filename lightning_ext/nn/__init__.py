"""lightning_ext.nn: SyncBatchNorm on every torch.distributed backend, lossless conversion. Pure torch."""

from lightning_ext.nn.convert import convert_sync_batchnorm, revert_sync_batchnorm
from lightning_ext.nn.precise_bn import update_bn_stats
from lightning_ext.nn.sync_batch_norm import SyncBatchNorm, sync_batch_norm_stats

__all__ = [
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "sync_batch_norm_stats",
    "update_bn_stats",
]
