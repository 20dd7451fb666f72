#!/usr/bin/env bash
# Create .venv (once) and install onnx-partition with its test tools into it.
# torch is pinned to the CPU build that lies on this machine's disk, so pip never pulls a
# multi-GB CUDA build; everything else comes from the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[cpu,test]"
