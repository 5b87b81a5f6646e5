"""An `sgl.Runtime` does not outlive the program that made it (issue 16, item 5).

A parent process starts a Runtime (tiny random model) and is then killed, by SIGTERM (what `timeout`
sends) and by SIGKILL (no atexit, no cleanup at all). The server and its HTTP front must exit within
seconds. Loopback only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import process_alive

from sgl_lite.lang.launcher import _child_env

PARENT = """
import subprocess, sys, time
from sgl_lite.lang.launcher import Runtime
rt = Runtime(model_path=sys.argv[1], startup_timeout=180, dtype="float32", max_total_tokens=1024, log_level="warning")
front = subprocess.run(["pgrep", "-P", str(rt.pid), "-f", "sgl_lite.http.launch"], capture_output=True, text=True)
print(rt.pid, front.stdout.split()[0], flush=True)
time.sleep(600)
"""
EXIT_WITHIN_S = 15.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_runtime_exits_when_its_parent_is_killed(tiny_llama_dir: Path, signum: int) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_llama_dir)], stdout=subprocess.PIPE,
                              text=True, env=_child_env())
    server_pid = front_pid = None
    try:
        line = parent.stdout.readline()
        assert line, f"parent exited with {parent.wait()} before its runtime was ready"
        server_pid, front_pid = (int(x) for x in line.split())
        assert process_alive(server_pid) and process_alive(front_pid)
        parent.send_signal(signum)
        parent.wait(10)
        deadline = time.monotonic() + EXIT_WITHIN_S
        while (process_alive(server_pid) or process_alive(front_pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not process_alive(server_pid), f"the runtime outlived its parent by {EXIT_WITHIN_S} s"
        assert not process_alive(front_pid), f"the HTTP front outlived its parent by {EXIT_WITHIN_S} s"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in (server_pid, front_pid):
            if pid is not None and process_alive(pid):
                os.kill(pid, signal.SIGKILL)
