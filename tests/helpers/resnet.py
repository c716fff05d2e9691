"""torchvision's ``resnet18`` architecture, written out (torchvision is not a test dependency).

Same layers, order, names and initialisation as ``torchvision.models.resnet18(num_classes=...)``:
a 7x7/2 convolution stem with batch norm and a 3x3/2 max pool, four stages of two ``BasicBlock``\\ s
(the first block of stages 2-4 strides by 2 and has a 1x1 convolution + batch norm ``downsample``),
global average pool and a linear classifier; 20 ``BatchNorm2d`` layers. ``width`` scales the channels
(64 is torchvision's). With 32x32 inputs the stages run on 8x8, 4x4, 2x2 and 1x1 maps.

For layer-by-layer comparisons ``forward`` returns a list: the output of the stem, of each of the 8
blocks, and the logits last.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["resnet18"]


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


class ResNet18(nn.Module):
    """torchvision's ``ResNet(BasicBlock, [2, 2, 2, 2])``: stem, ``layer1``-``layer4``, ``fc``."""

    def __init__(self, num_classes: int, width: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(3, width, 7, 2), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        for i, (c_in, c_out) in enumerate(zip([width, *widths[:-1]], widths), start=1):
            blocks = [BasicBlock(c_in, c_out, 1 if i == 1 else 2), BasicBlock(c_out, c_out, 1)]
            setattr(self, f"layer{i}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> list[Tensor]:
        outputs = [self.maxpool(self.relu(self.bn1(self.conv1(x))))]
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                outputs.append(block(outputs[-1]))
        return [*outputs, self.fc(self.avgpool(outputs[-1]).flatten(1))]


def resnet18(num_classes: int = 10, width: int = 64) -> nn.Module:
    """torchvision's ``resnet18(num_classes=num_classes)`` with ``width`` channels in the first stage
    (``forward``: the module docstring)."""
    return ResNet18(num_classes, width)
