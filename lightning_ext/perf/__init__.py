"""lightning_ext.perf: performance accounting: FLOPs, device peaks, MFU, goodput. Pure torch, no Lightning."""

from lightning_ext.perf.flops import FlopCount, FlopCounter, count_flops, mfu
from lightning_ext.perf.goodput import LOST_TIME_CAUSES, GoodputLedger
from lightning_ext.perf.peaks import (
    DEVICE_PEAKS,
    DevicePeak,
    clear_peak_cache,
    measure_peak_flops,
    peak_flops,
)

__all__ = [
    "DEVICE_PEAKS", "LOST_TIME_CAUSES", "DevicePeak", "FlopCount", "FlopCounter", "GoodputLedger",
    "clear_peak_cache", "count_flops", "measure_peak_flops", "mfu", "peak_flops",
]  # fmt: skip
