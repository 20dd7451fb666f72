"""Package layout only (everything else is in pyproject.toml): the recipes live in the
repository's ``models/`` (``from models import build`` from a checkout) but install as
``onnx_partition.models``, so a user's own ``models`` package neither shadows them nor is
shadowed by them. pyproject.toml's ``packages.find`` cannot add a package from another folder,
hence this file."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["onnx_partition", "onnx_partition.*"]),
              "onnx_partition.models"],
    package_dir={"onnx_partition.models": "models"},
)
