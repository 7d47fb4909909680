"""The per-run-directory claim, between real processes (claim.py imports no torch: fast)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEADLINE

from labrun.claim import LOCK_FILE, Busy, claim, holder

ROOT = Path(__file__).resolve().parent.parent

# A second process that claims the directory in argv[1], says so, then waits to be killed.
HOLDER = """
import sys, time
from labrun.claim import claim
held = claim(sys.argv[1])
print("held", flush=True)
time.sleep(300)
"""


def start_holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=DEADLINE)


def test_second_process_is_refused_and_told_who_holds_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_holder(run_dir)
    try:
        with pytest.raises(Busy) as busy:
            claim(run_dir)
        assert f"pid {proc.pid} on {socket.gethostname()} since " in str(busy.value)
        assert holder(run_dir).startswith(f"pid {proc.pid} on ")
    finally:
        stop(proc)


def test_kernel_frees_the_claim_when_the_holder_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_holder(run_dir)
    stop(proc, signal.SIGKILL)  # no clean-up code runs: the kernel drops the lock
    assert holder(run_dir) is None
    with claim(run_dir) as held:
        assert held.still_ours()
        assert f"pid={os.getpid()} " in (run_dir / LOCK_FILE).read_text()


def test_release_lets_another_process_claim(tmp_path):
    run_dir = tmp_path / "run"
    assert holder(run_dir) is None  # never claimed: no lock file, no directory needed
    with claim(run_dir):
        assert holder(run_dir).startswith(f"pid {os.getpid()} ")
        probe = subprocess.run(
            [sys.executable, "-c", HOLDER.replace("time.sleep(300)", ""), str(run_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert probe.returncode == 1
        assert "Busy" in probe.stderr
    proc = start_holder(run_dir)  # released: a new process gets it
    stop(proc)


def test_a_look_at_the_holder_never_makes_a_claim_fail(tmp_path):
    # holder() takes the lock for an instant; claim() must not mistake that probe for a holder.
    run_dir = tmp_path / "run"
    looker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "\n".join(
                [
                    "import sys",
                    "from labrun.claim import holder",
                    "while True: holder(sys.argv[1])",
                ]
            ),
            str(run_dir),
        ],
        cwd=ROOT,
    )
    try:
        for _ in range(50):
            claim(run_dir).release()
    finally:
        stop(looker)


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_lock_file_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with claim(tmp_path / "run"):
            mode = stat.S_IMODE((tmp_path / "run" / LOCK_FILE).stat().st_mode)
    finally:
        os.umask(old)
    assert mode == 0o666 & ~umask


def test_read_only_lock_file_still_claims(tmp_path):
    run_dir = tmp_path / "run"
    with claim(run_dir):
        pass
    (run_dir / LOCK_FILE).chmod(0o444)
    if os.access(run_dir / LOCK_FILE, os.W_OK):
        pytest.skip("running as root: a read-only file is still writable")
    with claim(run_dir), pytest.raises(Busy):
        claim(run_dir)
