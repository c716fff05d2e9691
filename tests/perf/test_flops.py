"""FLOPs by phase (lightning_ext.perf.flops) against torch's FlopCounterMode, and MFU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim.optimizer import _global_optimizer_pre_hooks
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from lightning_ext.perf import FlopCount, FlopCounter, count_flops, mfu


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 7 * 5, 10)
    )


def _flop_counter_mode(fn) -> int:
    with FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


def test_phases_add_up_to_flop_counter_modes_count():
    net, x, y = _net(), torch.randn(4, 3, 7, 5), torch.tensor([1, 2, 3, 4])
    with FlopCounter() as counter:
        loss = F.cross_entropy(net(x), y)
        loss.backward()
    count = counter.count
    forward = _flop_counter_mode(lambda: F.cross_entropy(net(x), y))
    loss = F.cross_entropy(net(x), y)
    backward = _flop_counter_mode(loss.backward)
    assert (count.forward, count.backward, count.recomputed) == (forward, backward, 0)
    assert count.model == count.hardware == forward + backward > 0
    # Conv2d: 2 * N * C_out * H * W * C_in * 3 * 3; Linear: 2 * N * 280 * 10.
    assert forward == 2 * 4 * 8 * 7 * 5 * 3 * 9 + 2 * 4 * 280 * 10


class _Orthogonalizing(torch.optim.SGD):
    """SGD whose step runs its closure (Lightning passes one), then a matmul per parameter (as Muon's
    Newton-Schulz iterations do)."""

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad.reshape(p.grad.shape[0], -1)
                p.grad.copy_((g @ g.T @ g).reshape(p.grad.shape))
        super().step()
        return loss


def test_an_optimizers_step_is_not_counted():
    # Its FLOPs are not the model's: counted, they were filed as forward and scaled with the samples
    # (72x the model's FLOPs for an MLP under Muon).
    net, x, y = _net(), torch.randn(4, 3, 7, 5), torch.tensor([1, 2, 3, 4])
    optimizer = _Orthogonalizing(net.parameters(), lr=0.1)
    F.cross_entropy(net(x), y).backward()
    assert _flop_counter_mode(optimizer.step) > 0  # it does run matmuls
    with FlopCounter() as counter:
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        F.cross_entropy(net(x), y).backward()  # counted again after the step
    with FlopCounter() as model_only:
        F.cross_entropy(net(x), y).backward()
    assert counter.count.model == 2 * model_only.count.model > 0
    def closure():  # a forward and a backward inside the step (as Lightning's): counted
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()

    for step in (lambda: optimizer.step(closure), lambda: optimizer.step(closure=closure)):
        with FlopCounter() as stepped:
            step()
        assert stepped.count == model_only.count
    with FlopCounter() as after:  # the hooks went with the block
        optimizer.step()
    assert after.count.model == 0 and not _global_optimizer_pre_hooks


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recomputed_forward_is_counted_apart(use_reentrant):
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
    x = torch.randn(8, 16, requires_grad=True)

    def plain(x):
        for block in blocks:
            x = block(x)
        return x

    def checkpointed(x):
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=use_reentrant)
        return x

    reference = count_flops(plain, x)
    count = count_flops(checkpointed, x)
    assert count.model == reference.model  # MFU's numerator does not see the recomputation
    # Each block's Linear runs once more in the backward (2 * 8 * 16 * 16 FLOPs each).
    assert count.recomputed == 3 * 2 * 8 * 16 * 16
    assert count.hardware == count.model + count.recomputed
    assert count.hardware == _flop_counter_mode(lambda: checkpointed(x).sum().backward())


def test_causal_attention_counts_the_full_score_matrix():
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))
    full = count_flops(lambda: F.scaled_dot_product_attention(q, k, v))
    causal = count_flops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    with sdpa_kernel(SDPBackend.MATH):  # matmuls FlopCounterMode counts (the CPU's fused kernel: ours)
        math = count_flops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert causal == full
    assert full.forward == math.forward == 2 * (2 * 2 * 4 * 32 * 32 * 16)  # Q @ K^T, P @ V: all L x S
    assert math.backward == 2 * full.forward  # dV, dP, dQ, dK
    assert full.backward == 5 * full.forward // 2  # the fused kernel also recomputes Q @ K^T


def test_count_flops_forward_only_outputs_and_errors():
    net, x = _net(), torch.randn(2, 3, 7, 5)
    conv = 2 * 2 * 8 * (7 * 5) * (3 * 3 * 3)  # 2 per multiply-add, N C_out (H W) (C_in k k)
    assert count_flops(net, x, backward=False) == FlopCount(_flop_counter_mode(lambda: net(x)), 0, 0, conv)
    pair = count_flops(lambda x: (net(x), net(x).argmax(dim=1)), x)  # integer outputs are left out
    assert pair.forward == 2 * _flop_counter_mode(lambda: net(x))
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"`backward=True` but no floating-point output of `fn`"),
    ):
        count_flops(net, x)


def test_mfu_is_flop_counter_modes_flops_over_the_peak():
    net, x, y = _net(), torch.randn(4, 3, 7, 5), torch.tensor([1, 2, 3, 4])
    flops = _flop_counter_mode(lambda: F.cross_entropy(net(x), y).backward())
    count = count_flops(lambda: F.cross_entropy(net(x), y))
    steps, seconds, peak = 25, 0.5, 1.0e9
    assert mfu(steps * count.model, seconds, peak) == steps * flops / seconds / peak
    # Two ranks did twice the work in the same time against twice the hardware: the same MFU.
    assert mfu(2 * steps * count.model, seconds, peak, world_size=2) == pytest.approx(
        steps * flops / seconds / peak, rel=1e-15
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seconds": 0.0}, ValueError, r"mfu: `seconds` must be a finite number > 0.0, got 0.0"),
        ({"peak_flops": float("nan")}, TypeError, r"`peak_flops` must be a finite number > 0.0, got nan"),
        ({"flops": -1.0}, ValueError, r"`flops` must be a finite number >= 0.0, got -1.0"),
        ({"world_size": 2.0}, TypeError, r"`world_size` must be an int >= 1, got 2.0 \(float\)"),
    ],
)
def test_mfu_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        mfu(**{"flops": 1.0, "seconds": 1.0, "peak_flops": 1.0, **kwargs})
