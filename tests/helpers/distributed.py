"""Run a function on N spawned gloo workers on CPU (the harness every distributed test uses).

``run_distributed(fn, world_size, *args, **kwargs)`` spawns ``world_size`` processes, each of
which initializes a gloo process group through a private file store, calls
``fn(rank, world_size, *args, **kwargs)`` and sends its return value back. The parent returns
the list of per-rank results (index = rank). Any worker exception is re-raised in the parent
with the failing rank and its traceback; if the workers do not finish within ``timeout``
seconds they are all killed and ``TimeoutError`` names the ranks that hung, so a deadlocked
collective fails the test instead of stalling CI.

Clean exit: after ``fn`` returns, a worker clears the pack's process-wide state
(:func:`lightning_ext.reset`; collectors' settings hold process groups), waits at a barrier until
every rank has finished its collectives, destroys every process group, and only then reports.
``destroy_process_group()`` only unregisters the groups: their gloo threads are joined when the
last reference to a group (or to one of its work handles) dies. A gloo thread still running at
interpreter exit can release a finished work's tensors while the interpreter is torn down, which
aborts the process ("terminate called without an active exception", pytorch/pytorch#179291). So a
worker whose gloo threads outlive the teardown fails the test, naming what still holds a group,
and the parent checks that every worker then exits with status 0.

``groups_outlive=True`` is for code outside this project that keeps a process group referenced
(torch's FSDP does, from C++): the leak is then expected, and the worker leaves with ``os._exit``
right after reporting, so no gloo thread runs during an interpreter teardown.

``fn`` must be importable from a module (a top-level function of a test module), and its
return value must be picklable by ``torch.save`` (tensors, numbers, containers of them).
"""

from __future__ import annotations

import gc
import io
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import signal
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_distributed"]

_EXIT_GRACE = 30.0  # seconds a worker may take to exit after its result arrived
_THREAD_EXIT_GRACE = 2.0  # seconds for joined gloo threads to leave /proc/self/task


def _gloo_threads() -> list[str]:
    """Names of this process's gloo threads (``pt_gloo_runloop`` workers, ``gloo_tcp_loop``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # exited meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def _teardown(success: bool) -> str | None:
    """Destroy every process group of this worker; an error message if a gloo thread outlives them.

    On success the ranks first meet at a barrier (gloo's waits for this rank's earlier work on the
    group), so no rank closes its connections while a peer still finishes a collective with it.
    After a failure there is no barrier: the other ranks may be blocked in a collective, and the
    parent kills them.
    """
    import lightning_ext

    lightning_ext.reset()  # collectors' settings and shared-memory segments hold process groups
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if success:
        dist.barrier()
    groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]
    dist.destroy_process_group()  # every group, the default one included
    gc.collect()  # cycles that hold a group or one of its work handles
    # A joined thread leaves /proc an instant after join() returns: give it a moment.
    deadline = time.monotonic() + _THREAD_EXIT_GRACE
    while (threads := _gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not threads:
        return None
    alive = [group for group in (ref() for ref in groups) if group is not None]
    holders = set()
    for group in alive:
        holders.update(type(r).__name__ for r in gc.get_referrers(group) if r is not alive)
    return (
        f"gloo threads {threads} still run after destroy_process_group(): "
        f"{len(alive)} process group(s) are still referenced (by objects of type {sorted(holders)}), "
        "or a work handle is. They would outlive the interpreter: drop such references (module "
        "state, async work handles) before the test function returns."
    )


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: mp.Queue,
    groups_outlive: bool,
) -> None:
    torch.set_num_threads(1)
    # torch._dynamo, imported lazily by the first optimizer step, keeps references to the process
    # groups that exist when it is imported: import it before there are any.
    import torch._dynamo as _dynamo  # noqa: F401

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            # Longer than the harness timeout, so the harness names the hung ranks first.
            timeout=timedelta(seconds=timeout + 60),
        )
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args, **kwargs), buffer)
    except BaseException:
        # Report first (flushed to the pipe), then tear down: that closes this rank's connections,
        # which fails the peers' pending collectives, and their errors must not arrive before this one.
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()
        _teardown(success=False)
        return
    try:
        leak = _teardown(success=True)
    except BaseException:
        leak = traceback.format_exc()
    if leak is None or groups_outlive:
        results.put((rank, "ok", buffer.getvalue()))
    else:
        results.put((rank, "error", f"after the test function returned: {leak}"))
    results.close()
    results.join_thread()
    if leak is not None and groups_outlive:
        os._exit(0)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    groups_outlive: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned gloo workers.

    Returns:
        The per-rank return values, index = rank.

    Raises:
        RuntimeError: a worker raised, still referenced a process group after ``fn`` returned, or
            did not exit with status 0 (e.g. killed by a signal); the message names the rank.
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
            args=(rank, world_size, init_file, timeout, fn, args, kwargs, results, groups_outlive),
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
                            f"rank {dead[0]} of {fn.__name__!r} exited with "
                            f"{_describe_exit(procs[dead[0]].exitcode)} without reporting"
                        ) from None
                else:
                    continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {fn.__name__!r} raised:\n{payload}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        # Every rank reported after its teardown: each must now exit by itself, with status 0.
        exit_deadline = time.monotonic() + _EXIT_GRACE
        for rank, proc in enumerate(procs):
            proc.join(timeout=max(exit_deadline - time.monotonic(), 0.0))
            if proc.exitcode != 0:
                state = (
                    "did not exit"
                    if proc.exitcode is None
                    else f"exited with {_describe_exit(proc.exitcode)}"
                )
                raise RuntimeError(
                    f"rank {rank} of {fn.__name__!r} {state} after reporting its result "
                    f"(within {_EXIT_GRACE:.0f}s): a worker must exit cleanly"
                )
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
