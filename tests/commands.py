"""Commands run in-process, as their console scripts run them (run_cli: one line per user
error, the exit code), their output captured: one harness for the tests of what a command
prints and how it exits. A subprocess is kept only where the process itself is under test
(--help's import time, signals, the server, the pty chat app, mlx.launch, two writers)."""

import contextlib
import importlib
import io
import signal
import sys
from dataclasses import dataclass
from typing import Optional

from mlx_eagle.cli import run_cli


@dataclass
class Ran:
    """What a command did, named as subprocess.CompletedProcess names it."""

    returncode: int
    stdout: str
    stderr: str


def run_command(module: str, *argv: str, stdin: bytes = b"") -> Ran:
    """``python -m module argv...`` in this process: ``module``'s ``main`` through run_cli."""
    try:
        entry = importlib.import_module(f"{module}.__main__")
    except ModuleNotFoundError:
        entry = importlib.import_module(module)
    main = getattr(entry, "main", None) or importlib.import_module(entry.cli.__module__).main
    out, err = io.StringIO(), io.StringIO()
    previous_stdin, previous_term = sys.stdin, signal.getsignal(signal.SIGTERM)
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    code: Optional[int] = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_cli(main, list(argv))
    except SystemExit as exited:
        code = exited.code
    finally:
        sys.stdin = previous_stdin
        signal.signal(signal.SIGTERM, previous_term)
    return Ran(int(code or 0), out.getvalue(), err.getvalue())


def run_generate(*argv: str) -> Ran:
    return run_command("mlx_eagle.generate", *argv)
