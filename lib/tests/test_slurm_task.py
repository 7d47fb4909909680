"""slurm_task.sh's forwarding of Slurm's time-limit warning, without a cluster: a USR1 that
comes while run.py is still starting (no handler yet) must stop it, not kill it (exit 138)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import labrun

TASK = Path(labrun.__file__).parent / "slurm_task.sh"


def test_the_warning_waits_until_the_child_catches_it(tmp_path):
    # A child that installs its USR1 handler 2 s after it starts, as a Python process does once
    # its imports have run; the warning is forwarded 0.2 s after the start.
    child = (
        "import signal, sys, time; time.sleep(2); "
        "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75)); time.sleep(60)"
    )
    script = tmp_path / "forward.sh"
    script.write_text(
        f"source <(sed -n '/^send_when_caught() {{/,/^}}/p' {TASK})\n"
        f'"{sys.executable}" -c "{child}" &\n'
        'pid=$!\nsleep 0.2\nsend_when_caught USR1 "${pid}"\n'
        'wait "${pid}"; echo "exit $?"\n'
    )
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == "exit 75", done.stdout + done.stderr
