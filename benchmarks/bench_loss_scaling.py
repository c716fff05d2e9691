"""Loss-scaler overhead per optimizer step: ``DynamicLossScaler`` vs ``torch.amp.GradScaler``.

One optimizer: the same 11M-parameter MLP (4 x Linear(1664, 1664); gradients of realistic magnitude,
1e-3 x N(0, 1) times the scale, so no denormals), the same optimizer configuration and the same timed
region per iteration: ``unscale_`` (one fused inf/NaN check + multiply) + ``step`` (including the
skip decision) + ``update``. Gradients are refilled outside the timed region. GradScaler runs right
before each other scaler, step by step (G A G B ...); ratio = ours / GradScaler (< 1: ours is
faster). A second GradScaler, timed the same way, is the A/A control: its paired ratio shows the
noise floor of the run.

Two optimizers (per-optimizer scales, as a GAN's generator and discriminator): two models of half
the depth, each with its own optimizer, both stepped every iteration; ours
``DynamicLossScaler(per_optimizer=True)`` (one scale per optimizer, ``scale(..., optimizer=)``) vs
ONE ``torch.amp.GradScaler`` shared by both, same calls (``unscale_``/``step`` per optimizer, one
``update()``), paired the same way, with its own A/A control. Target: paired ratio <= 1.05x.

Usage: ``python benchmarks/bench_loss_scaling.py [--quick] [--iters 200] [--device cpu|cuda]
[--profile]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _common import anchored_pairs, write_result  # noqa: E402

from lightning_ext.amp import DynamicLossScaler  # noqa: E402

WIDTH, DEPTH, SCALE = 1664, 4, 2.0**16
TARGET = 1.05  # two optimizers: ours / one shared GradScaler, paired

DEVICE = torch.device("cpu")  # set by --device


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _model(depth: int = DEPTH, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(depth)]).to(DEVICE)


class _Setup:
    """One scaler with its models, optimizers and fixed gradients: ``len(optimizers)`` of them."""

    def __init__(self, scaler_fn: Callable[[], torch.amp.GradScaler], optimizer_fn: Callable, n: int) -> None:
        self.scaler = scaler_fn()
        self.params, self.grads, self.optimizers = [], [], []
        for i in range(n):
            params = list(_model(DEPTH // n, seed=i).parameters())
            self.params.append(params)
            self.grads.append([torch.randn_like(p) * (1e-3 * SCALE) for p in params])
            self.optimizers.append(optimizer_fn(params))
        for opt in self.optimizers:  # the scale tensors are created lazily here, outside the timing
            if getattr(self.scaler, "per_optimizer", False):
                self.scaler.scale(torch.ones((), device=DEVICE), optimizer=opt)
            else:
                self.scaler.scale(torch.ones((), device=DEVICE))

    def step(self) -> tuple[float, float]:
        """Seconds of the whole timed step, and host seconds of its ``update()`` call alone."""
        for params, grads in zip(self.params, self.grads):
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        _sync()
        start = time.perf_counter()
        for opt in self.optimizers:
            if not getattr(opt, "_step_supports_amp_scaling", False):
                self.scaler.unscale_(opt)
            self.scaler.step(opt)
        before_update = time.perf_counter()
        self.scaler.update()
        update = time.perf_counter() - before_update
        _sync()  # on CUDA: the device work of the step counts, not only its launch
        return time.perf_counter() - start, update

    def scales(self) -> list[float]:
        if getattr(self.scaler, "per_optimizer", False):
            return [self.scaler.optimizer_scaler(opt).get_scale() for opt in self.optimizers]
        return [self.scaler.get_scale()]


def _time(scaler_fns: dict[str, Callable], optimizer_fn: Callable, iters: int, n: int = 1) -> dict:
    """Median ms per scaler and paired ratios to GradScaler (the first entry, the anchor): step by
    step, GradScaler runs right before each other scaler (``_common.anchored_pairs``), so machine
    noise hits them alike and no scaler follows itself."""
    warmup = 3
    setups = {name: _Setup(fn, optimizer_fn, n) for name, fn in scaler_fns.items()}
    times: dict[str, list[float]] = {name: [] for name in setups}
    updates: dict[str, list[float]] = {name: [] for name in setups}
    ratios: dict[str, list[float]] = {name: [] for name in setups}
    for i in range(warmup + iters):
        for anchor, name in anchored_pairs(list(setups)):
            before, anchor_update = setups[anchor].step()
            elapsed, update = setups[name].step()
            if i >= warmup:
                times[anchor].append(before)
                times[name].append(elapsed)
                updates[anchor].append(anchor_update)
                updates[name].append(update)
                ratios[name].append(elapsed / before)
    for name, setup in setups.items():
        assert all(s == SCALE for s in setup.scales()), f"{name}: no step may overflow in this benchmark"
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, r in ratios.items():
        out[f"{name} paired"] = statistics.median(r) if r else 1.0
        out[f"{name} update us"] = statistics.median(updates[name]) * 1e6
    return out


def _grad_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler(DEVICE.type, init_scale=SCALE)


def _profile() -> None:
    """Per-op host time and launches of one step (SGD foreach), GradScaler vs ours (diagnosis only)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    scalers = {
        "GradScaler": _grad_scaler,
        "ours": lambda: DynamicLossScaler(DEVICE.type, init_scale=SCALE, telemetry=False),
    }
    for name, fn in scalers.items():
        setup = _Setup(fn, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True), 1)
        for _ in range(5):
            setup.step()
        with profile(activities=activities) as prof:
            setup.step()
        print(f"--- {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


OPTIMIZERS = {
    "SGD momentum (foreach)": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True),
    "SGD momentum (fused)": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True),
    "Adam (foreach)": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "Adam (fused)": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
}
TWO_OPTIMIZERS = ("Adam (foreach)", "Adam (fused)")  # what GANs train with


def one_optimizer_section(iters: int, n_params: int) -> str:
    scalers = {
        "GradScaler": _grad_scaler,
        "ours": lambda: DynamicLossScaler(DEVICE.type, init_scale=SCALE, telemetry=False),
        "ours + telemetry": lambda: DynamicLossScaler(DEVICE.type, init_scale=SCALE, telemetry=True),
        # A/A control: a second GradScaler, timed like ours; its paired ratio is the noise floor.
        "GradScaler #2": _grad_scaler,
    }
    lines = [
        f"## Loss scaling: unscale + check + step + update per optimizer step ({DEVICE.type.upper()})",
        "",
        f"{n_params / 1e6:.1f}M fp32 parameters ({DEPTH} x Linear({WIDTH}, {WIDTH})), median of "
        f"{iters} steps, no overflow. Fused optimizers take `grad_scale`/`found_inf` (no host sync); "
        "for them ours only reads the gradients to check them (`check_finite`), GradScaler rewrites "
        "them at scale 1. Non-fused: GradScaler runs ATen's `_amp_foreach_non_finite_check_and_unscale_`, "
        "ours the kernel backend's `unscale_and_check_`.",
        "",
        "GradScaler runs right before each of ours, step by step (G A G B ...). Paired ratio: median "
        "over iterations of ours / the GradScaler step timed right before it. A/A control: a second "
        "GradScaler (own model and optimizer, like each of ours) timed the same way; how far its paired "
        "ratio strays from 1 is the noise floor of the others. update(): host time of that call alone, "
        "median."
        + (
            " CUDA: the timed region ends with `torch.cuda.synchronize()`, so the device work and the "
            "host sync of each step count."
            if DEVICE.type == "cuda"
            else ""
        ),
        "",
        "| optimizer | GradScaler ms | ours ms | ratio | paired ratio | ours + telemetry ms | paired ratio "
        "| A/A control paired ratio | GradScaler update() µs | ours update() µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for opt_name, opt_fn in OPTIMIZERS.items():
        ms = _time(scalers, opt_fn, iters)
        g, o, t = ms["GradScaler"], ms["ours"], ms["ours + telemetry"]
        line = (
            f"| {opt_name} | {g:.2f} | {o:.2f} | {o / g:.3f}x | {ms['ours paired']:.3f}x | {t:.2f} | "
            f"{ms['ours + telemetry paired']:.3f}x | {ms['GradScaler #2 paired']:.3f}x | "
            f"{ms['GradScaler update us']:.0f} | {ms['ours update us']:.0f} |"
        )
        print(line, flush=True)
        lines.append(line)
    return "\n".join(lines)


def two_optimizer_section(iters: int, n_params: int) -> str:
    scalers = {
        "GradScaler": _grad_scaler,
        "ours": lambda: DynamicLossScaler(DEVICE.type, init_scale=SCALE, telemetry=False, per_optimizer=True),
        "GradScaler #2": _grad_scaler,  # A/A control
    }
    lines = [
        f"## Loss scaling: two optimizers, one scale each vs one shared ({DEVICE.type.upper()})",
        "",
        f"Two models of {DEPTH // 2} x Linear({WIDTH}, {WIDTH}) ({n_params / 1e6:.1f}M fp32 parameters in "
        f"all), each with its own optimizer, both stepped every iteration; median of {iters} iterations, "
        "no overflow. Timed per iteration: `unscale_` (non-fused optimizers) and `step` for each optimizer, "
        "then one `update()`. Ours: `DynamicLossScaler(per_optimizer=True)` (one scale per optimizer, "
        "the loss scaled with `scale(loss, optimizer=...)`); anchor: ONE `torch.amp.GradScaler` for both. "
        "Paired and A/A control as in the one-optimizer table. Target: paired ratio ≤ "
        f"{TARGET:.2f}×.",
        "",
        "| optimizers | one GradScaler ms | ours, per-optimizer scales ms | ratio | paired ratio "
        "| A/A control paired ratio | met |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for opt_name in TWO_OPTIMIZERS:
        ms = _time(scalers, OPTIMIZERS[opt_name], iters, n=2)
        g, o, paired = ms["GradScaler"], ms["ours"], ms["ours paired"]
        line = (
            f"| 2 x {opt_name} | {g:.2f} | {o:.2f} | {o / g:.3f}x | {paired:.3f}x | "
            f"{ms['GradScaler #2 paired']:.3f}x | {'yes' if paired <= TARGET else 'NO'} |"
        )
        print(line, flush=True)
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 iterations (smoke run)")
    parser.add_argument("--iters", type=int, default=200, help="timed iterations per row")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--profile", action="store_true", help="print torch.profiler op tables, no timing")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("bench_loss_scaling.py --device cuda: no CUDA device, nothing to run")
        return 0
    if args.profile:
        _profile()
        return 0
    iters = 10 if args.quick else args.iters
    n_params = sum(p.numel() for p in _model().parameters())
    suffix = "" if DEVICE.type == "cpu" else "_gpu"
    markdown = one_optimizer_section(iters, n_params)
    print(markdown, flush=True)
    write_result(f"loss_scaling{suffix}", markdown, quick=args.quick)
    markdown = two_optimizer_section(iters, n_params)
    print(markdown, flush=True)
    write_result(f"loss_scaling_two_optimizers{suffix}", markdown, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
