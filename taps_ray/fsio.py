"""Atomic writes and the advisory lock: every file and folder this project publishes goes through here.

A reader (a resumed sweep, a report, another Ray process) never sees half a file or half a folder: each is
written under a temporary name in its final folder, then renamed into place (a rename within one file system
is atomic). Two processes building the same thing (a feature set, a head) hold `folder_lock` and so run one
after the other; the second one finds the work done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: no locking
    fcntl = None

log = logging.getLogger(__name__)


def _temp_name(path: Path, tag: str) -> Path:
    """A hidden sibling of `path` that no other writer (process, thread or call) picks."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{time.time_ns()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; whatever the body writes there replaces `path` when it succeeds.

    For writers that want a file name (parquet, safetensors): ``with atomic_path(p) as tmp: save(tmp)``.
    On an exception the temporary file is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path, "tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def report_lines(lines: list[str], out: str | os.PathLike | None) -> None:
    """A benchmark's markdown: printed, and written atomically to `out` when given."""
    text = "\n".join(lines) + "\n"
    if out:
        atomic_write_text(out, text)
    print(text)


def atomic_write_json(path: str | os.PathLike, data: Any, *, indent: int | None = 2, newline: bool = False,
                      default: Any = None) -> None:
    """`json.dumps(data, indent=indent, default=default)`, plus a final newline if asked, written atomically."""
    atomic_write_text(path, json.dumps(data, indent=indent, default=default) + ("\n" if newline else ""))


def atomic_write_parquet(path: str | os.PathLike, frame: Any) -> None:
    """A pandas DataFrame as parquet (without its index), written atomically."""
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)


def publish_dir(staging: Path, final: Path, *, replace: bool = True) -> bool:
    """Move the fully written folder `staging` to `final`; returns whether it was put in place.

    ``replace=True``: an existing `final` is swapped out (renamed aside, then removed), so `final` is always a
    complete folder. ``replace=False``: an existing `final` wins (another process published it first) and
    `staging` is removed.
    """
    if not replace and final.exists():
        shutil.rmtree(staging, ignore_errors=True)
        return False
    old = None
    if final.exists():
        old = _temp_name(final, "old")
        os.replace(final, old)
    try:
        os.replace(staging, final)
    except OSError:
        if replace:
            raise
        shutil.rmtree(staging, ignore_errors=True)  # someone else put it there first
        return False
    if old is not None:
        _remove(old)
    return True


def _remove(path: Path) -> None:
    """Remove a folder tree or a single file (what `publish_dir` swapped out may be either)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class OutputRefused(ValueError):
    """A command was asked to write where it must not (something is there, or nothing can be written)."""


def check_new_output(path: str | os.PathLike, force: bool, flag: str = "--out") -> Path:
    """`path` as a Path, once it is a place a new output may go: nothing there (or `force`, to replace it), and a
    writable folder above it. Called before any work, so a refused output costs nothing and deletes nothing."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not force:
        what = "folder" if path.is_dir() else "file"
        raise OutputRefused(f"{flag} {path}: a {what} is already there; choose a new path, or add --force to "
                            "replace it")
    parent = next((p for p in path.absolute().parents if p.exists()), Path("/"))
    if not parent.is_dir():
        raise OutputRefused(f"{flag} {path}: {parent} is a file, not a folder; choose a path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputRefused(f"{flag} {path}: {parent} is not writable (read-only or not yours); choose another path")
    return path


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder next to `final`, published with `publish_dir` when the body succeeds.

    On an exception the staging folder is removed and `final` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = _temp_name(final, "tmp")
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_dir(staging, final, replace=replace)


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if needed); a second process blocks until it is free."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        if fcntl is None:
            yield
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process holding %s", path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def folder_lock(folder: str | os.PathLike) -> contextlib.AbstractContextManager[None]:
    """The lock of everything built into `folder`: a hidden ``.<name>.lock`` file next to it."""
    folder = Path(folder)
    return exclusive_lock(folder.parent / f".{folder.name}.lock")
