"""Refusals at start: FreeToken's one-line errors that name what is wrong and the fix.

A ``RefusedError`` raised while SGLang starts (flags, model, format, cache size) ends the
launch with its message, exit code 2 from ``python -m sglang.launch_server`` and no Python
traceback (``patches/server_args.py``, ``patches/scheduler.py``); with ``--log-level debug``
the traceback is kept. ``sglang.Engine`` raises it as an exception.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

#: Exit code of a refused launch (argparse's code for bad arguments; not a signal).
EXIT_REFUSED = 2


class RefusedError(ValueError):
    """FreeToken refuses to start; the message names what is wrong and the fix."""


def _note_path(launcher_pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"freetoken-refused-{launcher_pid}.txt")


def leave_note(message: str, launcher_pid: Optional[int] = None) -> None:
    """Leave a refusal's message for the launcher process (a scheduler process's refusal
    reaches the launcher only as a dead child)."""
    with open(_note_path(launcher_pid or os.getppid()), "w") as f:
        f.write(message)


def take_note(launcher_pid: Optional[int] = None) -> Optional[str]:
    """The message a child left for this launcher, once (None if none)."""
    path = _note_path(launcher_pid or os.getpid())
    try:
        with open(path) as f:
            message = f.read()
    except OSError:
        return None
    try:
        os.unlink(path)
    except OSError:
        pass
    return message
