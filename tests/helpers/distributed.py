"""Run a function on N gloo workers on CPU (the harness every distributed test uses).

``run_distributed(fn, world_size, *args, **kwargs)`` calls ``fn(rank, world_size, *args, **kwargs)`` on
``world_size`` processes that share a gloo process group and returns the list of per-rank results
(index = rank). Any worker exception is re-raised in the parent with the failing rank and its
traceback; if the workers do not finish within ``timeout`` seconds ``TimeoutError`` names the ranks
that hung, so a deadlocked collective fails the test instead of stalling CI.

Where it runs (torchmetrics' test suite shares one process pool the same way):

- By default, for 2 or 3 ranks, on a **pool**: one set of workers per world size, started at
  the first call and reused by every later call of the test session, their gloo process group already
  initialized. Before each call a worker takes the parent's environment variables; after it, the
  worker clears the pack's process-wide state (:func:`lightning_ext.reset`), restores its environment
  variables, working directory, default dtype, grad mode and torch's seed, meets the other ranks at a
  barrier and destroys the process groups the call created (one still referenced fails the call). Any
  failure, timeout or interruption kills the pool, so the next call starts a new one: a failing or
  hanging test cannot leave its state to a later one.
- With ``fresh=True`` (and for ``groups_outlive=True``, other world sizes, or a ``timeout`` longer than
  the pool's process group allows), on **fresh processes** started for this call only. A test opts out
  of the pool this way when it kills or crashes a rank, breaks a collective (mismatched calls, a rank
  that never joins, a destroyed group), changes state that :func:`lightning_ext.reset` does not restore
  or that the pack reads at import time, or needs a new process for another reason.

Every worker is forked from one fork server per pytest process that imported torch, ``torch._dynamo``
and Lightning (``_context``): those come imported, as the server found them. A test of their own
import-time behaviour runs an interpreter of its own (``subprocess``).

Clean exit of a fresh worker: after ``fn`` returns, the worker clears the pack's process-wide state,
waits at a barrier until every rank has finished its collectives, destroys every process group, and
only then reports. ``destroy_process_group()`` only unregisters the groups: their gloo threads are
joined when the last reference to a group (or to one of its work handles) dies. A gloo thread still
running at interpreter exit can release a finished work's tensors while the interpreter is torn down,
which aborts the process ("terminate called without an active exception", pytorch/pytorch#179291). So
a fresh worker whose gloo threads outlive the teardown fails the test, naming what still holds a group,
and the parent checks that every worker then exits with status 0. Pool workers leave with ``os._exit``
after destroying their group, so no gloo thread runs during an interpreter teardown.

``groups_outlive=True`` is for code outside this project that keeps a process group referenced
(torch's FSDP does, from C++): the leak is then expected, and the worker leaves with ``os._exit``
right after reporting.

``fn`` must be importable from a module (a top-level function of a test module), and its
return value must be picklable by ``torch.save`` (tensors, numbers, containers of them).
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import shutil
import signal
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_distributed"]

_EXIT_GRACE = 30.0  # seconds a worker may take to exit after its result arrived
_THREAD_EXIT_GRACE = 2.0  # seconds for joined gloo threads to leave /proc/self/task
_POOL_SIZES = (2, 3)  # world sizes served by a pool
_POOL_GROUP_TIMEOUT = 300.0  # seconds: the process group timeout of pool workers
_pools: dict[int, _Pool] = {}  # world size -> its running pool


# ------------------------------------------------------------------------------------ in a worker


def _init_worker(rank: int, world_size: int, init_file: str, group_timeout: float) -> None:
    torch.set_num_threads(1)
    # torch._dynamo, imported lazily by the first optimizer step, keeps references to the process
    # groups that exist when it is imported: import it before there are any.
    import torch._dynamo as _dynamo  # noqa: F401

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=group_timeout),
    )


def _call(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, kwargs: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(fn(rank, world_size, *args, **kwargs), buffer)
    return buffer.getvalue()


def _report(results: mp.Queue, message: tuple) -> None:
    """Put ``message`` and wait until it is flushed to the pipe (before anything can kill this process)."""
    results.put(message)
    results.close()
    results.join_thread()


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


def _fresh_worker(
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
    try:
        # Longer than the harness timeout, so the harness names the hung ranks first.
        _init_worker(rank, world_size, init_file, timeout + 60)
        payload = _call(fn, rank, world_size, args, kwargs)
    except BaseException:
        # Report first, then tear down: that closes this rank's connections, which fails the
        # peers' pending collectives, and their errors must not arrive before this one.
        _report(results, (rank, "error", traceback.format_exc()))
        _teardown(success=False)
        return
    try:
        leak = _teardown(success=True)
    except BaseException:
        leak = traceback.format_exc()
    if leak is None or groups_outlive:
        _report(results, (rank, "ok", payload))
    else:
        _report(results, (rank, "error", f"after the test function returned: {leak}"))
    if leak is not None and groups_outlive:
        os._exit(0)


def _restore_after_call(environ: dict[str, str], cwd: str, seed: int) -> None:
    """Give the next call of a pool worker the state this worker had before the last one."""
    import lightning_ext

    lightning_ext.reset()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.manual_seed(seed)


def _destroy_subgroups() -> None:
    """After a barrier of every rank: destroy the groups a call created; raise if one is still referenced."""
    if not dist.is_initialized():
        raise RuntimeError("the test function destroyed the default process group: call it with fresh=True")
    world = dist.group.WORLD
    refs = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map if group is not world]
    for ref in refs:
        dist.destroy_process_group(ref())
    gc.collect()  # cycles that hold a group or one of its work handles
    if any(ref() is not None for ref in refs):
        raise RuntimeError(
            "a process group the test function created is still referenced after it returned: drop such "
            "references (module state, async work handles) before returning, or call it with fresh=True"
        )


def _pool_worker(
    rank: int, world_size: int, init_file: str, tasks: list[mp.Queue], results: mp.Queue
) -> None:
    _init_worker(rank, world_size, init_file, _POOL_GROUP_TIMEOUT)
    environ, cwd, seed = dict(os.environ), os.getcwd(), torch.initial_seed()
    while (task := tasks[rank].get()) is not None:
        try:
            fn, args, kwargs, parent_environ = pickle.loads(task)
            os.environ.clear()
            os.environ.update(parent_environ)
            payload = _call(fn, rank, world_size, args, kwargs)
            _restore_after_call(environ, cwd, seed)
            dist.barrier()  # every rank finished the call's collectives
            _destroy_subgroups()
        except BaseException:
            # The parent kills the pool at the first error: no teardown, no later call.
            _report(results, (rank, "error", traceback.format_exc()))
            os._exit(1)
        results.put((rank, "ok", payload))
    dist.destroy_process_group()
    os._exit(0)  # no gloo thread may run during an interpreter teardown


# ------------------------------------------------------------------------------------ in the parent


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


def _collect(results: mp.Queue, procs: list[mp.Process], fn: Callable[..., Any], timeout: float) -> list[Any]:
    """The per-rank results of one call of ``fn`` on ``procs``, or the first error of a rank."""
    world_size = len(procs)
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
            if not dead:
                continue
            # A worker died without reporting (e.g. killed by a signal); give the queue a moment in
            # case its message is still in flight.
            try:
                rank, status, payload = results.get(timeout=2.0)
            except queue_module.Empty:
                raise RuntimeError(
                    f"rank {dead[0]} of {fn.__name__!r} exited with "
                    f"{_describe_exit(procs[dead[0]].exitcode)} without reporting"
                ) from None
        if status == "error":
            raise RuntimeError(f"rank {rank} of {fn.__name__!r} raised:\n{payload}")
        outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [outputs[rank] for rank in range(world_size)]


def _context() -> Any:
    """The workers' start method: a fork server that imported torch, ``torch._dynamo`` and Lightning once
    (with ``OMP_NUM_THREADS=1``: no thread runs in it, so forking it is safe). A worker then starts in
    milliseconds instead of the seconds those imports take each spawned process; it is a new process
    that has run nothing else, and takes the parent's environment (``_started``), working directory
    and ``sys.path`` (the start method sends those) at its start."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "lightning.pytorch"])
    return ctx


def _started(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """In a worker: the parent's environment at the start (a forked worker has the fork server's), then
    ``target(*args)``."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def _spawn(world_size: int, target: Callable[..., None], *args: Any) -> tuple[list[mp.Process], str]:
    """Start ``target(rank, world_size, init_file, *args)`` on ``world_size`` worker processes."""
    store_dir = tempfile.mkdtemp(prefix="lightning_ext_dist_")
    init_file = os.path.join(store_dir, "store")
    ctx, environ = _context(), {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        ctx.Process(target=_started, args=(environ, target, rank, world_size, init_file, *args), daemon=True)
        for rank in range(world_size)
    ]
    env_backup = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read when the fork server (its first start) imports torch
    try:
        for proc in procs:
            proc.start()
    finally:
        if env_backup is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_backup
    return procs, store_dir


def _stop(procs: list[mp.Process], store_dir: str) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)
    shutil.rmtree(store_dir, ignore_errors=True)


class _Pool:
    """``world_size`` workers in one gloo group that run one call after another."""

    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results: mp.Queue = ctx.Queue()
        self.procs, self.store_dir = _spawn(world_size, _pool_worker, self.tasks, self.results)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        # Pickled here, so an argument that cannot be pickled raises in the test, not in a queue's thread;
        # once per rank, as a tensor's shared memory is handed over once per pickle.
        task = (fn, args, kwargs, {**os.environ, "OMP_NUM_THREADS": "1"})
        for tasks in self.tasks:
            tasks.put(bytes(ForkingPickler.dumps(task)))
        return _collect(self.results, self.procs, fn, timeout)

    def close(self) -> None:
        """Let the workers leave (destroying their group), then kill what is left."""
        for tasks in self.tasks:
            tasks.put(None)
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.0))
        _stop(self.procs, self.store_dir)


def _close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


atexit.register(_close_pools)


def _run_fresh(
    fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float, groups_outlive: bool
) -> list[Any]:
    results: mp.Queue = _context().Queue()
    procs, store_dir = _spawn(world_size, _fresh_worker, timeout, fn, args, kwargs, results, groups_outlive)
    try:
        outputs = _collect(results, procs, fn, timeout)
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
        return outputs
    finally:
        _stop(procs, store_dir)
        results.close()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    fresh: bool = False,
    groups_outlive: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo workers.

    Args:
        fn: a top-level function of an importable module.
        world_size: the number of ranks, >= 1.
        timeout: seconds the call may take on every rank, process start-up included.
        fresh: run on processes started for this call instead of the pool (see the module docstring).
        groups_outlive: ``fn`` leaves process groups referenced (implies ``fresh``).

    Returns:
        The per-rank return values, index = rank.

    Raises:
        ValueError: ``world_size < 1``.
        RuntimeError: a worker raised, still referenced a process group after ``fn`` returned, or
            did not exit with status 0 (e.g. killed by a signal); the message names the rank.
        TimeoutError: the workers did not all finish within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    pooled = world_size in _POOL_SIZES and timeout + 60 <= _POOL_GROUP_TIMEOUT
    if fresh or groups_outlive or not pooled:
        return _run_fresh(fn, world_size, args, kwargs, timeout, groups_outlive)
    pool = _pools.get(world_size) or _pools.setdefault(world_size, _Pool(world_size))
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:  # an error, a timeout, pytest-timeout or Ctrl-C: the next call starts anew
        del _pools[world_size]
        _stop(pool.procs, pool.store_dir)
        raise
