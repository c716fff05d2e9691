"""FLOPs of a training step, counted by ``torch.utils.flop_counter.FlopCounterMode`` and split by phase.

Conventions (``FlopCounterMode``'s, which this module keeps): 2 FLOPs per multiply-add; only matmuls,
convolutions and attention are counted (elementwise ops, norms and the optimizer's step are not); a backward
counts what autograd runs, about twice the forward (a gradient for the input and one for the weight;
none for an input that needs no gradient, so a first layer's backward is about its forward).
Attention (``scaled_dot_product_attention``): the full ``L × S`` score matrix, causal or not, as the
analytic formula of PaLM (Chowdhery et al. 2022, appendix B: ``6·N + 12·L·H·Q·T`` per token) counts
it, so that figures compare with the field's although a causal kernel skips about half of that work;
a fused kernel's backward also counts the scores it recomputes (five matmuls to the math path's four).
This module adds the formulas of the CPU's fused attention, which ``FlopCounterMode`` lacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from lightning_ext._checks import check_bool, check_int, check_number
from lightning_ext._compat import in_backward

__all__ = ["FlopCount", "FlopCounter", "count_flops", "mfu"]


def _cpu_sdpa(query: Any, key: Any, value: Any, *args: Any, out_shape: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad, query, key, value)


# Formulas FlopCounterMode lacks (it counts nothing for them): the CPU's fused attention, counted as
# FlopCounterMode counts the GPU's (arguments: shapes).
_MISSING_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """FLOPs of one step by phase (``int``), as :class:`FlopCounter` counted them.

    Attributes:
        forward: FLOPs of the forward pass.
        backward: FLOPs of the backward pass, recomputation excluded.
        recomputed: FLOPs of forward passes recomputed during the backward (activation checkpointing).
        convolution: of ``forward + backward``, the FLOPs of convolutions (in float32 on CUDA they run
            as cuDNN's TF32 setting says, the other ops as the matmul precision says).
    """

    forward: int
    backward: int
    recomputed: int = 0
    convolution: int = 0

    @property
    def model(self) -> int:
        """The model FLOPs ``forward + backward``, MFU's numerator."""
        return self.forward + self.backward

    @property
    def hardware(self) -> int:
        """What the device executed, ``model + recomputed``, HFU's numerator."""
        return self.model + self.recomputed


class FlopCounter:
    """Count the FLOPs run inside a ``with`` block, split into forward, backward and recomputation.

    ``FlopCounterMode`` counts every op; each count is filed by when it runs: outside a backward pass
    (forward), inside one with gradients disabled (backward), inside one with gradients enabled (a
    forward that ``torch.utils.checkpoint`` recomputes, reentrant or not, runs so); inside a
    ``torch.optim.Optimizer``'s ``step`` (an optimizer with matmuls, such as Muon's Newton-Schulz
    iterations) nothing is counted: model FLOPs are the forward's and the backward's. A backward with
    ``create_graph=True`` (a gradient penalty) counts as recomputed: its split is wrong, its total is
    right. Wrap a real step once (the count depends on shapes, not values): the counting itself costs
    a Python call per op. Conventions: the module docstring.

    Example::

        >>> net = torch.nn.Linear(8, 4)
        >>> with FlopCounter() as counter:
        ...     net(torch.randn(16, 8)).sum().backward()
        >>> counter.count  # forward 2·16·8·4; backward: the weight's gradient only
        FlopCount(forward=1024, backward=1024, recomputed=0, convolution=0)
    """

    def __init__(self) -> None:
        self._flops = {"forward": 0, "backward": 0, "recomputed": 0, "convolution": 0}
        self._stepping = 0  # optimizer steps running (their ops are not counted)
        self._mode = FlopCounterMode(display=False, custom_mapping=_MISSING_FORMULAS)
        # Each formula of this counter's own table also files its count by phase (no global changed).
        registry = self._mode.flop_registry
        self._mode.flop_registry = {op: self._filed(f, "conv" in str(op)) for op, f in registry.items()}

    def _filed(self, formula: Callable[..., int], convolution: bool) -> Callable[..., int]:
        def counted(*args: Any, **kwargs: Any) -> int:
            flops = formula(*args, **kwargs)
            if self._stepping:  # an optimizer's step: not the model's
                return flops
            phase = (
                "forward" if not in_backward() else "recomputed" if torch.is_grad_enabled() else "backward"
            )
            self._flops[phase] += flops
            if convolution and phase != "recomputed":
                self._flops["convolution"] += flops
            return flops

        return counted

    def __enter__(self) -> FlopCounter:
        self._flops, self._stepping = dict.fromkeys(self._flops, 0), 0
        self._hooks = (
            register_optimizer_step_pre_hook(self._step_begins),
            register_optimizer_step_post_hook(lambda *_: self._step(-1)),
        )
        self._mode.__enter__()
        return self

    def _step(self, change: int) -> None:
        self._stepping += change

    def _step_begins(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Stop counting for the optimizer's step, but not for its ``closure`` (Lightning runs the
        forward and the backward in one): the closure is wrapped to count."""
        self._step(1)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # (args[0]: the optimizer)
        if not callable(closure):
            return None

        def counted(*a: Any, **k: Any) -> Any:
            self._step(-1)
            try:
                return closure(*a, **k)
            finally:
                self._step(1)

        if "closure" in kwargs:
            return args, {**kwargs, "closure": counted}
        return (args[0], counted, *args[2:]), kwargs

    def __exit__(self, *exc_info: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._mode.__exit__(*exc_info)

    @property
    def count(self) -> FlopCount:
        """The FLOPs counted so far in the last ``with`` block."""
        return FlopCount(**self._flops)


def count_flops(fn: Callable[..., Any], *inputs: Any, backward: bool = True) -> FlopCount:
    """FLOPs of ``fn(*inputs)`` and of the backward of its outputs, counted by ``FlopCounterMode``.

    Runs ``fn`` once (a module or any function: its outputs, side effects and BatchNorm updates are
    real), then, with ``backward``, one backward pass from the sum of its floating-point outputs that
    require gradients (a tensor, or a tuple/list of them): the gradients accumulate in ``.grad`` as in
    a training step, so count before training or zero them after. Conventions: the module docstring;
    activation checkpointing inside ``fn`` shows up as ``FlopCount.recomputed``.

    Args:
        fn: the model or the step's forward (e.g. ``lambda x, y: F.cross_entropy(net(x), y)``).
        inputs: a real batch (the count depends on its shapes).
        backward: count the backward pass too.

    Returns:
        :class:`FlopCount` (``.model`` for MFU, ``.hardware`` for HFU).

    Raises:
        ValueError: ``backward`` and no output requires gradients.
        TypeError: ``fn`` is not callable, ``backward`` not a bool.

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> count = count_flops(net, torch.randn(16, 8))
        >>> count.forward, count.backward, count.model  # the first layer's input needs no gradient
        (12288, 16384, 28672)
    """
    if not callable(fn):
        raise TypeError(f"count_flops: `fn` must be callable (a module or a function), got {fn!r:.80}")
    check_bool("count_flops", "backward", backward)
    with FlopCounter() as counter:
        outputs = fn(*inputs)
        if backward:
            flat = outputs if isinstance(outputs, tuple | list) else (outputs,)
            leaves = [t for t in flat if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad]
            if not leaves:
                raise ValueError(
                    "count_flops: `backward=True` but no floating-point output of `fn` requires gradients. "
                    "HINT: pass backward=False to count the forward only."
                )
            torch.autograd.backward([t.sum() for t in leaves])
    return counter.count


def mfu(flops: float, seconds: float, peak_flops: float, world_size: int = 1) -> float:
    """Model FLOPs utilization: ``flops / seconds / (world_size · peak_flops)``; HFU with hardware FLOPs.

    Args:
        flops: FLOPs that all ``world_size`` devices did together in ``seconds`` (e.g. steps ×
            :attr:`FlopCount.model` summed over the ranks; :attr:`FlopCount.hardware` for HFU).
        seconds: the wall time they took, > 0.
        peak_flops: one device's peak FLOP/s for the dtype in use (:func:`peak_flops`, a datasheet
            figure of your own, or :func:`measure_peak_flops` on a CPU), > 0.
        world_size: devices that did the work.

    Returns:
        The utilization as a fraction (0.4 is 40 %).

    Raises:
        TypeError, ValueError: an argument not a finite number (``world_size``: an int) in its range.

    Example::

        >>> round(mfu(flops=3.0e15, seconds=2.0, peak_flops=989.4e12, world_size=4), 4)  # 375 TFLOP/s each
        0.379
    """
    check_number("mfu", "flops", flops, ge=0.0)
    check_number("mfu", "seconds", seconds, gt=0.0)
    check_number("mfu", "peak_flops", peak_flops, gt=0.0)
    check_int("mfu", "world_size", world_size, ge=1)
    return flops / seconds / (world_size * peak_flops)
