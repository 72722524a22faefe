"""The tests' way to run a real SGLang 0.5.17 server on the CPU (the README's CPU recipe),
on top of the benchmarks' launcher (``benchmarks/servers.py``)."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from servers import Server, cpu_env, free_port, run_expecting_failure  # noqa: E402,F401


def start_server(
    model_path: str,
    extra_args: Optional[List[str]] = None,
    log_path: Optional[str] = None,
    timeout: float = 300.0,
    max_running_requests: int = 8,
) -> Server:
    """A CPU-run ``launch_server`` with ``extra_args``, healthy on return; ``.stop()`` it.

    Raises:
        RuntimeError: the process exited or did not become healthy (with its log's tail).
    """
    log_path = log_path or f"/tmp/freetoken-test-server-{free_port()}.log"
    flags = ["--max-running-requests", str(max_running_requests), *(extra_args or [])]
    return Server(model_path, flags, log_path, cpu=True, timeout=timeout)


def run_launch_server_expecting_failure(model_path: str, extra_args: List[str]):
    """Run a CPU ``launch_server`` that is expected to refuse to start."""
    return run_expecting_failure(model_path, extra_args, cpu=True)
