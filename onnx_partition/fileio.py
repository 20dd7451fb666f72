"""Files written whole or not at all, and files hashed without reading them whole: the one rule
for each (every writer and every checksum of the package goes through here).

**Atomic writes.** :func:`atomic_write` (bytes or text) and :func:`atomic_path` (for writers that
need a path: ``torch.export.save``, ``onnx.save``, an exporter that adds a ``.data`` file beside
its ONNX file) write into a fresh hidden folder beside the target (``.NAME.tmp-XXXXXXXX``, so no
rename crosses a file system), under the target's own name. When the writer is done, every file
it wrote there is fsynced and renamed into the target's folder (:func:`os.replace`; extra files,
such as a ``.data`` file, first, the target last), then the folder is fsynced. A writer that fails
midway leaves the target as it was and no temporary behind. With ``overwrite=False`` the target
is published with a hard link instead, so a file that appeared at that name meanwhile is never
replaced (:class:`FileExistsError`). New files get the permissions a plain ``open`` gives them
(0o666 less the umask).

**Checksums.** :func:`sha256_file` hashes a file in 1 MiB blocks, so a multi-GB weights file
costs no more memory than one block. A file written through :class:`HashingWriter` is hashed as
its bytes go out, on a worker thread while the same bytes are written (hashlib and file
writes release the GIL, so the hash costs no time beside the write where a second core is
free); :meth:`HashingWriter.copy_from` copies a span of another file through one reused
buffer; every 64 MiB it asks the kernel to start writing them back (``posix_fadvise``), so
the fsync before publication waits for the tail only. :func:`written_sha256` gives that
digest back while the file's size and
modification time are still the ones it closed with, so a plan folder's manifest does not read
a multi-GB stage file a second time (a check of a folder, :func:`onnx_partition.plan.folder.
verify`, always reads).

Folders are another matter: a plan folder is published as a whole under a lock
(:func:`onnx_partition.plan.folder.publish`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["BLOCK", "HashingWriter", "atomic_path", "atomic_write", "sha256_file",
           "sync_file", "sync_folder", "written_sha256"]

#: Bytes read at a time by :func:`sha256_file`.
BLOCK = 1 << 20
#: A :class:`HashingWriter` starts the write-back of every this many bytes it wrote.
_WRITE_BACK = 64 << 20
#: (device, inode, size, mtime_ns) of a file a :class:`HashingWriter` closed -> its sha256.
_WRITTEN: dict[tuple[int, int, int, int], str] = {}


def _identity(path: str | os.PathLike[str]) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class HashingWriter:
    """A new binary file written front to back and hashed on the way (module docstring):
    :meth:`write`, :meth:`copy_from`, :meth:`tell`, and :meth:`pad_to` in place of a seek
    past the end. Each block is hashed on a worker thread while it is written, both done
    before :meth:`write` returns (so the caller may reuse its buffer)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115 (closed by close)
        self._digest = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._offset = 0
        self._flushed = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        hashed = self._hasher.submit(self._digest.update, view)
        try:
            while view:  # a raw file may write less than asked
                view = view[self._file.write(view) or 0:]
        finally:
            hashed.result()
        self._offset += len(data)
        if self._offset - self._flushed >= _WRITE_BACK and hasattr(os, "posix_fadvise"):
            # start writing these bytes to disk now (Linux: asynchronous write-back), so the
            # fsync before publication waits for the tail only
            os.posix_fadvise(self._file.fileno(), self._flushed, self._offset - self._flushed,
                             os.POSIX_FADV_DONTNEED)
            self._flushed = self._offset
        return len(data)

    def copy_from(self, source: str | os.PathLike[str], start: int, length: int,
                  block: int = BLOCK) -> None:
        """Append ``length`` bytes of ``source`` from offset ``start``, read into one reused
        buffer of ``block`` bytes; :class:`EOFError` if ``source`` ends first."""
        buffer = bytearray(min(block, length) or 1)
        with open(source, "rb", buffering=0) as src:
            src.seek(start)
            while length > 0:
                got = src.readinto(memoryview(buffer)[:min(len(buffer), length)])
                if not got:
                    raise EOFError(f"{Path(source).name} ended {length} bytes early")
                self.write(memoryview(buffer)[:got])
                length -= got

    def tell(self) -> int:
        return self._offset

    def pad_to(self, offset: int) -> None:
        """Zeros up to ``offset`` (not before the current end)."""
        gap = offset - self.tell()
        if gap < 0:
            raise ValueError(f"pad_to({offset}) before the end ({self.tell()})")
        self.write(bytes(gap))

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
            self._hasher.shutdown()
            _WRITTEN[_identity(self.path)] = self._digest.hexdigest()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def written_sha256(path: str | os.PathLike[str]) -> str | None:
    """The sha256 a :class:`HashingWriter` computed for the file at ``path``, or None when it
    wrote no such file or the file changed since (its size or modification time)."""
    try:
        return _WRITTEN.get(_identity(path))
    except OSError:
        return None
_NAME_MAX = 200  # longer names get a short hidden prefix (the file system allows 255 bytes)


def sha256_file(path: str | os.PathLike[str], *, sync: bool = False) -> str:
    """The sha256 (hex) of the file at ``path``, read in :data:`BLOCK` blocks; ``sync``: fsync
    the file too (a plan folder about to be published)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:  # every read of a checksum comes through here
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
        if sync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def sync_folder(folder: str | os.PathLike[str]) -> None:
    """fsync a folder, so the renames and new names in it are on disk."""
    _sync_file(folder)


def sync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file by path, so its bytes are on disk."""
    _sync_file(path)


def _sync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file or folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hidden_prefix(name: str) -> str:
    if len(name.encode()) > _NAME_MAX:
        name = hashlib.sha256(name.encode()).hexdigest()[:24]
    return f".{name}.tmp-"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path, under ``path``'s name in a fresh hidden folder beside it, for a
    writer to create; on a clean exit publish what it wrote (see the module docstring): files
    beside the yielded one first, ``path`` last. Any exception leaves ``path`` as it was and
    removes the temporary folder. The writer must create the yielded file (else
    :class:`FileNotFoundError`); ``overwrite=False``: a ``path`` that exists by then is left
    alone and :class:`FileExistsError` raised."""
    path = Path(path)
    stage = Path(tempfile.mkdtemp(dir=path.parent, prefix=_hidden_prefix(path.name)))
    try:
        staged = stage / path.name
        yield staged
        if not staged.is_file():
            raise FileNotFoundError(2, "the writer created no file", str(path))
        extras = sorted(p for p in stage.iterdir() if p != staged and p.is_file())
        for item in [*extras, staged]:
            _sync_file(item)
        for item in extras:
            os.replace(item, path.parent / item.name)
        if overwrite:
            os.replace(staged, path)
        else:
            os.link(staged, path)  # fails if the name was taken meanwhile
        sync_folder(path.parent)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def atomic_write(
    path: str | os.PathLike[str], data: bytes | str, *, overwrite: bool = True
) -> Path:
    """Write ``data`` (``str``: UTF-8) to ``path`` whole or not at all (:func:`atomic_path`);
    returns ``path``. ``overwrite=False``: never replace a file at ``path``
    (:class:`FileExistsError`)."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    with atomic_path(path, overwrite=overwrite) as staged, open(staged, "xb") as handle:
        handle.write(raw)
    return path
