"""Shared plumbing for the benchmark scripts: where results go and what machine measured them.

Each ``bench_*.py`` prints its table and calls :func:`write_result` with a Markdown section;
``run_all.py`` runs every script and joins the sections into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_description() -> str:
    """One line naming the CPU/GPU, core count and library versions the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    import lightning

    return (
        f"{cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}, "
        f"lightning {lightning.__version__}, Python {platform.python_version()}"
    )


def write_result(name: str, markdown: str) -> Path:
    """Write one benchmark's Markdown section to ``benchmarks/results/<name>.md``."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.md"
    path.write_text(f"{markdown.rstrip()}\n\n_Measured on: {machine_description()}._\n")
    return path


def align_ranks() -> None:
    """Untimed: start the next timed region on every rank together.

    A shared-memory all_reduce (``lightning_ext.shm_collectives``) releases the ranks ~20 µs apart;
    a gloo barrier can release them milliseconds apart, which the first collective of the timed
    region would absorb. Falls back to the barrier where the shared-memory path is off.
    """
    import torch.distributed as dist

    from lightning_ext import shm_collectives

    if shm_collectives.shm_available():
        shm_collectives.all_reduce(torch.zeros(1))
    else:
        dist.barrier()


def anchored_pairs(items: list) -> list[tuple]:
    """One interleaved iteration: ``[a, b, c]`` -> ``[(a, b), (a, c)]``, run in that order (a b a c).

    ``items[0]`` is the anchor (the implementation we compare against): it runs right before every
    other entry, so each other entry always follows the anchor and the anchor always follows another
    entry; no entry follows itself or a variant sharing its code, whose caches its own previous step
    would have left warm. Pair each entry's time with the anchor run just before it (slow machine
    drift cancels). A forward-then-reverse order (A B C C B A) instead let the outer entries follow
    themselves half the time and the middle one never: in ``bench_loss_scaling.py`` on a 2-core
    machine "ours + telemetry" (more work, an outer entry) came out 1.5-6% faster than "ours" (the
    middle one) on the SGD rows.
    """
    return [(items[0], other) for other in items[1:]]
