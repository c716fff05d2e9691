"""The peak FLOP/s of a device: a datasheet table for accelerators, a matmul measurement for the rest.

The table holds DENSE peaks (no 2:4 structured sparsity: the datasheets' starred figures halved) of the
matrix units per data type, each entry naming its source. ``fp8`` is its own column, never int8's; a
device without an fp8 (or tf32) unit has no entry for it, and asking for one raises.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping

import torch

from lightning_ext._checks import check_device, check_int

__all__ = ["DEVICE_PEAKS", "DevicePeak", "clear_peak_cache", "measure_peak_flops", "peak_flops"]

_DTYPE_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")
_FP8 = tuple(getattr(torch, name) for name in dir(torch) if name.startswith("float8_"))
_MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_measured: dict[tuple[str, torch.dtype, int], float] = {}  # (device, dtype, size) -> FLOP/s measured


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Dense peak FLOP/s of one device model by data type, and where the figures come from.

    Args:
        pattern: regular expression searched (case-insensitively) in ``torch.cuda.get_device_name()``.
        name: the device as its vendor names it, variant (SXM, PCIe, NVL) included.
        flops: FLOP/s by data type key (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``);
            a key the device has no unit for is absent.
        source: the vendor document the figures come from.
    """

    pattern: str
    name: str
    flops: Mapping[str, float]
    source: str


def _tflops(fp32: float, tf32: float | None, bf16: float, fp16: float, fp8: float | None) -> dict[str, float]:
    values = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8}
    return {key: value * 1e12 for key, value in values.items() if value is not None}


_H100_SXM = _tflops(66.9, 494.7, 989.4, 989.4, 1978.9)
_HOPPER_NVL = _tflops(60.0, 417.5, 835.5, 835.5, 1670.5)
_CDNA3 = _tflops(163.4, 653.7, 1307.4, 1307.4, 2614.9)
# First match wins: a more specific pattern (GB200, H100 NVL/PCIe) comes before a more general one; a
# model number is matched whole (no "A100" in "RTX A1000").
DEVICE_PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(r"GB200(?!\d)", "NVIDIA GB200 (NVL72, per GPU)", _tflops(80, 1250, 2500, 2500, 5000),
               "NVIDIA GB200 NVL72 datasheet (individual Blackwell GPU, sparse figures halved)"),
    DevicePeak(r"B200(?!\d)", "NVIDIA B200 (HGX, SXM)", _tflops(75, 1100, 2250, 2250, 4500),
               "NVIDIA HGX B200 datasheet (individual Blackwell GPU, sparse figures halved)"),
    DevicePeak(r"H200(?!\d).*NVL", "NVIDIA H200 NVL (PCIe)", _HOPPER_NVL,
               "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL column, sparse figures halved)"),
    DevicePeak(r"H200(?!\d)", "NVIDIA H200 SXM", _H100_SXM,
               "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column: H100 SXM's compute)"),
    DevicePeak(r"H100(?!\d).*NVL", "NVIDIA H100 NVL (PCIe)", _HOPPER_NVL,
               "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL column, sparse figures halved)"),
    DevicePeak(r"H100(?!\d).*PCIe", "NVIDIA H100 PCIe", _tflops(51.2, 378, 756, 756, 1513),
               "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column, sparse figures halved)"),
    DevicePeak(r"H100(?!\d)", "NVIDIA H100 SXM", _H100_SXM,
               "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column, sparse figures halved); "
               "NVIDIA H100 Tensor Core GPU Architecture whitepaper"),
    DevicePeak(r"A100(?!\d)", "NVIDIA A100 (SXM4 and PCIe alike)", _tflops(19.5, 156, 312, 312, None),
               "NVIDIA A100 Tensor Core GPU datasheet (dense figures)"),
    DevicePeak(r"L40S", "NVIDIA L40S", _tflops(91.6, 183, 362.05, 362.05, 733),
               "NVIDIA L40S GPU datasheet (dense figures)"),
    DevicePeak(r"\bL4\b", "NVIDIA L4", _tflops(30.3, 60, 121, 121, 242.5),
               "NVIDIA L4 Tensor Core GPU datasheet (sparse figures halved)"),
    DevicePeak(r"MI325X", "AMD Instinct MI325X (OAM)", _CDNA3,
               "AMD Instinct MI325X accelerator datasheet (dense figures)"),
    DevicePeak(r"MI300X", "AMD Instinct MI300X (OAM)", _CDNA3,
               "AMD Instinct MI300X accelerator datasheet (dense figures)"),
    DevicePeak(r"MI250X", "AMD Instinct MI250X (per GCD)",
               _tflops(47.85, None, 191.5, 191.5, None),
               "AMD Instinct MI250X accelerator datasheet (peak matrix figures of the OAM module halved: "
               "each of its two dies, GCDs, is one torch device)"),
)  # fmt: skip


def _matmuls_use_tf32() -> bool:
    """Whether float32 CUDA matmuls run as TF32: ``torch.get_float32_matmul_precision()``, or where the
    new ``torch.backends.cuda.matmul.fp32_precision`` was set too (the legacy getter then raises), that."""
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"


def _dtype_key(dtype: torch.dtype | str) -> str:
    """The table's column for ``dtype`` (float32 reads ``tf32`` unless matmul precision is highest)."""
    if isinstance(dtype, str):
        if dtype not in _DTYPE_KEYS:
            raise ValueError(
                f"peak_flops: `dtype` must be a torch dtype or one of {_DTYPE_KEYS}, got {dtype!r}"
            )
        return dtype
    if dtype == torch.float32:
        return "tf32" if _matmuls_use_tf32() else "fp32"
    keys = {torch.bfloat16: "bf16", torch.float16: "fp16", **dict.fromkeys(_FP8, "fp8")}
    if dtype not in keys:
        raise ValueError(
            f"peak_flops: `dtype` must be float32, bfloat16, float16 or a float8 dtype, got {dtype!r}"
        )
    return keys[dtype]


def peak_flops(dtype: torch.dtype | str, device_name: str | None = None) -> float:
    """The datasheet's dense peak FLOP/s of an accelerator for ``dtype``, from :data:`DEVICE_PEAKS`.

    Args:
        dtype: the data type of the matmuls: ``torch.float32`` (the ``"tf32"`` column when
            ``torch.get_float32_matmul_precision()`` is not ``"highest"``, as matmuls then use TF32;
            where ``torch.backends.cuda.matmul.fp32_precision`` is set, when it is ``"tf32"``),
            ``torch.bfloat16``, ``torch.float16``, any ``torch.float8_*``, or a column name
            (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``). A job mixing fp8 and bf16
            matmuls passes the dtype of most of its FLOPs, or weighs the two peaks itself.
        device_name: the device's name as ``torch.cuda.get_device_name()`` gives it; default: the
            current CUDA (or ROCm) device's.

    Returns:
        FLOP/s of one device (one GPU of a multi-GPU board).

    Raises:
        ValueError: an unknown ``dtype``; no CUDA device and no ``device_name``; a device the table
            does not know, or that has no unit for ``dtype`` (fp8 on an A100); a MIG instance (a share
            of a GPU).

    Example::

        >>> peak_flops(torch.bfloat16, "NVIDIA H100 80GB HBM3") / 1e12
        989.4
        >>> peak_flops(torch.float8_e4m3fn, "NVIDIA H100 80GB HBM3") / 1e12
        1978.9
    """
    key = _dtype_key(dtype)
    hint = "HINT: give the peak yourself, or measure_peak_flops() for an achievable matmul rate."
    if device_name is not None and not isinstance(device_name, str):
        raise TypeError(f"peak_flops: `device_name` must be a str or None, got {device_name!r}")
    if device_name is None:
        if not torch.cuda.is_available():
            raise ValueError(f"peak_flops: no CUDA device and no `device_name`. {hint}")
        device_name = torch.cuda.get_device_name()
    if re.search(r"\bMIG\b", device_name):
        raise ValueError(
            f"peak_flops: {device_name!r} is a MIG instance, which has a share of the GPU's compute units "
            f"(a 1g slice: a seventh of an A100's or H100's), not the datasheet's peak. {hint}"
        )
    entry = next((e for e in DEVICE_PEAKS if re.search(e.pattern, device_name, re.IGNORECASE)), None)
    if entry is None:
        raise ValueError(f"peak_flops: no peak known for the device {device_name!r}. {hint}")
    if key not in entry.flops:
        raise ValueError(
            f"peak_flops: the {entry.name} ({device_name!r}) has no {key} unit; it has "
            f"{sorted(entry.flops)}. {hint}"
        )
    return entry.flops[key]


def _time_matmuls(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """Seconds that ``repeats`` matmuls ``a @ b`` take, the device synchronized before and after."""
    synchronize = torch.cuda.synchronize if a.device.type == "cuda" else lambda device: None
    synchronize(a.device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    synchronize(a.device)
    return time.perf_counter() - start


def measure_peak_flops(dtype: torch.dtype = torch.float32, device: str = "cpu", size: int = 1024) -> float:
    """The achievable matmul rate of ``device`` in FLOP/s, measured once per process: not a datasheet peak.

    Times rounds of ``size × size`` matmuls (``2·size³`` FLOPs each, with torch's current thread
    count on CPU; a larger ``size`` such as 8192 for a GPU) and keeps the best round; the result is
    cached per ``(device, dtype, size)`` until :func:`lightning_ext.reset` (:func:`clear_peak_cache`).
    The first call costs a few seconds at most (float16 and bfloat16 on a CPU without native
    half-precision arithmetic are the slowest). For a device without a datasheet entry (a CPU), where
    an MFU against it reads as "the share of what a large matmul achieves here". Synchronizes host
    and device.

    Args:
        dtype: floating-point dtype of the matmul operands.
        device: where to run them: a CPU or a CUDA device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...;
            the timing waits for the device on these only).
        size: rows and columns of the square operands; at least 16.

    Returns:
        FLOP/s, a positive float.

    Raises:
        ValueError: ``size`` < 16 or ``dtype`` not float16, bfloat16, float32 or float64 (float8
            matmuls need ``torch._scaled_mm``: give the peak yourself); ``device`` neither a CPU nor an
            available CUDA device (an MPS or XPU timing would count the launches, not the work).
        TypeError: ``size`` not an int; ``device`` not a device (a str or a ``torch.device``).

    Example::

        >>> measure_peak_flops(torch.float32, "cpu", size=64) > 0
        True
    """
    check_int("measure_peak_flops", "size", size, ge=16)
    if dtype not in _MATMUL_DTYPES:
        raise ValueError(
            f"measure_peak_flops: `dtype` must be one of {_MATMUL_DTYPES} (torch.mm's), got {dtype!r}"
        )
    where = _timed_device(device)
    key = (str(where), dtype, size)
    if key not in _measured:
        a, b = (torch.randn(size, size, device=where).to(dtype) for _ in range(2))
        repeats = max(1, min(1000, round(0.02 / _time_matmuls(a, b, 1))))  # rounds of 0.02 s
        best = min(_time_matmuls(a, b, repeats) for _ in range(3))
        _measured[key] = 2.0 * size**3 * repeats / best
    return _measured[key]


def _timed_device(device: object) -> torch.device:
    """``device`` as a CPU or an available CUDA device, else the error naming it."""
    where = check_device("measure_peak_flops", "device", device)
    if not (where.type == "cpu" or (where.type == "cuda" and torch.cuda.is_available())):
        raise ValueError(f"measure_peak_flops: `device` must be a CPU or an available GPU, got {device!r}")
    return where


def clear_peak_cache() -> None:
    """Forget the rates :func:`measure_peak_flops` measured (part of :func:`lightning_ext.reset`)."""
    _measured.clear()
