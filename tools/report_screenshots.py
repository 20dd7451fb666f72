"""Screenshots of the HTML report as headless Chromium draws it, for a look by eye.

    python tools/report_screenshots.py OUT_DIR [--size small]

Exports the GPT recipe (``--size``; small has 365 operators, so its graph is drawn condensed),
plans it twice, writes both reports and a PNG of each, and prints the browser check's verdict
(console errors, charts without titles or units, text outside a chart, scientific notation):

* ``plain``: 4 pipeline stages, one CPU device each (inference);
* ``hybrid``: training on 2 machines x 8 CUDA devices of 16 GB (planning needs no GPU).

Needs Debian's ``chromium`` (``apt-get install chromium``; ``graphviz`` for the condensed graph).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from onnx_partition import models
from onnx_partition.cli import main as cli
from onnx_partition.report.browser import chromium, probe, screenshot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the plans, reports and PNGs")
    parser.add_argument("--size", default="small", help="GPT recipe size: tiny | small")
    parser.add_argument("--height", type=int, default=3400, help="screenshot height in pixels")
    args = parser.parse_args()
    if chromium() is None:
        print("error: chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / f"gpt-{args.size}.onnx"
    if not model.is_file():
        models.export("gpt", model, size=args.size, batch_size=2)
    plans = {
        "plain": ["-s", "4"],
        "hybrid": ["--nnodes", "2", "--nproc-per-node", "8", "--device-memory", "16G",
                   "--device-kind", "cuda", "--mode", "train"],
    }
    for name, options in plans.items():
        folder = args.out / name
        code = cli(["-q", "partition", str(model), "--batch-size", "8", "-o", str(folder),
                    "--force", *options])
        if code:
            return code
        cli(["-q", "report", str(folder)])
        page = folder.with_name(f"{folder.name}.report.html")
        png = screenshot(page, args.out / f"report-{name}.png", height=args.height)
        verdict = probe(page)
        problems = {k: v for k, v in verdict.items() if k in ("errors", "console", "scientific")
                    and v}
        problems |= {f"svg {s['label']!r}": s["outside"] for s in verdict["svgs"] if s["outside"]}
        problems |= {f"svg {s['label']!r} untitled": True for s in verdict["svgs"]
                     if not s["title"]}
        print(f"{png}: {json.dumps(problems) if problems else 'no problem found'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
