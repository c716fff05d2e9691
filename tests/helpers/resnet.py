"""torchvision's ResNet with ``BasicBlock``\\ s, written out (torchvision is not a test dependency).

Same layers, order, names and initialisation as torchvision's ``ResNet(BasicBlock, blocks,
num_classes=...)``: a 7x7/2 convolution stem with batch norm and a 3x3/2 max pool, four stages of
``blocks[i]`` ``BasicBlock``\\ s (the first block of stages 2-4 strides by 2 and has a 1x1 convolution
+ batch norm ``downsample``), global average pool and a linear classifier. ``blocks=(2, 2, 2, 2)`` is
``resnet18``; ``(1, 1, 1, 1)`` (ResNet-10) keeps every kind of layer: the stem, a block with an
identity shortcut (stage 1) and blocks with a downsample (stages 2-4). ``width`` scales the channels
(64 is torchvision's). With 32x32 inputs the stages run on 8x8, 4x4, 2x2 and 1x1 maps.

For layer-by-layer comparisons ``forward`` returns a list: the output of the stem, of each block
and the logits last, named in order by ``output_names`` (``"stem"``, ``"layer{stage}.{block}"``,
``"fc"``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["resnet"]


def _conv(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + downsample(x))``, as torchvision's."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(c_in, c_out, 3, stride), nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = _conv(c_out, c_out, 3), nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(_conv(c_in, c_out, 1, stride), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """torchvision's ``ResNet(BasicBlock, blocks)``: stem, ``layer1``-``layer4``, ``fc``."""

    def __init__(self, blocks: Sequence[int], num_classes: int, width: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(3, width, 7, 2), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        c_in, self.output_names = width, ["stem"]
        for i, (c_out, n) in enumerate(zip(widths, blocks, strict=True), start=1):
            stage = [BasicBlock(c_in, c_out, 1 if i == 1 else 2)]
            stage += [BasicBlock(c_out, c_out, 1) for _ in range(n - 1)]
            setattr(self, f"layer{i}", nn.Sequential(*stage))
            self.output_names += [f"layer{i}.{b}" for b in range(n)]
            c_in = c_out
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)
        self.output_names.append("fc")
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> list[Tensor]:
        outputs = [self.maxpool(self.relu(self.bn1(self.conv1(x))))]
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                outputs.append(block(outputs[-1]))
        return [*outputs, self.fc(self.avgpool(outputs[-1]).flatten(1))]


def resnet(blocks: Sequence[int] = (2, 2, 2, 2), num_classes: int = 10, width: int = 64) -> nn.Module:
    """torchvision's ``ResNet(BasicBlock, blocks, num_classes=num_classes)`` with ``width`` channels in
    the first stage (``forward``: the module docstring); the default ``blocks`` is ``resnet18``'s."""
    return ResNet(blocks, num_classes, width)
