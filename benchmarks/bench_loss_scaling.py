"""Loss-scaler overhead per optimizer step: ``DynamicLossScaler`` vs ``torch.amp.GradScaler``.

Same 11M-parameter MLP (4 x Linear(1664, 1664) with PyTorch's default init, gradients of realistic
magnitude, 1e-3 x N(0, 1) times the scale, so no denormals), same optimizer configuration, same
timed region per iteration: ``unscale_`` (one fused inf/NaN check + multiply) + ``step`` (including
the skip decision) + ``update``. Gradients are refilled outside the timed region. Median of
``--iters`` iterations after warm-up, GradScaler running right before each other scaler step by
step (G A G B ...); ratio = ours / GradScaler (< 1 means ours is faster). A second GradScaler, timed
the same way, is the A/A control: its paired ratio shows the noise floor of the run.

Usage: ``python benchmarks/bench_loss_scaling.py [--iters 200] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import anchored_pairs, write_result

from lightning_ext.amp import DynamicLossScaler

WIDTH, DEPTH, SCALE = 1664, 4, 2.0**16


DEVICE = torch.device("cpu")  # set by --device


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).to(DEVICE)


def _setup(scaler_fn: Callable[[], object], optimizer_fn: Callable) -> tuple:
    model = _model()
    params = list(model.parameters())
    grads = [torch.randn_like(p) * (1e-3 * SCALE) for p in params]
    scaler = scaler_fn()
    scaler.scale(torch.ones((), device=DEVICE))  # GradScaler creates its scale tensor lazily here
    return params, grads, optimizer_fn(params), scaler


def _one_step(params, grads, opt, scaler) -> tuple[float, float]:
    """Seconds of the whole timed step, and host seconds of its ``update()`` call alone."""
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    _sync()
    start = time.perf_counter()
    if not getattr(opt, "_step_supports_amp_scaling", False):
        scaler.unscale_(opt)
    scaler.step(opt)
    before_update = time.perf_counter()
    scaler.update()
    update = time.perf_counter() - before_update
    _sync()  # on CUDA: the device work of the step counts, not only its launch
    return time.perf_counter() - start, update


def _time(scaler_fns: dict[str, Callable], optimizer_fn: Callable, iters: int, warmup: int = 3) -> dict:
    """Median ms per scaler and paired ratios to GradScaler (the first entry, the anchor): step by
    step, GradScaler runs right before each other scaler (``_common.anchored_pairs``), so machine
    noise hits them alike and no scaler follows itself."""
    setups = {name: _setup(fn, optimizer_fn) for name, fn in scaler_fns.items()}
    times: dict[str, list[float]] = {name: [] for name in setups}
    updates: dict[str, list[float]] = {name: [] for name in setups}
    ratios: dict[str, list[float]] = {name: [] for name in setups}
    for i in range(warmup + iters):
        for anchor, name in anchored_pairs(list(setups)):
            before, anchor_update = _one_step(*setups[anchor])
            elapsed, update = _one_step(*setups[name])
            if i >= warmup:
                times[anchor].append(before)
                times[name].append(elapsed)
                updates[anchor].append(anchor_update)
                updates[name].append(update)
                ratios[name].append(elapsed / before)
    for name, (_, _, _, scaler) in setups.items():
        assert scaler.get_scale() == SCALE, f"{name}: no step may overflow in this benchmark"
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, r in ratios.items():
        out[f"{name} paired"] = statistics.median(r) if r else 1.0
        out[f"{name} update us"] = statistics.median(updates[name]) * 1e6
    return out


def _profile() -> None:
    """Per-op host time and launches of one step (SGD foreach), GradScaler vs ours (diagnosis only)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    scalers = {
        "GradScaler": lambda: torch.amp.GradScaler(DEVICE.type, init_scale=SCALE),
        "ours": lambda: DynamicLossScaler(init_scale=SCALE, telemetry=False),
    }
    for name, fn in scalers.items():
        setup = _setup(fn, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True))
        for _ in range(5):
            _one_step(*setup)
        with profile(activities=activities) as prof:
            _one_step(*setup)
        print(f"--- {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--device", default="cpu", help="cpu (default; results/loss_scaling.md) or cuda")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler op tables, no timing")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be 'cpu' or 'cuda', got {args.device!r}")
    if args.profile:
        _profile()
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    n_params = sum(p.numel() for p in _model().parameters())

    optimizers = {
        "SGD momentum (foreach)": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True),
        "SGD momentum (fused)": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True),
        "Adam (foreach)": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
        "Adam (fused)": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    }
    scalers = {
        "GradScaler": lambda: torch.amp.GradScaler(DEVICE.type, init_scale=SCALE),
        "ours": lambda: DynamicLossScaler(init_scale=SCALE, telemetry=False),
        "ours + telemetry": lambda: DynamicLossScaler(init_scale=SCALE, telemetry=True),
        # A/A control: a second GradScaler, timed like ours; its paired ratio is the noise floor.
        "GradScaler #2": lambda: torch.amp.GradScaler(DEVICE.type, init_scale=SCALE),
    }
    rows = []
    for opt_name, opt_fn in optimizers.items():
        ms = _time(scalers, opt_fn, args.iters)
        rows.append((opt_name, ms))
        print(
            f"{opt_name:24s} GradScaler {ms['GradScaler']:7.2f} ms  ours {ms['ours']:7.2f} ms "
            f"({ms['ours'] / ms['GradScaler']:.2f}x, paired {ms['ours paired']:.3f}x)  "
            f"ours+telemetry {ms['ours + telemetry']:7.2f} ms (paired {ms['ours + telemetry paired']:.3f}x)  "
            f"GradScaler #2 paired {ms['GradScaler #2 paired']:.3f}x  update() GradScaler "
            f"{ms['GradScaler update us']:.0f} us, ours {ms['ours update us']:.0f} us",
            flush=True,
        )

    lines = [
        f"## Loss scaling: unscale + check + step + update per optimizer step ({DEVICE.type.upper()})",
        "",
        f"{n_params / 1e6:.1f}M fp32 parameters ({DEPTH} x Linear({WIDTH}, {WIDTH})), median of "
        f"{args.iters} steps, no overflow. Fused optimizers take `grad_scale`/`found_inf` (no host sync); "
        "for them ours only reads the gradients to check them (`check_finite`), GradScaler rewrites "
        "them at scale 1. Non-fused: both run ATen's `_amp_foreach_non_finite_check_and_unscale_`.",
        "",
        "GradScaler runs right before each of ours, step by step (G A G B ...). Paired ratio: median "
        "over iterations of ours / the GradScaler step timed right before it. A/A control: a second "
        "GradScaler (own model and optimizer, like each of ours) timed the same way; how far its paired "
        "ratio strays from 1 is the noise floor of the others. update(): host time of that call alone, "
        "median.",
        "",
        "| optimizer | GradScaler ms | ours ms | ratio | paired ratio | ours + telemetry ms | paired ratio "
        "| A/A control paired ratio | GradScaler update() µs | ours update() µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for opt_name, ms in rows:
        g, o, t = ms["GradScaler"], ms["ours"], ms["ours + telemetry"]
        lines.append(
            f"| {opt_name} | {g:.2f} | {o:.2f} | {o / g:.3f}x | {ms['ours paired']:.3f}x | {t:.2f} | "
            f"{ms['ours + telemetry paired']:.3f}x | {ms['GradScaler #2 paired']:.3f}x | "
            f"{ms['GradScaler update us']:.0f} | {ms['ours update us']:.0f} |"
        )
    if DEVICE.type == "cuda":
        lines += [
            "",
            "CUDA: the timed region ends with `torch.cuda.synchronize()`, so the device work and the",
            "host sync of each step count. Ours unscales with the kernel backend's `unscale_and_check_`",
            "(Triton kernels for tensors >= 64Ki elements), GradScaler with ATen's multi-tensor op.",
        ]
    write_result("loss_scaling" if DEVICE.type == "cpu" else "loss_scaling_gpu", "\n".join(lines))


if __name__ == "__main__":
    main()
