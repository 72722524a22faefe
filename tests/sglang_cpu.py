"""Start and stop a real SGLang 0.5.17 server on the CPU for the tests (the recipe of
DEVELOPERS.md: CPU engine, torch-native attention, no CUDA graphs, a stand-in sgl_kernel)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

import requests

STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")

CPU_ARGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--max-total-tokens", "8192",
    "--chunked-prefill-size", "512",
    "--skip-server-warmup",
    "--dtype", "float32",
]


def cpu_env() -> dict:
    """Environment for a CPU-run SGLang process (and for in-process SGLang imports)."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [STUBS] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str
    args: List[str] = field(default_factory=list)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def start_server(
    model_path: str,
    extra_args: Optional[List[str]] = None,
    log_path: Optional[str] = None,
    timeout: float = 240.0,
    max_running_requests: int = 8,
) -> Server:
    """Launch ``python -m sglang.launch_server`` on the CPU and wait until /health answers.

    Raises:
        RuntimeError: the process exited or did not become healthy; the message holds the
            tail of its log.
    """
    port = free_port()
    args = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--port", str(port),
        "--max-running-requests", str(max_running_requests),
        *CPU_ARGS,
        *(extra_args or []),
    ]
    log_path = log_path or f"/tmp/freetoken-test-server-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=cpu_env())
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, args)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}:\n{server.log()[-4000:]}"
            )
        try:
            if requests.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except requests.RequestException:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()[-4000:]}")


def run_launch_server_expecting_failure(
    model_path: str, extra_args: List[str], timeout: float = 240.0
) -> subprocess.CompletedProcess:
    """Run launch_server until it exits (it is expected to refuse to start)."""
    args = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--port", str(free_port()),
        *CPU_ARGS,
        *extra_args,
    ]
    return subprocess.run(
        args, env=cpu_env(), capture_output=True, text=True, timeout=timeout
    )
