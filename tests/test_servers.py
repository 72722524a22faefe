"""The benchmarks' server launcher (benchmarks/servers.py) stops its server when the benchmark gets SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "benchmarks")

# Stands in for ``python -m sglang.launch_server``: answers every GET with 200; like SGLang it
# has a child process in its group (its pid goes to $FAKE_CHILD_PID) and takes a moment to
# shut down on SIGTERM.
FAKE_LAUNCH_SERVER = '''
import http.server, os, signal, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen(["sleep", "300"])
with open(os.environ["FAKE_CHILD_PID"], "w") as f:
    f.write(str(child.pid))
def drain(*a):
    time.sleep(1.0)
    os._exit(0)
signal.signal(signal.SIGTERM, drain)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _python(code: str) -> list:
    """Run ``code`` in a fresh Python with benchmarks/ on sys.path; its last output line, split."""
    prelude = f"import sys; sys.path.insert(0, {BENCH!r})\n"
    out = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1].split()


def _fake_sglang_env(tmp_path) -> dict:
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    return dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), NO_PROXY="127.0.0.1",
                no_proxy="127.0.0.1", FAKE_CHILD_PID=str(tmp_path / "child.pid"))


@pytest.mark.parametrize("signals", [1, 2])
def test_server_stopped_when_the_benchmark_gets_sigterm(tmp_path, signals):
    """``timeout 600 bash benchmarks/run_all.sh ...`` sends SIGTERM (to the process, then to
    its group): the server the benchmark started in its own session must stop with it, not
    outlive it holding the GPU and the pinned pool. A second SIGTERM must not cut the cleanup
    short: the server's whole process group goes."""
    child = (
        "import sys, time\n"
        f"sys.path.insert(0, {BENCH!r})\n"
        "from servers import Server, stop_servers_on_sigterm\n"
        "assert stop_servers_on_sigterm()\n"
        f"with Server('unused', [], {str(tmp_path / 'server.log')!r}, timeout=60) as s:\n"
        "    print(s.proc.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], env=_fake_sglang_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_pid = None
    try:
        line = proc.stdout.readline()
        assert line.strip(), f"the benchmark did not start its server: {proc.stderr.read()}"
        server_pid = int(line)
        group = [server_pid, int((tmp_path / "child.pid").read_text())]
        assert all(_alive(p) for p in group)
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read()
        deadline = time.time() + 10
        while any(_alive(p) for p in group) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in group), \
            "the server or its child outlived the benchmark that started it"
    finally:
        if proc.poll() is None:
            proc.kill()
        if server_pid is not None:
            try:
                os.killpg(server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("script", ["run_all.py", "bench_decode.py"])
def test_benchmark_scripts_arm_the_sigterm_handler(script):
    """Run as scripts, run_all.py and bench_decode.py install the handler (before parsing
    their arguments: ``--help`` exits in argparse); imported, as the tests do, they don't."""
    assert _python(f"import signal, {script[:-3]}\n"
                   "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)") == ["True"]
    assert _python(
        "import runpy, signal\n"
        f"sys.argv = [{script!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({os.path.join(BENCH, script)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "import servers\n"
        "print(signal.getsignal(signal.SIGTERM) is servers._raise_exit)\n"
    ) == ["True"]


def test_handler_not_installed_over_another():
    """A SIGTERM handler already set (pytest's, uvicorn's) is left alone."""
    assert _python(
        "import signal\n"
        "from servers import stop_servers_on_sigterm\n"
        "mine = lambda *a: None\n"
        "signal.signal(signal.SIGTERM, mine)\n"
        "print(stop_servers_on_sigterm(), signal.getsignal(signal.SIGTERM) is mine)\n"
    ) == ["False", "True"]


def test_sigterm_handler_is_one_shot():
    """The first SIGTERM raises SystemExit(143); a second one during the cleanup does nothing
    (a Python no-op, so that processes started meanwhile don't inherit SIG_IGN)."""
    assert _python(
        "import os, signal\n"
        "import servers\n"
        "assert servers.stop_servers_on_sigterm()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    signal.pause()\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print(code, signal.getsignal(signal.SIGTERM) is servers._ignore)\n"
    ) == ["143", "True"]
