"""``python -m onnx_partition.cli ...``: the console script ``onnx-partition``."""

import sys

from onnx_partition.cli.verbs import main

sys.exit(main())
