"""Where a writer puts its checkpoint: never over its source, never silently over another
checkpoint, and never half-written. The files go to a hidden directory beside the
destination, which takes the destination's name only once it is complete."""
from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from typing import Iterable, Iterator

from ..errors import OutputError


def source_dirs(paths: Iterable[str | os.PathLike]) -> set[str]:
    """The real directories a checkpoint's local files (or directory) live in, symlinks followed."""
    dirs = set()
    for path in paths:
        if "://" in os.fspath(path):  # a remote object: no local directory to protect
            continue
        real = os.path.realpath(path)
        dirs.add(real if os.path.isdir(real) else os.path.dirname(real))
        if not os.path.isdir(path):  # a symlinked file (a Hugging Face snapshot): its directory too
            dirs.add(os.path.realpath(os.path.dirname(os.path.abspath(path))))
    return dirs


def check_output(out_dir: str | os.PathLike, sources: set[str], overwrite: bool) -> None:
    """Refuse, before anything is written, an output that is (inside, or holds) the source,
    or that already holds files unless `overwrite`."""
    out = os.path.realpath(out_dir)
    for src in sorted(sources):
        if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
            relation = "is" if out == src else "is inside" if out.startswith(src) else "holds"
            raise OutputError(f"{out_dir}: {relation} the source checkpoint's directory {src}; write the copy to "
                              "a directory of its own (overwrite=True never replaces the source).")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutputError(f"{out_dir}: exists and is not a directory; pass a directory to write the checkpoint to.")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held and not overwrite:
        raise OutputError(f"{out_dir}: already holds {len(held)} file(s) ({', '.join(held[:3])}"
                          f"{', ...' if len(held) > 3 else ''}); pass overwrite=True (`--overwrite`) to replace "
                          "all of it, or write to a new or empty directory.")


@contextmanager
def staged_directory(out_dir: str | os.PathLike) -> Iterator[str]:
    """A fresh directory beside `out_dir` to write into; on success it replaces `out_dir`,
    on any failure it is removed, and `out_dir` is left as it was."""
    out = os.path.realpath(out_dir)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    staging = _fresh_beside(out, "partial")
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.isdir(out) and os.listdir(out):  # overwrite: the old one leaves only once the new one is whole
        old = _fresh_beside(out, "old")
        os.rename(out, os.path.join(old, "replaced"))
        os.rename(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(staging, out)


def _fresh_beside(out: str, kind: str) -> str:
    path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{secrets.token_hex(4)}.{kind}")
    os.mkdir(path)  # the umask's permissions, as the destination would have had
    return path
