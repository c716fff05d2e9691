"""A shared-memory segment per process group: the ``all_reduce`` of small CPU tensors of one host.

After DeepSpeed's shared-memory all-reduce for CPU ranks of one node (``deepspeed/csrc/cpu/comm/shm.cpp``),
which skips gloo's worker thread and TCP loopback: each rank writes its tensor into its slot, raises
its sequence counter, waits until every counter reached that sequence and reduces the slots itself,
in rank order, so every rank computes the bitwise same result.

Set-up, once per group (``_create``, a collective): group rank 0 creates a ``/dev/shm`` file, maps it
and unlinks it at once (nothing outlives the process, whatever happens next), then broadcasts the path
of its open file descriptor (``/proc/<pid>/fd/<fd>``), a random token and its host name; the other
ranks map that path (``torch.from_file(shared=True)``) only on the same host and when the token reads
back; two ``all_reduce(MIN)`` agree that every rank could and that every rank sees every other rank's
process (so a waiter can tell a dead peer from a slow one). Any failure gives ``None`` on every rank:
the group keeps its own ``all_reduce``. Layout::

    header: per rank one 64-byte cache line (no false sharing), int64 words:
            sequence counter, pid, descriptor of the even sequence, descriptor of the odd sequence
    data:   2 (double buffer by sequence parity) x W slots x _SLOT_BYTES

Every reduction writes its descriptor (what the ranks must agree on: op, dtype, layout, element count;
see ``agreement._descriptor``) into its header line, and its data into its slot when it fits, then
publishes its counter; each rank reads every descriptor before it reduces, so a disagreement raises on
every rank and a tensor too large for a slot goes to the process group on every rank alike. A rank
writes buffer ``s % 2`` (data and descriptor) for sequence ``s`` only after every counter reached
``s - 1``, i.e. every rank finished reading that buffer at ``s - 2``. The counter is published after the
data by one aligned 8-byte store, which x86-64's total store order makes visible after it (others use
gloo).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__: list[str] = []  # the transport of all_reduce_: private, used through it only

_SLOT_BYTES = 1 << 17  # 128 KiB per rank and buffer: larger tensors go through the process group
_LINE = 64  # bytes per rank header line: int64 sequence counter, pid, descriptor by sequence parity (2)
_SPIN_SECONDS = 0.02  # a waiter polls with sched_yield this long, then sleeps between polls
_LIVENESS_PERIOD = 0.5  # seconds between checks, while sleeping, that the missing ranks still run


class _ShmGroup:
    """The shared segment of one process group.

    Args:
        storage: uint8 tensor mapping the segment (``W * 64 + 2 * W * _SLOT_BYTES`` bytes).
        rank, world_size: this process's rank in the group and the group's size.
        pids: process id of every rank (a waiter checks that missing ranks still run).
        timeout: seconds a reduction waits for the other ranks (the process group's timeout).
    """

    def __init__(
        self, storage: torch.Tensor, rank: int, world_size: int, pids: list[int], timeout: float
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.pids = pids
        header = world_size * _LINE
        # (W, 8) int64 header words as NumPy: a scalar store or a column read there costs a fraction of
        # torch's indexing, on the path of every reduction
        self.words = storage[:header].numpy().view(np.int64).reshape(world_size, _LINE // 8)
        self.counters = self.words[:, 0]  # (W,) int64, 64 bytes apart
        self.data = storage[header:].view(2, world_size, _SLOT_BYTES)  # (buffer, rank, bytes) uint8
        self.seq = int(self.counters[rank])
        self.lock = threading.Lock()
        self.timeout = timeout
        self._views_cache: dict[tuple[int, torch.dtype, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def all_reduce_(self, tensor: torch.Tensor, op: dist.ReduceOp, descriptor: int) -> list[int]:
        """Publish ``descriptor`` and, when ``_fits(tensor, op)``, reduce ``tensor`` (CPU, contiguous) in
        place.

        Returns:
            Every rank's descriptor, index = group rank. The reduction happened only when they are all
            equal to ``descriptor`` and ``tensor`` fits; otherwise ``tensor`` is unchanged.

        Raises:
            RuntimeError: a rank did not join within ``timeout`` seconds, or its process exited.
        """
        in_slot = _fits(tensor, op) and tensor.numel() > 0
        flat = tensor.view(-1) if in_slot else tensor
        with self.lock:
            self.seq += 1
            parity = self.seq % 2
            if in_slot:
                mine, rows = self._views(parity, flat)
                mine.copy_(flat.view(torch.uint8))
            self.words[self.rank, 2 + parity] = descriptor
            self.counters[self.rank] = self.seq  # publish after the data and the descriptor: one 8-byte store
            self._wait_all(self.seq)
            descriptors = self.words[:, 2 + parity].tolist()
            if not in_slot or descriptors.count(descriptor) != self.world_size:
                return descriptors
            reduce = _REDUCE[op]
            reduce(rows[0], rows[1], out=flat)  # rows combined in rank order on every rank
            for row in rows[2:]:
                reduce(flat, row, out=flat)
        return descriptors

    def _views(self, parity: int, flat: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(this rank's slot as bytes, every rank's slot as ``flat``'s elements) of one buffer, cached."""
        key = (parity, flat.dtype, flat.numel())
        views = self._views_cache.get(key)
        if views is None:
            if len(self._views_cache) >= 64:
                self._views_cache.clear()
            slots = self.data[parity, :, : flat.numel() * flat.element_size()]  # (W, nbytes)
            rows = slots.view(flat.dtype)  # (W, numel)
            views = self._views_cache[key] = (slots[self.rank], [rows[r] for r in range(self.world_size)])
        return views

    def _wait_all(self, seq: int) -> None:
        """Until every rank's counter reached ``seq``; the timeout counts from the call, whatever the
        load (a count of polls would not: on a busy host each ``sched_yield`` can take milliseconds)."""
        start = time.monotonic()
        deadline, next_check, sleep = start + self.timeout, start + _SPIN_SECONDS, 1e-5
        while min(self.counters.tolist()) < seq:
            now = time.monotonic()
            if now < start + _SPIN_SECONDS:
                os.sched_yield()
                continue
            missing = [r for r, s in enumerate(self.counters.tolist()) if s < seq]
            if now >= next_check:  # a dead peer fails the wait now, as a closed gloo socket would
                next_check = now + _LIVENESS_PERIOD
                dead = [r for r in missing if not _process_alive(self.pids[r])]
                if dead:
                    raise RuntimeError(
                        f"shared-memory all_reduce #{seq}: group ranks {dead} (pids "
                        f"{[self.pids[r] for r in dead]}) exited without joining it"
                    )
            if now > deadline:
                raise RuntimeError(
                    f"shared-memory all_reduce #{seq} timed out after {self.timeout:.0f}s waiting for "
                    f"group ranks {missing}: every rank of the group must call the same collectives "
                    "in the same order"
                )
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)


_REDUCE = {  # ReduceOp -> out-of-place op taking out=
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
    dist.ReduceOp.PRODUCT: torch.mul,
}


def _fits(tensor: torch.Tensor, op: Any) -> bool:
    """Whether a segment reduces ``tensor`` by ``op`` itself: a strided tensor of at most ``_SLOT_BYTES``
    bytes, reduced by SUM, MAX, MIN or PRODUCT (ranks that agree on op, dtype, layout and element count
    agree on this)."""
    nbytes = tensor.numel() * tensor.element_size()
    return tensor.layout == torch.strided and nbytes <= _SLOT_BYTES and op in _REDUCE


def _create(group: Any, timeout: float) -> _ShmGroup | None:
    """Collective over ``group``: map one shared segment on every rank, or agree that it cannot be done.

    Four collectives: a broadcast of (path, token, host name), a MIN all_reduce (every rank mapped the
    segment), a MIN all_reduce (every rank sees every other rank's process), a barrier (the token is
    cleared). The file is unlinked before the first of them: a rank that fails or is killed during the
    set-up leaves nothing in ``/dev/shm``.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    size = world_size * _LINE + 2 * world_size * _SLOT_BYTES
    fd, info = _create_file(size) if rank == 0 else (None, [None])
    try:
        dist.broadcast_object_list(info, src=dist.get_global_rank(group, 0), group=group)
        storage = _map(info[0], size) if info[0] is not None else None
        if storage is not None:
            _pid_words(storage, world_size)[rank] = os.getpid()
        ok = _all_ranks_agree(storage is not None, group)
    finally:
        if fd is not None:
            os.close(fd)  # every rank mapped it or gave up: the mappings keep the memory
    if not ok:
        return None
    pids = _pid_words(storage, world_size).tolist()
    if not _all_ranks_agree(all(_process_alive(pid) for pid in pids), group):
        return None
    if rank == 0:
        storage[:8].zero_()  # the token shared rank 0's counter
    dist.barrier(group=group)  # nobody publishes before rank 0 cleared its counter
    return _ShmGroup(storage, rank, world_size, pids, timeout)


def _create_file(size: int) -> tuple[int | None, list[Any]]:
    """Rank 0: an unlinked ``/dev/shm`` file of ``size`` bytes holding a token, kept open.

    Returns:
        ``(fd, [(path, token, host)])`` where ``path`` is ``/proc/<pid>/fd/<fd>`` (the other ranks map
        the file through it), or ``(None, [None])``.
    """
    if not os.path.isdir("/dev/shm"):  # a temp dir could be a network file system: no shared path
        return None, [None]
    path = os.path.join("/dev/shm", f"lightning_ext_shm_{uuid.uuid4().hex}")
    token = secrets.randbits(62)
    fd = None
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve the pages: a full tmpfs fails here, not with a SIGBUS
            storage = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        finally:
            os.unlink(path)  # before any collective: nothing outlives this process
        storage[:8].view(torch.int64).fill_(token)  # in rank 0's counter, cleared before first use
    except (OSError, RuntimeError):
        if fd is not None:
            os.close(fd)
        return None, [None]
    return fd, [(f"/proc/{os.getpid()}/fd/{fd}", token, socket.gethostname())]


def _map(info: tuple[str, int, str], size: int) -> torch.Tensor | None:
    """Map rank 0's file when this rank runs on the same host and reads its token back; else ``None``."""
    path, token, host = info
    try:
        if host != socket.gethostname() or os.path.getsize(path) != size:
            return None
        storage = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    return storage if int(storage[:8].view(torch.int64)) == token else None


def _all_ranks_agree(flag: bool, group: Any, device: torch.device | str = "cpu") -> bool:
    """Collective over ``group``: whether ``flag`` holds on every rank (a MIN all_reduce on ``device``)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value)


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
    except (OSError, IndexError):  # no readable /proc: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's
            pass
        return True
