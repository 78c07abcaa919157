"""A Docker engine for a test: the one already running, or a dockerd started here and
stopped again afterwards (with the containerd it starts), so no process outlives the
test. Where none runs and none can start (no dockerd installed, no privileges for its
mounts and networks), the test is skipped with dockerd's own words."""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import signal
import subprocess
import time

import pytest

START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 60


def answers() -> bool:
    """Whether an engine answers on the default socket (False: no docker command either)."""
    docker = shutil.which("docker")
    if not docker:
        return False
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:  # an engine that hangs is one that does not answer
        return False


@contextlib.contextmanager
def engine(logs: pathlib.Path):
    """Yields once an engine answers; stops the dockerd it started, if it started one."""
    if answers():
        yield
        return
    dockerd = shutil.which("dockerd")
    if not dockerd or not shutil.which("docker"):
        pytest.skip("no Docker engine runs and dockerd or docker is not installed (apt-get install docker.io)")
    log_path = logs / "dockerd.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not answers():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                pytest.skip(f"dockerd cannot start here (exit status {process.poll()}): {tail}")
            time.sleep(0.5)
        yield
    finally:
        _stop(process, log_path)


def _stop(process: subprocess.Popen, log_path: pathlib.Path) -> None:
    # SIGTERM: dockerd stops its containers and the containerd it started, then exits.
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise AssertionError(f"dockerd did not stop within {STOP_TIMEOUT_S} s of SIGTERM; killed. Its log: "
                                 + log_path.read_text(errors="replace")[-2000:])
    # Its session (start_new_session) is its and its children's: none may be left.
    left = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the test's dockerd outlived it: {left}"
