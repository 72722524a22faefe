"""Hooks into SGLang 0.5.17's launcher (``sglang.srt.entrypoints.engine``).

- ``_wait_for_scheduler_ready`` (around): when a scheduler process ended because FreeToken
  refused to start (``freetoken_sglang.errors``; it left its message), the launch ends with
  that one-line message: from ``python -m sglang.launch_server`` with exit code 2 and no
  traceback, from ``sglang.Engine`` as a ``RefusedError``.
"""

from __future__ import annotations

import os
import sys

from freetoken_sglang.patches import Hook

#: Set when the launch came from the command line (``patches/server_args.from_cli_args``).
LAUNCHED_FROM_CLI = {"value": False}


def wait_for_scheduler_ready(original, *args, **kwargs):
    try:
        return original(*args, **kwargs)
    except Exception:
        from freetoken_sglang import errors

        note = errors.take_note()
        if note is None:
            raise
        if not LAUNCHED_FROM_CLI["value"]:
            raise errors.RefusedError(note) from None
        from sglang.srt.utils import kill_process_tree

        sys.stderr.write(f"FreeToken refused to start: {note}\n")
        sys.stderr.flush()
        kill_process_tree(os.getpid(), include_parent=False)
        os._exit(errors.EXIT_REFUSED)


HOOKS = [
    Hook("sglang.srt.entrypoints.engine._wait_for_scheduler_ready", wait_for_scheduler_ready,
         "around"),
]
