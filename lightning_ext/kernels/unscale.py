"""Loss-scaling op family: ``unscale_and_check_`` and ``check_finite``, each the reference (ATen, as
``torch.amp.GradScaler``) and one multi-tensor Triton kernel (its stores off for ``check_finite``)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, tl, triton
from lightning_ext.kernels.backend import define_op

__all__: list[str] = []  # an op family: its ops are registered below (lightning_ext.kernels.ops)


def _by_dtype(tensors: list[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    groups: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


# ---------------------------------------------------------------------------- reference (pure torch)


def _unscale_and_check_reference(tensors: list[Tensor], inv_scale: Tensor) -> Tensor:
    """Multiply every tensor in place by ``inv_scale`` and flag any inf/NaN, in one pass; follows
    ``torch._amp_foreach_non_finite_check_and_unscale_`` (``torch.amp.GradScaler``).

    Args:
        tensors: floating point tensors (gradients) of any dtypes, on one device.
        inv_scale: float32 tensor with one element, ``1 / scale``, on the tensors' device.

    Returns:
        ``found_inf``: float32 0-dim tensor on ``inv_scale.device``, 1.0 iff any element was inf or
        NaN before scaling.

    ATen's multi-tensor op: one call on CPU (it takes mixed dtypes), one per dtype elsewhere.
    """
    found = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    groups = [tensors] if inv_scale.is_cpu else list(_by_dtype(tensors).values())
    for group in groups:
        if group:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale)
    return found


def _check_finite_reference(tensors: list[Tensor], device: torch.device) -> Tensor:
    """Whether any element of ``tensors`` is inf/NaN, without changing them: the check fused optimizers
    need (they unscale inside their own step).

    Args:
        tensors: float16, bfloat16, float32 or float64 tensors (gradients), on ``device``.
        device: the tensors' device (needed when ``tensors`` is empty).

    Returns:
        ``found_inf``: float32 0-dim tensor on ``device``, 1.0 iff any element is inf or NaN.

    Read-only: one ``aminmax`` per non-empty tensor (NaN propagates into the extremes, inf is one).
    GradScaler checks for fused optimizers with its multiply-and-check op at scale 1, which writes
    every tensor: it fails on overlapping (expanded) tensors and, on CPU, rewrites bfloat16 NaNs' bits.
    """
    finite = [torch.isfinite(torch.stack(torch.aminmax(t))).all() for t in tensors if t.numel()]
    if not finite:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.logical_not(torch.stack(finite).all()).to(torch.float32)


# ---------------------------------------------------------------------------- Triton kernel
# One launch per (device, dtype) bucket covers every tensor of the bucket (multi-tensor apply, as
# ATen's ``_amp_foreach_non_finite_check_and_unscale_`` and Apex's ``multi_tensor_apply`` do): one
# program per BLOCK elements of any tensor. A cached int64 table holds one word per program,
# ``start << 24 | valid``: where its block starts (elements from the bucket's first tensor) and how
# many of its BLOCK elements are valid, so a program's second load already reads the gradients.
# The inf/NaN flag is a masked store by the offending lanes: no reduction, no barrier.

_VALID_BITS = 24  # low bits of a table word: valid elements of the block (BLOCK < 2**24)
# The high bits hold a signed element offset from the base pointer: tensors farther than this from
# the bucket's first one (2**38 elements, 512 GiB of fp16; never seen within one device) take ATen's op.
_MAX_OFFSET = 1 << (63 - _VALID_BITS - 1)

if HAS_TRITON:

    @triton.jit
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
        bad = (v != v) | (tl.abs(v) == float("inf"))
        tl.store(found_ptr + lanes * 0, tl.full([BLOCK], 1.0, tl.float32), mask=bad)
        if WRITE:
            out = (v * tl.load(inv_ptr).to(ACC)).to(g.dtype)
            if valid == BLOCK:
                tl.store(ptrs, out)
            else:
                tl.store(ptrs, out, mask=lanes < valid)


# ---------------------------------------------------------------------------- launcher

_BLOCK, _BLOCK_INTERPRET = 4096, 1024  # elements per program (the interpreter: fewer, faster)
_NUM_WARPS = 8
_Meta = tuple[Tensor | None, list[int], int]  # (per-program words, indices of the kernel's tensors, programs)
_META_CACHE: dict[tuple, _Meta] = {}  # bucket signature -> metadata
_META_CACHE_SIZE = 64


def _forget_launch_metadata() -> None:
    """Empty ``_META_CACHE`` (:func:`~lightning_ext.kernels.clear_backend_cache`)."""
    _META_CACHE.clear()


def _is_dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a gap-free block of ``t.numel()`` storage elements (any order)."""
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _bucket_metadata(group: list[Tensor], block: int) -> _Meta:
    """``(table, fast, programs)`` for the tensors of one (device, dtype) bucket.

    ``fast``: indices of the tensors the kernel takes (non-empty, dense, 16-byte aligned, within
    ``_MAX_OFFSET`` elements of the first such tensor); ``table``: the program words on the device.
    Cached by the tensors' addresses and sizes (gradients keep their storage from step to step). On a
    miss the host copies 3 numbers per tensor without a sync (pinned, ``non_blocking``) and the device
    computes the words (``searchsorted`` of each program's tensor).
    """
    ptrs, sizes = tuple(map(Tensor.data_ptr, group)), tuple(map(Tensor.numel, group))
    dense = (True,) * len(group) if all(map(Tensor.is_contiguous, group)) else tuple(map(_is_dense, group))
    key = (group[0].device, group[0].dtype, block, ptrs, sizes, dense)
    hit = _META_CACHE.get(key)
    if hit is not None:
        return hit
    elsize = group[0].element_size()
    fast = [
        i
        for i, (ptr, numel, ok) in enumerate(zip(ptrs, sizes, dense))
        if ok and 0 < numel < _MAX_OFFSET and ptr % 16 == 0
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


def _multi_tensor_pass(tensors: list[Tensor], inv_scale: Tensor | None, device: torch.device) -> Tensor:
    """found_inf (float32 0-dim on ``device``) of ``tensors``, each multiplied by ``inv_scale`` in
    place unless it is None. Tensors the kernel does not take go through the references."""
    block = _BLOCK_INTERPRET if device.type == "cpu" else _BLOCK
    found = torch.zeros((), dtype=torch.float32, device=device)
    for dtype, group in _by_dtype(tensors).items():
        table, fast, total = _bucket_metadata(group, block)
        if fast:
            _unscale_multi_kernel[(total,)](
                group[fast[0]], table, found if inv_scale is None else inv_scale, found,
                ACC=tl.float64 if dtype == torch.float64 else tl.float32, WRITE=inv_scale is not None,
                VEC=16 // group[0].element_size(), BLOCK=block, VALID_BITS=_VALID_BITS,
                **({} if device.type == "cpu" else {"num_warps": _NUM_WARPS}),
            )  # fmt: skip
        taken = set(fast)
        others = [t for i, t in enumerate(group) if i not in taken and t.numel() > 0]
        if others and inv_scale is not None:
            torch._amp_foreach_non_finite_check_and_unscale_(others, found, inv_scale)
        elif others:  # read-only, also for overlapping (expanded) tensors
            torch.maximum(found, _check_finite_reference(others, device), out=found)
    return found


def _unscale_and_check_triton(tensors: list[Tensor], inv_scale: Tensor) -> Tensor:
    """One launch per dtype: each element read once, written once. No host sync."""
    return _multi_tensor_pass(tensors, inv_scale, inv_scale.device)


def _check_finite_triton(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The multi-tensor kernel with its stores off (half the bytes of unscaling). No host sync."""
    return _multi_tensor_pass(tensors, None, torch.device(device))  # (the schema's Device: a str too)


# ---------------------------------------------------------------------------- the ops

unscale_and_check_ = define_op(
    "unscale_and_check_(Tensor(a0!)[] tensors, Tensor inv_scale) -> Tensor",
    _unscale_and_check_reference,
    fake=lambda tensors, inv_scale: inv_scale.new_empty((), dtype=torch.float32),
    clone=True,
    triton=_unscale_and_check_triton,
)
check_finite = define_op(
    "check_finite(Tensor[] tensors, Device device) -> Tensor",
    _check_finite_reference,
    fake=lambda tensors, device: torch.empty((), dtype=torch.float32, device=device),
    clone=True,
    triton=_check_finite_triton,
)
