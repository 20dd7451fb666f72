"""GoogLeNet / Inception-v1 (Szegedy et al., 2014), without the auxiliary classifiers.

Each Inception module runs four parallel branches -- 1x1; 1x1 -> 3x3; 1x1 -> 5x5;
3x3 max-pool -> 1x1 -- and concatenates them on the channel axis. "realistic" is the
paper's nine modules (3a..5b) at 224x224; smaller sizes scale the channel counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._layers import conv_relu, init_cnn
from ._recipe import Recipe, finish, input_generator, seeded

# (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj) per module; "pool" = 3x3/2 max-pool.
GOOGLENET: tuple[tuple[int, ...] | str, ...] = (
    (64, 96, 128, 16, 32, 32),  # 3a
    (128, 128, 192, 32, 96, 64),  # 3b
    "pool",
    (192, 96, 208, 16, 48, 64),  # 4a
    (160, 112, 224, 24, 64, 64),  # 4b
    (128, 128, 256, 24, 64, 64),  # 4c
    (112, 144, 288, 32, 64, 64),  # 4d
    (256, 160, 320, 32, 128, 128),  # 4e
    "pool",
    (256, 160, 320, 32, 128, 128),  # 5a
    (384, 192, 384, 48, 128, 128),  # 5b
)


@dataclass(frozen=True)
class Config:
    width: float  # channel multiplier
    modules: int  # how many Inception modules of GOOGLENET to keep
    image: int
    classes: int


CONFIGS = {
    "tiny": Config(width=1 / 8, modules=2, image=32, classes=10),
    "small": Config(width=1 / 4, modules=9, image=64, classes=100),
    "realistic": Config(width=1.0, modules=9, image=224, classes=1000),
}


class InceptionModule(nn.Module):
    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pp: int) -> None:
        super().__init__()
        self.b1 = conv_relu(cin, c1, 1)
        self.b3 = nn.Sequential(conv_relu(cin, c3r, 1), conv_relu(c3r, c3, 3))
        self.b5 = nn.Sequential(conv_relu(cin, c5r, 1), conv_relu(c5r, c5, 5))
        self.bp = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), conv_relu(cin, pp, 1))
        self.out_channels = c1 + c3 + c5 + pp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1)


class GoogLeNet(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()

        def ch(c: int) -> int:
            return max(4, round(c * cfg.width))

        self.stem = nn.Sequential(
            conv_relu(3, ch(64), 7, stride=2), nn.MaxPool2d(3, stride=2, padding=1),
            conv_relu(ch(64), ch(64), 1), conv_relu(ch(64), ch(192), 3),
            nn.MaxPool2d(3, stride=2, padding=1),
        )  # fmt: skip
        layers: list[nn.Module] = []
        cin, kept = ch(192), 0
        for spec in GOOGLENET:
            if kept == cfg.modules:
                break
            if isinstance(spec, str):
                layers.append(nn.MaxPool2d(3, stride=2, padding=1))
                continue
            module = InceptionModule(cin, *(ch(c) for c in spec))
            layers.append(module)
            cin, kept = module.out_channels, kept + 1
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, cfg.classes)
        init_cnn(self)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.body(self.stem(image))
        return self.fc(x.mean(dim=(2, 3)))


def build(size: str, batch_size: int) -> Recipe:
    cfg = CONFIGS[size]
    with seeded():
        module = GoogLeNet(cfg)
    image = torch.randn(batch_size, 3, cfg.image, cfg.image, generator=input_generator())
    return finish(module, {"image": image}, ["logits"])
