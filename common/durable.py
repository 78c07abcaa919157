"""Durable renames: what both the coordinator (its checkpoint manifests) and the stage
servers (their shard files) need so that a crash leaves either the old file or the new
one, never half of one."""

from __future__ import annotations

import os
import pathlib
import secrets


def fsync_folder(folder: pathlib.Path) -> None:
    """Makes a rename in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_beside(path: pathlib.Path) -> tuple[int, str]:
    """A new file to write `path` through before renaming it there: (its descriptor, its
    name), in the same folder (a rename within one file system). Its mode is 0666 less
    the process's umask, as open() gives a new file: tempfile.mkstemp's 0600 would leave
    every token file, checkpoint and exported model renamed from it unreadable to other
    users (a colleague, a container's stage server running as another uid)."""
    path = pathlib.Path(path)
    while True:
        name = str(path.parent / f".{path.name}.{secrets.token_hex(6)}")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), name
        except FileExistsError:  # 48 random bits taken: another name
            continue
