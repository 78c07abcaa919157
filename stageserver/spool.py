"""A job's checkpoint files on a server that does not share the coordinator's filesystem.

The coordinator keeps every checkpoint in `checkpoint.dir` on its own host. At setup it
asks each server whether it sees that folder (a probe file it wrote there, by SHA-256).
A server that does writes its files there in place; one that does not writes them into
its spool, a folder of its own per job, and the coordinator streams them out (ReadFile)
into the checkpoint; to resume such a server, the coordinator streams the state files
in (WriteFile). The spool goes with the job.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import secrets
import shutil
import tempfile

CHUNK_BYTES = 1 << 20  # under gRPC's default message limit, large enough to stream at disk speed


def default_root() -> pathlib.Path:
    """Per user: another user's server on the host neither blocks nor reads ours."""
    return pathlib.Path(tempfile.gettempdir()) / f"interleaf-spool-{os.getuid()}"


def sees(path: str, sha256: str) -> bool:
    """Whether `path` here holds the bytes with that SHA-256 (the coordinator's probe)."""
    try:
        return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest() == sha256
    except OSError:
        return False


class Spool:
    def __init__(self, root: pathlib.Path, job_id: str, rank: int):
        # Per server and job: servers on one host share the root, and each removes only
        # its own folder (a rank handed to another server after this one was declared
        # lost keeps its files).
        self.folder = pathlib.Path(root) / f"{job_id.replace('/', '_')}-rank{rank}-{secrets.token_hex(4)}"

    def path(self, relative: str) -> pathlib.Path:
        """A file in the spool; `relative` must stay inside it."""
        parts = pathlib.PurePosixPath(relative).parts
        if not parts or pathlib.PurePosixPath(relative).is_absolute() or ".." in parts:
            raise ValueError(f"spool path {relative!r} must be relative and stay inside the spool")
        return self.folder.joinpath(*parts)

    def read(self, relative: str):
        """Yields the file's bytes in chunks, then removes it: once the coordinator has
        the file, the spool need not keep it."""
        path = self.path(relative)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk
        path.unlink(missing_ok=True)  # the job may have been torn down meanwhile

    def receive(self, relative: str, sha256: str, chunks) -> tuple[pathlib.Path, int]:
        """Writes `chunks` to the file (a temporary name, renamed once complete);
        refused, and nothing kept, unless the bytes have `sha256`."""
        path = self.path(relative)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
            if digest.hexdigest() != sha256:
                raise ValueError(f"{relative} arrived with SHA-256 {digest.hexdigest()}, expected {sha256}")
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path, size

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
