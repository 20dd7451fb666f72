"""Shared fixtures: recipe exports cached for the session, and the hypothesis profiles. Shared
helpers that are not fixtures live in :mod:`support` (tests import ``support.<module>``, never
another test module)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests: no per-example deadline (CI machines are slow and shared); in CI the examples
# are derived from each test's name, so a run is reproducible and a failure can be replayed.
settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


#: Test files that take minutes, run first: with one worker per core (pytest-xdist, each file on
#: one worker) the longest files started last would leave the other cores idle at the end.
LONGEST_FIRST = ("test_readme.py", "test_train_hf.py", "test_train_optim.py",
                 "test_train_recipes.py", "test_shard_optimizer.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """:data:`LONGEST_FIRST`'s files first, in that order; the rest as collected."""
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``XDG_CACHE_HOME`` in a temporary folder for the whole session (and the processes it
    starts): the analytic CPU speed that ``partition`` measures and
    caches (``cost.devices.measured_cpu``) never lands in the real home, and is measured once.
    A train plan for this CPU is priced by the roofline here (``$ONNX_PARTITION_TRAIN_PRICING
    =analytic``, as ``--analytic``): measuring it takes a minute or two per model, and most
    tests plan for their plans' shape, not their times. The tests of the measured default
    (``test_train_pricing.py``) unset it."""
    from onnx_partition.cost.profile.train_cache import PRICING_ENV

    folder = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(folder))
        patch.setenv(PRICING_ENV, "analytic")
        yield folder


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """``exported(name, size)``: the recipe's ONNX file, exported once per test session."""
    from onnx_partition import models

    root = tmp_path_factory.mktemp("recipes")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, size: str = "tiny") -> Path:
        if (name, size) not in cache:
            cache[name, size] = models.export(name, root / f"{name}-{size}.onnx", size=size)
        return cache[name, size]

    return get


@pytest.fixture(scope="session")
def hf_exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``hf_exported(name, labels=False)``: a tiny Hugging Face model (``support.hf``: gpt2,
    bert, llama, vit) exported as it is, once per test session; ``labels=True``: with labels
    as an input, the model's own loss its first output."""
    from support.hf import export_hf

    root = tmp_path_factory.mktemp("hf")
    cache: dict[tuple[str, bool], Path] = {}

    def get(name: str, labels: bool = False) -> Path:
        if (name, labels) not in cache:
            suffix = "-labels" if labels else ""
            cache[name, labels] = export_hf(name, root / f"{name}{suffix}.onnx", labels=labels)
        return cache[name, labels]

    return get
