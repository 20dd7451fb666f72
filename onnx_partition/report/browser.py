"""Load a report in headless Chromium (Debian's ``chromium``) and check what a reader sees.

A copy of the page gets a script that records console errors and uncaught errors from the first
moment, then, after layout, checks each ``<svg>``: a ``<title>``; for charts (a label containing
"chart" or a bar chart) an axis title with a unit in brackets; every text inside the drawing
(client rectangles) and where it is drawn; whether the drawing runs past its section; no
number in scientific notation anywhere in the page's text; and the page's scroll width against
the window's.
``--dump-dom`` returns the verdict as JSON. Used by the tests and ``tools/report_screenshots.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["FLAGS", "chromium", "probe", "screenshot"]

_PROBE_HEAD = """<script>
window.__errors = [];
const __error = console.error.bind(console);
console.error = (...a) => { window.__errors.push(a.map(String).join(" ")); __error(...a); };
window.addEventListener("error", e => window.__errors.push(
  "error: " + (e.message || (e.target && (e.target.src || e.target.href)) || "?")), true);
</script>"""

_PROBE_END = """<script>
window.addEventListener("load", () => {
  const out = {errors: window.__errors, svgs: [], scientific: [],
               page: {scroll_width: document.documentElement.scrollWidth,
                      inner_width: window.innerWidth}};
  const text = document.body.innerText;
  out.scientific = text.match(/\\d(\\.\\d+)?e[+-]\\d+/g) || [];
  for (const svg of document.querySelectorAll("main svg")) {
    const label = svg.getAttribute("aria-label") || "";
    const title = svg.querySelector(":scope > title");
    const box = svg.getBoundingClientRect();
    const texts = [...svg.querySelectorAll("text")].map(t => t.textContent);
    const outside = [];
    const placed = [];
    const parent = svg.parentElement.getBoundingClientRect();
    for (const t of svg.querySelectorAll("text")) {
      const r = t.getBoundingClientRect();
      placed.push({text: t.textContent, x: r.left, y: r.top});
      const b = t.getBoundingClientRect();
      if (b.width && (b.left < box.left - 1 || b.top < box.top - 1
                      || b.right > box.right + 1 || b.bottom > box.bottom + 1)) {
        outside.push(t.textContent);
      }
    }
    out.svgs.push({label, title: title ? title.textContent : "", texts, outside, placed,
                   width: box.width, overflow: box.right > parent.right + 1});
  }
  const pre = document.createElement("pre");
  pre.id = "probe-result";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-dev-shm-usage", "--hide-scrollbars")


def chromium() -> str | None:
    """Debian's Chromium binary, if installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(args: list[str], profile: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("chromium is not installed")
    return subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}",
                           "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def probe(report: Path, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Load ``report`` with the probe; the JSON verdict (see the module docstring)."""
    page = Path(report).read_text(encoding="utf-8")
    page = page.replace("<head>", "<head>" + _PROBE_HEAD, 1).replace(
        "</body>", _PROBE_END + "</body>", 1)
    with tempfile.TemporaryDirectory(prefix="onnx-partition-browser-") as tmp:
        copy = Path(tmp) / "probe.html"
        copy.write_text(page, encoding="utf-8")
        done = _run(["--window-size=1400,1000", "--dump-dom", copy.as_uri()],
                    str(Path(tmp) / "profile"), timeout_s)
    marker = '<pre id="probe-result">'
    if marker not in done.stdout:
        raise RuntimeError(f"chromium gave no verdict (exit {done.returncode}): "
                           f"{done.stderr[-2000:]}")
    raw = done.stdout.split(marker, 1)[1].split("</pre>", 1)[0]
    import html

    result: dict[str, Any] = json.loads(html.unescape(raw))
    result["console"] = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    return result


def screenshot(report: Path, png: Path, *, width: int = 1400, height: int = 2600,
               timeout_s: float = 120.0) -> Path:
    """A PNG of the top ``height`` pixels of ``report`` as Chromium draws it."""
    with tempfile.TemporaryDirectory(prefix="onnx-partition-browser-") as tmp:
        done = _run([f"--window-size={width},{height}", f"--screenshot={Path(png).resolve()}",
                     Path(report).resolve().as_uri()], str(Path(tmp) / "profile"), timeout_s)
    if not Path(png).is_file():
        raise RuntimeError(f"chromium wrote no screenshot: {done.stderr[-2000:]}")
    return Path(png)
