"""Every fenced ``python`` and ``bash`` block of README.md runs as written, in order, in one
scratch folder, so the README cannot drift from the code.

Shell blocks run under ``bash -euo pipefail`` with ``.venv`` linked to the interpreter running the
tests; python blocks run as scripts (so the multi-process example needs its ``__main__`` guard,
as a user's script would). Two commands are not run here, and only these: ``bash
tools/setup.sh`` (CI runs it before the tests; the test checks .ci/run does; the set-up's
``bash tools/setup.sh && CMD`` runs CMD) and ``.venv/bin/python -m pytest`` (this very
runner).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOT_RUN_HERE = ("bash tools/setup.sh", ".venv/bin/python -m pytest")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced python/bash/sh/shell block, in order."""
    return [(lang, code) for lang, code in FENCE.findall(text)
            if lang in ("python", "bash", "sh", "shell")]


def _command(line: str) -> str:
    return line.split("  #")[0].strip()


def test_readme_block_extraction():
    text = "x\n```bash\necho 1  # one\n```\n```text\nno\n```\n```python\nprint(2)\n```\n"
    assert readme_blocks(text) == [("bash", "echo 1  # one\n"), ("python", "print(2)\n")]
    assert _command("bash tools/setup.sh     # note") == "bash tools/setup.sh"


def test_readme_blocks_run_verbatim(tmp_path):
    blocks = readme_blocks((ROOT / "README.md").read_text())
    assert any(lang == "python" for lang, _ in blocks) and any(lang == "bash" for lang, _ in blocks)
    assert "bash tools/setup.sh" in (ROOT / ".ci" / "run").read_text()
    (tmp_path / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               ONNX_PARTITION_CACHE=str(tmp_path / "profile-cache"))  # profile's, not the home's
    env.pop("ONNX_PARTITION_DIST_EXIT_RANK", None)
    skipped = []
    for number, (lang, code) in enumerate(blocks):
        if lang == "python":
            script = tmp_path / f"readme_block_{number}.py"
            script.write_text(code)
            argv = [sys.executable, str(script)]
        else:
            lines = []
            for line in code.splitlines():
                command = _command(line)
                setup = f"{NOT_RUN_HERE[0]} && "
                if command.startswith(setup):  # the set-up's `bash tools/setup.sh && CMD`
                    skipped.append(NOT_RUN_HERE[0])
                    command = line = command[len(setup):]
                if command in NOT_RUN_HERE:
                    skipped.append(command)
                    continue
                lines.append(line)
            argv = ["bash", "-euo", "pipefail", "-c", "\n".join(lines)]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            pytest.fail(f"README block {number} ({lang}) failed with exit code "
                        f"{done.returncode}:\n{code}\n--- stdout\n{done.stdout[-3000:]}\n"
                        f"--- stderr\n{done.stderr[-3000:]}")
    assert set(skipped) == set(NOT_RUN_HERE)
    assert (tmp_path / "plan2.report.html").is_file()  # the quick start's report, beside
