"""A picklable ``progress(done, total)`` that a rank process can call: lines in a file."""

from __future__ import annotations

from pathlib import Path

__all__ = ["FileProgress"]


class FileProgress:
    """Appends ``done total`` to ``path`` on every call (from whichever process calls it)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __call__(self, done: int, total: int) -> None:
        with self.path.open("a") as f:
            f.write(f"{done} {total}\n")

    def calls(self) -> list[tuple[int, int]]:
        if not self.path.exists():
            return []
        return [(int(a), int(b)) for a, b in
                (line.split() for line in self.path.read_text().splitlines())]
