"""Helpers of the guides' ``testcode`` blocks (``doctest_global_setup`` in conf.py), not of the package."""

from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent


def quiet_lightning() -> None:
    """Keep Lightning's banners and hints ("GPU available", "does not have many workers") out of the
    guides' outputs."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(path: str, *args: str, nproc: int = 2, nnodes: int = 1, timeout: float = 300.0) -> None:
    """Run ``docs/<path> <args>`` with torchrun on CPU processes and print its standard output (the
    scripts print on rank 0 only).

    ``nnodes == 1``: one ``torchrun --standalone --nproc_per_node=<nproc>``. ``nnodes > 1``: that many
    torchrun agents on this machine, each one "node" with ``nproc`` processes, meeting through a c10d
    rendezvous on 127.0.0.1, as on several machines. Raises ``RuntimeError`` with the end of the
    output when an agent fails. A command that already ran in this build (the same script, arguments
    and processes, e.g. ``examples/gan_ddp.py`` in two guides) prints the output of its run again.
    """
    print(_torchrun(path, args, nproc, nnodes, timeout), end="")


@functools.cache  # (a run that raised is not kept)
def _torchrun(path: str, args: tuple[str, ...], nproc: int, nnodes: int, timeout: float) -> str:
    """The standard output of ``run_script``'s torchrun agents, concatenated."""
    script = [str(DOCS / path), *args]
    if nnodes == 1:
        commands = [["--standalone", f"--nproc_per_node={nproc}", *script]]
    else:
        endpoint = f"127.0.0.1:{_free_port()}"
        rendezvous = ["--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=docs"]
        commands = [[f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", *rendezvous, *script]] * nnodes
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for command in commands
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout))
    finally:
        for agent in agents:
            agent.kill()
    for agent, (stdout, stderr) in zip(agents, outputs):
        if agent.returncode != 0:
            raise RuntimeError(
                f"torchrun {path} failed ({agent.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
            )
    return "".join(stdout for stdout, _ in outputs)
