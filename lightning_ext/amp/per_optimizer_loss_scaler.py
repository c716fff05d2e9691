"""``PerOptimizerLossScaler``: one :class:`DynamicLossScaler` per optimizer behind the scaler's API."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_ext.amp.dynamic_loss_scaler import (
    _OPTIONS,
    DynamicLossScaler,
    _check_optimizer,
    _check_per_optimizer_keys,
)

__all__ = ["PerOptimizerLossScaler"]


class PerOptimizerLossScaler(DynamicLossScaler):
    """One scale, growth tracker and set of counters per optimizer: ``DynamicLossScaler(per_optimizer=True)``.

    ``DynamicLossScaler(..., per_optimizer=True)`` is one (same arguments, same methods), so code
    written for the scaler drives it unchanged but for ``scale(loss, optimizer=...)``: each optimizer's
    gradients are scaled by its own scale, checked and stepped or skipped on their own, and each scale
    moves with the overflows of its own optimizer. A generator whose discriminator overflows keeps its
    scale (StyleGAN2-ADA's per-``Optimizer`` loss scaling; Apex's ``num_losses``/``loss_id``).

    Each optimizer's scale is a :class:`DynamicLossScaler` with this one's settings, created at the
    optimizer's first use and named by :meth:`register_optimizer`, else ``"0"``, ``"1"``, ... in order
    of first use; telemetry ``AMP/<name>/loss_scale_log2``, ``AMP/<name>/overflow``,
    ``AMP/<name>/skipped_steps``. Host syncs: those of each optimizer's scaler.

    It takes :class:`DynamicLossScaler`'s arguments (``per_optimizer`` must be ``True`` if given).

    Raises:
        ValueError: ``per_optimizer=False``; :class:`DynamicLossScaler`'s errors.

    Example::

        >>> import torch
        >>> g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        >>> opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
        >>> scaler = DynamicLossScaler("cpu", init_scale=2.0**10, per_optimizer=True, telemetry=False)
        >>> type(scaler).__name__
        'PerOptimizerLossScaler'
        >>> scaler.register_optimizer(opt_g, "G"); scaler.register_optimizer(opt_d, "D")
        >>> scaler.scale(d(torch.ones(1, 2)).sum(), optimizer=opt_d).backward()
        >>> d.weight.grad.fill_(float("inf"))  # D overflows
        tensor([[inf, inf]])
        >>> _ = scaler.step(opt_d)
        >>> scaler.scale(d(g(torch.ones(1, 2))).sum(), optimizer=opt_g).backward()
        >>> _ = scaler.step(opt_g)
        >>> scaler.update()
        >>> scaler.optimizer_scaler(opt_d).get_scale(), scaler.optimizer_scaler(opt_g).get_scale()
        (512.0, 1024.0)
    """

    _per_optimizer = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"per_optimizer": True, **kwargs})

    def _init_scales(self) -> None:
        """The per-optimizer state, set up by :class:`DynamicLossScaler`'s ``__init__``."""
        self._children: dict[str, DynamicLossScaler] = {}  # name -> that optimizer's scaler
        self._names: dict[int, str] = {}  # id(optimizer) -> name
        self._pending: dict[str, dict[str, Any]] = {}  # loaded states of scalers not yet used

    def register_optimizer(self, optimizer: Optimizer, name: str) -> None:
        """Name ``optimizer``'s scale: telemetry ``AMP/<name>/...`` and its state-dict key.

        Raises:
            TypeError: ``optimizer`` is not an optimizer or ``name`` not a non-empty str.
            ValueError: ``name`` already names another optimizer.
        """
        _check_optimizer(optimizer)
        if not isinstance(name, str) or not name:
            raise TypeError(f"`name` must be a non-empty str, got {name!r}")
        if name in self._names.values() and self._names.get(id(optimizer)) != name:
            raise ValueError(f"`name` {name!r} already names another optimizer's scale")
        self._names[id(optimizer)] = name

    def optimizer_scaler(self, optimizer: Optimizer) -> DynamicLossScaler:
        """The scaler holding ``optimizer``'s own scale, created (and given its loaded state) at first use.

        Raises:
            TypeError: ``optimizer`` is not an optimizer.
        """
        _check_optimizer(optimizer)
        name = self._names.setdefault(id(optimizer), str(len(self._names)))
        child = self._children.get(name)
        if child is None:
            child = self._children[name] = DynamicLossScaler(
                self._device, self._init_scale, self._growth_factor, self._backoff_factor,
                self._growth_interval, self._enabled, **{key: getattr(self, key) for key in _OPTIONS},
            )  # fmt: skip
            child._name = name
            if name in self._pending:
                child.load_state_dict(self._pending.pop(name))
        return child

    def scale(self, outputs: Any, *, optimizer: Optimizer | None = None) -> Any:
        """Multiply ``outputs`` by the scale of ``optimizer``, the optimizer that will step their gradients.

        Raises:
            ValueError: no ``optimizer``.
        """
        if optimizer is None:
            raise ValueError(
                "DynamicLossScaler(per_optimizer=True).scale(outputs, optimizer=...) needs the optimizer "
                "that will step these gradients: each optimizer has its own scale"
            )
        return self.optimizer_scaler(optimizer).scale(outputs)

    def unscale_(self, optimizer: Optimizer) -> None:
        """:meth:`DynamicLossScaler.unscale_` by ``optimizer``'s own scale."""
        return self.optimizer_scaler(optimizer).unscale_(optimizer)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """:meth:`DynamicLossScaler.step` with ``optimizer``'s own scale."""
        return self.optimizer_scaler(optimizer).step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None, *, optimizer: Optimizer | None = None) -> None:
        """Move the scale of ``optimizer`` (for its steps since its last update), or with ``None`` of
        every optimizer that stepped since its last update; see :meth:`DynamicLossScaler.update`."""
        if optimizer is not None:
            stepped = [self.optimizer_scaler(optimizer)]
        else:
            stepped = [c for c in self._children.values() if c._has_steps()]
        for child in stepped:
            child.update(new_scale)

    @property
    def steps(self) -> int:
        """Optimizer steps counted, summed over the optimizers. Syncs host and device."""
        return sum(c.steps for c in self._children.values())

    @property
    def skipped_steps(self) -> int:
        """Skipped optimizer steps, summed over the optimizers. Syncs host and device."""
        return sum(c.skipped_steps for c in self._children.values())

    @property
    def consecutive_overflows(self) -> int:
        """The longest run of skipped steps up to the last update over the optimizers. Syncs."""
        return max((c.consecutive_overflows for c in self._children.values()), default=0)

    @property
    def last_step_skipped(self) -> bool:
        """Whether any optimizer's last update counted a skipped step. Syncs host and device."""
        return any(c.last_step_skipped for c in self._children.values())

    def state_dict(self) -> dict[str, Any]:
        """``{"per_optimizer": {name: DynamicLossScaler.state_dict()}}``. Syncs host and device."""
        return {"per_optimizer": {**self._pending, **{n: c.state_dict() for n, c in self._children.items()}}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: into each optimizer's scaler now, or at its first use.

        Raises:
            ValueError: ``state_dict`` is a shared scale's; the errors of
                :meth:`DynamicLossScaler.load_state_dict`.
        """
        _check_per_optimizer_keys(state_dict, True)
        for name, state in state_dict.get("per_optimizer", {}).items():
            if name in self._children:
                self._children[name].load_state_dict(state)
            else:
                self._pending[name] = state

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_names": {}}  # object ids mean nothing in another process
