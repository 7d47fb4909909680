"""labrun's command line: where the library's shell part is installed.

    python -m labrun slurm-task    # the script of one Slurm array task (run.sh --slurm submits it)

The sweep engine itself is Python: run.sh ends with `exec "${PYTHON}" -m labrun.sweep ...`, so the
engine is the one of the labrun installed in the project's environment, the version its
pyproject.toml pins. Imports no torch: it answers in the time Python takes to start.
"""

from __future__ import annotations

import sys
from pathlib import Path

from labrun import __version__
from labrun.config import Parser  # a bad command line: one `error:` line, exit 2

SLURM_TASK = "print the path of the Slurm array task script"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m labrun", description="labrun's command line (the library's shell files)."
    )
    parser.add_argument("--version", action="version", version=f"labrun {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("slurm-task", help=SLURM_TASK, description=SLURM_TASK + ".")
    parser.parse_args(argv)  # slurm-task, the one command
    # Package data installed beside this file (lib/pyproject.toml ships *.sh).
    path = Path(__file__).resolve().with_name("slurm_task.sh")
    if not path.is_file():  # a broken install: say so instead of letting sbatch fail later
        print(f"error: {path} is missing (reinstall labrun)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
