"""Fused gradient unscaling with an inf/NaN check: ``unscale_and_check_``.

Reference: ATen's ``_amp_foreach_non_finite_check_and_unscale_`` (what ``torch.amp.GradScaler``
uses), one call per (device, dtype) bucket. The Triton kernel does the same in one launch per bucket:
it reads each element once, writes it scaled, and raises a device-side flag; ``check_finite_triton``
runs it read-only for fused optimizers.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, kernel, tl, tl_dtype

__all__ = [
    "bucket_by_device_and_dtype",
    "check_finite_reference",
    "check_finite_triton",
    "combine_found_inf",
    "unscale_and_check_reference",
    "unscale_and_check_triton",
]


def bucket_by_device_and_dtype(tensors: list[Tensor]) -> dict[torch.device, dict[torch.dtype, list[Tensor]]]:
    """Group ``tensors`` by device, then dtype, keeping their order (no copies).

    Uses torch's C++ grouping (what ``torch.optim``'s foreach paths use), ~1.5x faster than a
    Python loop for a few dozen tensors.
    """
    buckets: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(dict)
    if not tensors:
        return buckets
    grouped = torch._C._group_tensors_by_device_and_dtype([list(tensors)], False)
    for (device, dtype), (lists, _) in grouped.items():
        buckets[device][dtype] = lists[0]
    return buckets


def combine_found_inf(flags: list[Tensor], device: torch.device) -> Tensor:
    """Combine per-device float32 0-dim flags into one on ``device`` (``non_blocking`` copies, no sync)."""
    if len(flags) == 1 and flags[0].device == device:
        return flags[0]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    moved = [f.to(device, non_blocking=True) for f in flags]
    return torch.stack(moved).amax()


# ---------------------------------------------------------------------------- reference (pure torch)


def unscale_and_check_reference(tensors: list[Tensor], inv_scale: Tensor) -> Tensor:
    """One ``_amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) bucket (one in all
    on CPU, whose kernel takes mixed dtypes)."""
    if inv_scale.is_cpu and all(t.is_cpu for t in tensors):
        found = torch.zeros((), dtype=torch.float32)
        if tensors:
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale)
        return found
    flags = []
    for device, by_dtype in bucket_by_device_and_dtype(tensors).items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        inv = inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        flags.append(found)
    return combine_found_inf(flags, inv_scale.device)


_CPU_ONE: Tensor | None = None


def _cpu_one() -> Tensor:
    """A float32 0-dim CPU tensor holding 1.0, made once (only ever read, as the unscale factor)."""
    global _CPU_ONE
    if _CPU_ONE is None:
        _CPU_ONE = torch.ones((), dtype=torch.float32)
    return _CPU_ONE


def check_finite_reference(tensors: list[Tensor], device: torch.device, small_numel: int = 1 << 16) -> Tensor:
    """``found_inf`` of ``tensors`` without writing them: what fused optimizers need before their step.

    GradScaler checks gradients for fused optimizers with the same multiply-and-check op as
    ``unscale_``, at scale 1, which rewrites every gradient. On CPU, tensors of at least
    ``small_numel`` elements are instead checked with one read-only ``aminmax`` each (NaN
    propagates into min/max, inf shows as an infinite extreme; ``benchmarks/bench_kernels.py`` times
    it against GradScaler's check); smaller ones, where one op per tensor would cost more than the
    writes, and other devices go through the multi-tensor op at scale 1 (multiplying by 1 leaves
    every value bitwise unchanged). Returns float32 0-dim on ``device``, 1.0 iff any inf/NaN. No host sync.
    """
    if device.type == "cpu" and all(t.is_cpu and t.numel() < small_numel for t in tensors):
        # The common CPU case in one op: ATen's CPU kernel takes tensors of mixed dtypes.
        found = torch.zeros((), dtype=torch.float32)
        if tensors:
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, _cpu_one())
        return found
    flags = []
    one = torch.ones((), dtype=torch.float32, device=device)
    for dev, by_dtype in bucket_by_device_and_dtype(tensors).items():
        found = torch.zeros((), dtype=torch.float32, device=dev)
        inv = one if dev == device else one.to(dev, non_blocking=True)
        extremes: list[Tensor] = []
        for group in by_dtype.values():
            if dev.type == "cpu":
                small = [t for t in group if t.numel() < small_numel]
                for t in group:
                    if t.numel() >= small_numel:
                        extremes.extend(torch.aminmax(t))
            else:
                small = group
            if small:
                torch._amp_foreach_non_finite_check_and_unscale_(small, found, inv)
        if extremes:
            bad = ~torch.isfinite(torch.stack([e.float() for e in extremes])).all()
            found = torch.maximum(found, bad.float())
        flags.append(found)
    return combine_found_inf(flags, device)


# ---------------------------------------------------------------------------- Triton kernel
# One launch per (device, dtype) bucket covers every tensor of the bucket (multi-tensor apply, as
# ATen's ``_amp_foreach_non_finite_check_and_unscale_`` and Apex's ``multi_tensor_apply`` do): one
# program per BLOCK elements of any tensor. A cached int64 table holds one word per program: where
# its block starts (elements from a base pointer) and how many of its BLOCK elements are valid, so a
# program's first load is its own word and its second already reads the gradients (no chain of
# table loads through a tensor index). The inf/NaN flag is a masked store by the offending lanes:
# no reduction across the block, so no barrier between a program's loads and its stores.

_VALID_BITS = 24  # low bits of a table word: valid elements of the block (BLOCK < 2**24)
# The high bits hold a signed element offset from the base pointer: tensors farther than this from
# the bucket's first one (2**38 elements, 512 GiB of fp16; never seen within one device) take ATen's op.
_MAX_OFFSET = 1 << (63 - _VALID_BITS - 1)

if HAS_TRITON:

    def _unscale_multi_kernel(
        base_ptr,  # the bucket's first tensor: sets the element type; every tensor is base + offset
        blocks_ptr,  # (num_programs,) int64: (block start from base_ptr, in elements) << 24 | valid
        inv_ptr,  # inv_scale: () fp32 (read only when WRITE)
        found_ptr,  # found_inf: () fp32, set to 1.0 by any lane that sees inf/NaN
        ACC: tl.constexpr, WRITE: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr,
        VALID_BITS: tl.constexpr,
    ):  # fmt: skip
        word = tl.load(blocks_ptr + tl.program_id(0))
        # Every tensor starts 16-byte aligned (the launcher checks) and BLOCK is a multiple of VEC.
        start = tl.multiple_of(word >> VALID_BITS, VEC)  # arithmetic shift: starts may be negative
        valid = word & ((1 << VALID_BITS) - 1)
        lanes = tl.arange(0, BLOCK)
        ptrs = base_ptr + start + lanes
        if valid == BLOCK:  # a full block: unmasked, vectorized
            g = tl.load(ptrs)
        else:
            g = tl.load(ptrs, mask=lanes < valid, other=0.0)
        v = g.to(ACC)
        # Every writer stores the same value: no atomic, and lanes without inf/NaN store nothing.
        tl.store(
            found_ptr + lanes * 0,
            tl.full([BLOCK], 1.0, tl.float32),
            mask=(v != v) | (tl.abs(v) == float("inf")),
        )
        if WRITE:
            out = (v * tl.load(inv_ptr).to(ACC)).to(g.dtype)
            if valid == BLOCK:
                tl.store(ptrs, out)
            else:
                tl.store(ptrs, out, mask=lanes < valid)


# ---------------------------------------------------------------------------- launcher

_BLOCK, _BLOCK_INTERPRET = 4096, 1024
_NUM_WARPS = 8
_Meta = tuple[Tensor | None, list[int], int]  # (per-program words, indices of the kernel's tensors, programs)
_META_CACHE: dict[tuple, _Meta] = {}  # bucket signature -> metadata
_META_CACHE_SIZE = 64


def _is_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a gap-free block of ``t.numel()`` storage elements (any order)."""
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _bucket_metadata(group: list[Tensor], block: int, small_numel: int) -> _Meta:
    """``(table, fast, programs)`` for the tensors of one (device, dtype) bucket, cached.

    ``fast``: indices of the tensors the kernel takes (non-empty, >= ``small_numel`` elements, dense,
    16-byte aligned, within ``_MAX_OFFSET`` elements of the first such tensor); ``table``: one int64
    word per program on the device, ``start << 24 | valid`` (``start``: the first element of its
    block, counted from the first fast tensor's address; ``valid``: how many of the block's ``block``
    elements belong to the tensor). Cached by the tensors' addresses and sizes (gradients keep their
    storage from step to step), so a step builds no table and copies nothing to the device.
    Non-contiguous tensors are re-checked for density on every call. On a miss the host builds 3
    numbers per tensor and copies them without a sync (pinned memory, ``non_blocking``); the
    per-program words are computed on the device (``searchsorted`` for each program's tensor), so the
    cost does not grow with the number of elements.
    """
    ptrs = tuple(map(Tensor.data_ptr, group))
    sizes = tuple(map(Tensor.numel, group))
    head = (group[0].device, group[0].dtype, block, small_numel)
    if all(map(Tensor.is_contiguous, group)):
        key: tuple = (*head, ptrs, sizes)
    else:
        key = (*head, ptrs, sizes, tuple(map(_is_dense, group)))
    hit = _META_CACHE.get(key)
    if hit is not None:
        return hit
    dense = key[6] if len(key) > 6 else (True,) * len(group)
    elsize = group[0].element_size()
    fast = [
        i
        for i, (ptr, numel, ok) in enumerate(zip(ptrs, sizes, dense))
        if ok and 0 < numel < _MAX_OFFSET and numel >= small_numel and ptr % 16 == 0
    ]
    if fast:  # the base tensor (offset 0, numel < _MAX_OFFSET) stays first
        base = ptrs[fast[0]]
        fast = [i for i in fast if -_MAX_OFFSET < (ptrs[i] - base) // elsize < _MAX_OFFSET - sizes[i]]
    if not fast:
        entry: _Meta = (None, [], 0)
    else:
        offsets, numels, firsts, total = [], [], [], 0
        for i in fast:
            offsets.append((ptrs[i] - base) // elsize)
            numels.append(sizes[i])
            firsts.append(total)
            total += -(-sizes[i] // block)
        device = group[0].device
        host = torch.tensor(offsets + numels + firsts, dtype=torch.int64, pin_memory=device.type == "cuda")
        offsets_d, numels_d, firsts_d = host.to(device, non_blocking=True).view(3, len(fast)).unbind()
        programs = torch.arange(total, dtype=torch.int64, device=device)
        owner = torch.searchsorted(firsts_d, programs, right=True) - 1
        done = (programs - firsts_d[owner]) * block  # elements of the tensor before this block
        valid = (numels_d[owner] - done).clamp_(max=block)
        # start * 2**24 + valid == start << 24 | valid, negative starts included (two's complement).
        entry = ((offsets_d[owner] + done) * (1 << _VALID_BITS) + valid, fast, total)
    if len(_META_CACHE) >= _META_CACHE_SIZE:
        _META_CACHE.pop(next(iter(_META_CACHE)))
    _META_CACHE[key] = entry
    return entry


def _multi_tensor_pass(
    by_dtype: dict[torch.dtype, list[Tensor]],
    inv_scale: Tensor | None,
    device: torch.device,
    interpret: bool,
    small_numel: int,
) -> Tensor:
    """found_inf (float32 0-dim on ``device``) of the tensors on ``device``, by dtype; each is multiplied
    by ``inv_scale`` in place unless it is None.

    One kernel launch per dtype bucket for the dense, aligned tensors; the others go through ATen's
    multi-tensor op (at scale 1 when only checking: values unchanged).
    """
    block = _BLOCK_INTERPRET if interpret else _BLOCK
    found = torch.zeros((), dtype=torch.float32, device=device)
    for dtype, group in by_dtype.items():
        table, fast, total = _bucket_metadata(group, block, small_numel)
        if fast:
            kernel(_unscale_multi_kernel, interpret)[(total,)](
                group[fast[0]], table, found if inv_scale is None else inv_scale, found,
                ACC=tl_dtype(dtype == torch.float64), WRITE=inv_scale is not None,
                VEC=16 // group[0].element_size(), BLOCK=block, VALID_BITS=_VALID_BITS,
                **({} if interpret else {"num_warps": _NUM_WARPS}),
            )  # fmt: skip
        if len(fast) < len(group):
            taken = set(fast)
            others = [t for i, t in enumerate(group) if i not in taken and t.numel() > 0]
            if others:
                one = inv_scale if inv_scale is not None else torch.ones((), device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(others, found, one)
    return found


def unscale_and_check_triton(
    tensors: list[Tensor], inv_scale: Tensor, interpret: bool = False, small_numel: int = 0
) -> Tensor:
    """Multiply every tensor in place by ``inv_scale`` and report whether any element is inf/NaN.

    One multi-tensor Triton launch per (device, dtype) bucket: each element read once, written once.
    Tensors with fewer than ``small_numel`` elements (default 0: none), non-dense and not 16-byte
    aligned ones go through ATen's multi-tensor op.

    Args:
        tensors: floating point tensors of any shape, dtype and (CUDA, or CPU with ``interpret``)
            device; updated in place. Validation is the caller's (``KernelBackend.unscale_and_check_``).
        inv_scale: float32 0-dim tensor, ``1 / scale``.
        interpret: run in Triton's interpreter (CPU tensors; needs Triton >= 3.9).
        small_numel: tensors below this many elements take ATen's op.

    Returns:
        ``found_inf``: float32 0-dim tensor on ``inv_scale``'s device, 1.0 iff any element was inf or
        NaN (before scaling). The per-device flags are combined without host sync; a first call for a
        new set of tensors copies a small table to the device (pinned, non-blocking: no sync).
    """
    flags = []
    for device, by_dtype in bucket_by_device_and_dtype(tensors).items():
        inv = inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
        flags.append(_multi_tensor_pass(by_dtype, inv, device, interpret, small_numel))
    return combine_found_inf(flags, inv_scale.device)


def check_finite_triton(tensors: list[Tensor], device: torch.device, interpret: bool = False) -> Tensor:
    """``found_inf`` of ``tensors`` without writing them: the multi-tensor kernel with its stores off.

    Args:
        tensors: floating point tensors of any shape and dtype (CUDA, or CPU with ``interpret``).
        device: where to return the flag.
        interpret: run in Triton's interpreter (CPU tensors; needs Triton >= 3.9).

    Returns:
        float32 0-dim tensor on ``device``, 1.0 iff any element is inf or NaN. Reads each element
        once (half the bytes of unscaling; 0.46-0.48x ATen's check at scale 1 on an H100 with the
        previous table layout, 2026-11-22, ``benchmarks/bench_kernels.py``). No host sync.
    """
    flags = [
        _multi_tensor_pass(by_dtype, None, dev, interpret, 0)
        for dev, by_dtype in bucket_by_device_and_dtype(tensors).items()
    ]
    return combine_found_inf(flags, device)
