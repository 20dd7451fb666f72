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
costs no more memory than one block.

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
from pathlib import Path

__all__ = ["BLOCK", "atomic_path", "atomic_write", "sha256_file", "sync_folder"]

#: Bytes read at a time by :func:`sha256_file`.
BLOCK = 1 << 20
_NAME_MAX = 200  # longer names get a short hidden prefix (the file system allows 255 bytes)


def sha256_file(path: str | os.PathLike[str], *, sync: bool = False) -> str:
    """The sha256 (hex) of the file at ``path``, read in :data:`BLOCK` blocks; ``sync``: fsync
    the file too (a plan folder about to be published)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
        if sync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def sync_folder(folder: str | os.PathLike[str]) -> None:
    """fsync a folder, so the renames and new names in it are on disk."""
    _sync_file(folder)


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
