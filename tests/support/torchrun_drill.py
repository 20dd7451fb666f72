"""A worker script for ``torchrun`` that trains as ``python -m onnx_partition.train.runtime``
does, with :class:`~onnx_partition.runtime.launch.hooks.KillOnce` as the rank's hook: the rank
``DRILL_RANK`` kills itself (SIGKILL) at its forward number ``DRILL_AT``, once per
``DRILL_MARKER`` file, so torchrun's own ``--max-restarts`` has a lost worker to restart."""

from __future__ import annotations

import os
import sys

from onnx_partition.cli.torchrun import train_main
from onnx_partition.runtime.launch.hooks import KillOnce

if __name__ == "__main__":
    drill = KillOnce(os.environ["DRILL_MARKER"], rank=int(os.environ["DRILL_RANK"]),
                     at=int(os.environ["DRILL_AT"]))
    sys.exit(train_main(sys.argv[1:], hook=drill))
