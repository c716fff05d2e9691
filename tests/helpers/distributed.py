"""Run a function on N spawned gloo workers on CPU (the harness every distributed test uses).

``run_distributed(fn, world_size, *args, **kwargs)`` spawns ``world_size`` processes, each of
which initializes a gloo process group through a private file store, calls
``fn(rank, world_size, *args, **kwargs)`` and sends its return value back. The parent returns
the list of per-rank results (index = rank). Any worker exception is re-raised in the parent
with the failing rank and its traceback; if the workers do not finish within ``timeout``
seconds they are all killed and ``TimeoutError`` names the ranks that hung, so a deadlocked
collective fails the test instead of stalling CI.

``fn`` must be importable from a module (a top-level function of a test module), and its
return value must be picklable by ``torch.save`` (tensors, numbers, containers of them).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_distributed"]


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: mp.Queue,
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            # Longer than the harness timeout, so the harness names the hung ranks first.
            timeout=timedelta(seconds=timeout + 60),
        )
        value = fn(rank, world_size, *args, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned gloo workers.

    Returns:
        The per-rank return values, index = rank.

    Raises:
        RuntimeError: a worker raised; the message names the rank and holds its traceback.
        TimeoutError: the workers did not all finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="lightning_ext_dist_")
    init_file = os.path.join(store_dir, "store")
    env_backup = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, init_file, timeout, fn, args, kwargs, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        outputs: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                hung = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(
                    f"distributed test {fn.__name__!r} timed out after {timeout:.0f}s; "
                    f"ranks {hung} did not finish (likely a collective that not every rank called)"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]
                if dead:
                    # A worker died without reporting (e.g. killed by a signal); give the
                    # queue a moment in case its message is still in flight.
                    try:
                        rank, status, payload = results.get(timeout=2.0)
                    except queue_module.Empty:
                        raise RuntimeError(
                            f"rank {dead[0]} of {fn.__name__!r} exited with code "
                            f"{procs[dead[0]].exitcode} without reporting"
                        ) from None
                else:
                    continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {fn.__name__!r} raised:\n{payload}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for proc in procs:
            proc.join(timeout=10)
        return [outputs[rank] for rank in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        if env_backup is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_backup
        shutil.rmtree(store_dir, ignore_errors=True)
