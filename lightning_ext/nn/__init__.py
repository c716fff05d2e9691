"""lightning_ext.nn: SyncBatchNorm on every torch.distributed backend, lossless conversion. Pure torch."""

# Not API (exported by lightning_ext.distributed only); still imported here by the SyncBatchNorm plugin
# and its tests until they import it from lightning_ext.distributed.
from lightning_ext.distributed import create_process_groups  # noqa: F401
from lightning_ext.nn.convert import convert_sync_batchnorm, revert_sync_batchnorm
from lightning_ext.nn.sync_batch_norm import SyncBatchNorm, sync_batch_norm_stats

__all__ = [
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
    "sync_batch_norm_stats",
]
