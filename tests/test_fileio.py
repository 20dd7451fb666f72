"""The one rule for writing a file whole or not at all, and for hashing one in blocks."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from onnx_partition.fileio import BLOCK, atomic_path, atomic_write, sha256_file


def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_atomic_write_creates_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "costs.json"
    assert atomic_write(target, "one\n") == target
    assert target.read_text() == "one\n"
    atomic_write(target, b"\x00two")
    assert target.read_bytes() == b"\x00two"
    assert _leftovers(tmp_path, {"costs.json"}) == []


def test_a_writer_that_fails_midway_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "model.pt2"
    target.write_bytes(b"the user's file")
    with (pytest.raises(RuntimeError, match="disk on fire"), atomic_path(target) as staged,
          open(staged, "wb") as handle):
        handle.write(b"half of the new")
        handle.flush()
        raise RuntimeError("disk on fire")
    assert target.read_bytes() == b"the user's file"
    assert _leftovers(tmp_path, {"model.pt2"}) == []


def test_a_writer_that_writes_nothing_changes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(FileNotFoundError), atomic_path(target):
        pass
    assert target.read_text() == "old"
    assert _leftovers(tmp_path, {"out.json"}) == []


def test_files_beside_the_staged_one_are_published_first(tmp_path: Path) -> None:
    """An exporter that writes ``NAME.data`` beside ``NAME`` (as onnx external data does)."""
    target = tmp_path / "model.onnx"
    with atomic_path(target) as staged:
        assert staged.name == "model.onnx" and staged.parent != tmp_path
        staged.write_bytes(b"graph")
        staged.with_name("model.onnx.data").write_bytes(b"weights")
    assert target.read_bytes() == b"graph"
    assert (tmp_path / "model.onnx.data").read_bytes() == b"weights"
    assert _leftovers(tmp_path, {"model.onnx", "model.onnx.data"}) == []


def test_no_overwrite_never_replaces_a_file(tmp_path: Path) -> None:
    target = tmp_path / "report.html"
    atomic_write(target, "first", overwrite=False)
    assert target.read_text() == "first"
    with pytest.raises(FileExistsError):
        atomic_write(target, "second", overwrite=False)
    assert target.read_text() == "first"
    assert _leftovers(tmp_path, {"report.html"}) == []


def test_new_files_get_the_permissions_open_gives(tmp_path: Path) -> None:
    plain, atomic = tmp_path / "plain", tmp_path / "atomic"
    plain.write_text("x")
    atomic_write(atomic, "x")
    assert atomic.stat().st_mode == plain.stat().st_mode


def test_a_long_name_still_gets_a_temporary(tmp_path: Path) -> None:
    target = tmp_path / ("n" * 250)
    atomic_write(target, "ok")
    assert target.read_text() == "ok"


@pytest.mark.parametrize("size", [0, 1, BLOCK, 2 * BLOCK + 12345])
def test_sha256_file_equals_hashlib(tmp_path: Path, size: int) -> None:
    path = tmp_path / "blob"
    data = os.urandom(size)
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    assert sha256_file(path) == expected
    assert sha256_file(path, sync=True) == expected


def test_sha256_file_reads_in_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed: no read asks for more than one block, however large the file."""
    path = tmp_path / "blob"
    path.write_bytes(b"\x01" * (3 * BLOCK + 1))
    asked: list[int] = []
    real_open = open

    class Spy:
        def __init__(self, handle):  # type: ignore[no-untyped-def]
            self.handle = handle

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            self.handle.close()

        def read(self, n: int = -1) -> bytes:
            asked.append(n)
            return bytes(self.handle.read(n))

        def fileno(self) -> int:
            return int(self.handle.fileno())

    monkeypatch.setattr("builtins.open", lambda *a, **k: Spy(real_open(*a, **k)))
    assert sha256_file(path) == hashlib.sha256(b"\x01" * (3 * BLOCK + 1)).hexdigest()
    assert asked and all(0 < n <= BLOCK for n in asked)
