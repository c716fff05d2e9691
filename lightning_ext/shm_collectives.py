"""Low-latency ``all_reduce`` of small CPU tensors among processes of one host, through shared memory.

Why: a gloo ``all_reduce`` of a few hundred numbers between two processes on one machine takes
0.3-0.5 ms median and 2-4 ms at p90 on a 2-core VM (``benchmarks/bench_shm_collectives.py``; a
worker-thread hand-off, TCP loopback and several wake-ups per call), while the same exchange
through shared memory takes 18-35 µs (p90 under 0.1 ms). Layers that reduce a little on every step
(:class:`lightning_ext.nn.SyncBatchNorm`: one call per layer and direction;
:class:`lightning_ext.stats.Collector`) are bound by that latency on
CPU. This follows the shared-memory all-reduce DeepSpeed uses for CPU ranks of one node
(``deepspeed/csrc/cpu/comm/shm.cpp``): each rank writes its buffer into its slot of a shared
segment, raises a per-rank sequence counter, waits until every counter has reached the same
sequence, and reduces the slots itself, in rank order, so every rank computes the bitwise same
result.

Shared state per process group, created lazily at the first call on that group (a collective over
the group, once): group rank 0 creates a file in ``/dev/shm`` (Linux; elsewhere there is no
shared-memory path), broadcasts its path and a random token through the group, every rank maps it
(``torch.from_file(shared=True)``), checks the token and writes its process id, one gloo
``all_reduce(MIN)`` agrees that all ranks could, a second that every rank sees every other rank's
process (so a waiter can tell a dead peer from a slow one); rank 0 unlinks the file (the mappings
stay). If any rank cannot (another host, another pid namespace), the group keeps using its own
``all_reduce``. Layout::

    header: per rank one 64-byte cache line (no false sharing): int64 sequence counter, int64 pid
    data:   2 (double buffer by sequence parity) x W slots x _SLOT_BYTES

Double buffering makes one counter per rank enough: a rank writes buffer ``s % 2`` for sequence
``s`` only after it saw every counter reach ``s - 1``, i.e. after every rank finished reading
buffer ``s % 2`` for sequence ``s - 2``.

Used only where it is correct and useful: dense CPU tensors of at most ``_SLOT_BYTES`` bytes,
a gloo group of several ranks, outside ``torch.compile`` tracing, on x86-64 (whose total store
order makes the counter visible only after the data; other architectures use gloo), and unless
``LIGHTNING_EXT_SHM_COLLECTIVES=0`` (set it on every rank or none). The choice depends only on
what every rank of the group shares (sizes, dtypes, group, platform; not the memory layout), so all
ranks take the same path. A rank waits with
``os.sched_yield`` then short sleeps and raises ``RuntimeError`` naming the missing ranks after
``timeout`` seconds (the group's default, 30 min) instead of hanging forever; while it sleeps it
checks every 0.5 s that the ranks it waits for still run, and raises at once if one exited (as
gloo does when a peer's socket closes).
"""

from __future__ import annotations

import os
import platform
import secrets
import threading
import time
import uuid
import weakref
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["all_reduce", "shm_available"]

_SLOT_BYTES = 1 << 17  # 128 KiB per rank and buffer: larger tensors go through the process group
_LINE = 64  # bytes per sequence counter (one cache line each)
_ENV = "LIGHTNING_EXT_SHM_COLLECTIVES"  # "0" disables the shared-memory path
_SPIN_YIELDS = 20_000  # sched_yield polls before the waiter starts sleeping (~20-50 ms)
_TIMEOUT = timedelta(minutes=30)  # gloo's default collective timeout
_LIVENESS_PERIOD = 0.5  # seconds between checks, while sleeping, that the missing ranks still run
_X86 = platform.machine().lower() in ("x86_64", "amd64")

_groups: weakref.WeakKeyDictionary[Any, _ShmGroup | None] = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


class _Done:
    """Completed-work handle returned for ``async_op=True`` on the shared-memory path."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ShmGroup:
    """Shared segment of one process group: sequence counters and double-buffered rank slots."""

    def __init__(self, storage: torch.Tensor, rank: int, world_size: int, pids: list[int]) -> None:
        self.rank = rank
        self.pids = pids  # process id of every rank (a waiter checks that missing ranks still run)
        self.world_size = world_size
        header = world_size * _LINE
        # (W,) int64 counters, 64 bytes apart, read and written as aligned 8-byte words.
        self.counters = storage[:header].view(torch.int64)[:: _LINE // 8]
        self.counters_np = self.counters.numpy()
        self.data = storage[header:].view(2, world_size, _SLOT_BYTES)  # (buffer, rank, bytes) uint8
        self.data_np = self.data.numpy()
        self.seq = int(self.counters[rank])
        self.lock = threading.Lock()
        self._cache: dict[tuple[Any, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._cache_np: dict[tuple[Any, ...], tuple[np.ndarray, list[np.ndarray]]] = {}
        self.timeout = _TIMEOUT.total_seconds()

    def _wait_all(self, seq: int) -> None:
        counters = self.counters_np
        polls = 0
        deadline = next_check = None
        sleep = 1e-5
        while min(counters.tolist()) < seq:
            polls += 1
            if polls < _SPIN_YIELDS:
                os.sched_yield()
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
                next_check = now
            if now >= next_check:  # a dead peer fails the wait now, as a closed gloo socket would
                next_check = now + _LIVENESS_PERIOD
                missing = [r for r in range(self.world_size) if counters[r] < seq]
                dead = [r for r in missing if not _process_alive(self.pids[r])]
                if dead:
                    raise RuntimeError(
                        f"shared-memory all_reduce #{seq}: group ranks {dead} (pids "
                        f"{[self.pids[r] for r in dead]}) exited without joining it"
                    )
            if now > deadline:
                missing = [r for r in range(self.world_size) if counters[r] < seq]
                raise RuntimeError(
                    f"shared-memory all_reduce #{seq} timed out after {self.timeout:.0f}s waiting for "
                    f"group ranks {missing}: every rank of the group must call the same collectives "
                    "in the same order"
                )
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)

    def _views(self, parity: int, tensor: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(this rank's slot as flat uint8, every rank's slot viewed like ``tensor``) of a buffer, cached."""
        key = (parity, tensor.dtype, tensor.shape)
        views = self._cache.get(key)
        if views is None:
            if len(self._cache) > 256:
                self._cache.clear()
            nbytes = tensor.numel() * tensor.element_size()
            slots = self.data[parity, :, :nbytes]  # (W, nbytes) uint8
            values = slots.view(tensor.dtype).view(self.world_size, *tensor.shape)
            views = self._cache[key] = (slots[self.rank], [values[r] for r in range(self.world_size)])
        return views

    def _views_np(self, parity: int, dtype: np.dtype, numel: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """:meth:`_views` as NumPy arrays, for the common dense NumPy-typed tensor, cached."""
        key = (parity, dtype, numel)
        views = self._cache_np.get(key)
        if views is None:
            if len(self._cache_np) > 256:
                self._cache_np.clear()
            slots = self.data_np[parity, :, : numel * dtype.itemsize]  # (W, nbytes) uint8
            values = slots.view(dtype)  # (W, numel)
            views = self._cache_np[key] = (slots[self.rank], [values[r] for r in range(self.world_size)])
        return views

    def all_reduce_(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        # Dense tensors of NumPy dtypes move and combine through NumPy views (about a microsecond per
        # call each, against a few for a torch op: this path is latency-bound). Both paths compute
        # the same IEEE operations in rank order, so ranks taking different paths (a non-contiguous
        # tensor on one of them) still agree bit for bit.
        host = None
        if tensor.dtype in _NUMPY_DTYPES and tensor.is_contiguous() and not tensor.requires_grad:
            host = tensor.numpy().reshape(-1)
        with self.lock:
            self.seq += 1
            seq = self.seq
            if host is not None:
                mine_np, rows_np = self._views_np(seq % 2, host.dtype, host.size)
                np.copyto(mine_np, host.view(np.uint8))
            else:
                mine, rows = self._views(seq % 2, tensor)
                mine.copy_(tensor.reshape(-1).view(torch.uint8))
            self.counters_np[self.rank] = seq  # publish: one aligned 8-byte store, after the data
            self._wait_all(seq)
            # Rank order on every rank: bitwise identical results everywhere.
            if host is not None:
                ufunc = _NUMPY_UFUNCS[op]
                ufunc(rows_np[0], rows_np[1], out=host)
                for row in rows_np[2:]:
                    ufunc(host, row, out=host)
                return
            tensor.copy_(rows[0])
            for row in rows[1:]:
                _combine_(tensor, row, op)


def _combine_(acc: torch.Tensor, other: torch.Tensor, op: dist.ReduceOp) -> None:
    if op == dist.ReduceOp.SUM:
        acc.add_(other)
    elif op == dist.ReduceOp.MAX:
        torch.maximum(acc, other, out=acc)
    elif op == dist.ReduceOp.MIN:
        torch.minimum(acc, other, out=acc)
    elif op == dist.ReduceOp.PRODUCT:
        acc.mul_(other)
    else:  # pragma: no cover - filtered by _eligible
        raise AssertionError(op)


_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)
_NUMPY_UFUNCS = {
    dist.ReduceOp.SUM: np.add,
    dist.ReduceOp.MAX: np.maximum,  # propagates NaN, as torch.maximum
    dist.ReduceOp.MIN: np.minimum,
    dist.ReduceOp.PRODUCT: np.multiply,
}
# Dtypes whose NumPy arithmetic is torch's (float16 included: both round the float32 result).
_NUMPY_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
)


def _shm_dir() -> str | None:
    """``/dev/shm`` (host-local memory on Linux); ``None`` elsewhere: no shared-memory path, since a
    temp dir could be a network file system whose mappings are not coherent across hosts."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _create(group: Any) -> _ShmGroup | None:
    """Collective over ``group``: map one shared segment on every rank, or agree that it cannot be done.

    Four collectives, once per group: broadcast (path, token), MIN all_reduce (every rank mapped the
    segment, saw the token and wrote its pid), MIN all_reduce (every rank sees every other rank's
    process, so a waiter can tell a dead peer from a slow one), barrier (the token is cleared).
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    size = world_size * _LINE + 2 * world_size * _SLOT_BYTES
    storage = None
    info: list[Any] = [None]
    shm_dir = _shm_dir()
    if rank == 0 and shm_dir is not None:
        path = os.path.join(shm_dir, f"lightning_ext_shm_{uuid.uuid4().hex}")
        token = secrets.randbits(62)
        try:
            # Reserve the pages first: a tmpfs that is too small fails here with ENOSPC, not with a
            # SIGBUS at the first write into the mapping.
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            storage = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            storage[:8].view(torch.int64).fill_(token)  # in rank 0's counter, cleared before first use
            info = [(path, token)]
        except (OSError, RuntimeError):
            info = [None]
            try:
                os.unlink(path)
            except OSError:
                pass
    dist.broadcast_object_list(info, src=dist.get_global_rank(group, 0), group=group)
    ok = info[0] is not None
    if ok and rank != 0:
        path, token = info[0]
        try:
            ok = os.path.getsize(path) == size
            if ok:
                storage = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                ok = int(storage[:8].view(torch.int64)) == token
        except (OSError, RuntimeError):
            ok = False
    if ok:
        _pid_words(storage, world_size)[rank] = os.getpid()
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # everyone has read the token
    if rank == 0 and info[0] is not None:
        try:
            os.unlink(info[0][0])  # the mappings stay valid; nothing is left behind on disk
        except OSError:
            pass
    if not int(flag):
        return None
    pids = _pid_words(storage, world_size).tolist()
    flag.fill_(1 if all(_process_alive(pid) for pid in pids) else 0)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # e.g. separate pid namespaces: gloo
    if not int(flag):
        return None
    if rank == 0:
        storage[:8].zero_()  # the token shared rank 0's counter
    dist.barrier(group=group)  # nobody publishes before rank 0 cleared its counter
    return _ShmGroup(storage, rank, world_size, pids)


def _pid_words(storage: torch.Tensor, world_size: int) -> torch.Tensor:
    """(W,) int64 view of the second word of each rank's header line: that rank's process id."""
    return storage[: world_size * _LINE].view(torch.int64)[1 :: _LINE // 8]


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X", b"x")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _shm_group(group: Any) -> _ShmGroup | None:
    with _groups_lock:
        if group in _groups:
            return _groups[group]
    state = _create(group)
    with _groups_lock:
        _groups[group] = state
    return state


def _eligible(tensor: torch.Tensor, op: Any, group: Any) -> bool:
    return (
        not torch.compiler.is_compiling()
        and _X86
        and os.environ.get(_ENV, "1") != "0"
        and tensor.device.type == "cpu"
        and not tensor.is_sparse
        and tensor.numel() * tensor.element_size() <= _SLOT_BYTES
        and op in _OPS
        and dist.get_world_size(group) > 1
        and "gloo" in str(dist.get_backend(group)).lower()
    )


def shm_available(group: dist.ProcessGroup | None = None) -> bool:
    """Whether :func:`all_reduce` over ``group`` (default: WORLD) takes the shared-memory path.

    Returns ``False`` when ``torch.distributed`` is not initialized, the group has one rank or is
    not gloo, on non-x86-64 machines, with ``LIGHTNING_EXT_SHM_COLLECTIVES=0``, or when the
    segment could not be set up on every rank. The first call for a group sets the segment up: a
    collective over ``group`` (a broadcast, two all_reduces, a barrier) that every rank must join;
    later calls are local. No host-device sync; raises nothing of its own.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    group = group if group is not None else dist.group.WORLD
    probe = torch.zeros(1)
    return _eligible(probe, dist.ReduceOp.SUM, group) and _shm_group(group) is not None


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``torch.distributed.all_reduce`` with a shared-memory fast path for small CPU tensors.

    Same contract as ``torch.distributed.all_reduce``: every rank of ``group`` calls it in the same
    order with a tensor of the same shape and dtype; ``tensor`` is reduced in place. Eligible calls
    (module docstring: dense CPU, <= 128 KiB, gloo, x86-64, ``SUM``/``MAX``/``MIN``/``PRODUCT``)
    exchange through shared memory and reduce in rank order, so the result is bitwise identical on
    every rank (it may differ from gloo's own summation order in the last bits); the others go
    to ``torch.distributed.all_reduce`` unchanged. The first eligible call on a group sets the segment
    up (a broadcast, two all_reduces and a barrier over the group, once).

    Args:
        tensor: tensor of any shape and dtype on the group's collective device; reduced in place.
        op: ``torch.distributed.ReduceOp``.
        group: process group (default: WORLD).
        async_op: return a work handle (already completed on the shared-memory path).

    Returns:
        ``None``, or a handle with ``wait()`` when ``async_op``.

    Raises:
        RuntimeError: a rank did not join within the timeout (30 min), or its process exited;
            the message names the ranks.

    Synchronizes only the ranks (no host-device sync: the tensors are on the CPU).
    """
    group = group if group is not None else dist.group.WORLD
    if _eligible(tensor, op, group):
        state = _shm_group(group)
        if state is not None:
            if tensor.numel():
                state.all_reduce_(tensor, op)
            return _Done() if async_op else None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
