"""Run every ``benchmarks/bench_*.py`` in turn (``make bench``); each writes its own sections of RESULTS.md.

Usage: ``python benchmarks/run_all.py [--only NAME ...] [--quick]``. ``NAME`` is a script's name
without ``bench_`` and ``.py`` (e.g. ``stats``); ``--quick`` passes ``--quick`` to every script (a
smoke run: prints its tables, writes only where ``$BENCH_RESULTS`` points). Exits non-zero when a
script failed, after running the others.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import run_each  # benchmarks/ is sys.path[0] when a script runs

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
    flag = ["--quick"] if args.quick else []
    commands = {s.name: [sys.executable, str(s), *flag] for s in scripts}
    return run_each(commands, HERE.parent)


if __name__ == "__main__":
    raise SystemExit(main())
