"""The `Recipe` record and small helpers shared by every recipe module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

SIZES: tuple[str, ...] = ("tiny", "small", "realistic")

#: Seed for module weights; inputs use a separate generator seeded with SEED + 1.
SEED = 0


@dataclass(frozen=True)
class Recipe:
    """A ready-to-export model: an eval-mode module, example inputs and output names.

    ``inputs`` maps ONNX input names to example tensors (batch dimension first), in the
    order of the module's ``forward`` parameters.
    """

    module: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    output_names: list[str]


#: What each recipe module exposes: ``build(size, batch_size) -> Recipe``.
Builder = Callable[[str, int], Recipe]


@contextmanager
def seeded(seed: int = SEED) -> Iterator[None]:
    """Seed torch's global RNG inside the block, restoring the caller's RNG state after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def input_generator(seed: int = SEED + 1) -> torch.Generator:
    """A private generator for example inputs, so inputs never disturb weight init."""
    return torch.Generator().manual_seed(seed)


def finish(
    module: torch.nn.Module, inputs: dict[str, torch.Tensor], output_names: list[str]
) -> Recipe:
    """Put ``module`` in eval mode with gradients off and wrap it in a `Recipe`."""
    module.eval()
    module.requires_grad_(False)
    return Recipe(module=module, inputs=inputs, output_names=output_names)


def randomize_batchnorm(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every BatchNorm non-trivial running stats and affine params.

    Freshly built BatchNorms are the identity in eval mode; random statistics make the
    exported normalization actually do something (and be checked against torch).
    """
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            assert m.running_mean is not None and m.running_var is not None
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(n, generator=generator) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=generator) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(n, generator=generator) * 0.5 + 0.75)
                m.bias.copy_(torch.randn(n, generator=generator) * 0.1)
