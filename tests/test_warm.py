"""The warm launcher of the tests (tests/warm.py) behaves like a fresh ``python script.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import warm

SCRIPT = """
import os, signal, sys
print("out", sys.argv[1:], os.getcwd() == sys.argv[1], __name__)
print("err", os.environ.get("WARM_PROBE"), file=sys.stderr)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "raise":
    raise ValueError("boom")
if sys.argv[2] == "interrupt":
    raise KeyboardInterrupt
if sys.argv[2] == "hang":
    signal.pause()
sys.exit(int(sys.argv[2]))
"""


def test_a_warm_run_has_its_own_exit_code_streams_directory_and_environment(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {"WARM_PROBE": "seen", "PATH": "/usr/bin:/bin"}
    done = warm.run([str(script), str(tmp_path), "3"], cwd=tmp_path, env=env, timeout=120)
    fresh = subprocess.run([sys.executable, str(script), str(tmp_path), "3"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr) == (
        3, f"out ['{tmp_path}', '3'] True __main__\n", "err seen\n")
    assert warm.run([str(script), str(tmp_path), "kill"], cwd=tmp_path, env=env).returncode == -9
    raised = warm.run([str(script), str(tmp_path), "raise"], cwd=tmp_path, env={})
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: boom")
    assert "err None" in raised.stderr  # the environment given, not the server's
    interrupted = warm.run([str(script), str(tmp_path), "interrupt"], cwd=tmp_path, env=env)
    fresh = subprocess.run([sys.executable, str(script), str(tmp_path), "interrupt"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert interrupted.returncode == fresh.returncode == -2 and "KeyboardInterrupt" in interrupted.stderr
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([str(script), str(tmp_path), "hang"], cwd=tmp_path, env=env, timeout=2)


def test_off_linux_a_run_is_a_fresh_interpreter(tmp_path, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    monkeypatch.setattr(warm.sys, "platform", "darwin")  # fork after importing torch is unsafe there
    done = warm.run([str(script), str(tmp_path), "4"], cwd=tmp_path, env={"WARM_PROBE": "fresh"}, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (4, f"out ['{tmp_path}', '4'] True __main__\n",
                                                           "err fresh\n")
