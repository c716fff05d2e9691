"""Run one benchmark script on an earlier revision and on the working tree, interleaved, in one run.

A change that claims to cost nothing (or to be faster) shows it against the code before it on the
same machine in the same minutes: ``--rounds`` alternations of (base, ours), each a fresh process of
the same interpreter, so both see the same load. The base revision is checked out as a git worktree
under ``runs/compare/<rev>`` (kept for the next run) and imported from there (``PYTHONPATH``); its
``cpu`` kernel backend builds into the same cache under its own key. Each run's output goes to the
screen and to ``runs/compare/<script>-<label>-<round>.txt``; ``BENCH_RESULTS`` points every run at a
scratch file, so ``benchmarks/RESULTS.md`` is not rewritten.

Usage: ``python benchmarks/compare_revisions.py REV SCRIPT [ARGS ...] [--rounds N]``, e.g.
``python benchmarks/compare_revisions.py HEAD~3 bench_stats.py --flush-only --rounds 3``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worktree(rev: str) -> Path:
    """A checkout of ``rev`` under ``runs/compare/`` (created once, moved to ``rev`` each time)."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True)
    sha = commit.stdout.strip()
    path = ROOT / "runs" / "compare" / sha[:12]
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True)
    return path


def _run(tree: Path, script: str, args: list[str], out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree), BENCH_RESULTS=str(out.with_suffix(".md")))
    with open(out, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(tree / "benchmarks" / script), *args],
            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        log.write(proc.stdout)
    print(f"===== {out.name} (exit {proc.returncode}) =====\n{proc.stdout}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the base revision (anything git rev-parse takes)")
    parser.add_argument("script", help="a benchmark script's file name, e.g. bench_stats.py")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of (base, ours)")
    args, rest = parser.parse_known_args()
    base = _worktree(args.rev)
    out_dir = ROOT / "runs" / "compare"
    for i in range(args.rounds):
        for label, tree in (("base", base), ("ours", ROOT)):
            _run(tree, args.script, rest, out_dir / f"{Path(args.script).stem}-{label}-{i}.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
