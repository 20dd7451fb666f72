"""ResNet (He et al., 2015): residual blocks with identity or projection shortcuts.

"tiny" uses four basic blocks; "small" and "realistic" use the ResNet-50 layout of
bottleneck blocks (3, 4, 6, 3) -- "small" at a quarter width on 64x64 images, "realistic"
at full width on 224x224.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._layers import conv_bn_relu
from ._recipe import Recipe, finish, input_generator, randomize_batchnorm, seeded


@dataclass(frozen=True)
class Config:
    bottleneck: bool
    blocks: tuple[int, ...]  # blocks per stage
    widths: tuple[int, ...]  # inner width per stage
    stem: int
    image: int
    classes: int


CONFIGS = {
    "tiny": Config(False, (2, 2), (8, 16), stem=8, image=32, classes=10),
    "small": Config(True, (3, 4, 6, 3), (16, 32, 64, 128), stem=16, image=64, classes=100),
    "realistic": Config(True, (3, 4, 6, 3), (64, 128, 256, 512), stem=64, image=224, classes=1000),
}


class Block(nn.Module):
    """Basic (3x3, 3x3) or bottleneck (1x1, 3x3, 1x1 x4) block; output = relu(f(x) + s(x))."""

    def __init__(self, cin: int, width: int, stride: int, bottleneck: bool) -> None:
        super().__init__()
        cout = width * 4 if bottleneck else width
        if bottleneck:
            last = nn.Conv2d(width, cout, 1, bias=False)
            self.branch = nn.Sequential(
                conv_bn_relu(cin, width, 1), conv_bn_relu(width, width, 3, stride),
                last, nn.BatchNorm2d(cout),
            )  # fmt: skip
        else:
            last = nn.Conv2d(width, cout, 3, padding=1, bias=False)
            self.branch = nn.Sequential(
                conv_bn_relu(cin, width, 3, stride), last, nn.BatchNorm2d(cout)
            )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )
        self.out_channels = cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.branch(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            conv_bn_relu(3, cfg.stem, 7, stride=2), nn.MaxPool2d(3, stride=2, padding=1)
        )
        blocks: list[nn.Module] = []
        cin = cfg.stem
        for stage, (n, width) in enumerate(zip(cfg.blocks, cfg.widths, strict=True)):
            for i in range(n):
                block = Block(cin, width, 2 if stage > 0 and i == 0 else 1, cfg.bottleneck)
                blocks.append(block)
                cin = block.out_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, cfg.classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(image))
        return self.fc(x.mean(dim=(2, 3)))


def build(size: str, batch_size: int) -> Recipe:
    cfg = CONFIGS[size]
    with seeded():
        module = ResNet(cfg)
    gen = input_generator()
    randomize_batchnorm(module, gen)
    image = torch.randn(batch_size, 3, cfg.image, cfg.image, generator=gen)
    return finish(module, {"image": image}, ["logits"])
