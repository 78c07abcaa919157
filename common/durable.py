"""Durable renames: what both the coordinator (its checkpoint manifests) and the stage
servers (their shard files) need so that a crash leaves either the old file or the new
one, never half of one."""

from __future__ import annotations

import os
import pathlib


def fsync_folder(folder: pathlib.Path) -> None:
    """Makes a rename in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
