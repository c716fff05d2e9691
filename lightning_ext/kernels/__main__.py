"""``python -m lightning_ext.kernels``: build the ``cpu`` kernel backend ahead of time.

Builds the compiled extension of :mod:`lightning_ext.kernels.cpu` for this environment unless the
cache holds a verified build of it, then prints where it lives and how long it took; exits 1 with the
reason in one line when it cannot be built or loaded (no C++ compiler, no ``ninja``, a failed
compilation, an untrusted cache, a damaged build in a read-only one). Without it the first process
that needs the backend builds it (about 30 s), and the others on the machine wait for that one. Run
by the owner of a cache that others share read-only, it builds what they load.

Example (a shell; the build key ending the directory's name depends on the environment, see
:mod:`lightning_ext.kernels.cpu`; ``TORCH_EXTENSIONS_DIR`` defaults to
``~/.cache/torch_extensions/py311_cpu``)::

    $ TORCH_EXTENSIONS_DIR=/tmp/ext python -m lightning_ext.kernels
    lightning_ext: cpu kernels built in 27.4 s in /tmp/ext/lightning_ext_kernels_cpu_3f9a1c0b7e2d
    $ TORCH_EXTENSIONS_DIR=/tmp/ext python -m lightning_ext.kernels
    lightning_ext: cpu kernels cached, loaded in 0.1 s from /tmp/ext/lightning_ext_kernels_cpu_3f9a1c0b7e2d
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Build the ``cpu`` kernel backend; the process's exit status.

    Args:
        argv: the command-line arguments (``--verbose``: print the compiler's output); by default
            ``sys.argv[1:]``.

    Returns:
        0 when the extension is built and loads, 1 when it cannot be (the reason on stderr).
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_ext.kernels",
        description="Build the compiled `cpu` kernel backend of lightning_ext ahead of time.",
    )
    parser.add_argument("--verbose", action="store_true", help="print the compiler's output")
    args = parser.parse_args(argv)

    from lightning_ext._compat import extension_build_directory
    from lightning_ext.kernels import cpu

    name = cpu._extension_name()
    start = time.perf_counter()
    try:
        library = extension_build_directory(name) / f"{name}.so"
        cached = library.stat().st_mtime_ns if library.exists() else None
        module = cpu._load(verbose=args.verbose)
    except (RuntimeError, OSError) as error:
        print(
            f"lightning_ext: cannot build the cpu kernels: {error}. Until then automatic selection uses "
            "the `reference` backend for CPU tensors (same results, slower).",
            file=sys.stderr,
        )
        return 1
    seconds = time.perf_counter() - start
    library = Path(module.__file__)
    if library.stat().st_mtime_ns == cached:
        print(f"lightning_ext: cpu kernels cached, loaded in {seconds:.1f} s from {library.parent}")
    else:
        print(f"lightning_ext: cpu kernels built in {seconds:.1f} s in {library.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
