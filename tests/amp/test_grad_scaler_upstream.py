# Ported from PyTorch (https://github.com/pytorch/pytorch): test/test_torch.py and
# torch/testing/_internal/common_cuda.py. PyTorch's licence notice follows.
#
# From PyTorch:
#
# Copyright (c) 2016-     Facebook, Inc            (Adam Paszke)
# Copyright (c) 2014-     Facebook, Inc            (Soumith Chintala)
# Copyright (c) 2011-2014 Idiap Research Institute (Ronan Collobert)
# Copyright (c) 2012-2014 Deepmind Technologies    (Koray Kavukcuoglu)
# Copyright (c) 2011-2012 NEC Laboratories America (Koray Kavukcuoglu)
# Copyright (c) 2011-2013 NYU                      (Clement Farabet)
# Copyright (c) 2006-2010 NEC Laboratories America (Ronan Collobert, Leon Bottou, Iain Melvin, Jason Weston)
# Copyright (c) 2006      Idiap Research Institute (Samy Bengio)
# Copyright (c) 2001-2004 Idiap Research Institute (Ronan Collobert, Samy Bengio, Johnny Mariethoz)
#
# All rights reserved.
#
# Redistribution and use in source and binary forms, with or without
# modification, are permitted provided that the following conditions are met:
#
# 1. Redistributions of source code must retain the above copyright
#    notice, this list of conditions and the following disclaimer.
#
# 2. Redistributions in binary form must reproduce the above copyright
#    notice, this list of conditions and the following disclaimer in the
#    documentation and/or other materials provided with the distribution.
#
# 3. Neither the names of Facebook, Deepmind Technologies, NYU, NEC Laboratories America
#    and IDIAP Research Institute nor the names of its contributors may be
#    used to endorse or promote products derived from this software without
#    specific prior written permission.
#
# THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"
# AND ANY EXPRESS OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE
# IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE
# ARE DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT OWNER OR CONTRIBUTORS BE
# LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR
# CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF
# SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS
# INTERRUPTION) HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN
# CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING NEGLIGENCE OR OTHERWISE)
# ARISING IN ANY WAY OUT OF THE USE OF THIS SOFTWARE, EVEN IF ADVISED OF THE
# POSSIBILITY OF SUCH DAMAGE.
#
# ruff: noqa: B023
# (B023: upstream defines ``run`` closures inside ``for enabled in True, False`` loops and calls them in the
# same iteration; they are kept as upstream wrote them.)
"""PyTorch's own ``GradScaler`` tests, run against ``torch.amp.GradScaler`` AND ``DynamicLossScaler``.

Ported from ``test/test_torch.py`` of pytorch/pytorch (class ``TestTorchDeviceType``, newest stored
version; its helpers ``_create_scaling_models_optimizers`` / ``_create_scaling_case`` are vendored from
``torch/testing/_internal/common_cuda.py`` of the installed torch 2.13.0 and are identical to the ones
that file imports). The port changes the device only (``device`` is ``"cpu"``), plus the plumbing a
pytest port needs:

* every scaler is built through the fixture ``make`` exactly as upstream builds ``GradScaler``
  (``torch.GradScaler(device=..., **kw)`` / ``partial(torch.GradScaler, device=...)`` become
  ``make(device=..., **kw)`` / ``partial(make, device=...)``); ``make`` is parametrized over
  ``"GradScaler"`` -> ``torch.amp.GradScaler`` and
  ``"DynamicLossScaler"`` -> ``lightning_ext.amp.DynamicLossScaler``;
* ``self.assertEqual`` & co. are the minimal equivalents of ``common_utils.TestCase``'s (same tolerance
  rules, see :class:`_TestCaseAsserts`); the RNG is seeded with 1234 before each test as ``TestCase.setUp``
  does; ``@dtypes`` / ``@parametrize`` / ``@optims`` become ``pytest.mark.parametrize``;
* the CUDA-only branches inside CPU-runnable tests (``TEST_MULTIGPU`` grads on ``cuda:1``,
  ``torch.cuda.FloatTensor`` / ``amp_definitely_not_available()`` checks) are dropped: on CPU they never run.

Upstream test (test_torch.py) -> test here (all in ``TestTorchDeviceType``):
  test_pickle_gradscaler -> test_pickle_grad_scaler (renamed: -k GradScaler selects GradScaler's half only)
  test_grad_scaling_unscale -> test_grad_scaling_unscale
  test_grad_scaling_update_scale -> test_grad_scaling_update_scale (no scaler: torch._amp_update_scale_ only)
  test_grad_scaling_unscale_sparse -> test_grad_scaling_unscale_sparse
  test_grad_scaling_state_dict -> test_grad_scaling_state_dict
  test_grad_scaling_autocast -> test_grad_scaling_autocast
  test_grad_scale_will_not_overflow -> test_grad_scale_will_not_overflow
  test_grad_scaling_clipping -> test_grad_scaling_clipping
  test_grad_scaling_clipping_separate_unscale -> test_grad_scaling_clipping_separate_unscale
  test_grad_scaling_penalty -> test_grad_scaling_penalty
  test_grad_scaling_accumulation -> test_grad_scaling_accumulation
  test_grad_scaling_multiple -> test_grad_scaling_multiple
  test_grad_scaler_pass_itself -> test_grad_scaler_pass_itself
  test_grad_scaler_deprecated_warning -> test_grad_scaler_deprecated_warning (torch's alias only, no ``make``)

Left out:
  test_params_invalidated_with_grads_invalidated_between_unscale_and_step: not a test_grad_scal* test; needs
    optim_db's input generators (torch.testing._internal.common_optimizers), whose import runs
    torch.backends.disable_global_flags() for the whole pytest process (breaks Lightning's Trainer).
  test_params_invalidated_with_grads_invalidated_and_graph_partition: the same under an inductor config patch.
  GradScaler tests of test/test_cuda.py and test/distributed/test_multigpu.py (CUDA graphs, streams, several
    GPUs): CUDA-only, and outside test_torch.py.

Not upstream: :class:`TestDynamicLossScalerSideBySide` trains identical models with
``torch.amp.GradScaler("cpu", **kw)`` and ``DynamicLossScaler("cpu", **kw)`` side by side and requires
the same scale after every step and bit-identical weights and optimizer state at the end.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import random
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import chain, pairwise

import pytest
import torch

from lightning_ext.amp import DynamicLossScaler

_SCALERS = {"GradScaler": torch.amp.GradScaler, "DynamicLossScaler": DynamicLossScaler}


@pytest.fixture(params=list(_SCALERS))
def make(request):
    """The scaler class under test, called exactly as upstream calls ``torch.GradScaler``."""
    return _SCALERS[request.param]


@pytest.fixture
def device():
    """Upstream's device-generic tests get the device as a string; here always ``"cpu"``."""
    return "cpu"


# ------------------------------------------------------------------------------------------------
# Helpers vendored from torch/testing/_internal/common_cuda.py (torch 2.13.0); default device "cpu".
# ------------------------------------------------------------------------------------------------


# Shared by test_torch.py and test_multigpu.py
def _create_scaling_models_optimizers(device="cpu", optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    # Create a module+optimizer that will use scaling, and a control module+optimizer
    # that will not use scaling, against which the scaling-enabled module+optimizer can be compared.
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device=device)
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device=device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            s.copy_(c)

    kwargs = {"lr": 1.0}
    if optimizer_kwargs is not None:
        kwargs.update(optimizer_kwargs)
    opt_control = optimizer_ctor(mod_control.parameters(), **kwargs)
    opt_scaling = optimizer_ctor(mod_scaling.parameters(), **kwargs)

    return mod_control, mod_scaling, opt_control, opt_scaling


# Shared by test_torch.py, test_cuda.py and test_multigpu.py
def _create_scaling_case(
    device="cpu", dtype=torch.float, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
):
    data = [
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
        (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
    ]

    loss_fn = torch.nn.MSELoss().to(device)

    skip_iter = 2

    return _create_scaling_models_optimizers(  # noqa: RUF005 (upstream's concatenation)
        device=device,
        optimizer_ctor=optimizer_ctor,
        optimizer_kwargs=optimizer_kwargs,
    ) + (data, loss_fn, skip_iter)


# ------------------------------------------------------------------------------------------------
# The TestCase assertions the ported tests use
# ------------------------------------------------------------------------------------------------

# NumberPair's default tolerances: float inputs compare as float32, ints exactly.
_FLOAT_RTOL, _FLOAT_ATOL = 1.3e-6, 1e-5


def _to_number(x):
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise AssertionError(
                f"Only single element tensors can be compared against a number, got {x.numel()}"
            )
        x = x.item()
    return int(x) if isinstance(x, bool) else x


class _TestCaseAsserts:
    """``common_utils.TestCase``'s assertions, reduced to the input kinds the ported tests compare.

    ``assertEqual``: two tensors -> ``torch.testing.assert_close`` (``equal_nan=True``, dtypes must match,
    devices need not: TestCase's defaults); a number against a number or a 1-element tensor ->
    RelaxedNumberPair's rule (float32 tolerances if either side is a float, exact for ints); mappings and
    sequences element by element; anything else ``==``.
    """

    def assertEqual(self, x, y, msg=None, *, atol=None, rtol=None, equal_nan=True, exact_dtype=True):
        __tracebackhide__ = True
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            try:
                torch.testing.assert_close(
                    x,
                    y,
                    atol=atol,
                    rtol=rtol,
                    equal_nan=equal_nan,
                    check_dtype=exact_dtype,
                    check_device=False,
                )
            except AssertionError as e:
                raise AssertionError(f"{e}\n{msg}" if msg else str(e)) from None
        elif isinstance(x, (int, float, torch.Tensor)) and isinstance(y, (int, float, torch.Tensor)):
            a, b = _to_number(x), _to_number(y)
            if rtol is None and atol is None:
                floats = isinstance(a, float) or isinstance(b, float)
                rtol, atol = (_FLOAT_RTOL, _FLOAT_ATOL) if floats else (0.0, 0.0)
            if (
                equal_nan
                and isinstance(a, float)
                and isinstance(b, float)
                and math.isnan(a)
                and math.isnan(b)
            ):
                return
            if not (a == b or abs(a - b) <= atol + rtol * abs(b)):
                raise AssertionError(
                    f"Scalars are not close: {a!r} != {b!r} (atol={atol}, rtol={rtol}) {msg or ''}"
                )
        elif isinstance(x, Mapping) and isinstance(y, Mapping):
            if set(x) != set(y):
                raise AssertionError(
                    f"Keys differ: {sorted(map(str, x))} != {sorted(map(str, y))} {msg or ''}"
                )
            for k in x:
                self.assertEqual(
                    x[k], y[k], msg, atol=atol, rtol=rtol, equal_nan=equal_nan, exact_dtype=exact_dtype
                )
        elif isinstance(x, Sequence) and isinstance(y, Sequence) and not isinstance(x, str):
            if len(x) != len(y):
                raise AssertionError(f"Lengths differ: {len(x)} != {len(y)} {msg or ''}")
            for a, b in zip(x, y):
                self.assertEqual(
                    a, b, msg, atol=atol, rtol=rtol, equal_nan=equal_nan, exact_dtype=exact_dtype
                )
        elif not x == y:
            raise AssertionError(f"{x!r} != {y!r} {msg or ''}")

    def assertTrue(self, expr, msg=None):
        __tracebackhide__ = True
        if not expr:
            raise AssertionError(msg or f"{expr!r} is not true")

    def assertFalse(self, expr, msg=None):
        __tracebackhide__ = True
        if expr:
            raise AssertionError(msg or f"{expr!r} is not false")

    def assertRaises(self, expected_exception):
        return pytest.raises(expected_exception)

    def assertWarns(self, expected_warning):
        return pytest.warns(expected_warning)

    def assertWarnsRegex(self, expected_warning, expected_regex):
        return pytest.warns(expected_warning, match=expected_regex)


# ------------------------------------------------------------------------------------------------
# The ported tests
# ------------------------------------------------------------------------------------------------

_AUTOCAST_OPTIMS = [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD]  # optim_db order


class TestTorchDeviceType(_TestCaseAsserts):
    exact_dtype = True

    @pytest.fixture(autouse=True)
    def _seed(self):
        # common_utils.TestCase.setUp -> set_rng_seed(SEED), SEED = 1234
        torch.manual_seed(1234)
        random.seed(1234)

    # FIXME: move to test_serialization
    def test_pickle_grad_scaler(self, make, device):
        # This test should pass in 3 cases for cuda:
        #  1. cuda is not available.
        #  2. cuda is available but device is not cuda.
        #  3. cuda is available and device is cuda.
        # In case 1, a and b disable themselves on construction and shouldn't try to pickle workhorse
        # attributes.
        # In case 2, a and b are enabled.  Workhorse attributes participate in pickling, but none are
        # lazy-inited to cuda Tensors, because I don't want to do cuda things if device is not cuda.
        # In case 3, a and b are enabled and we may also try lazy-initing _scale to a cuda tensor.
        device = torch.device(device)
        try_lazy_inits = (True, False)
        GradScaler = partial(make, device=device.type)
        for lazy_init_scale in try_lazy_inits:
            a = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
            # (the device.type == "cuda" branch, amp_definitely_not_available(), is CUDA-only)
            self.assertTrue(a.is_enabled())
            if lazy_init_scale:
                # Dummy a.scale() call lazy-inits a._scale Tensor.
                a.scale(torch.tensor([4.0], dtype=torch.float32, device=device))
                self.assertTrue(a._scale.device.type == device.type)
            # The following three lines should work whether or not cuda is available.
            serialized = pickle.dumps(a)
            b = pickle.loads(serialized)
            self.assertEqual(b.is_enabled(), a.is_enabled())
            if a.is_enabled():
                self.assertEqual(b.get_scale(), 3.0)
                self.assertEqual(b.get_growth_factor(), 4.0)
                self.assertEqual(b.get_backoff_factor(), 0.5)
                self.assertEqual(b.get_growth_interval(), 2)
                self.assertEqual(b._init_growth_tracker, 0)
                # supplies a dummy key to test the defaultdict's default_factory
                self.assertEqual(
                    b._per_optimizer_states["fdsa"], torch.amp.grad_scaler._refresh_per_optimizer_state()
                )
                if lazy_init_scale:
                    self.assertEqual(b.scale(torch.tensor([4.0], dtype=torch.float32, device=device)), 12.0)

    @pytest.mark.parametrize("dtype", [torch.float, torch.double], ids=["float32", "float64"])
    def test_grad_scaling_unscale(self, make, device, dtype):
        device = torch.device(device)
        device0 = "cuda:0" if device.type == "cuda" else "cpu"
        inv_scale = torch.full((1,), 0.25, dtype=torch.float, device=device0)
        found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device0)

        size = 20
        g = torch.full((size, size), 4.0, dtype=dtype, device=device0)
        ginf = g.clone()
        ginf[2, 2] = float("inf")
        gnan = g.clone()
        gnan[2, 2] = float("nan")

        # Tries selected combinations of
        #  - contiguous grads
        #  - g.clone().t() which is not contiguous but still non overlapping and dense
        #  - variants of g.clone()[:, :5] which are not non overlapping and dense
        # Non overlapping and dense grads route into a multi tensor apply kernel,
        # others use a fallback per-tensor kernel, so we should try both.
        cases = (
            ([g.clone(), g.clone()], False),
            ([g.clone(), g.clone().t()], False),
            ([g.clone(), g.clone()[:, :5]], False),
            ([g.clone()[:, :5], g.clone()[:, :5]], False),
            ([g.clone(), ginf.clone()], True),
            ([g.clone(), gnan.clone()], True),
            ([g.clone(), ginf.clone()[:, :5]], True),
            ([g.clone(), gnan.clone()[:, :5]], True),
            ([ginf.clone(), g.clone()[:, :5]], True),
            ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
        )

        for grads, has_inf in cases:
            found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            if has_inf:
                self.assertEqual(found_inf, 1.0)
            else:
                self.assertEqual(found_inf, 0.0)
                for grad in grads:
                    self.assertEqual(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

        # When passing lists with mismatched dtypes to a raw
        # _amp_foreach_non_finite_check_and_unscale_ call on CUDA,
        # it's expected to fall back to single-tensor TensorIterator kernel.
        grads = [g.clone(), g.to(dtype=torch.float16)]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        for grad in grads:
            self.assertEqual(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

        # (the mismatched-devices check, device.type == "cuda" and TEST_MULTIGPU, is CUDA-only)

        # Creates a list of grads with mismatched dtypes and devices, to ensure
        # scaler._unscale_grads_ organizes grads by dtype and device before calling
        # _amp_foreach_non_finite_check_and_unscale_ on each set.
        # If inject_inf >= 0, writes an inf into one grad for _unscale_grads_ to find.
        def perfect_storm_grads(inject_inf):
            grads = [g.clone(), g.clone()[:, :5], g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
            # (the cuda:1 grads of device.type == "cuda" and TEST_MULTIGPU are CUDA-only)
            if inject_inf >= 0:
                grads[inject_inf][2, 2] = float("inf")
            return grads

        GradScaler = partial(make, device=device.type)
        scaler = GradScaler()
        dummy_params = [torch.empty_like(g) for g in perfect_storm_grads(-1)]
        dummy_opt = torch.optim.SGD(dummy_params, lr=1.0)

        # Ensures the inf/nan checking can find an inf injected onto any grad in the perfect storm.
        for inject_inf in range(-1, len(dummy_params)):
            found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device0)
            grads = perfect_storm_grads(inject_inf)
            for i, p in enumerate(dummy_params):
                p.grad = grads[i]
            found_inf_per_device = scaler._unscale_grads_(dummy_opt, inv_scale, found_inf, True)
            if inject_inf < 0:
                # No inf was injected, ensures unscaling worked normally.
                self.assertTrue(sum(v.item() for v in found_inf_per_device.values()) == 0)
                for grad in grads:
                    self.assertEqual(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
            else:
                # inf was injected, ensures inf was found.
                self.assertTrue(sum(v.item() for v in found_inf_per_device.values()) == 1)

    @pytest.mark.parametrize("dtype", [torch.float], ids=["float32"])
    def test_grad_scaling_update_scale(self, device, dtype):
        growth = 2.0
        backoff = 0.25
        growth_interval = 2
        scale = torch.full((1,), 4.0, dtype=dtype, device=device)
        growth_tracker = torch.full((1,), 0.0, dtype=torch.int32, device=device)
        found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device)

        # Simulates 2 consecutive unskipped iterations
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
        self.assertEqual(growth_tracker, 1)
        self.assertEqual(scale, 4.0)
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
        self.assertEqual(growth_tracker, 0)
        self.assertEqual(scale, 8.0)

        # Simulates a skipped iteration
        found_inf.fill_(1.0)
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
        self.assertEqual(growth_tracker, 0)
        self.assertEqual(scale, 2.0)

    @pytest.mark.parametrize("dtype", [torch.float], ids=["float32"])
    def test_grad_scaling_unscale_sparse(self, make, device, dtype):
        device = torch.device(device)
        scaler = make(device=device.type)

        inv_scale = torch.full((1,), 0.25, dtype=dtype, device=device)
        found_inf = torch.empty((1,), dtype=dtype, device=device)
        cur = found_inf.device

        i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=device, dtype=torch.int64)
        v = torch.tensor([16.0, 32.0, 64.0], device=device, dtype=torch.float)
        s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)

        p = s.clone()
        if not p.is_sparse:
            raise AssertionError("expected p to be sparse")
        opt = torch.optim.SGD([p], lr=1.0)

        p.grad = s.clone()
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
        self.assertEqual(found_inf, 0.0)
        self.assertEqual(p.grad.to_dense(), (s / 4).to_dense())

        v = torch.FloatTensor([16.0, 32.0, float("inf")])
        p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
        self.assertEqual(found_inf, 1.0)

        v = torch.FloatTensor([16.0, 32.0, float("nan")])
        p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, False)[cur]
        self.assertEqual(found_inf, 1.0)

        p = s.clone().half()
        if not p.is_sparse:
            raise AssertionError("expected p to be sparse")
        opt = torch.optim.SGD([p], lr=1.0)

        p.grad = s.clone().half()
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
        self.assertEqual(found_inf, 0.0)
        self.assertEqual(p.grad.to_dense(), (s.half() / 4).to_dense())

        # Creates fp16 sparse tensor with duplicated indices (uncoalesced).  The uncoalesced representation
        # does not overflow in fp16, but the coalesced representation would, because 64000 + 64000 > fp16 max.
        # _amp_non_finite_check_and_unscale_ should report an overflow here.
        i = torch.LongTensor([[0, 1, 0], [2, 0, 2]])
        v = torch.FloatTensor([64000.0, 32.0, 64000.0])
        p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=torch.float16)
        found_inf.zero_()
        found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf, True)[cur]
        self.assertEqual(found_inf, 1.0)

    def test_grad_scaling_state_dict(self, make, device):
        device = torch.device(device)
        GradScaler = partial(make, device=device.type)
        for lazy_init_scale in True, False:
            s0 = GradScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
            s1 = GradScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)

            # sets a random value for load_state_dict to overwrite
            s1._init_growth_tracker = 7

            if lazy_init_scale:
                # Dummy scale() call to ensure the scale tensor is lazily initialized.
                s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=device))
                # (the "cuda" == device.type branch, torch.cuda.FloatTensor, is CUDA-only)
                self.assertTrue(isinstance(s1._scale, torch.FloatTensor))

            s1.load_state_dict(s0.state_dict())

            self.assertEqual(s1.get_scale(), 3.0)
            self.assertEqual(s1.get_growth_factor(), 4.0)
            self.assertEqual(s1.get_backoff_factor(), 0.5)
            self.assertEqual(s1.get_growth_interval(), 2)
            self.assertEqual(s1._init_growth_tracker, 0)

    # _run_scaling_case generalizes some single-optimizer test logic to avoid too much copy-pasting below.
    # (port: takes the scaler factory ``make`` first)
    def _run_scaling_case(
        self,
        make,
        device,
        run,
        unskipped,
        skipped,
        atol=1e-7,
        optimizer_ctor=torch.optim.SGD,
        optimizer_kwargs=None,
    ):
        # Ensure scaling can be disabled without changing user control flow.
        for enabled in True, False:
            (
                mod_control,
                mod_scaling,
                opt_control,
                opt_scaling,
                data,
                loss_fn,
                skip_iter,
            ) = _create_scaling_case(
                device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
            )

            # For functionality, test with a modest initial scale, and an unrealistically-large growth factor
            # so any potential errors with the growth factor handling will be magnified.
            GradScaler = partial(make, device=device)
            scaler = GradScaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

            _ = run(device, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
            ret = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)

            # Allows run() to optionally return a different scaler instance.
            scaler = ret if ret else scaler

            # If scaling was enabled, the scale factor should have been multiplied by the growth factor
            # len(data) - skipped times and the backoff factor "skipped" times.
            if enabled:
                net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
                net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
                self.assertTrue(scaler.get_scale() == (128.0 * net_growth * net_backoff))
            else:
                self.assertTrue(scaler.get_scale() == 1.0)

            for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
                self.assertEqual(c.grad, s.grad, atol=atol, rtol=1e-05)

                c_state, s_state = opt_control.state[c], opt_scaling.state[s]
                for k in c_state:
                    self.assertEqual(c_state[k], s_state[k], atol=atol, rtol=1e-05, msg=k)

                self.assertEqual(c, s, atol=atol, rtol=1e-05)

    @pytest.mark.parametrize("foreach, fused", [(None, None), (True, None), (None, True)])
    @pytest.mark.parametrize("optimizer_ctor", _AUTOCAST_OPTIMS, ids=lambda c: c.__name__)
    @pytest.mark.parametrize("dtype", [torch.float32], ids=["float32"])
    def test_grad_scaling_autocast(self, make, device, dtype, optimizer_ctor, foreach, fused):
        try_pickle = False

        def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
            for i, (input, target) in enumerate(data):
                optimizer.zero_grad()
                with torch.autocast(device_type=device, dtype=torch.half, enabled=try_scaling_api):
                    output = model(input)
                    loss = loss_fn(output, target)
                if try_scaling_api:
                    scaler.scale(loss).backward()
                    if i == skip_iter and scaler.is_enabled():
                        with torch.no_grad():
                            model[1].weight.grad.fill_(float("inf"))
                    scaler.step(optimizer)
                    scaler.update()
                    if try_pickle:
                        scaler = pickle.loads(pickle.dumps(scaler))
                else:
                    loss.backward()
                    if (not scaler.is_enabled()) or (i != skip_iter):
                        optimizer.step()
            return scaler

        # (upstream: optimizer_ctor = optim_info.optim_cls)

        # Compares no scaling + no autocasting against scaling + autocasting.
        # NOTE(mkozuki): With current way of testing, `torch.optim.Adam` is failing in spite of `foreach` and
        #   `fused`. Giving some flexibility to this test might help.
        context = contextlib.nullcontext
        if optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW):
            context = partial(self.assertRaises, AssertionError)
        with context():
            # sets atol=1e-3 because we're comparing pure fp32 arithmetic vs a mixture of fp16 and fp32
            self._run_scaling_case(
                make,
                device,
                run,
                unskipped=3,
                skipped=1,
                atol=1e-3,
                optimizer_ctor=optimizer_ctor,
                optimizer_kwargs={"foreach": foreach, "fused": fused},
            )
            # this will be picked up by try_pickle within run():
            try_pickle = True
            self._run_scaling_case(
                make,
                device,
                run,
                unskipped=3,
                skipped=1,
                atol=1e-3,
                optimizer_ctor=optimizer_ctor,
                optimizer_kwargs={"foreach": foreach, "fused": fused},
            )

    def test_grad_scale_will_not_overflow(self, make, device):
        device = torch.device(device)
        model = torch.nn.Linear(5, 1).to(device)
        optimizer = torch.optim.Adam(model.parameters())
        scaler = make(device=device.type, growth_interval=1, growth_factor=2**4, init_scale=1e38)
        optimizer.zero_grad()
        x = torch.randn(1, 5).to(device)
        y = 1e-30 * torch.randn(1, 1).to(device)
        l = ((model(x) - y) ** 2).mean()  # noqa: E741 (upstream's name)
        scaler.scale(l).backward()
        scaler.step(optimizer)
        scaler.update()
        if scaler._scale == float("inf") or scaler._scale != scaler._scale:
            raise AssertionError(f"scaler._scale should not be inf or nan, got {scaler._scale}")

    def test_grad_scaling_clipping(self, make, device):
        device = torch.device(device)

        def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
            max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
            for i, (input, target) in enumerate(data):
                optimizer.zero_grad()
                output = model(input)
                loss = loss_fn(output, target)
                if try_scaling_api:
                    scaler.scale(loss).backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                    if i == skip_iter and scaler.is_enabled():
                        model[1].weight.grad.data.fill_(float("inf"))
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                    if (not scaler.is_enabled()) or (i != skip_iter):
                        optimizer.step()

        self._run_scaling_case(make, device.type, run, unskipped=3, skipped=1, atol=1e-5)

    def test_grad_scaling_clipping_separate_unscale(self, make, device):
        device = torch.device(device)

        def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
            max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
            for i, (input, target) in enumerate(data):
                optimizer.zero_grad()
                output = model(input)
                loss = loss_fn(output, target)
                if try_scaling_api:
                    scaler.scale(loss).backward()
                    if i == skip_iter and scaler.is_enabled():
                        model[1].weight.grad.data.fill_(float("inf"))
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                    if (not scaler.is_enabled()) or (i != skip_iter):
                        optimizer.step()

        self._run_scaling_case(make, device.type, run, unskipped=3, skipped=1)

    def test_grad_scaling_penalty(self, make, device):
        device = torch.device(device)

        def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
            for i, (input, target) in enumerate(data):
                optimizer.zero_grad()
                output = model(input)
                loss = loss_fn(output, target)

                if try_scaling_api:
                    grad_params = torch.autograd.grad(
                        scaler.scale(loss), model.parameters(), create_graph=True
                    )
                    inv_scale = 1.0 / scaler.get_scale()
                    grad_params = [p * inv_scale for p in grad_params]
                else:
                    grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)

                grad_norm = 0
                for grad in grad_params:
                    grad_norm += grad.pow(2).sum()
                grad_norm = grad_norm.sqrt()
                loss = loss + grad_norm

                if try_scaling_api:
                    scaler.scale(loss).backward()
                    if i == skip_iter and scaler.is_enabled():
                        model[1].weight.grad.data.fill_(float("inf"))
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    if (not scaler.is_enabled()) or (i != skip_iter):
                        optimizer.step()

        self._run_scaling_case(make, device.type, run, unskipped=3, skipped=1)

    def test_grad_scaling_accumulation(self, make, device):
        device = torch.device(device)

        def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
            iters_to_accumulate = 2
            for i, (input, target) in enumerate(data):
                output = model(input)
                loss = loss_fn(output, target)
                loss = loss / iters_to_accumulate
                if try_scaling_api:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                if (i + 1) % iters_to_accumulate == 0:
                    if try_scaling_api:
                        scaler.step(optimizer)
                        scaler.update()
                        optimizer.zero_grad()
                    else:
                        optimizer.step()
                        optimizer.zero_grad()

        self._run_scaling_case(make, device.type, run, unskipped=2, skipped=0)

    def test_grad_scaling_multiple(self, make, device):
        device = torch.device(device)
        # Tests gradient scaling with 2 models and 2 optimizers that both receive gradients from 2 losses.
        # Some of the logic here cannot reuse the generic helper functions created for the 1-optimizer cases.
        for enabled in True, False:
            mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = (
                _create_scaling_case(device.type)
            )
            mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers(
                device.type
            )

            GradScaler = partial(make, device=device.type)
            scaler = GradScaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

            def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
                for i, (input, target) in enumerate(data):
                    optimizer0.zero_grad()
                    optimizer1.zero_grad()
                    output0 = model0(input)
                    output1 = model1(input)
                    loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
                    loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)

                    if try_scaling_api:
                        scaler.scale(loss0).backward(retain_graph=True)
                        scaler.scale(loss1).backward()
                        if i == skip_iter and scaler.is_enabled():
                            model1[1].weight.grad.data.fill_(float("inf"))

                        # As an additional stress test, separately unscale for one of the optimizers.
                        scaler.unscale_(optimizer0)

                        scaler.step(optimizer0)
                        scaler.step(optimizer1)
                        scaler.update()
                    else:
                        loss0.backward(retain_graph=True)
                        loss1.backward()
                        optimizer0.step()
                        if (not scaler.is_enabled()) or (i != skip_iter):
                            optimizer1.step()

            run(mod_control0, mod_control1, opt_control0, opt_control1, False)
            run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)

            # The loss scale should have been multiplied by the growth factor 3 times and the backoff factor
            # once.
            self.assertTrue(
                scaler.get_scale()
                == (128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() ** 1)
                if enabled
                else 1.0
            )

            for c, s in zip(
                chain(mod_control0.parameters(), mod_control1.parameters()),
                chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
            ):
                self.assertEqual(c, s, rtol=1e-5, atol=1e-7)

    def test_grad_scaler_pass_itself(self, make, device):
        device = torch.device(device)
        GradScaler = partial(make, device=device.type)

        class _PlaceHolderOptimizer(torch.optim.Optimizer):
            tester = self

            def __init__(self, params, defaults=None):
                if defaults is None:
                    defaults = {}
                super().__init__(params, defaults)
                self._step_supports_amp_scaling = True

        class Optimizer1(_PlaceHolderOptimizer):
            def step(self, closure=None, *, grad_scaler=None):
                self.tester.assertTrue(isinstance(grad_scaler, torch.amp.GradScaler))
                self.tester.assertFalse(hasattr(self, "grad_scale"))
                self.tester.assertFalse(hasattr(self, "found_inf"))

        class Optimizer2(_PlaceHolderOptimizer):
            def step(self, closure=None):
                self.tester.assertTrue(isinstance(self.grad_scale, torch.Tensor))
                self.tester.assertTrue(isinstance(self.found_inf, torch.Tensor))

        x = torch.randn(4, 4).to(device)
        m = torch.nn.Linear(4, 1).to(device)
        o1 = Optimizer1(m.parameters())
        o2 = Optimizer2(m.parameters())
        scaler = GradScaler(init_scale=2.0)

        with torch.autocast(device_type=device.type, dtype=torch.half):
            y = m(x)
            loss = y.mean()
        scaler.scale(loss).backward()
        with self.assertWarns(FutureWarning):
            scaler.step(o1)
        scaler.step(o2)
        scaler.update()

    def test_grad_scaler_deprecated_warning(self, device):
        device = torch.device(device)
        GradScaler = torch.cuda.amp.GradScaler if "cuda" == device.type else torch.cpu.amp.GradScaler

        with self.assertWarnsRegex(
            FutureWarning,
            rf"`torch.{device.type}.amp.GradScaler\(args...\)` is deprecated.",
        ):
            _ = GradScaler(init_scale=2.0)


# ------------------------------------------------------------------------------------------------
# Not upstream: torch.amp.GradScaler and DynamicLossScaler side by side, bit for bit
# ------------------------------------------------------------------------------------------------

_INF, _NAN = float("inf"), float("nan")
_STEPS = 12

# id -> (constructor kwargs, {iteration: value written into model[1].weight.grad}, {iteration: new_scale})
_SIDE_BY_SIDE_CASES = {
    # _run_scaling_case's scaler, several skipped steps (inf and nan) between growths
    "upstream_kw": (
        {"init_scale": 128.0, "growth_factor": 2.0, "growth_interval": 1},
        {2: _INF, 5: _NAN, 6: _INF, 10: _INF},
        {},
    ),
    # growth every 3rd clean step, back-off by 1/4; the tracker restarts after each overflow
    "interval3_backoff_quarter": (
        {"init_scale": 2.0**16, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3},
        {3: _INF, 4: _NAN, 9: _INF},
        {},
    ),
    # test_grad_scale_will_not_overflow's kwargs: growing 1e38 by 16 would overflow float32, so GradScaler
    # keeps the scale on clean steps (0-3); three back-offs take it to 1.25e37, which grows once to 2e38 and
    # then stays: it never becomes inf
    "init_scale_1e38": (
        {"init_scale": 1e38, "growth_factor": 2.0**4, "growth_interval": 1},
        {4: _INF, 5: _NAN, 6: _INF},
        {},
    ),
    # back-off below 1.0: GradScaler goes 1.0 -> 0.5 -> 0.25 -> 0.125 and has no floor
    "backoff_below_one": (
        {"init_scale": 1.0, "growth_interval": 2},
        {0: _INF, 1: _INF, 2: _NAN, 7: _INF},
        {},
    ),
    # update(new_scale=float) and update(new_scale=1-element float32 tensor) replace the scale; the growth
    # tracker carries on. The tensor is 0-dim: torch 2.13's GradScaler keeps its scale 0-dim, and
    # update(new_scale=torch.tensor([0.25])) raises "output with shape [] doesn't match the broadcast
    # shape [1]".
    "update_new_scale": (
        {"init_scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2},
        {5: _INF},
        {2: 0.5, 7: torch.tensor(0.25)},
    ),
    # disabled: scale 1.0, every step taken
    "disabled": ({"init_scale": 128.0, "growth_interval": 1, "enabled": False}, {}, {}),
}

# id -> (optimizer class, its kwargs over _create_scaling_models_optimizers' lr=1.0)
_SIDE_BY_SIDE_OPTIMS = {
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}),
    "Adam-fused": (torch.optim.Adam, {"lr": 1e-2, "fused": True}),  # takes grad_scale/found_inf itself
    "AdamW-foreach": (torch.optim.AdamW, {"lr": 1e-2, "foreach": True}),
}


class TestDynamicLossScalerSideBySide:
    @pytest.mark.parametrize("optim_id", list(_SIDE_BY_SIDE_OPTIMS))
    @pytest.mark.parametrize("case", list(_SIDE_BY_SIDE_CASES))
    def test_matches_torch_bitwise(self, case, optim_id):
        kw, poison, new_scales = _SIDE_BY_SIDE_CASES[case]
        optimizer_ctor, optimizer_kwargs = _SIDE_BY_SIDE_OPTIMS[optim_id]
        torch.manual_seed(1234)
        mod_ref, mod_ours, opt_ref, opt_ours, data, loss_fn, _ = _create_scaling_case(
            "cpu", optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
        )
        ref = torch.amp.GradScaler("cpu", **kw)
        ours = DynamicLossScaler("cpu", **kw)
        # Before the first scale(), GradScaler reports init_scale as given (a Python float, not rounded to
        # float32: 1e38 stays 1e38).
        assert ours.get_scale() == ref.get_scale(), (
            f"before step 0: {ours.get_scale()!r} != {ref.get_scale()!r}"
        )
        self_check = [ref.get_scale()]

        for i in range(_STEPS):
            input, target = data[i % len(data)]
            for model, optimizer, scaler in ((mod_ref, opt_ref, ref), (mod_ours, opt_ours, ours)):
                optimizer.zero_grad()
                loss = loss_fn(model(input), target)
                scaler.scale(loss).backward()
                if i in poison:
                    with torch.no_grad():
                        model[1].weight.grad.fill_(poison[i])
                scaler.step(optimizer)
                if i in new_scales:
                    scaler.update(new_scale=new_scales[i])
                else:
                    scaler.update()
            assert ours.get_scale() == ref.get_scale(), (
                f"step {i}: {ours.get_scale()!r} != {ref.get_scale()!r}"
            )
            self_check.append(ref.get_scale())

        for (name, p_ref), p_ours in zip(mod_ref.named_parameters(), mod_ours.parameters(), strict=True):
            assert torch.equal(p_ref, p_ours), f"weights of {name} differ"
            s_ref, s_ours = opt_ref.state[p_ref], opt_ours.state[p_ours]
            assert set(s_ref) == set(s_ours), name
            for k in s_ref:
                assert torch.equal(s_ref[k], s_ours[k]), f"optimizer state {k!r} of {name} differs"

        # The cases exercise what they claim (checked on GradScaler's trajectory).
        assert all(math.isfinite(s) and s > 0 for s in self_check)
        if kw.get("enabled", True):
            steps = list(pairwise(self_check))
            assert any(b > a for a, b in steps), f"no growth in {self_check}"
            assert any(b < a for a, b in steps), f"no back-off in {self_check}"
        else:
            assert self_check == [1.0] * (_STEPS + 1)
        if case == "backoff_below_one":
            assert self_check[:4] == [1.0, 0.5, 0.25, 0.125]
        if case == "init_scale_1e38":
            blocked = float(torch.tensor(1e38, dtype=torch.float32))
            assert self_check[1:5] == [blocked] * 4, self_check  # clean steps 0-3: growth to 1.6e39 refused
            assert self_check[7:9] == [blocked / 8, blocked * 2], self_check  # 1.25e37 -> 2e38
        if case == "update_new_scale":
            assert self_check[3] == 0.5 and self_check[8] == 0.25
