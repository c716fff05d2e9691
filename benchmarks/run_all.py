"""Run every ``benchmarks/bench_*.py`` in turn (``make bench``); each writes its own sections of RESULTS.md.

Usage: ``python benchmarks/run_all.py [--only NAME ...] [--quick]``. ``NAME`` is a script's name
without ``bench_`` and ``.py`` (e.g. ``stats``); ``--quick`` passes ``--quick`` to every script (a
smoke run: prints its tables, writes only where ``$BENCH_RESULTS`` points). Exits non-zero when a
script failed, after running the others.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only bench_NAME.py")
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script")
    args = parser.parse_args()
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.only:
        unknown = set(args.only) - {s.stem.removeprefix("bench_") for s in scripts}
        if unknown:
            parser.error(f"no benchmark named {sorted(unknown)}; have {[s.stem[6:] for s in scripts]}")
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.only]
    failed = []
    for script in scripts:
        print(f"=== {script.name}", flush=True)
        start = time.perf_counter()
        command = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        rc = subprocess.call(command, cwd=HERE.parent)
        print(f"=== {script.name}: exit {rc} in {time.perf_counter() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
