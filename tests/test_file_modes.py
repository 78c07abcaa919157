"""Files Interleaf writes through a temporary name and a rename (token files and their
sidecars, checkpoint state files and manifests, exported weights) get the mode open()
would give them, 0666 less the umask: tempfile.mkstemp's 0600 had left them unreadable
to other users, a container's stage server running as another uid among them."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from interleaf.common.durable import temporary_beside
from interleaf.coordinator.checkpoints import write_manifest
from interleaf.stageserver import safetensors
from interleaf.stageserver.data.tokenfile import write_tokens


@pytest.fixture(params=[0o022, 0o077])
def umask(request):
    before = os.umask(request.param)
    yield request.param
    os.umask(before)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_take_the_umask(tmp_path, umask):
    expected = 0o666 & ~umask
    written = [tmp_path / "data.bin", tmp_path / "data.bin.json", tmp_path / "state.safetensors",
               tmp_path / "manifest.json"]
    write_tokens(written[0], np.arange(10, dtype=np.uint16), vocab_size=256)
    safetensors.write(written[2], {"w": torch.ones(2)}, {})
    write_manifest(written[3], {"step": 1})
    assert {path.name: oct(_mode(path)) for path in written} == {path.name: oct(expected) for path in written}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)  # no temporary left


def test_a_temporary_name_is_never_taken_twice(tmp_path):
    target = tmp_path / "f"
    made = [temporary_beside(target) for _ in range(50)]
    for fd, _ in made:
        os.close(fd)
    assert len({name for _, name in made}) == 50
    assert all(os.path.dirname(name) == str(tmp_path) for _, name in made)
