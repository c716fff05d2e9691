"""SyncBatchNorm: sharded multi-process runs vs ONE process running torch BatchNorm in float64.

The distributed checks are packed into few spawned runs (each spawn costs seconds): every worker
runs a table of cases (input rank, memory format, dtype, momentum, affine, uneven/empty shards) for
two training steps and an eval step, and the parent compares the gathered shards with the reference.
Each run uses one kernel backend (``cpu``, the compiled kernels, or ``reference``).
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_ext._compat import at_least
from lightning_ext.distributed import create_process_groups
from lightning_ext.kernels import BACKEND_ENV_VAR, get_backend, payload_moments, registry
from lightning_ext.nn import SyncBatchNorm, sync_batch_norm_stats
from tests.helpers.cpu_extension import require_cpu_backend
from tests.helpers.distributed import run_distributed

C = 3
SPATIAL = {2: (), 3: (5,), 4: (3, 4), 5: (2, 3, 2)}
FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}

# (input rank, channels_last, dtype, momentum, affine); shard sizes are drawn per case.
CASES = [
    (2, False, torch.float32, 0.1, True),
    (3, False, torch.float32, None, True),
    (4, False, torch.float32, 0.1, False),
    (4, True, torch.float32, 0.3, True),
    (5, False, torch.float32, None, True),
    (5, True, torch.float32, 0.1, True),
    (4, True, torch.bfloat16, 0.1, True),
    (3, False, torch.bfloat16, None, True),
    (2, False, torch.float16, 0.1, True),
    (4, True, torch.float64, 0.1, True),
    (3, False, torch.float64, None, True),
]


def _shards(world_size: int, case_index: int) -> list[int]:
    """Uneven per-rank batch sizes, including 0 and 1, fixed per case."""
    g = torch.Generator().manual_seed(100 + case_index)
    sizes = torch.randint(0, 6, (world_size,), generator=g).tolist()
    sizes = [1 + s for s in sizes]
    if case_index % 2 == 0:
        sizes[case_index % world_size] = 0  # every other case has an empty rank
    if case_index % 4 == 1:
        sizes[(case_index + 1) % world_size] = 1  # and some a rank with a single sample
    if sum(sizes) - max(sizes) == 0:
        sizes[(case_index + 1) % world_size] = 3  # never all data on one rank
    return sizes


def _data(case_index: int, step: int, n: int, ndim: int, large_mean: bool = False):
    """Full batch ``x`` and upstream gradient ``dy`` (float64), identical in every process."""
    g = torch.Generator().manual_seed(1000 * case_index + step)
    shape = (n, C, *SPATIAL[ndim])
    offset = 1e4 if large_mean else 3.0
    x = offset + 2.0 * torch.randn(shape, generator=g, dtype=torch.float64)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, dy


def _params(case_index: int):
    g = torch.Generator().manual_seed(case_index)
    return 1.0 + 0.5 * torch.randn(C, generator=g), 0.5 * torch.randn(C, generator=g)


def _to_input(x: torch.Tensor, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
    x = x.to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=FORMATS[x.dim()])
    return x


def _run_case(rank, world_size, case_index, case, group=None, ranks=None, large_mean=False):
    ndim, channels_last, dtype, momentum, affine = case
    ranks = list(range(world_size)) if ranks is None else ranks
    sizes = _shards(len(ranks), case_index)
    me = ranks.index(rank)
    lo, hi = sum(sizes[:me]), sum(sizes[: me + 1])
    module_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # as torch's BatchNorm needs
    bn = SyncBatchNorm(C, momentum=momentum, affine=affine, process_group=group, dtype=module_dtype)
    if affine:
        weight, bias = _params(case_index)
        with torch.no_grad():
            bn.weight.copy_(weight)
            bn.bias.copy_(bias)
    out = {"sizes": sizes, "steps": []}
    for step in range(2):
        x, dy = _data(case_index, step, sum(sizes), ndim, large_mean)
        xs = _to_input(x[lo:hi], dtype, channels_last).requires_grad_(True)
        y = bn(xs)
        y.backward(dy[lo:hi].to(dtype))
        fmt = FORMATS.get(ndim) if channels_last else torch.contiguous_format
        out["steps"].append(
            {
                "y": y.detach(),
                "dx": xs.grad,
                "gw": bn.weight.grad.clone() if affine else None,
                "gb": bn.bias.grad.clone() if affine else None,
                "keeps_format": y.is_contiguous(memory_format=fmt)
                and xs.grad.is_contiguous(memory_format=fmt)
                and y.dtype == dtype,
            }
        )
        if affine:
            bn.weight.grad = None
            bn.bias.grad = None
    out["running_mean"] = bn.running_mean.clone()
    out["running_var"] = bn.running_var.clone()
    out["num_batches_tracked"] = bn.num_batches_tracked.clone()
    # Eval never synchronizes (torch's rule): with running stats the layer uses them; without, each
    # rank normalizes with its own batch's statistics (needs more than one value per channel).
    bn.eval()
    x, _ = _data(case_index, 7, sum(sizes), ndim, large_mean)
    out["eval_y"] = bn(_to_input(x[lo:hi], dtype, channels_last)).detach()
    free = SyncBatchNorm(C, affine=False, track_running_stats=False, process_group=group, dtype=module_dtype)
    free.eval()
    shard = _to_input(x[lo:hi], dtype, channels_last)
    out["eval_free_y"] = free(shard).detach() if shard.numel() > 2 * C else None
    return out


def _reference(case_index, case, sizes, large_mean=False):
    """One process, torch BatchNorm on the concatenated batch, in float64 (and in the case dtype)."""
    ndim, _, dtype, momentum, affine = case
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[ndim]
    n = sum(sizes)
    results = {}
    for run_dtype in {torch.float64, dtype}:
        bn = cls(C, momentum=momentum, affine=affine).to(
            torch.float64 if run_dtype == torch.float64 else torch.float32
        )
        if affine:
            weight, bias = _params(case_index)
            with torch.no_grad():
                bn.weight.copy_(weight)
                bn.bias.copy_(bias)
        steps = []
        for step in range(2):
            x, dy = _data(case_index, step, n, ndim, large_mean)
            x = x.to(dtype).to(run_dtype).requires_grad_(True)
            y = bn(x)
            y.backward(dy.to(dtype).to(run_dtype))
            steps.append(
                {
                    "y": y.detach(),
                    "dx": x.grad,
                    "gw": bn.weight.grad.clone() if affine else None,
                    "gb": bn.bias.grad.clone() if affine else None,
                }
            )
            if affine:
                bn.weight.grad = None
                bn.bias.grad = None
        bn.eval()
        x, _ = _data(case_index, 7, n, ndim, large_mean)
        x = x.to(dtype).to(run_dtype)
        free = cls(C, affine=False, track_running_stats=False).to(x.dtype)
        shards = [s for s in x.split(sizes) if s.numel() > 2 * C]  # local statistics per rank
        results[run_dtype] = {
            "steps": steps,
            "running_mean": bn.running_mean,
            "running_var": bn.running_var,
            "num_batches_tracked": bn.num_batches_tracked,
            "eval_y": bn(x).detach(),
            "eval_free_y": torch.cat([free(s).detach() for s in shards]),
        }
    return results


def _close(actual, expected64, expected_low, dtype, what, scale_tol=1.0):
    """float64: within 1e-12 relative (float64 arithmetic on these sizes agrees to ~1e-15); fp32: within
    1e-5 relative of float64. Low precision: error <= 2x torch's own error in that dtype."""
    actual = actual.to(torch.float64)
    if dtype == torch.float64:
        scale = max(1.0, expected64.abs().max().item() if expected64.numel() else 1.0)
        err = (actual - expected64).abs().max().item() if actual.numel() else 0.0
        assert err <= 1e-12 * scale_tol * scale, f"{what}: max error {err:.3g} > {1e-12 * scale:.3g}"
    elif dtype == torch.float32:
        tol = 1e-5 * scale_tol * max(1.0, expected64.abs().max().item() if expected64.numel() else 1.0)
        err = (actual - expected64).abs().max().item() if actual.numel() else 0.0
        assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"
    else:
        err = (actual - expected64).abs().max().item() if actual.numel() else 0.0
        ref_err = (expected_low.to(torch.float64) - expected64).abs().max().item() if actual.numel() else 0.0
        bound = (
            2.0 * ref_err
            + 1e-2 * max(1.0, expected64.abs().max().item() if expected64.numel() else 1.0) * 0.1
        )
        assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g} (torch {dtype} error {ref_err:.3g})"


def _check_case(case_index, case, outs, large_mean=False):
    sizes = outs[0]["sizes"]
    ref = _reference(case_index, case, sizes, large_mean)
    dtype = case[2]
    r64, rlow = ref[torch.float64], ref[dtype]
    tag = f"case {case_index} {case} shards {sizes}"
    scale = 300.0 if large_mean else 1.0  # inputs at 1e4 carry fp32 rounding of ~1e-3 std
    for step in range(2):
        for key in ("y", "dx"):
            got = torch.cat([o["steps"][step][key].to(torch.float64) for o in outs])
            _close(
                got,
                r64["steps"][step][key],
                rlow["steps"][step][key],
                dtype,
                f"{tag} step {step} {key}",
                scale,
            )
        assert all(o["steps"][step]["keeps_format"] for o in outs), f"{tag}: memory format or dtype not kept"
        if case[4]:
            for key in ("gw", "gb"):
                got = sum(o["steps"][step][key].to(torch.float64) for o in outs)
                _close(got, r64["steps"][step][key], rlow["steps"][step][key], dtype, f"{tag} {key}", scale)
    for o in outs:
        for key in ("running_mean", "running_var"):
            tol = {torch.float64: 1e-12, torch.float32: 1e-5 * scale}.get(dtype, 2e-2)
            torch.testing.assert_close(o[key].double(), r64[key], rtol=tol, atol=tol, msg=f"{tag} {key}")
        assert int(o["num_batches_tracked"]) == int(r64["num_batches_tracked"]) == 2
        # Every rank holds bitwise identical running stats (they come from the same all_reduce).
        assert torch.equal(o["running_mean"], outs[0]["running_mean"])
        assert torch.equal(o["running_var"], outs[0]["running_var"])
    for key in ("eval_y", "eval_free_y"):
        got = torch.cat([o[key].to(torch.float64) for o in outs if o[key] is not None])
        _close(got, r64[key], rlow[key], dtype, f"{tag} {key}", scale * (10 if dtype == torch.float32 else 1))


# ------------------------------------------------------------------------------------------ workers


def _equivalence_worker(rank, world_size, backend="cpu"):
    os.environ[BACKEND_ENV_VAR] = backend  # every layer of this run uses this kernel backend
    registry.clear_backend_cache()
    results = {"cases": [_run_case(rank, world_size, i, case) for i, case in enumerate(CASES)]}
    results["backend"] = get_backend(device="cpu").name
    results["large_mean"] = _run_case(
        rank, world_size, 99, (4, False, torch.float32, 0.1, True), large_mean=True
    )

    # A global batch with one value per channel raises on EVERY rank (no hang), like torch.
    bn = SyncBatchNorm(C)
    x = torch.randn(1 if rank == 0 else 0, C)
    try:
        bn(x)
        results["one_value_error"] = None
    except ValueError as err:
        results["one_value_error"] = str(err)
    assert int(bn.num_batches_tracked) == 1

    # Subgroups: consecutive blocks of one rank are plain local batch norm; a block of all ranks is WORLD.
    singles = create_process_groups(1)
    whole = create_process_groups(world_size)
    x = torch.randn(4 + rank, C, 3, generator=torch.Generator().manual_seed(rank))
    local = nn.BatchNorm1d(C)(x)
    results["singles_equal_local"] = torch.allclose(
        SyncBatchNorm(C, process_group=singles)(x), local, atol=1e-6
    )
    results["whole_y"] = SyncBatchNorm(C, process_group=whole)(x).detach()
    results["whole_x"] = x
    if world_size == 3:
        # Every rank creates the subgroup; only its members use it.
        pair = dist.new_group([0, 2])
        if rank != 1:
            results["pair"] = _run_case(
                rank, world_size, 43, (4, True, torch.float32, 0.1, True), pair, [0, 2]
            )
        try:
            create_process_groups(2)
        except ValueError as err:
            results["bad_group_size"] = str(err)
        try:  # the ranks disagree: every rank raises, before any group is made
            create_process_groups(3 if rank == 0 else 1)
        except ValueError as err:
            results["disagreeing_group_sizes"] = str(err)
    if world_size == 2:
        results["checkpoint"] = _checkpoint_worker(rank, world_size)
        results["torch_errors"] = _torch_sync_batch_norm_errors()
    # The collectives are still aligned after all that.
    t = torch.ones(1)
    dist.all_reduce(t)
    results["final_sum"] = t
    return results


def _torch_sync_batch_norm_errors():
    """The anchor on gloo/CPU: torch's SyncBatchNorm and DDP's check (what sync_batchnorm=True hits)."""
    errors = {}
    try:
        nn.SyncBatchNorm(C)(torch.randn(4, C))
    except ValueError as err:
        errors["forward"] = str(err)
    try:
        nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(C, C), nn.SyncBatchNorm(C)))
    except ValueError as err:
        errors["ddp"] = str(err)
    ours = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(C, C), SyncBatchNorm(C)))
    ours(torch.randn(4, C)).sum().backward()
    return errors


def _checkpoint_worker(rank, world_size):
    """Checkpoint recomputation joins the collective but does not update running stats twice."""
    from torch.utils.checkpoint import checkpoint

    out = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Conv2d(2, C, 3, padding=1), SyncBatchNorm(C, momentum=0.3))
        plain = nn.Sequential(nn.Conv2d(2, C, 3, padding=1), SyncBatchNorm(C, momentum=0.3))
        plain.load_state_dict(block.state_dict())
        x = torch.randn(2 + rank, 2, 4, 4, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        y = checkpoint(block, x, use_reentrant=reentrant)
        y.square().sum().backward()
        x2 = x.detach().clone().requires_grad_(True)
        plain(x2).square().sum().backward()
        bn, ref = block[1], plain[1]
        out[reentrant] = {
            "nbt": int(bn.num_batches_tracked),
            "stats_equal": torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6)
            and torch.allclose(bn.running_var, ref.running_var, atol=1e-6),
            "grad_equal": torch.allclose(x.grad, x2.grad, atol=1e-5)
            and torch.allclose(block[0].weight.grad, plain[0].weight.grad, atol=1e-5),
        }
    return out


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.smoke
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world_size", "backend"),
    [(2, "cpu"), (3, "cpu"), (2, "reference")],
    ids=["2-cpu", "3-cpu", "2-reference"],
)
def test_matches_one_process_batch_norm_on_concatenation(world_size, backend):
    if backend == "cpu":
        require_cpu_backend()
    outs = run_distributed(_equivalence_worker, world_size, backend, timeout=180)
    assert [o["backend"] for o in outs] == [backend] * world_size
    for i, case in enumerate(CASES):
        _check_case(i, case, [o["cases"][i] for o in outs])
    _check_case(99, (4, False, torch.float32, 0.1, True), [o["large_mean"] for o in outs], large_mean=True)
    for o in outs:
        assert o["one_value_error"] is not None
        assert "Expected more than 1 value per channel" in o["one_value_error"]
        assert o["singles_equal_local"]
        assert float(o["final_sum"]) == world_size
    x = torch.cat([o["whole_x"] for o in outs]).double()
    expected = nn.BatchNorm1d(C).double()(x).detach()
    torch.testing.assert_close(
        torch.cat([o["whole_y"] for o in outs]).double(), expected, rtol=1e-5, atol=1e-5
    )
    if world_size == 2:
        # Checkpoint recomputation joins the collective but does not update running stats twice.
        for o in outs:
            for reentrant in (False, True):
                assert o["checkpoint"][reentrant] == {"nbt": 1, "stats_equal": True, "grad_equal": True}
            # torch's SyncBatchNorm fails on gloo/CPU where ours trains under DDP.
            assert "expected input tensor to be on GPU" in o["torch_errors"]["forward"]
            assert "SyncBatchNorm layers only work with GPU modules" in o["torch_errors"]["ddp"]
    if world_size == 3:
        _check_case(43, (4, True, torch.float32, 0.1, True), [outs[0]["pair"], outs[2]["pair"]])
        for o in outs:
            assert "must divide the world size 3" in o["bad_group_size"]
            said = "passed different `group_size`s (rank 0: 3; rank 1: 1; rank 2: 1)"
            assert said in o["disagreeing_group_sizes"]


def test_checkpoint_recomputation_single_process():
    from torch.utils.checkpoint import checkpoint

    for momentum in (0.1, None):
        bn = SyncBatchNorm(C, momentum=momentum)
        x = torch.randn(4, C, 5, requires_grad=True)
        checkpoint(bn, x, use_reentrant=False).sum().backward()
        ref = nn.BatchNorm1d(C, momentum=momentum)
        ref(x.detach())
        assert int(bn.num_batches_tracked) == 1
        torch.testing.assert_close(bn.running_mean, ref.running_mean)
        torch.testing.assert_close(bn.running_var, ref.running_var)


@pytest.mark.skipif(
    not at_least(torch.__version__, "2.13"),
    reason="torch 2.5's compiled checkpoint replays the buffer update too (the docstring's versions)",
)
def test_a_compiled_function_holding_the_checkpoint_updates_the_statistics_once():
    # The remedy the docstring gives for a checkpoint around a layer compiled on its own (whose
    # replayed graph updates the statistics again): compile the checkpointed function.
    from torch.utils.checkpoint import checkpoint

    torch._dynamo.reset()
    bn, ref = SyncBatchNorm(C), nn.BatchNorm1d(C)
    x = torch.randn(4, C, 5) * 3 + 1
    step = torch.compile(lambda x: checkpoint(bn, x, use_reentrant=False), fullgraph=True)
    step(x.clone().requires_grad_()).sum().backward()
    ref(x)
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close((bn.running_mean, bn.running_var), (ref.running_mean, ref.running_var))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_combination_is_exact_far_from_zero(backend):
    """|mean| / std = 1e8 in float64: the payloads about a shared shift, summed over shards, give the
    moments of the whole batch where raw sums cancel completely."""
    if backend == "cpu":
        require_cpu_backend()
    kernels = get_backend(backend, device="cpu")
    g = torch.Generator().manual_seed(0)
    shards = [1e8 + torch.randn(n, C, generator=g, dtype=torch.float64) for n in (7, 0, 30, 1)]
    full = torch.cat(shards)
    shift = full[:1].mean(0)  # any value identical on every rank near the data, e.g. running_mean
    payload = sum(kernels.run("batch_norm_moments", s, shift) for s in shards)
    n, mean, var = payload_moments(payload, shift)
    assert float(n) == full.shape[0]
    torch.testing.assert_close(mean, full.mean(0), rtol=1e-15, atol=1e-7)
    torch.testing.assert_close(var, full.var(0, unbiased=False), rtol=1e-6, atol=0)
    # The raw E[x^2] - E[x]^2 form (what an all_reduce of (sum, sum of squares) gives) is useless here.
    raw = (full**2).mean(0) - full.mean(0) ** 2
    assert ((raw - full.var(0, unbiased=False)).abs() > 0.1).any()


def test_single_process_fallback_matches_torch():
    torch.manual_seed(0)
    for momentum in (0.1, None):
        ours, ref = SyncBatchNorm(C, momentum=momentum), nn.BatchNorm2d(C, momentum=momentum)
        for _ in range(3):
            x = torch.randn(4, C, 3, 3).contiguous(memory_format=torch.channels_last)
            xr = x.clone().requires_grad_(True)
            x.requires_grad_(True)
            y = ours(x)
            assert y.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(y, ref(xr))
            y.sum().backward()
        torch.testing.assert_close(ours.running_mean, ref.running_mean)
        torch.testing.assert_close(ours.running_var, ref.running_var)
        assert int(ours.num_batches_tracked) == 3
    stats = sync_batch_norm_stats(torch.ones(3, C) * 2, sync=False)
    assert float(stats[0]) == 3 and torch.equal(stats[1], torch.full((C,), 2.0, dtype=torch.float64))
    # An input that requires grad (e.g. an activation): the statistics come without autograd history.
    h = torch.randn(5, C, 2, generator=torch.Generator().manual_seed(3), requires_grad=True)
    count, mean, m2 = sync_batch_norm_stats(h * 1.0, sync=False)
    hd = h.detach().double()
    assert float(count) == 10 and not mean.requires_grad
    tol = dict(rtol=1e-5, atol=1e-6)  # float32 accumulation
    torch.testing.assert_close(mean, hd.mean((0, 2)), **tol)
    torch.testing.assert_close(m2, ((hd - hd.mean((0, 2), keepdim=True)) ** 2).sum((0, 2)), **tol)
    # A shift of another float dtype is taken as float64.
    _, mean_b, m2_b = sync_batch_norm_stats(h, shift=torch.ones(C, dtype=torch.bfloat16), sync=False)
    torch.testing.assert_close(mean_b, mean, **tol)
    torch.testing.assert_close(m2_b, m2, **tol)


def test_a_gradient_penalty_differentiates_the_cumulative_local_layer_twice_as_torch():
    # momentum=None outside distributed training took the layer's own autograd Function, whose
    # backward is not differentiable: create_graph=True raised where torch's layer (and ours with a
    # momentum) differentiate twice.
    torch.manual_seed(0)
    ours, ref = SyncBatchNorm(C, momentum=None), nn.BatchNorm2d(C, momentum=None)
    for _ in range(3):
        x = torch.randn(4, C, 3, 3, requires_grad=True)
        penalties = []
        for layer in (ours, ref):
            (grad,) = torch.autograd.grad(layer(x).pow(3).sum(), x, create_graph=True)
            penalties.append(grad.square().sum())
            (second,) = torch.autograd.grad(penalties[-1], x)
            penalties.append(second)
        torch.testing.assert_close(penalties[0], penalties[2])
        torch.testing.assert_close(penalties[1], penalties[3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)


def test_the_cumulative_local_layer_in_float64_moves_its_statistics_as_torch_does():
    # the factor 1 / num_batches_tracked was an int64 tensor's reciprocal, float32: float64 running
    # statistics drifted from torch's by 1e-9 (relative) after a few steps
    torch.manual_seed(0)
    ours, ref = SyncBatchNorm(C, momentum=None).double(), nn.BatchNorm2d(C, momentum=None).double()
    for _ in range(7):
        x = torch.randn(4, C, 3, 3, dtype=torch.float64) * 3 + 1
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    for name in ("running_mean", "running_var"):  # ATen's arithmetic in both: a few float64 ulps
        torch.testing.assert_close(getattr(ours, name), getattr(ref, name), rtol=1e-15, atol=0)


def test_autocast_keeps_float32_statistics():
    bn = SyncBatchNorm(C, momentum=None)
    conv = nn.Conv2d(2, C, 1)
    x = torch.randn(4, 2, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = conv(x)
        y = bn(h)
        # The module runs its kernels with autocast off and restores it for the rest of the region.
        assert torch.is_autocast_enabled("cpu") and conv(x).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    assert h.dtype == y.dtype == torch.bfloat16
    assert bn.running_mean.dtype == bn.weight.dtype == torch.float32
    torch.testing.assert_close(bn.running_mean, h.float().mean((0, 2, 3)).detach(), rtol=1e-6, atol=1e-6)


def test_state_dict_interchange_with_torch_modules():
    torch.manual_seed(0)
    src = nn.BatchNorm2d(C)
    src(torch.randn(4, C, 2, 2))
    with torch.no_grad():
        src.weight.uniform_()
    ours = SyncBatchNorm(C)
    ours.load_state_dict(src.state_dict())
    torch_sync = nn.SyncBatchNorm(C)
    torch_sync.load_state_dict(ours.state_dict())
    back = nn.BatchNorm2d(C)
    back.load_state_dict(torch_sync.state_dict())
    for key, value in src.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert list(ours.state_dict()) == list(src.state_dict()) and ours._version == src._version == 2
    # Version-1 checkpoints (before num_batches_tracked) migrate as in torch.
    from collections import OrderedDict

    old = OrderedDict((k, v) for k, v in src.state_dict().items() if k != "num_batches_tracked")
    old._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    torch_old = nn.BatchNorm2d(C)
    torch_old.num_batches_tracked.fill_(5)
    ours.num_batches_tracked.fill_(5)
    torch_old.load_state_dict(old)
    ours.load_state_dict(old)
    # torch keeps the module's current count when the checkpoint predates it; so do we.
    assert int(ours.num_batches_tracked) == int(torch_old.num_batches_tracked) == 5
    torch.testing.assert_close(ours.running_var, src.running_var)


def test_bad_inputs():
    bn = SyncBatchNorm(C)
    with pytest.raises(ValueError, match=r"expected input of shape \(N, 3, \*\).*got shape \(3,\)"):
        bn(torch.randn(C))
    with pytest.raises(ValueError, match=r"expected input of shape \(N, 3, \*\).*got shape \(2, 4, 5\)"):
        bn(torch.randn(2, 4, 5))
    with pytest.raises(
        TypeError, match=r"expected a float16, bfloat16, float32 or float64 input, got dtype torch.int64"
    ):
        bn(torch.ones(2, C, dtype=torch.long))
    with pytest.raises(TypeError, match=r"got dtype torch.float8_e4m3fn"):
        bn(torch.ones(2, C).to(torch.float8_e4m3fn))
    # The functional statistics check their arguments too.
    with pytest.raises(TypeError, match=r"`x` must be a torch.Tensor"):
        sync_batch_norm_stats([[1.0, 2.0]], sync=False)
    with pytest.raises(ValueError, match=r"`shift` must have shape \(3,\) on cpu, got \(2,\)"):
        sync_batch_norm_stats(torch.randn(4, C), shift=torch.zeros(2, dtype=torch.float64), sync=False)
    with pytest.raises(ValueError, match=r"^SyncBatchNorm: `eps` must be a finite number > 0\.0, got 0\.0$"):
        SyncBatchNorm(C, eps=0.0)
    with pytest.raises(TypeError, match=r"`eps` must be a finite number > 0\.0, got nan \(float\)$"):
        SyncBatchNorm(C, eps=float("nan"))
    in_range = r"`momentum` must be a finite number in \[0\.0, 1\.0\] or None, got "
    with pytest.raises(ValueError, match=in_range + r"1\.5\. HINT: None: a cumulative average\.$"):
        SyncBatchNorm(C, momentum=1.5)
    with pytest.raises(ValueError, match=in_range + r"-0\.1\."):
        SyncBatchNorm(C, momentum=-0.1)
    with pytest.raises(ValueError, match=r"^SyncBatchNorm: `num_features` must be an int >= 1, got 0$"):
        SyncBatchNorm(0)
    with pytest.raises(TypeError, match=r"`num_features` must be an int >= 1, got 3\.0 \(float\)$"):
        SyncBatchNorm(3.0)
    with pytest.raises(TypeError, match=r"`backend` must be a kernel backend name \(str\) or None, got 3"):
        SyncBatchNorm(C, backend=3)
    with pytest.raises(ValueError, match=r"unknown kernel backend 'nope'"):
        SyncBatchNorm(C, backend="nope")
    with pytest.raises(
        TypeError, match=r"`process_group` must be a torch.distributed.ProcessGroup or None, got 'world'"
    ):
        SyncBatchNorm(C, process_group="world")
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        SyncBatchNorm(C, momentum=None)(torch.randn(1, C))
    with pytest.raises(TypeError, match=r"^create_process_groups: `group_size` must be an int >= 1, got 2\."):
        create_process_groups(2.0)
    with pytest.raises(ValueError, match=r"^create_process_groups: `group_size` must be an int >= 1, got 0$"):
        create_process_groups(0)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_torch_compile_without_graph_breaks(momentum):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, C, 3), SyncBatchNorm(C, momentum=momentum), nn.ReLU())
    reference = nn.Sequential(nn.Conv2d(2, C, 3), nn.BatchNorm2d(C, momentum=momentum), nn.ReLU())
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 2, 6, 6)
    explanation = torch._dynamo.explain(copy.deepcopy(model))(x)  # explain runs the model: use a copy
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var, rtol=1e-5, atol=1e-6)


def test_non_finite_input_gives_torchs_result_without_warnings():
    """inf in the input gives the NaN/inf torch's BatchNorm gives (inf - inf in the moments), with no
    RuntimeWarning."""
    x = torch.randn(4, C, 3, 3)
    x[0, 0, 0, 0] = float("inf")
    ours, ref = SyncBatchNorm(C, momentum=None), nn.BatchNorm2d(C, momentum=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = ours(x)
    torch.testing.assert_close(y, ref(x), equal_nan=True)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, equal_nan=True)
    torch.testing.assert_close(ours.running_var, ref.running_var, equal_nan=True)
    # The next batches train on their own statistics, as torch's: the moments were taken about the
    # running mean, inf or NaN from then on, and every later output was NaN (0 of 5 finite).
    for _ in range(5):
        x = torch.randn(4, C, 3, 3)
        y = ours(x)
        assert y.isfinite().all()
        torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, equal_nan=True)
    count, mean, m2 = sync_batch_norm_stats(x, shift=ours.running_mean)  # (non-finite there too)
    torch.testing.assert_close(mean, x.double().mean((0, 2, 3)))
    torch.testing.assert_close(m2, x.double().var((0, 2, 3), unbiased=False) * count)
