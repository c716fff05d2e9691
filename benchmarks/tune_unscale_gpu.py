"""Diagnosis of the multi-tensor unscale pass on a GPU (the figures of record come from
``bench_kernels.py``): where its time goes against a copy of the same bytes, and which kernel
version and launch constants are fastest.

Prints, for 10.5M gradients in 45 tensors (5 of 2M elements, 40 of 512: ``bench_kernels``' case), in
float32 and float16, device time per call from CUDA-graph replays over input sets larger than L2:

- ceilings: a multi-tensor copy of the same tensors (``torch._foreach_copy_``, same bytes read and
  written) and one contiguous copy of the same bytes;
- ATen's ``_amp_foreach_non_finite_check_and_unscale_`` with a preallocated flag, and with the
  ``torch.zeros`` flag our API allocates per call (what ``unscale_and_check_`` pays in the graph);
- ``v1``: the kernel measured at 0.80 of copy (2026-11-22; kept below verbatim with its table): a
  per-program tensor index, then the tensor's offset/numel/first block (two dependent table loads),
  and a block-wide max before the flag store (a barrier between a program's loads and its stores);
- ``v2``: the library's kernel (one table word per program, flag by masked lane stores), at several
  block sizes and warp counts;
- ``v3``: v2 whose flag is written once, by the last program to finish (an atomic ticket per
  program, a self-resetting scratch pair), so the per-call flag needs no fill kernel;
- every version is first checked against ATen's op (clean, poisoned, clean again), bit for bit;
- kernel-only durations from the profiler (CUPTI) for copy, ATen and v2, i.e. without the flag's
  fill kernel and the gaps between graph nodes.

Usage (GPU only): ``python benchmarks/tune_unscale_gpu.py``.
"""

# ruff: noqa: B023  (every lambda is timed at once, inside the iteration that defines it)
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
import triton.language as tl
from bench_kernels import _n_sets, gpu_device_time

from lightning_ext.kernels import unscale as us

SHAPES = [(2048, 1024)] * 5 + [(512,)] * 40
DEVICE = "cuda"  # a smoke test of this script sets "cpu" (Triton interpreter, no timings)


@triton.jit
def _v1_kernel(
    base_ptr, meta_ptr, inv_ptr, found_ptr, T, ACC: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    t = tl.load(meta_ptr + 3 * T + pid)
    off = tl.multiple_of(tl.load(meta_ptr + t), VEC)
    numel = tl.load(meta_ptr + T + t)
    start = (pid - tl.load(meta_ptr + 2 * T + t)) * BLOCK
    ptrs = base_ptr + off + start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        g = tl.load(ptrs)
    else:
        g = tl.load(ptrs, mask=start + tl.arange(0, BLOCK) < numel, other=0.0)
    v = g.to(ACC)
    bad = tl.max(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32), axis=0)
    if bad > 0:
        tl.store(found_ptr, 1.0)
    out = (v * tl.load(inv_ptr).to(ACC)).to(g.dtype)
    if start + BLOCK <= numel:
        tl.store(ptrs, out)
    else:
        tl.store(ptrs, out, mask=start + tl.arange(0, BLOCK) < numel)


def v1_table(group: list[torch.Tensor], block: int) -> tuple[torch.Tensor, int]:
    """v1's table: offsets, numels, first blocks, then the tensor index of each program."""
    base, elsize = group[0].data_ptr(), group[0].element_size()
    offsets, numels, firsts, total = [], [], [], 0
    for t in group:
        offsets.append((t.data_ptr() - base) // elsize)
        numels.append(t.numel())
        firsts.append(total)
        total += -(-t.numel() // block)
    small = torch.tensor(offsets + numels + firsts, dtype=torch.int64, device=DEVICE)
    programs = torch.arange(total, dtype=torch.int64, device=DEVICE)
    owner = torch.searchsorted(small[2 * len(group) :], programs, right=True) - 1
    return torch.cat([small, owner]), total


def v1_unscale(group, inv, tables, block, warps):
    found = torch.zeros((), dtype=torch.float32, device=DEVICE)
    table, total = tables[id(group)]
    _v1_kernel[(total,)](group[0], table, inv, found, len(group), ACC=tl.float32,
                         VEC=16 // group[0].element_size(), BLOCK=block, num_warps=warps)  # fmt: skip
    return found


@triton.jit
def _v3_kernel(
    base_ptr, blocks_ptr, inv_ptr, found_ptr, scratch_ptr, num_programs,
    VEC: tl.constexpr, BLOCK: tl.constexpr, VALID_BITS: tl.constexpr,
):  # fmt: skip
    """v2 plus a flag written once by the last program to finish, so the caller's flag needs no
    zeroing kernel: ``scratch`` (int32: [any inf/NaN, programs done]) starts at zero and the last
    program resets it (the launch leaves it as it found it)."""
    word = tl.load(blocks_ptr + tl.program_id(0))
    start = tl.multiple_of(word >> VALID_BITS, VEC)
    valid = word & ((1 << VALID_BITS) - 1)
    lanes = tl.arange(0, BLOCK)
    ptrs = base_ptr + start + lanes
    if valid == BLOCK:
        g = tl.load(ptrs)
    else:
        g = tl.load(ptrs, mask=lanes < valid, other=0.0)
    v = g.to(tl.float32)
    bad = (v != v) | (tl.abs(v) == float("inf"))
    # Returning atomics: each lane waits until its update is performed, before the barrier below.
    tl.atomic_max(scratch_ptr + lanes * 0, tl.full([BLOCK], 1, tl.int32), mask=bad, sem="acq_rel")
    out = (v * tl.load(inv_ptr)).to(g.dtype)
    if valid == BLOCK:
        tl.store(ptrs, out)
    else:
        tl.store(ptrs, out, mask=lanes < valid)
    tl.debug_barrier()
    ticket = tl.atomic_add(scratch_ptr + 1, 1, sem="acq_rel")
    if ticket == num_programs - 1:
        any_bad = tl.atomic_xchg(scratch_ptr, 0, sem="acq_rel")
        tl.store(found_ptr, any_bad.to(tl.float32))
        tl.atomic_xchg(scratch_ptr + 1, 0, sem="acq_rel")


def v3_unscale(group, inv, tables, block, warps):
    found = torch.empty((), dtype=torch.float32, device=DEVICE)
    table, total, scratch = tables[id(group)]
    _v3_kernel[(total,)](group[0], table, inv, found, scratch, total, VEC=16 // group[0].element_size(),
                         BLOCK=block, VALID_BITS=us._VALID_BITS, num_warps=warps)  # fmt: skip
    return found


def v3_table(group: list[torch.Tensor], block: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """v2's table (the library's) and a zeroed scratch pair."""
    table, fast, total = us._bucket_metadata(group, block, 0)
    assert fast == list(range(len(group))), "every tensor dense and aligned"
    return table, total, torch.zeros(2, dtype=torch.int32, device=DEVICE)


def check(name, fn, group, inv) -> None:
    """``fn`` against ATen's op on copies of ``group``: clean, then one inf in a 512-element
    tensor's last element, then clean again (a stale flag would show), values bit for bit."""
    for poison in (False, True, False):
        grads = [t.clone() for t in group]
        if poison:
            grads[-1].view(-1)[-1] = float("inf")
        expected = [t.clone() for t in grads]
        flag = torch.zeros((), device=DEVICE)
        torch._amp_foreach_non_finite_check_and_unscale_(expected, flag, inv)
        found = fn(grads)
        assert found.item() == flag.item() == float(poison), (name, poison, found.item())
        for a, b in zip(grads, expected):
            torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True, msg=name)


def kernel_us(fn, sets, reps: int = 20) -> dict[str, float]:
    """Mean CUDA-kernel microseconds per call of ``fn(inputs)``, by kernel name (profiler, CUPTI)."""
    for inputs in sets:
        fn(inputs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for inputs in sets:
                fn(inputs)
        torch.cuda.synchronize()
    calls = reps * len(sets)
    return {
        e.key[:40]: e.device_time_total / calls
        for e in prof.key_averages()
        if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA
    }


def copy_gbs() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.randn(2**28, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=40) * 1e-3)


def main() -> None:
    copy = copy_gbs()
    print(f"copy 1 GiB: {copy / 1e9:.0f} GB/s (the 'of copy' reference)")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        nb = 2 * sum(torch.Size(sh).numel() for sh in SHAPES) * torch.finfo(dtype).bits // 8  # read + write
        n = _n_sets(nb)
        sets = [
            [(torch.randn(sh, device=DEVICE, generator=gen) * 1e-3).to(dtype) for sh in SHAPES]
            for _ in range(n)
        ]
        dsts = {id(g): [torch.empty_like(t) for t in g] for g in sets}
        words = nb // 2 // 4  # float32 elements of the same bytes
        flat = [
            (torch.randn(words, device=DEVICE, generator=gen), torch.empty(words, device=DEVICE))
            for _ in range(n)
        ]
        inv = torch.tensor(0.5, device=DEVICE)
        flag = torch.zeros((), device=DEVICE)
        print(f"\n{dtype}: {nb / 2e6:.1f} MB of gradients, {len(SHAPES)} tensors, {n} input sets per graph")

        def row(name, fn, inputs=sets):
            s = gpu_device_time(fn, inputs)
            print(f"  {name:44s} {s * 1e6:7.1f} us  {nb / s / copy:5.2f} of copy", flush=True)
            return s

        row("copy, same tensors (_foreach_copy_)", lambda g: torch._foreach_copy_(dsts[id(g)], g))
        row("copy, same bytes, one tensor", lambda f: f[1].copy_(f[0]), flat)
        row(
            "ATen op, preallocated flag",
            lambda g: torch._amp_foreach_non_finite_check_and_unscale_(g, flag, inv),
        )
        row(
            "ATen op + torch.zeros flag",
            lambda g: torch._amp_foreach_non_finite_check_and_unscale_(
                g, torch.zeros((), device=DEVICE), inv
            ),
        )
        for block, warps in ((4096, 8), (2048, 4), (8192, 8), (8192, 16), (16384, 16)):
            us._BLOCK, us._NUM_WARPS = block, warps
            us._META_CACHE.clear()
            versions = {
                "v1": lambda g, t: v1_unscale(g, inv, t, block, warps),
                "v2": lambda g, t: us.unscale_and_check_triton(g, inv),
                "v3": lambda g, t: v3_unscale(g, inv, t, block, warps),
            }
            make_table = {"v1": v1_table, "v2": lambda g, b: None, "v3": v3_table}
            for version, fn in versions.items():
                check(version, lambda g: fn(g, {id(g): make_table[version](g, block)}), sets[0], inv)
                tables = {id(g): make_table[version](g, block) for g in sets}
                fill = " (no fill)" if version == "v3" else ""
                row(f"{version} block {block} warps {warps}{fill}", lambda g: fn(g, tables))
            row(f"v2 block {block} warps {warps}, check only",
                lambda g: us.check_finite_triton(g, torch.device(DEVICE)))  # fmt: skip
        us._BLOCK, us._NUM_WARPS = 4096, 8
        us._META_CACHE.clear()
        tables = {id(g): v1_table(g, 4096) for g in sets}
        tables3 = {id(g): v3_table(g, 4096) for g in sets}
        for name, fn, inputs in (
            ("copy, same tensors", lambda g: torch._foreach_copy_(dsts[id(g)], g), sets),
            ("copy, one tensor", lambda f: f[1].copy_(f[0]), flat),
            ("ATen op", lambda g: torch._amp_foreach_non_finite_check_and_unscale_(g, flag, inv), sets),
            ("v1 4096/8", lambda g: v1_unscale(g, inv, tables, 4096, 8), sets),
            ("v2 4096/8", lambda g: us.unscale_and_check_triton(g, inv), sets),
            ("v3 4096/8", lambda g: v3_unscale(g, inv, tables3, 4096, 8), sets),
        ):
            kernels = kernel_us(fn, inputs)
            total = sum(kernels.values())
            detail = ", ".join(f"{k} {v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]))
            frac = nb / (total * 1e-6) / copy
            print(f"  kernels only, {name:20s} {total:7.1f} us  {frac:5.2f} of copy  [{detail}]", flush=True)


if __name__ == "__main__":
    main()
