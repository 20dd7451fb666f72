"""Plan folders on disk: what is in them, how they are checked, how they are written.

**Manifest.** plan.json carries ``"manifest": {"<relative path>": {"size": N, "sha256": H}}``
naming every file of the folder except plan.json itself and the report (stage files and their
``.data`` files alike). :func:`verify` checks it before any session or process starts: sizes
always, sha256 (streamed in 1 MiB blocks) unless asked not to. A plan without a manifest, or with
an empty or malformed checksum, is refused.

**Earlier plan.** A folder may be replaced without ``--force`` only when every file in it is
plan.json, our report, or a manifest entry that matches (:func:`is_earlier_plan`): a forged
plan.json naming a user's file cannot make that file replaceable.

**Publication** (:func:`publish`). Under an exclusive lock (``flock`` on ``.OUT.lock`` beside
OUT; held: "another partition is writing OUT"), the new folder is written to ``.OUT.tmp-<tag>``,
hashed and fsynced, then swapped in with one ``renameat2(RENAME_EXCHANGE)`` (the old plan ends
under the temporary name and is removed). Where the kernel or file system lacks it, two renames
are used (OUT -> ``.OUT.old-<tag>``, temporary -> OUT). Whatever point a crash hits, the next
publication into OUT (under the lock) finds the leftovers: it puts an ``.old`` folder back when
OUT is missing, and removes stale temporaries. The model a plan is cut from is never inside
what ``--force`` replaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError, read_json
from onnx_partition.fileio import atomic_write, sha256_file, sync_file, sync_folder, written_sha256
from onnx_partition.plan import MANIFEST, PLAN_FILE, REPORT_FILE, Plan, plan_text, read_plan
from onnx_partition.plan.declare import json_of
from onnx_partition.plan.extras import FileEntry, Manifest

__all__ = ["PUBLISH_STEPS", "REPORT_MARK", "Manifest", "exchange", "is_earlier_plan",
           "is_our_report", "locked", "make_manifest", "manifest_of", "publish",
           "read_body", "recover", "verify", "write_file"]

#: Marks an HTML report written by this tool (its ``<head>`` holds it).
REPORT_MARK = b'<meta name="generator" content="onnx-partition">'
#: The steps of a publication that :func:`publish` reports to its ``step_hook``: the temporary
#: folder is complete; it was exchanged with OUT; OUT was moved aside (the two-rename fallback).
PUBLISH_STEPS = ("written", "swapped", "moved-old")



# --------------------------------------------------------------------------- the manifest


#: The manifest's checksum: sha256 streamed in blocks (:func:`onnx_partition.fileio.sha256_file`).


def _members(folder: Path) -> Iterator[tuple[str, Path]]:
    """(relative posix path, path) of everything below ``folder`` but directories."""
    for path in sorted(folder.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        yield path.relative_to(folder).as_posix(), path


def make_manifest(folder: Path, *, sync: bool = False) -> Manifest:
    """The manifest of every regular file below ``folder`` except plan.json and the report."""
    entries: Manifest = {}
    for name, path in _members(folder):
        if name in (PLAN_FILE, REPORT_FILE):
            continue
        if path.is_symlink() or not path.is_file():
            raise PartitionError(f"plan folder: {name} is not a regular file")
        digest = written_sha256(path)  # hashed as it was written (fileio's HashingWriter)
        if digest is None:
            digest = sha256_file(path, sync=sync)
        elif sync:
            sync_file(path)
        entries[name] = FileEntry(size=path.stat().st_size, sha256=digest)
    return entries


def manifest_of(plan: Plan, folder: Path) -> Manifest:
    """The plan's manifest, or a PartitionError when it has none."""
    entries = plan.manifest
    if not entries:
        raise PartitionError(f"{folder / PLAN_FILE} has no manifest of its files (written by an "
                             f"older onnx-partition?); partition the model again")
    return dict(entries)


def verify(
    folder: str | os.PathLike[str],
    plan: Plan,
    *,
    hashes: bool = True,
    stages: Sequence[int] | None = None,
) -> list[Path]:
    """Check the plan folder against plan.json's manifest before anything reads it: every stage
    file is listed and, like every listed file, present with its size (and sha256 unless
    ``hashes`` is false). ``stages`` limits the check to those stages' files (one machine's
    share). Returns the stage files' paths."""
    folder = Path(folder)
    root = folder.resolve()
    entries = manifest_of(plan, folder)
    chosen = [plan.stages[k] for k in stages] if stages is not None else plan.stages
    if not chosen:
        raise PartitionError(f"plan folder {folder} has no stages")
    names: list[str] = []
    paths = []
    for stage in chosen:
        if stage.file not in entries:
            raise PartitionError(f"plan folder {folder}: stage file {stage.file} is not in the "
                                 f"manifest of plan.json")
        paths.append(_inside(root, stage.file, folder))
        data = stage.file + ".data"
        if data not in entries and (root / data).exists():
            raise PartitionError(f"plan folder {folder}: {data} is not in the manifest of "
                                 f"plan.json")
        names += [stage.file] + ([data] if data in entries else [])
    for name in names if stages is not None else list(entries):
        _check_entry(folder, root, name, entries[name], hashes)
    return paths


def _inside(root: Path, name: str, folder: Path) -> Path:
    path = (root / name).resolve()
    if os.path.isabs(name) or root not in path.parents:
        raise PartitionError(f"plan.json: file {name!r} is outside the plan folder {folder}")
    return path


def _check_entry(folder: Path, root: Path, name: str, entry: FileEntry, hashes: bool) -> None:
    path = _inside(root, name, folder)
    if not path.is_file():
        raise PartitionError(f"plan folder {folder}: {name} is missing")
    size = path.stat().st_size
    if size != entry.size:
        raise PartitionError(f"plan folder {folder}: {name} has {size} bytes, its manifest says "
                             f"{entry.size} (changed or truncated)")
    if hashes and sha256_file(path) != entry.sha256:
        raise PartitionError(f"plan folder {folder}: {name} does not match its sha256 in "
                             f"plan.json (changed or corrupted)")


def is_our_report(path: Path) -> bool:
    """Whether ``path`` is an HTML report written by this tool."""
    try:
        with open(path, "rb") as handle:
            return REPORT_MARK in handle.read(4096)
    except OSError:
        return False


def is_earlier_plan(folder: Path) -> bool:
    """Whether every file in ``folder`` is plan.json, our report, or listed in the manifest and
    matching it (size and sha256)."""
    try:
        plan = read_plan(folder)
        entries = manifest_of(plan, folder)
    except PartitionError:
        return False
    for name, path in _members(folder):
        if name == PLAN_FILE or (name == REPORT_FILE and is_our_report(path)):
            continue
        entry = entries.get(name)
        if entry is None or path.is_symlink() or not path.is_file():
            return False
        if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            return False
    return True


# --------------------------------------------------------------------------- writing


def _prefix(out: Path) -> str:
    """The hidden-name prefix of OUT's lock and temporaries (short even for a long OUT name)."""
    name = out.name
    if len(name.encode()) > 180:
        name = hashlib.sha256(name.encode()).hexdigest()[:24]
    return f".{name}"


@contextlib.contextmanager
def locked(out: Path, what: str = "partition") -> Iterator[None]:
    """Hold the exclusive lock of OUT (``flock`` on ``.OUT.lock`` beside it), or fail at once
    with "another partition is writing OUT". The holder removes the lock file before it lets go;
    a taker whose file was meanwhile removed (its inode no longer at the path) tries again."""
    lock = out.parent / f"{_prefix(out)}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PartitionError(f"another {what} is writing {out}; try again when it "
                                 f"has finished") from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)  # releases the lock


def recover(out: Path) -> None:
    """Clean up after a publication into ``out`` that crashed (call under :func:`locked`): an
    ``.old`` folder goes back to OUT when OUT is missing; other temporaries are removed."""
    prefix = _prefix(out)
    olds = sorted((p for p in out.parent.iterdir() if p.name.startswith(f"{prefix}.old-")),
                  key=lambda p: p.stat().st_mtime)
    if olds and not os.path.lexists(out):
        os.rename(olds.pop(), out)
    for path in out.parent.iterdir():
        if path.name.startswith((f"{prefix}.tmp-", f"{prefix}.old-")):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step with ``renameat2(RENAME_EXCHANGE)``; False where the C
    library, kernel or file system does not offer it (nothing was changed then)."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "renameat2", None)
    if call is None:
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if call(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def _replaceable(out: Path, force: bool, protect: Sequence[Path]) -> None:
    for item in protect:
        target = item.resolve()
        if target == out or out in target.parents:
            raise PartitionError(f"output folder {out} holds {item}, which the plan needs; "
                                 f"choose another output folder")
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise PartitionError(f"output {out} exists and is not a folder")
    if any(out.iterdir()) and not force and not is_earlier_plan(out):
        raise PartitionError(
            f"output folder {out} exists and is not an earlier plan; use --force to replace it"
        )


def publish(
    out: str | os.PathLike[str],
    write: Callable[[Path], dict[str, Any]],
    *,
    force: bool = False,
    protect: Sequence[str | os.PathLike[str]] = (),
    step_hook: Callable[[str], None] | None = None,
) -> Manifest:
    """Write a plan folder to ``out`` as one atomic step; returns its manifest.

    ``write(tmp)`` writes every file but plan.json into the empty folder ``tmp`` and returns
    plan.json's body; the manifest is added to it here. ``out`` may be missing, empty or an
    earlier plan; anything else needs ``force``, and never may ``out`` hold a ``protect`` path
    (the model). Any failure leaves ``out`` as it was and no temporary behind; an ``OSError``
    becomes a one-line PartitionError. ``step_hook(step)`` is called as each of
    :data:`PUBLISH_STEPS` is reached (the tests crash a publication there).
    """
    out = Path(os.path.abspath(out))
    if out.is_symlink():
        out = out.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with locked(out):
            recover(out)
            _replaceable(out, force, [Path(p) for p in protect])
            return _swap_in(out, write, step_hook or _no_step)
    except OSError as exc:
        where = exc.filename or out
        raise PartitionError(f"cannot write the plan folder {out}: {exc.strerror or exc} "
                             f"({where})") from None


def _no_step(step: str) -> None:
    pass


def _swap_in(out: Path, write: Callable[[Path], dict[str, Any]],
             step_hook: Callable[[str], None]) -> Manifest:
    tag = uuid.uuid4().hex[:8]
    tmp = out.parent / f"{_prefix(out)}.tmp-{tag}"
    tmp.mkdir()
    try:
        body = write(tmp)
        (tmp / PLAN_FILE).unlink(missing_ok=True)
        entries = make_manifest(tmp, sync=True)
        body = {**body, MANIFEST: json_of(entries)}
        atomic_write(tmp / PLAN_FILE, plan_text(body))
        os.chmod(tmp, 0o755)
        sync_folder(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    step_hook("written")
    if not os.path.lexists(out):
        os.rename(tmp, out)
    elif exchange(tmp, out):  # tmp now holds the earlier plan
        step_hook("swapped")
        shutil.rmtree(tmp)
    else:
        old = out.parent / f"{_prefix(out)}.old-{tag}"
        os.rename(out, old)
        step_hook("moved-old")
        os.rename(tmp, out)
        shutil.rmtree(old)
    sync_folder(out.parent)
    return entries


def write_file(
    path: str | os.PathLike[str], text: str, *, replace: Callable[[Path], bool]
) -> Path:
    """Write ``text`` to ``path`` whole or not at all (:func:`onnx_partition.fileio.atomic_write`).
    An existing ``path`` is replaced only when ``replace(path)`` says so (else a PartitionError);
    one that appears meanwhile is never overwritten. A folder at ``path`` or an OSError is a
    one-line PartitionError."""
    path = Path(os.path.abspath(path))
    if path.is_dir():
        raise PartitionError(f"{path} is a folder; give a file name")
    exists = os.path.lexists(path)
    if exists and not replace(path):
        raise PartitionError(f"{path} exists; use --force to overwrite it")
    try:
        return atomic_write(path, text, overwrite=exists)
    except FileExistsError:
        raise PartitionError(f"{path} appeared while writing; not overwritten") from None
    except OSError as exc:
        raise PartitionError(f"cannot write {path}: {exc.strerror or exc}") from None


def read_body(folder: Path) -> dict[str, Any]:
    """plan.json of ``folder`` as a plain dict (for callers that wrote it themselves)."""
    body: dict[str, Any] = read_json(folder / PLAN_FILE, "plan")
    return body
