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
# From Caffe2:
#
# Copyright (c) 2016-present, Facebook Inc. All rights reserved.
#
# All contributions by Facebook:
# Copyright (c) 2016 Facebook Inc.
#
# All contributions by Google:
# Copyright (c) 2015 Google Inc.
# All rights reserved.
#
# All contributions by Yangqing Jia:
# Copyright (c) 2015 Yangqing Jia
# All rights reserved.
#
# All contributions by Kakao Brain:
# Copyright 2019-2020 Kakao Brain
#
# All contributions by Cruise LLC:
# Copyright (c) 2022 Cruise LLC.
# All rights reserved.
#
# All contributions by Tri Dao:
# Copyright (c) 2024 Tri Dao.
# All rights reserved.
#
# All contributions by Arm:
# Copyright (c) 2021, 2023-2025 Arm Limited and/or its affiliates
#
# All contributions from Caffe:
# Copyright(c) 2013, 2014, 2015, the respective contributors
# All rights reserved.
#
# All other contributions:
# Copyright(c) 2015, 2016 the respective contributors
# All rights reserved.
#
# Caffe2 uses a copyright model similar to Caffe: each contributor holds
# copyright over their contributions to Caffe2. The project versioning records
# all such contribution and copyright details. If a contributor wants to further
# mark their specific copyright on a particular contribution, they should
# indicate their copyright solely in the commit message of the change when it is
# committed.
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

"""PyTorch's own SyncBatchNorm tests, ported to 2 gloo ranks on CPU against ``lightning_ext.nn``.

Ported from ``torch/testing/_internal/distributed/distributed_test.py`` of torch 2.13.0 (the copy
installed with torch; the licence notice above is PyTorch's ``LICENSE``), class
``DistributedTest._DistTestBase``.

Upstream test -> test here (2 gloo ranks each):

- ``test_DistributedDataParallel_SyncBatchNorm`` -> same name (its three calls in one spawn)
- ``test_DistributedDataParallel_SyncBatchNorm_No_Affine`` -> same name
- ``test_DistributedDataParallel_SyncBatchNorm_2D_Input`` -> same name
- ``test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process`` -> same name
- ``test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value`` -> same name
- ``test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient`` -> same name
- ``test_DistributedDataParallel_SyncBatchNorm_Channels_Last`` -> same name (channels_last and
  channels_last_3d in one spawn)
- ``test_DistributedDataParallel_SyncBatchNorm_half`` -> same name (float16 on CPU)
- ``test_SyncBatchNorm_process_group`` -> same name (needs torchvision, skipped without it as upstream),
  and ``test_SyncBatchNorm_process_group_nested``: the same check on a torchvision-free model with
  resnet50's nesting (``layer1[0].bn1``)
- ``test_ddp_inference``, its SyncBatchNorm part -> ``test_ddp_inference_SyncBatchNorm``
- ``test_ddp_uneven_inputs_stop_iteration_sync_bn``, its SyncBatchNorm model -> same name

Helpers ported with them: ``BatchNormNet``, ``_model_step``, ``_model_step_with_zero_grad``,
``_test_DDP_helper``, ``_assert_equal_param``, ``_test_DDP_niter``,
``_test_DistributedDataParallel_SyncBatchNorm``,
``_test_DistributedDataParallel_SyncBatchNorm_with_memory_format`` and ``validate_net_equivalence``.

What changed, and only that: ``cuda:rank`` -> ``cpu``;
``device_ids``/``output_device`` -> not passed (None: DDP's CPU form); ``torch.backends.cudnn.flags(False)``
dropped; NCCL -> gloo (the harness ``tests.helpers.distributed.run_distributed``, 2 spawned ranks, file
store); ``nn.SyncBatchNorm(...)`` -> ``lightning_ext.nn.SyncBatchNorm(...)`` and
``nn.SyncBatchNorm.convert_sync_batchnorm`` -> ``lightning_ext.nn.convert_sync_batchnorm``;
``self._barrier()`` -> ``dist.barrier()``; upstream's per-process seed (``common_utils.set_rng_seed()``,
SEED 1234) -> ``torch.manual_seed(1234)`` in each worker. ``self.assertEqual`` on tensors ->
``torch.testing.assert_close`` with its defaults (the same dtype-based rtol/atol as ``TestCase.assertEqual``;
it differs only in ``equal_nan=False`` and an exact device check, moot here), on other values -> ``==``;
``assertRaisesRegex`` -> ``pytest.raises(match=...)`` (both ``re.search``). Upstream quirks are kept on
purpose (e.g. ``_test_DistributedDataParallel_SyncBatchNorm`` passes ``5 if affine else 2`` positionally
into ``zero_grad``, so every run takes 5 iterations with ``_model_step_with_zero_grad``; its
``output_device`` argument is unused, so its three calls in the plain test differ only in their data).

Not ported: ``test_sync_bn_logged`` (DDP logs ``has_sync_bn`` for ``isinstance(m, torch.nn.SyncBatchNorm)``;
ours is deliberately not a subclass, as DDP rejects that class in CPU modules) and
``test_ddp_sync_bn_training_vs_eval`` (``unittest.skip`` upstream, and it counts gloo ``all_gather`` calls
in the profiler; its rule, eval does not synchronize, is ``test_eval_never_synchronizes``).

Added (torch's rules, written for the SyncBatchNorm rewrite): ``test_eval_never_synchronizes``,
``test_float64_matches_one_process_batch_norm`` and the float64 ``gradcheck`` tests.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_ext.nn import SyncBatchNorm, convert_sync_batchnorm
from tests.helpers.distributed import run_distributed

WORLD_SIZE = 2
SEED = 1234  # torch.testing._internal.common_utils.SEED, which upstream's run_test seeds with


# ----------------------------------------------------------------------------- upstream models/helpers


class BatchNormNet(nn.Module):
    def __init__(self, affine=True):
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4, affine=affine)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x):
        x = torch.reshape(self.fc1(x), (-1, 4, 10))
        x = self.bn(x)
        x = torch.reshape(x, (-1, 40))
        x = self.fc2(x)
        return F.softmax(x, dim=1)


def _model_step(model):
    for param in model.parameters():
        if param.grad is not None:
            with torch.no_grad():
                param += param.grad
            param.grad = None


def _model_step_with_zero_grad(model):
    for param in model.parameters():
        if param.grad is not None:
            with torch.no_grad():
                param += param.grad
            param.grad.requires_grad_(False)
            param.grad.zero_()


def _test_DDP_helper(model, input_var, target, loss, scale_factor=1.0, memory_format=None):
    model.train()
    output = model(input_var)
    l = loss(output, target) * scale_factor  # noqa: E741 (upstream's name)
    l.backward()
    if memory_format is not None:
        assert output.is_contiguous(memory_format=memory_format)


def _assert_equal_param(param_gpu, param_DDP):
    assert len(param_gpu) == len(param_DDP)
    for p_gpu, p_DDP in zip(param_gpu, param_DDP, strict=True):
        torch.testing.assert_close(p_gpu, p_DDP)


def _test_DDP_niter(
    model_base,
    model_DDP,
    input,
    target,
    loss,
    local_bs,
    rank,
    batch_size,
    test_save,
    offset=None,
    world_size=0,
    zero_grad=False,
    memory_format=None,
    n_iter=5,
):
    for idx in range(n_iter):
        # single cpu/gpu training
        _test_DDP_helper(model_base, input, target, loss, memory_format=memory_format)

        if offset is None:
            offset = rank * local_bs

        # DDP training, DDP scatters subsets of input_cpu to nodes/GPUs
        _test_DDP_helper(
            model_DDP,
            input[offset : offset + local_bs],
            target[offset : offset + local_bs],
            loss,
            world_size * local_bs / batch_size if world_size != 0 else 1,
            memory_format=memory_format,
        )

        # Update weights and run a second iteration to shake out errors
        if zero_grad:
            _model_step_with_zero_grad(model_base)
            _model_step_with_zero_grad(model_DDP)
        else:
            _model_step(model_base)
            _model_step(model_DDP)
        _assert_equal_param(list(model_base.parameters()), list(model_DDP.module.parameters()))

        # Shuffle the input so that DDP input is different
        input = input[torch.randperm(batch_size)]

        # save the model in the middle and reload (upstream: only with a file:// INIT_METHOD, which the
        # harness always uses)
        if test_save and idx == 2:
            with tempfile.NamedTemporaryFile() as tmp:
                if sys.platform == "win32":
                    torch.save(model_DDP, tmp)
                    tmp.seek(0)
                    # weights_only=False as this is legacy code that saves the model
                    model_DDP = torch.load(tmp, weights_only=False)
                else:
                    torch.save(model_DDP, tmp.name)
                    # weights_only=False as this is legacy code that saves the model
                    model_DDP = torch.load(tmp.name, weights_only=False)

    with tempfile.TemporaryFile() as tmp_file:
        torch.save(model_DDP, tmp_file)
        tmp_file.seek(0)
        # weights_only=False as this is legacy code that saves the model
        saved_model = torch.load(tmp_file, weights_only=False)
    for k in model_DDP.state_dict():
        torch.testing.assert_close(model_DDP.state_dict()[k], saved_model.state_dict()[k])


def _test_DistributedDataParallel_SyncBatchNorm(
    rank,
    local_bs,
    global_bs,
    offset,
    output_device=None,  # unused upstream too
    affine=True,
):
    # Run a simple end to end DDP model, use result of single node model
    # as baseline

    # cpu training setup
    model = BatchNormNet() if affine else BatchNormNet(affine=False)

    # single gpu training setup
    model_gpu = copy.deepcopy(model)

    # DDP training setup
    model_DDP = convert_sync_batchnorm(copy.deepcopy(model))
    model_DDP = nn.parallel.DistributedDataParallel(model_DDP)

    # test serializable/unserializable
    with tempfile.NamedTemporaryFile() as tmp:
        if sys.platform == "win32":
            torch.save(model_DDP, tmp)
            tmp.seek(0)
            # weights_only=False as this is legacy code that saves the model
            model_DDP = torch.load(tmp, weights_only=False)
        else:
            torch.save(model_DDP, tmp.name)
            # weights_only=False as this is legacy code that saves the model
            model_DDP = torch.load(tmp.name, weights_only=False)

    # data initialization
    input_cpu = torch.randn(global_bs, 2)
    target = torch.randn(global_bs, 4)
    loss = nn.MSELoss()

    # check two model parameters over 5 iterations
    _test_DDP_niter(
        model_gpu,
        model_DDP,
        input_cpu,
        target,
        loss,
        local_bs,
        rank,
        global_bs,
        True,
        offset,
        dist.get_world_size(),
        5 if affine else 2,  # upstream: lands in `zero_grad` (positional), n_iter stays 5
    )
    dist.barrier()


def _test_DistributedDataParallel_SyncBatchNorm_with_memory_format(rank, memory_format):
    num_processes = dist.get_world_size()
    local_bs = 2
    bs_offset = int(rank * 2)
    global_bs = int(num_processes * 2)

    model = SyncBatchNorm(2, momentum=0.99)
    model_gpu = copy.deepcopy(model)
    model_DDP = nn.parallel.DistributedDataParallel(model_gpu)

    shapes = [global_bs, 2, 4, 4] + ([] if memory_format is torch.channels_last else [4])

    input_gpu = torch.randn(*shapes, dtype=torch.float).to(memory_format=memory_format)
    target_gpu = torch.randn(*shapes, dtype=torch.float).to(memory_format=memory_format)
    loss = nn.MSELoss()

    # check two model parameters over 5 iterations
    _test_DDP_niter(
        model_gpu,
        model_DDP,
        input_gpu,
        target_gpu,
        loss,
        local_bs,
        rank,
        global_bs,
        True,
        bs_offset,
        dist.get_world_size(),
        memory_format=memory_format,
    )
    dist.barrier()


def _validate_net_equivalence(net):
    # Helper to validate synchronization of nets across ranks.
    net_module_states = list(net.module.state_dict().values())
    # Check that all tensors in module's state_dict() are equal.
    for t in net_module_states:
        tensor_list = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(tensor_list, t)
        for tensor in tensor_list:
            torch.testing.assert_close(tensor, t)


# ------------------------------------------------------------------------------ upstream tests: workers


def _sbn_worker(rank, world_size):
    torch.manual_seed(SEED)
    # DDP does not support replicating BN layers within a process, hence
    # testing with one module replica per process
    local_bs = 2
    bs_offset = int(rank * 2)
    global_bs = int(world_size * 2)

    _test_DistributedDataParallel_SyncBatchNorm(
        rank=rank, local_bs=local_bs, global_bs=global_bs, offset=bs_offset
    )
    # test output_device (upstream: output_device=torch.device("cuda"); CPU DDP takes none)
    _test_DistributedDataParallel_SyncBatchNorm(
        rank=rank, local_bs=local_bs, global_bs=global_bs, offset=bs_offset, output_device=None
    )
    # test device_ids (upstream: torch.device("cuda:rank") in device_ids; CPU DDP takes none)
    _test_DistributedDataParallel_SyncBatchNorm(
        rank=rank, local_bs=local_bs, global_bs=global_bs, offset=bs_offset, output_device=None
    )
    return True


def _sbn_no_affine_worker(rank, world_size):
    torch.manual_seed(SEED)
    local_bs = 2
    bs_offset = int(rank * 2)
    global_bs = int(world_size * 2)

    _test_DistributedDataParallel_SyncBatchNorm(
        rank=rank, local_bs=local_bs, global_bs=global_bs, offset=bs_offset, affine=False
    )
    return True


def _sbn_2d_input_worker(rank, world_size):
    torch.manual_seed(SEED)
    model = nn.BatchNorm1d(2)

    # single gpu training setup
    model_gpu = copy.deepcopy(model)

    # DDP training setup
    model_DDP = convert_sync_batchnorm(copy.deepcopy(model))
    model_DDP = nn.parallel.DistributedDataParallel(model_DDP)

    local_bs = 1 * 2  # upstream: len(gpus) * 2 with gpus = [rank]
    global_bs = dist.get_world_size() * local_bs
    input_cpu = torch.randn(global_bs, 2)
    target = torch.randn(global_bs, 2)
    loss = nn.MSELoss()

    # (upstream disables cudnn here; no cudnn on CPU)
    # check two model parameters over 5 iterations
    _test_DDP_niter(model_gpu, model_DDP, input_cpu, target, loss, local_bs, rank, global_bs, True)
    dist.barrier()
    return True


def _sbn_single_input_worker(rank, world_size):
    torch.manual_seed(SEED)
    model = nn.BatchNorm1d(2)

    # single gpu training setup
    model_gpu = copy.deepcopy(model)

    # DDP training setup
    model_DDP = convert_sync_batchnorm(copy.deepcopy(model))
    model_DDP = nn.parallel.DistributedDataParallel(model_DDP)

    local_bs = 1
    global_bs = dist.get_world_size()
    input_cpu = torch.randn(global_bs, 2)
    target = torch.randn(global_bs, 2)
    loss = nn.MSELoss()

    # (upstream disables cudnn here; no cudnn on CPU)
    # check two model parameters over 5 iterations
    _test_DDP_niter(model_gpu, model_DDP, input_cpu, target, loss, local_bs, rank, global_bs, True)
    dist.barrier()
    return True


def _sbn_diff_input_sizes_running_value_worker(rank, world_size):
    torch.manual_seed(SEED)
    ONLY_SBN_NET = SyncBatchNorm(2, momentum=0.99)
    model = nn.parallel.DistributedDataParallel(ONLY_SBN_NET)

    input_var = []
    for i in range(dist.get_world_size()):
        input_var_rank = torch.cat(
            [
                torch.ones(2, 1, 10 ** (i + 1)) * (0.1 ** (i - 1)),
                torch.ones(2, 1, 10 ** (i + 1)) * (0.3 ** (i - 1)),
            ],
            dim=1,
        )
        input_var.append(input_var_rank)

    all_input_var = torch.cat(
        [x.permute(1, 0, 2).reshape(ONLY_SBN_NET.num_features, -1) for x in input_var],
        dim=1,
    )

    for _ in range(100):
        y = model(input_var[rank])
        y.mean().backward()

    running_mean, running_var = (
        model.module.running_mean,
        model.module.running_var,
    )
    torch.testing.assert_close(running_mean, all_input_var.mean(1))
    torch.testing.assert_close(running_var, all_input_var.var(1))
    return True


def _sbn_diff_input_sizes_gradient_worker(rank, world_size):
    torch.manual_seed(SEED)
    num_processes = dist.get_world_size()
    local_bs = rank + 2
    bs_offset = int((rank + 3) * rank / 2)
    global_bs = int((num_processes + 3) * num_processes / 2)

    _test_DistributedDataParallel_SyncBatchNorm(
        rank=rank, local_bs=local_bs, global_bs=global_bs, offset=bs_offset
    )
    return True


def _sbn_channels_last_worker(rank, world_size):
    torch.manual_seed(SEED)
    _test_DistributedDataParallel_SyncBatchNorm_with_memory_format(rank, torch.channels_last)
    _test_DistributedDataParallel_SyncBatchNorm_with_memory_format(rank, torch.channels_last_3d)
    return True


def _sbn_half_worker(rank, world_size):
    torch.manual_seed(SEED)
    model = BatchNormNet()
    model = model.half()
    model = convert_sync_batchnorm(model)
    model = nn.parallel.DistributedDataParallel(model)
    inp = torch.randn(2, 2, dtype=torch.float16)
    # Check that forward/backward do not error with dtype mismatch
    out = model(inp)
    assert out.dtype == torch.float16
    out.sum().backward()
    for param in model.parameters():
        assert param.grad.dtype == torch.float16
    return True


class _Bottleneck(nn.Module):
    """The nesting of torchvision's ``resnet50().layer1[0]`` (a stand-in where torchvision is missing)."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(
            nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels)
        )


class _NestedResNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(_Bottleneck(4), _Bottleneck(4))
        self.layer2 = nn.Sequential(nn.Sequential(_Bottleneck(4)))


def _sbn_process_group_worker(rank, world_size, use_torchvision):
    # When adopting `convert_sync_batchnorm` to convert a `nn.modules`,
    # it needs to recursively pass the `process_group` in the module when the `SyncBatchNorm`
    # is nested in a sub-module or sub-sub-module (e.g. resnet50 in torchvision.models).
    process_ids = 0
    process_group = torch.distributed.new_group([process_ids])
    if use_torchvision:
        import torchvision

        res50_model = torchvision.models.resnet50()
    else:
        res50_model = _NestedResNetLike()
    res50_model_sync = convert_sync_batchnorm(copy.deepcopy(res50_model), process_group)
    process_group_sync = res50_model_sync.layer1[0].bn1.process_group
    assert process_group_sync == process_group
    if not use_torchvision:  # added for the stand-in: every layer at every depth got converted, with it
        converted = [m for m in res50_model_sync.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert len(converted) == 1 + 3 * 3
        for m in converted:
            assert isinstance(m, SyncBatchNorm)
            assert m.process_group == process_group
    return True


def _ddp_inference_worker(rank, world_size):
    # tests that DDP module can be run on a single node with no_grad
    # or eval setting and there is no hang.
    # (upstream also runs `Net()` through DDP first: not SyncBatchNorm, not ported)
    torch.manual_seed(SEED)
    syncbn_model = SyncBatchNorm(2, momentum=0.99, track_running_stats=False)
    local_syncbn_model = copy.deepcopy(syncbn_model)
    syncbn_model = torch.nn.parallel.DistributedDataParallel(syncbn_model)
    inp_syncbn = torch.randn(10, 2, 4, 4)
    tests = [
        (syncbn_model, local_syncbn_model, inp_syncbn),
    ]
    for test in tests:
        test_model, test_local_model, test_inp = test
        if rank == 0:
            test_model.eval()
            test_local_model.eval()
            for _ in range(6):
                torch.testing.assert_close(test_model(test_inp), test_local_model(test_inp))

    # Barrier since only rank 0 runs inference. Test should be
    # much faster than 30s, but this is to avoid flakiness.
    # (upstream: self._barrier(timeout=30); here the harness timeout is 30 s)
    dist.barrier()
    return True


def _stop_iteration_sync_bn_worker(rank, world_size):
    # Tests that uneven inputs join handler correctly throws StopIteration
    # for models with SyncBN ... when throw_on_early_termination=True.
    # (upstream also runs a model with a plain all_reduce: not SyncBatchNorm, not ported)
    torch.manual_seed(SEED)
    model_bn = BatchNormNet()
    model_bn = convert_sync_batchnorm(copy.deepcopy(model_bn))
    model_input = torch.randn(10, 2)

    for model in [model_bn]:
        model = torch.nn.parallel.DistributedDataParallel(model)
        min_num_iters = 5
        if rank != 0:
            # Early termination rank(s)
            num_iters = min_num_iters
            exception_ctx = pytest.raises(RuntimeError, match=f"Rank {rank} exhausted all inputs")
        else:
            # Non early termination rank
            num_iters = min_num_iters * 2
            exception_ctx = pytest.raises(
                RuntimeError, match=r"Detected at least one rank that exhausted inputs."
            )
        n = 0
        with exception_ctx:
            with model.join(throw_on_early_termination=True):
                for _ in range(num_iters):
                    loss = model(model_input).sum()
                    loss.backward()
                    _model_step(model)
                    n += 1

        assert n == min_num_iters
        # Verify model equivalence
        _validate_net_equivalence(model)
    return True


# -------------------------------------------------------------------------------------- upstream tests


def test_DistributedDataParallel_SyncBatchNorm():
    assert run_distributed(_sbn_worker, WORLD_SIZE, timeout=120) == [True] * WORLD_SIZE


def test_DistributedDataParallel_SyncBatchNorm_No_Affine():
    assert run_distributed(_sbn_no_affine_worker, WORLD_SIZE, timeout=120) == [True] * WORLD_SIZE


def test_DistributedDataParallel_SyncBatchNorm_2D_Input():
    assert run_distributed(_sbn_2d_input_worker, WORLD_SIZE, timeout=120) == [True] * WORLD_SIZE


def test_DistributedDataParallel_SyncBatchNorm_Single_Input_Per_Process():
    assert run_distributed(_sbn_single_input_worker, WORLD_SIZE, timeout=120) == [True] * WORLD_SIZE


def test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_Running_Value():
    results = run_distributed(_sbn_diff_input_sizes_running_value_worker, WORLD_SIZE, timeout=120)
    assert results == [True] * WORLD_SIZE


def test_DistributedDataParallel_SyncBatchNorm_Diff_Input_Sizes_gradient():
    results = run_distributed(_sbn_diff_input_sizes_gradient_worker, WORLD_SIZE, timeout=120)
    assert results == [True] * WORLD_SIZE


def test_DistributedDataParallel_SyncBatchNorm_Channels_Last():
    assert run_distributed(_sbn_channels_last_worker, WORLD_SIZE, timeout=120) == [True] * WORLD_SIZE


def test_DistributedDataParallel_SyncBatchNorm_half():
    # torch's CPU kernels run BatchNormNet in float16 (Linear, batch norm, softmax and their backward).
    assert run_distributed(_sbn_half_worker, WORLD_SIZE, timeout=120) == [True] * WORLD_SIZE


def test_SyncBatchNorm_process_group():
    pytest.importorskip("torchvision")  # upstream: @skipIfNoTorchVision
    assert run_distributed(_sbn_process_group_worker, WORLD_SIZE, True, timeout=120) == [True] * WORLD_SIZE


def test_SyncBatchNorm_process_group_nested():
    """test_SyncBatchNorm_process_group with a torchvision-free model of resnet50's nesting."""
    assert run_distributed(_sbn_process_group_worker, WORLD_SIZE, False, timeout=120) == [True] * WORLD_SIZE


def test_ddp_inference_SyncBatchNorm():
    assert run_distributed(_ddp_inference_worker, WORLD_SIZE, timeout=30) == [True] * WORLD_SIZE


def test_ddp_uneven_inputs_stop_iteration_sync_bn():
    assert run_distributed(_stop_iteration_sync_bn_worker, WORLD_SIZE, timeout=120) == [True] * WORLD_SIZE


# -------------------------------------------------------------- torch's rules: eval never synchronizes


def _eval_never_syncs_worker(rank, world_size):
    torch.manual_seed(SEED)
    model = SyncBatchNorm(2, track_running_stats=False)
    with torch.no_grad():  # non-trivial affine parameters, identical on both ranks (same seed)
        model.weight.uniform_(0.5, 1.5)
        model.bias.uniform_(-1.0, 1.0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.eval()
    elapsed = None
    if rank == 0:
        reference = nn.BatchNorm2d(2, track_running_stats=False)
        with torch.no_grad():
            reference.weight.copy_(ddp.module.weight)
            reference.bias.copy_(ddp.module.bias)
        reference.eval()  # no running statistics: normalizes with the local batch statistics
        generator = torch.Generator().manual_seed(SEED + 1)
        inputs = [torch.randn(4, 2, 3, 3, generator=generator) for _ in range(6)]
        start = time.monotonic()
        outputs = [ddp(x) for x in inputs]  # rank 1 is at the barrier: a collective here would hang
        elapsed = time.monotonic() - start
        for x, y in zip(inputs, outputs):
            torch.testing.assert_close(y, reference(x))
        # The one time bound of this file: six 72-element forwards take milliseconds (10 s: a loaded
        # host's stalls stay below it); a forward that waits for rank 1 never returns.
        assert elapsed < 10.0, f"six eval forwards took {elapsed:.3f} s"
    dist.barrier()  # rank 1 waits here the whole time; rank 0 joins after its forwards
    return elapsed


def test_eval_never_synchronizes():
    """torch's SyncBatchNorm synchronizes only while training (``need_sync = bn_training and self.training``):
    in eval mode, even without running statistics, it normalizes with the local batch, no collective."""
    elapsed = run_distributed(_eval_never_syncs_worker, WORLD_SIZE, timeout=30)
    assert elapsed[0] is not None and elapsed[0] < 10.0


# ------------------------------------------------------------------ torch's rules: float64 is float64

F64_C = 3
F64_SHARDS = (3, 5)  # uneven per-rank batches
F64_STEPS = 2
# name: (spatial dims, channels_last); the reference layer follows from the input's rank.
F64_CASES = {
    "2d": ((), False),
    "3d": ((4,), False),
    "4d": ((3, 2), False),
    "4d_channels_last": ((3, 2), True),
    "5d": ((2, 3, 2), False),
}
_F64_REFERENCE = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _f64_params(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + list(F64_CASES).index(case))
    weight = 1.0 + 0.5 * torch.randn(F64_C, generator=g, dtype=torch.float64)
    bias = torch.randn(F64_C, generator=g, dtype=torch.float64)
    return weight, bias


def _f64_data(case: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch ``x`` and the loss weights (both float64, the same in every process)."""
    spatial, _ = F64_CASES[case]
    g = torch.Generator().manual_seed(1000 * list(F64_CASES).index(case) + step)
    shape = (sum(F64_SHARDS), F64_C, *spatial)
    view = (1, F64_C) + (1,) * len(spatial)
    mean = 4.0 * torch.randn(F64_C, generator=g, dtype=torch.float64)
    std = 0.5 + torch.rand(F64_C, generator=g, dtype=torch.float64) * 2.0
    x = torch.randn(shape, generator=g, dtype=torch.float64) * std.view(view) + mean.view(view)
    loss_weights = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, loss_weights


def _float64_worker(rank, world_size):
    start = sum(F64_SHARDS[:rank])
    stop = start + F64_SHARDS[rank]
    results = {}
    for case, (_, channels_last) in F64_CASES.items():
        layer = SyncBatchNorm(F64_C).double()
        weight, bias = _f64_params(case)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        steps = []
        for step in range(F64_STEPS):
            x, loss_weights = _f64_data(case, step)
            x = x[start:stop].clone()
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            x.requires_grad_(True)
            y = layer(x)
            (y * loss_weights[start:stop]).sum().backward()
            steps.append(
                {
                    "y": y.detach(),
                    "dx": x.grad,
                    "dweight": layer.weight.grad.clone(),
                    "dbias": layer.bias.grad.clone(),
                }
            )
            layer.weight.grad = None
            layer.bias.grad = None
        results[case] = {
            "steps": steps,
            "running_mean": layer.running_mean.clone(),
            "running_var": layer.running_var.clone(),
        }
    return results


_F64_RUN: dict[str, Any] = {}


def _float64_run() -> list[dict]:
    """One spawn for every case (memoized, its failure too, so a hang costs one timeout)."""
    if "outcome" not in _F64_RUN:
        try:
            _F64_RUN["outcome"] = run_distributed(_float64_worker, WORLD_SIZE, timeout=120)
        except (RuntimeError, TimeoutError) as error:
            _F64_RUN["outcome"] = error
    outcome = _F64_RUN["outcome"]
    if isinstance(outcome, BaseException):
        raise RuntimeError(f"the float64 workers failed:\n{outcome}")
    return outcome


def _assert_close_f64(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # float64 arithmetic on these sizes (at most 8 * 12 values per channel) agrees to ~1e-15 relative;
    # 1e-12 of the largest magnitude leaves three orders of margin and still catches any float32 step.
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12 * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", list(F64_CASES))
def test_float64_matches_one_process_batch_norm(case):
    """Sharded float64 SyncBatchNorm == ONE process of float64 torch BatchNorm on the whole batch."""
    per_rank = [r[case] for r in _float64_run()]
    spatial, _ = F64_CASES[case]
    reference = _F64_REFERENCE[2 + len(spatial)](F64_C).double()
    weight, bias = _f64_params(case)
    with torch.no_grad():
        reference.weight.copy_(weight)
        reference.bias.copy_(bias)
    for step in range(F64_STEPS):
        x, loss_weights = _f64_data(case, step)
        x.requires_grad_(True)
        y = reference(x)
        (y * loss_weights).sum().backward()
        got = [r["steps"][step] for r in per_rank]
        _assert_close_f64(torch.cat([g["y"] for g in got]), y.detach(), f"step {step} output")
        _assert_close_f64(torch.cat([g["dx"] for g in got]), x.grad, f"step {step} input grad")
        # DDP all-reduces the parameter gradients: their sum over ranks is the summed loss's gradient.
        _assert_close_f64(sum(g["dweight"] for g in got), reference.weight.grad, f"step {step} weight grad")
        _assert_close_f64(sum(g["dbias"] for g in got), reference.bias.grad, f"step {step} bias grad")
        reference.weight.grad = None
        reference.bias.grad = None
    for r in per_rank:
        _assert_close_f64(r["running_mean"], reference.running_mean, "running_mean")
        _assert_close_f64(r["running_var"], reference.running_var, "running_var")


# --------------------------------------------------------------------- float64 gradcheck of the layer


def _layer_function(layer: SyncBatchNorm):
    def f(x, weight, bias):
        return torch.func.functional_call(layer, {"weight": weight, "bias": bias}, (x,))

    return f


def _gradcheck_inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 + 0.7).requires_grad_(True)
    weight = (1.0 + 0.5 * torch.randn(shape[1], generator=g, dtype=torch.float64)).requires_grad_(True)
    bias = torch.randn(shape[1], generator=g, dtype=torch.float64).requires_grad_(True)
    return x, weight, bias


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum0.1", "cumulative"])
def test_gradcheck_float64_one_process(momentum):
    """Not distributed: plain local batch norm (``momentum=None`` takes our own autograd path)."""
    layer = SyncBatchNorm(2, momentum=momentum).double()
    for shape in [(3, 2, 2), (5, 2), (2, 2, 2, 3)]:
        inputs = _gradcheck_inputs(shape, seed=sum(shape))
        assert torch.autograd.gradcheck(_layer_function(layer), inputs, fast_mode=False)


class _SumGradOverRanks(torch.autograd.Function):
    """Identity; the backward all-reduces (SUM) the gradient over the ranks."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class _GatherShards(torch.autograd.Function):
    """Forward: the whole output (each rank's shard at its offset, zeros elsewhere, all-reduced: exact).
    Backward: this rank's slice of the whole gradient, which is the same on every rank."""

    @staticmethod
    def forward(ctx, shard, start, total):
        whole = shard.new_zeros((total, *shard.shape[1:]))
        whole[start : start + shard.shape[0]] = shard
        dist.all_reduce(whole)
        ctx.start, ctx.stop = start, start + shard.shape[0]
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.stop], None, None


def _gradcheck_worker(rank, world_size, shards):
    # gradcheck cannot be run on each rank's own shard as its input: each rank's numerical Jacobian
    # perturbs ITS element while the other rank perturbs another one in the same collective forward
    # (every rank's output depends on every rank's input), so both Jacobians would be contaminated,
    # and with uneven shards the ranks would not even make the same number of forwards/backwards
    # (gradcheck perturbs every input element and back-propagates every output element: 12 vs 8 for
    # (3, 2, 2) and (2, 2, 2)), so the collectives would not match and it would hang.
    # So every rank gradchecks THE SAME function of the WHOLE batch, f(x, weight, bias) -> y: it runs
    # our SyncBatchNorm (training mode) on this rank's shard of x, gathers the shards' outputs and
    # all-reduces the gradients of x/weight/bias. Identical inputs on every rank + deterministic
    # gradcheck = identical perturbations and the same sequence of collectives on every rank, and
    # f's Jacobian is the exact Jacobian of the distributed layer (shard-local dx of our backward
    # included, as the backward receives this rank's slice of the same whole-output gradient).
    start = sum(shards[:rank])
    stop = start + shards[rank]
    total = sum(shards)
    checked = 0
    for momentum in (0.1, None):
        layer = SyncBatchNorm(2, momentum=momentum).double()

        def f(x, weight, bias, layer=layer):
            x = _SumGradOverRanks.apply(x)[start:stop]
            params = {"weight": _SumGradOverRanks.apply(weight), "bias": _SumGradOverRanks.apply(bias)}
            shard = torch.func.functional_call(layer, params, (x,))
            return _GatherShards.apply(shard, start, total)

        for spatial in [(2,), ()]:
            inputs = _gradcheck_inputs((total, 2, *spatial), seed=11 + len(spatial))
            assert torch.autograd.gradcheck(f, inputs, fast_mode=False)
            checked += 1
    return checked


def test_gradcheck_float64_two_ranks():
    """Per rank (3, 2, 2) and (2, 2, 2) (then (3, 2) and (2, 2)), momentum 0.1 and cumulative."""
    assert run_distributed(_gradcheck_worker, WORLD_SIZE, (3, 2), timeout=120) == [4] * WORLD_SIZE
