"""convert_sync_batchnorm / revert_sync_batchnorm: shared state, original classes, lossless round trip."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_ext.nn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm


class TaggedBatchNorm2d(nn.BatchNorm2d):
    """A user subclass with its own attribute: must come back with its class and attribute."""

    def __init__(self, num_features: int, tag: str) -> None:
        super().__init__(num_features, momentum=0.3)
        self.tag = tag


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Conv2d(4, 4, 1), TaggedBatchNorm2d(4, tag="mine")),
        nn.SyncBatchNorm(4, eps=1e-3),
        nn.Flatten(2),
        nn.BatchNorm1d(4, affine=False),
        nn.Unflatten(2, (1, 5, 5)),
        nn.BatchNorm3d(4, track_running_stats=False),
    )
    model[2][1].eval()
    model[1].qconfig = "qconfig-marker"
    for _ in range(2):
        model(torch.randn(3, 2, 5, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def test_convert_shares_state_and_revert_restores_original_classes():
    model = _model()
    classes = [type(m) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    flags = [m.training for m in model.modules()]
    x = torch.randn(3, 2, 5, 5)
    model.eval()
    expected = model(x)
    model.train()
    model[2][1].eval()

    converted = convert_sync_batchnorm(model, backend="reference")
    bns = [m for m in converted.modules() if isinstance(m, SyncBatchNorm)]
    assert len(bns) == 5 and all(m.backend == "reference" for m in bns)
    assert [m.training for m in converted.modules()] == flags
    assert converted[1].qconfig == "qconfig-marker"
    assert converted[3].eps == 1e-3 and converted[2][1].momentum == 0.3 and converted[5].weight is None
    assert converted[7].running_mean is None
    for name, p in converted.named_parameters():
        assert p is params[name], name  # the very same Parameter objects
    assert list(converted.state_dict()) == list(state)

    # Changes while converted (dtype moves, loaded values, training) flow back through revert.
    converted.double()
    converted.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})
    reverted = revert_sync_batchnorm(converted)
    assert [type(m) for m in reverted.modules()] == classes
    assert reverted[2][1].tag == "mine" and reverted[1].qconfig == "qconfig-marker"
    assert [m.training for m in reverted.modules()] == flags
    assert reverted[1].running_mean.dtype == torch.float64
    reverted.float()
    for key, value in reverted.state_dict().items():
        assert torch.equal(value, state[key]), key
    for name, p in reverted.named_parameters():
        assert p is params[name], name
    reverted.eval()
    torch.testing.assert_close(reverted(x), expected, rtol=0, atol=0)


def test_round_trip_outputs_identical_in_training():
    model = _model()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 2, 5, 5)
    reverted = revert_sync_batchnorm(convert_sync_batchnorm(model))
    torch.testing.assert_close(reverted(x), reference(x), rtol=0, atol=0)
    for (key, a), b in zip(reverted.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), key


def test_root_layer_pickling_and_direct_sync_batch_norm():
    bn = nn.BatchNorm1d(3)
    converted = convert_sync_batchnorm(bn)
    assert type(converted) is SyncBatchNorm and converted.weight is bn.weight
    # The template travels with pickling/deep copies (ddp_spawn, Lightning checkpoints of the module).
    clone = pickle.loads(pickle.dumps(converted))
    assert type(revert_sync_batchnorm(clone)) is nn.BatchNorm1d
    assert type(revert_sync_batchnorm(copy.deepcopy(converted))) is nn.BatchNorm1d
    # The template holds no tensors and never shows in the state dict.
    assert list(converted.state_dict()) == list(bn.state_dict())
    # Converting twice is a no-op; a layer built as SyncBatchNorm reverts to a local batch norm of any rank.
    assert convert_sync_batchnorm(converted) is converted
    direct = SyncBatchNorm(3, momentum=None)
    local = revert_sync_batchnorm(direct)
    assert type(local) is not SyncBatchNorm and isinstance(local, nn.modules.batchnorm._BatchNorm)
    assert local.momentum is None and local.running_mean is direct.running_mean
    for shape in [(4, 3), (4, 3, 5), (4, 3, 2, 2), (4, 3, 2, 2, 2)]:
        assert local(torch.randn(shape)).shape == shape


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"`module` must be a torch.nn.Module, got 3"):
        convert_sync_batchnorm(3)
    with pytest.raises(TypeError, match=r"`module` must be a torch.nn.Module, got 'x'"):
        revert_sync_batchnorm("x")
    with pytest.raises(TypeError, match=r"`backend` must be a kernel backend name \(str\) or None, got 1"):
        convert_sync_batchnorm(nn.BatchNorm1d(2), backend=1)
    with pytest.raises(ValueError, match=r"unknown kernel backend 'nope'"):
        convert_sync_batchnorm(nn.BatchNorm1d(2), backend="nope")


class AnyDimBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A user's batch norm derived from torch's base class, as timm's and detectron2's are."""

    def _check_input_dim(self, input):
        pass


def test_every_batch_norm_class_converts_and_settings_changed_while_converted_revert_with_it():
    # torch converts every _BatchNorm (its subclasses of the base and torch's classes alike); a class
    # left out computed per-rank statistics with nothing said. And a schedule or Lightning's
    # BaseFinetuning.freeze (track_running_stats=False) acting on the converted layer outlives the
    # revert (which rebuilt the layer's settings from the original).
    lazy = nn.LazyBatchNorm1d()
    lazy(torch.randn(4, 3))
    model = nn.Sequential(nn.Linear(3, 3), AnyDimBatchNorm(3), lazy)
    converted = SyncBatchNorm.convert_sync_batchnorm(model)  # torch's classmethod spelling
    assert [type(m) for m in converted] == [nn.Linear, SyncBatchNorm, SyncBatchNorm]
    assert converted[2].weight is lazy.weight
    for layer in converted[1:]:
        layer.momentum, layer.eps, layer.track_running_stats = 0.01, 1e-2, False
    reverted = revert_sync_batchnorm(converted)
    assert [type(m) for m in reverted] == [nn.Linear, AnyDimBatchNorm, nn.BatchNorm1d]
    for layer in reverted[1:]:
        assert (layer.momentum, layer.eps, layer.track_running_stats) == (0.01, 1e-2, False)
    with pytest.raises(ValueError, match=r"the lazy layer LazyBatchNorm1d\(0,.*has not seen an input yet"):
        convert_sync_batchnorm(nn.LazyBatchNorm1d())


def test_hooks_fire_while_converted_and_those_added_then_survive_the_revert():
    # Quantization-aware training's observers are forward hooks on the batch norm: they stopped
    # observing while the layer was converted (QAT trained without fake-quantization there), and a
    # hook registered on the converted layer was gone after the revert.
    net, calls = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)), []
    net[1].register_forward_hook(lambda module, args, out: calls.append("original"))
    net[1].register_forward_pre_hook(lambda module, args: calls.append("original pre"))
    net = convert_sync_batchnorm(net)
    net(torch.randn(2, 1, 5, 5))
    assert calls == ["original pre", "original"]
    net[1].register_forward_hook(lambda module, args, out: calls.append("converted"))
    net[1].register_state_dict_pre_hook(lambda module, prefix, keep_vars: calls.append("state_dict"))
    net = revert_sync_batchnorm(net)
    assert type(net[1]) is nn.BatchNorm2d
    calls.clear()
    net(torch.randn(2, 1, 5, 5))
    net.state_dict()
    assert calls == ["original pre", "original", "converted", "state_dict"]


def test_a_torchscript_module_holding_batch_norms_raises_instead_of_converting_nothing():
    scripted = torch.jit.script(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)))
    with pytest.raises(TypeError, match=r"'Sequential' is a TorchScript module holding batch norms"):
        convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 2), scripted))
    convert_sync_batchnorm(torch.jit.script(nn.Linear(2, 2)))  # nothing to replace: fine


class _SharedNorm(nn.Module):
    """One batch norm used under two names (applied twice in the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 3, 1)
        self.bn2 = self.bn

    def forward(self, x):
        return self.bn2(self.conv(self.bn(x)))


def test_a_layer_used_under_two_names_stays_one_layer_through_convert_and_revert():
    # named_children skips a module it has seen: the second name stayed a BatchNorm2d sharing the
    # converted layer's tensors, unsynchronized (the plugin, which keeps DDP from broadcasting the
    # converted layers' buffers, let the ranks' running statistics drift apart), and revert made two
    # layers of one.
    model = _SharedNorm()
    converted = convert_sync_batchnorm(model)
    assert type(converted.bn) is SyncBatchNorm and converted.bn2 is converted.bn
    reverted = revert_sync_batchnorm(converted)
    assert type(reverted.bn) is nn.BatchNorm2d and reverted.bn2 is reverted.bn
    assert list(reverted.state_dict()) == list(_SharedNorm().state_dict())
