"""U-Net (Ronneberger et al., 2015), with same-padded convs.

The encoder halves the resolution ``depth`` times; the decoder upsamples with transposed
convs and concatenates the encoder feature map of matching resolution at every level, so
the outermost skip connection spans the whole network. "realistic" is the original
channel plan (64 .. 1024, depth 4) on 256x256 images.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._layers import conv_relu, init_cnn
from ._recipe import Recipe, finish, input_generator, seeded


@dataclass(frozen=True)
class Config:
    depth: int  # number of 2x downsamplings
    base: int  # channels at full resolution; doubled per level
    image: int
    classes: int


CONFIGS = {
    "tiny": Config(depth=2, base=8, image=32, classes=2),
    "small": Config(depth=4, base=16, image=64, classes=2),
    "realistic": Config(depth=4, base=64, image=256, classes=2),
}


def double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(conv_relu(cin, cout, 3), conv_relu(cout, cout, 3))


class UNet(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        chans = [cfg.base * 2**i for i in range(cfg.depth + 1)]
        self.inc = double_conv(3, chans[0])
        self.down = nn.ModuleList(
            nn.Sequential(nn.MaxPool2d(2), double_conv(chans[i], chans[i + 1]))
            for i in range(cfg.depth)
        )
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2)
            for i in reversed(range(cfg.depth))
        )
        self.dec = nn.ModuleList(
            double_conv(2 * chans[i], chans[i]) for i in reversed(range(cfg.depth))
        )
        self.head = nn.Conv2d(chans[0], cfg.classes, 1)
        init_cnn(self)
        # Classifier-style small init keeps the logits small, so float32 reassociation noise
        # (ORT vs torch) stays inside atol=1e-5 at the realistic size too.
        nn.init.normal_(self.head.weight, std=0.01)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.inc(image)
        skips = [x]
        for down in self.down:
            x = down(x)
            skips.append(x)
        skips.pop()  # the bottleneck output is not a skip
        for up, dec in zip(self.up, self.dec, strict=True):
            x = dec(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


def build(size: str, batch_size: int) -> Recipe:
    cfg = CONFIGS[size]
    with seeded():
        module = UNet(cfg)
    image = torch.randn(batch_size, 3, cfg.image, cfg.image, generator=input_generator())
    return finish(module, {"image": image}, ["logits"])
